"""Issue 25, items 7 and 8: signals sent to ``deepinfer generate`` in a subprocess (tests/engine/signal_driver.py
stops it at a known phase). SIGTERM during start-up or loading ends like an interrupted run: exit 130 and one
record per line. A second SIGINT exits 130. SIGKILL leaves no temporary file beside the output.

The rule for the output write (round two): a first signal during the write lets it finish, so no record is lost;
a second one abandons it, leaving the output file complete or absent, never partial; a signal after the write only
says so. Every case exits 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.cli import main

HERE = Path(__file__).parent
REPO = HERE.parents[1]
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "thinking": {"type": "disabled"},
        "temperature": 0}
BATCH = {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": BODY}


def _start(tmp_path, phase: str) -> tuple[subprocess.Popen, Path]:
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([json.dumps(BODY), "{not json", json.dumps(BATCH)]) + "\n")
    out = tmp_path / "out.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "engine")]))
    proc = subprocess.Popen([sys.executable, str(HERE / "signal_driver.py"), phase, "--", "generate", "--input",
                             str(inp), "--output", str(out), "--no-progress", "--created", "0"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    return proc, out


def _wait_for(proc: subprocess.Popen, phase: str) -> None:
    seen = []
    for line in proc.stderr:  # ends when the process exits
        seen.append(line)
        if line.strip() == f"phase: {phase}":
            return
    pytest.fail(f"the driver exited (rc {proc.wait()}) before phase {phase!r}:\n{''.join(seen)}")


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    err = proc.stderr.read()
    return proc.wait(timeout=300), err


def _assert_all_interrupted(out: Path) -> None:
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3
    assert recs[0] == {"line": 1, "error": {"type": "server_error", "code": "interrupted", "message": recs[0]["error"][
        "message"], "param": None, "status_code": 500}}
    assert recs[1]["line"] == 2 and recs[1]["error"]["code"] == "invalid_json"  # its own error, as during a run
    assert recs[2]["custom_id"] == "b" and recs[2]["response"]["status_code"] == 500
    assert recs[2]["response"]["body"]["error"]["code"] == "interrupted"


@pytest.mark.parametrize("phase", ["import", "load"])
def test_sigterm_during_start_up_or_loading_writes_interrupted_records(tmp_path, phase):
    proc, out = _start(tmp_path, phase)
    _wait_for(proc, phase)
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 130, err
    _assert_all_interrupted(out)
    assert "Traceback" not in err and "interrupted" in err


def test_sigterm_during_the_run_writes_the_same_records(tmp_path):
    proc, out = _start(tmp_path, "run")
    _wait_for(proc, "run")
    proc.send_signal(signal.SIGTERM)
    rc, err = _finish(proc)
    assert rc == 130, err
    _assert_all_interrupted(out)


def test_a_second_sigint_exits_130(tmp_path):
    proc, out = _start(tmp_path, "write")
    _wait_for(proc, "run")
    proc.send_signal(signal.SIGINT)
    _wait_for(proc, "write")  # the first interrupt is being handled: the results are about to be written
    proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    assert rc == 130, err
    assert "interrupted again" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # nothing half-written left behind


def test_sigkill_leaves_no_temporary_file(tmp_path):
    proc, out = _start(tmp_path, "run")
    _wait_for(proc, "run")
    proc.kill()
    proc.wait(timeout=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_killed_writers_temporary_file_is_removed_by_the_next_run(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text("{not json\n")
    dead = tmp_path / ".out.jsonl.4194305.x1y2.tmp"  # above Linux's largest pid: no such process
    alive = tmp_path / f".out.jsonl.{os.getpid()}.x1y2.tmp"  # a live writer's: kept
    other = tmp_path / ".other.jsonl.4194305.x1y2.tmp"  # another output's: kept
    for p in (dead, alive, other):
        p.write_text("")
    rc = main(["generate", "--input", str(inp), "--output", str(tmp_path / "out.jsonl"), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert not dead.exists() and alive.exists() and other.exists()
    assert json.loads((tmp_path / "out.jsonl").read_text())["error"]["code"] == "invalid_json"


def _assert_all_answered(out: Path) -> None:
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3 and recs[0]["object"] == "chat.completion"
    assert recs[1]["error"]["code"] == "invalid_json" and recs[2]["response"]["status_code"] == 200


def test_a_first_signal_during_the_write_lets_it_finish(tmp_path):
    proc, out = _start(tmp_path, "write")
    _wait_for(proc, "write")  # the run finished uninterrupted
    proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    assert rc == 130, err
    _assert_all_answered(out)  # every record is there, none lost
    assert "finishing the output" in err and "every result was written" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_a_signal_after_the_write_says_so_without_a_traceback(tmp_path):
    proc, out = _start(tmp_path, "after")
    _wait_for(proc, "run")
    proc.send_signal(signal.SIGINT)  # the run is interrupted; its records get written
    _wait_for(proc, "after")
    proc.send_signal(signal.SIGINT)
    rc, err = _finish(proc)
    assert rc == 130, err
    _assert_interrupted_run(out)
    assert "already written" in err and "without writing" not in err
    assert "Traceback" not in err and "Exception ignored" not in err


def _assert_interrupted_run(out: Path) -> None:
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 3 and recs[1]["error"]["code"] == "invalid_json"
    for rec in (recs[0], recs[2]):  # finished or interrupted: each has its record
        body = rec.get("response", {}).get("body", rec) if "custom_id" in rec else rec
        assert body.get("object") == "chat.completion" or body["error"]["code"] == "interrupted", rec


def test_the_handler_phases():
    """The rule in one place (cli._Interrupts), without timing: start-up signals wait for ``arm``; during the write
    the first is held and the second aborts; after it they are only noted."""
    from deepinfer.cli import _Interrupts

    h = _Interrupts()
    h(signal.SIGTERM, None)  # inside an import: noted, not raised
    with pytest.raises(KeyboardInterrupt):
        h.arm()
    h = _Interrupts()
    h(signal.SIGINT, None)
    with pytest.raises(SystemExit) as e:
        h(signal.SIGINT, None)
    assert e.value.code == 130
    h = _Interrupts("run")
    h.arm()  # nothing pending
    with pytest.raises(KeyboardInterrupt):
        h(signal.SIGINT, None)
    h.phase = "write"
    with pytest.raises(SystemExit):  # a second signal: the write is abandoned
        h(signal.SIGINT, None)
    h = _Interrupts("write")
    h(signal.SIGINT, None)  # a first one: the write goes on
    assert h.in_write
    h.phase = "done"
    h(signal.SIGINT, None)
    h(signal.SIGINT, None)  # after the write: never raised


def test_a_signal_before_main_is_acted_on_after_start_up(tmp_path):
    """The CLI's module installs a noting handler first thing; a signal then (before ``main`` and its imports,
    where numpy could be left half-imported) ends the run with every record and exit 130, never 143."""
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join([json.dumps(BODY), "{not json", json.dumps(BATCH)]) + "\n")
    out = tmp_path / "out.jsonl"
    script = ("import os, signal, sys; sys.argv[0] = 'deepinfer'; from deepinfer import cli; "
              "os.kill(os.getpid(), signal.SIGTERM); sys.exit(cli.main(sys.argv[1:]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "engine")]))
    proc = subprocess.run([sys.executable, "-c", script, "generate", "--input", str(inp), "--output", str(out),
                           "--no-progress", "--created", "0"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 130, proc.stderr
    _assert_all_interrupted(out)
    assert "Traceback" not in proc.stderr
