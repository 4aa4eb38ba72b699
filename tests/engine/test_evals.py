"""``deepinfer eval``: answer extraction per task (malformed answers counted wrong), item checks naming the line and
field, pass@1 with its interval, the per-sample log and resuming it, and the CLI through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer import evals
from deepinfer.cli import build_parser, run_eval
from fake_model import ScriptedModel

SAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"


@pytest.mark.parametrize("task,reply,answer", [
    ("aime", "so the total is \\boxed{19}.", "19"),
    ("aime", "first \\boxed{3}, corrected: \\boxed{ 042 }", "42"),
    ("aime", "\\boxed{1,000}", "1000"),
    ("aime", "$\\boxed{\\text{25}}$", "25"),
    ("aime", "\\boxed{90^\\circ}", "90"),
    ("aime", "\\boxed{\\frac{1}{2}}", None),  # not an integer
    ("aime", "\\boxed{12", None),  # never closed
    ("aime", "The answer is 19.", None),  # no box
    ("aime", "", None),
    ("gpqa", "Reasoning...\nAnswer: C", "C"),
    ("gpqa", "the answer is (B)", "B"),
    ("gpqa", "**Answer:** D", "D"),
    ("gpqa", "Answer: A\nwait, no.\nAnswer: B", "B"),  # the last one counts
    ("gpqa", "\\boxed{\\text{A}}", "A"),
    ("gpqa", "the answer is a mystery", None),  # a lower-case word is no choice
    ("gpqa", "I pick the second option", None),
    ("hle", "Explanation: ...\nExact Answer: Tungsten\nConfidence: 80%", "tungsten"),
    ("hle", "**Exact Answer:** $97$.", "97"),
    ("hle", "Answer:   B  ", "b"),
    ("hle", "It is tungsten.", None),
])
def test_extraction(task, reply, answer):
    got, reason = evals.extract(task, reply)
    assert got == answer
    assert (reason is None) == (answer is not None)


@pytest.mark.parametrize("task,line,needle", [
    ("aime", "{bad", "line 1: malformed JSON"),
    ("aime", "[1]", "line 1: an item must be a JSON object"),
    ("aime", '{"problem": "x", "answer": "1/2"}', "line 1: 'answer' must be an integer"),
    ("aime", '{"problem": "", "answer": 3}', "line 1: 'problem' must be a non-empty string"),
    ("aime", '{"problem": "x", "answer": true}', "'answer' must be an integer"),
    ("gpqa", '{"question": "q", "choices": ["a"], "answer": "A"}', "'choices' must be a list of 2 to 26"),
    ("gpqa", '{"question": "q", "choices": ["a", "b"], "answer": "C"}', "'answer' must be a choice letter A..B"),
    ("gpqa", '{"question": "q", "choices": ["a", "b"], "answer": 2}', "'answer' must be a choice letter"),
    ("hle", '{"question": "q", "answer": "x", "answer_type": "judged"}', "'answer_type' 'judged' is not closed-form"),
    ("hle", '{"question": "q", "answer": "x", "image": "data:image/png;base64,AA"}', "'image'"),
    ("hle", '{"id": [1], "question": "q", "answer": "x"}', "'id' must be a string or an integer"),
])
def test_bad_items_name_line_and_field(tmp_path, task, line, needle):
    f = tmp_path / "d.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(evals.DataError, match=None) as e:
        evals.load_items(task, f)
    assert needle in str(e.value)


def test_repeated_ids_and_empty_files_are_refused(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"id": 1, "problem": "x", "answer": 1}\n\n{"id": "1", "problem": "y", "answer": 2}\n')
    with pytest.raises(evals.DataError, match="line 3: id '1' repeats line 1"):
        evals.load_items("aime", f)
    f.write_text("\n")
    with pytest.raises(evals.DataError, match="no items"):
        evals.load_items("aime", f)


def test_the_samples_load_in_each_format():
    for task in evals.TASKS:
        items = evals.load_items(task, SAMPLES / f"{task}.jsonl")
        assert len(items) == 4 and len({it.id for it in items}) == 4
    gpqa = evals.load_items("gpqa", SAMPLES / "gpqa.jsonl")
    assert [it.answer for it in gpqa] == ["B", "C", "C", "A"] and "C) 3" in gpqa[2].messages[0]["content"]
    assert evals.load_items("hle", SAMPLES / "hle.jsonl")[1].answer == "tungsten"


def _replies(table: dict):
    """A ``generate`` that answers each body by its item's problem text, recording every call."""
    calls = []

    def gen(bodies):
        calls.append(len(bodies))
        out = []
        for b in bodies:
            text = b["messages"][-1]["content"]
            reply = next(v for k, v in table.items() if k in text)
            out.append(reply(b) if callable(reply) else reply)
        return out

    return gen, calls


def test_scores_with_malformed_answers_and_errors(tmp_path):
    items = evals.load_items("aime", SAMPLES / "aime.jsonl")
    gen, calls = _replies({
        "a + b = 20": {"text": "\\boxed{19}", "finish_reason": "stop"},  # right
        "marbles": lambda b: {"text": "\\boxed{29}" if b["seed"] % 2 else "\\boxed{30}", "finish_reason": "stop"},
        "2^10": {"text": "I think \\boxed{267", "finish_reason": "length"},  # cut off: unparsed
        "odd integers": {"error": {"message": "boom", "code": "engine_error"}},  # a failed request
    })
    s = evals.EvalSettings(task="aime", num_repeats=4, max_tokens=64)
    rep = evals.run_eval(items, s, gen, tmp_path / "log.jsonl", chunk_size=5)
    seeds = [evals.sample_seed("di-aime-2", k, 0) for k in range(4)]
    p2 = sum(x % 2 for x in seeds) / 4
    assert rep["per_item"] == {"di-aime-1": 1.0, "di-aime-2": p2, "di-aime-3": 0.0, "di-aime-4": 0.0}
    assert rep["pass@1"] == pytest.approx((1 + p2) / 4) and rep["complete"] and calls == [5, 5, 5, 1]
    assert rep["num_samples"] == 16 and rep["num_errors"] == 4 and rep["num_unparsed"] == 8
    lo, hi = rep["ci95"]
    assert 0 <= lo <= rep["pass@1"] <= hi <= 1 and rep["stderr"] > 0
    log = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert len(log) == 16 and {r["settings"]["max_tokens"] for r in log} == {64}
    bad = next(r for r in log if r["id"] == "di-aime-4")
    assert not bad["correct"] and bad["extracted"] is None and "boom" in bad["reason"]


def test_resume_after_interruption_and_settings_check(tmp_path):
    items = evals.load_items("gpqa", SAMPLES / "gpqa.jsonl")
    log = tmp_path / "log.jsonl"
    state = {"n": 0}

    def flaky(bodies):  # the run is interrupted after 3 samples
        out = []
        for b in bodies:
            state["n"] += 1
            out.append({"text": "Answer: C", "finish_reason": "stop"} if state["n"] <= 3 else
                       {"error": {"code": "interrupted", "message": "interrupted"}})
        return out

    s = evals.EvalSettings(task="gpqa", num_repeats=2)
    rep = evals.run_eval(items, s, flaky, log, chunk_size=4)
    assert not rep["complete"] and rep["num_samples"] == 3 and len(log.read_text().splitlines()) == 3
    with open(log, "a") as f:
        f.write('{"id": "di-gpqa-3", "rep')  # a line torn by a kill: dropped
    seen = []

    def rest(bodies):
        seen.extend(bodies)
        return [{"text": "Answer: C", "finish_reason": "stop"} for _ in bodies]

    rep = evals.run_eval(items, s, rest, log)
    assert rep["complete"] and len(seen) == 5 and rep["num_samples"] == 8
    assert rep["per_item"] == {"di-gpqa-1": 0.0, "di-gpqa-2": 1.0, "di-gpqa-3": 1.0, "di-gpqa-4": 0.0}
    assert all(json.loads(x) for x in log.read_text().splitlines())  # every line whole
    seen.clear()
    assert evals.run_eval(items, s, rest, log)["pass@1"] == 0.5 and not seen  # nothing left to run
    with pytest.raises(ValueError, match="other settings.*--restart"):
        evals.run_eval(items, evals.EvalSettings(task="gpqa", num_repeats=2, temperature=0.6), rest, log)
    assert evals.run_eval(items, evals.EvalSettings(task="gpqa", num_repeats=1, temperature=0.6), rest, log,
                          restart=True)["num_samples"] == 4


def test_score_of_one_item_has_no_interval():
    rep = evals.score([{"id": "a", "correct": True, "extracted": "1"}, {"id": "a", "correct": False,
                                                                     "extracted": None}])
    assert rep["pass@1"] == 0.5 and rep["ci95"] is None and rep["num_unparsed"] == 1


def test_cli_through_the_engine_scores_a_scripted_model(tmp_path, capsys):
    """A model that always writes a thought and ``\\boxed{19}``: item 1 right, the others wrong; the second run
    resumes from the log and runs nothing."""
    from deepinfer import LLM

    ids = LLM(ScriptedModel([0]), num_blocks=16, max_model_len=4096).encode("Let me count.</think>The answer is "
                                                                            "\\boxed{19}.")
    argv = ["eval", "--task", "aime", "--data", str(SAMPLES / "aime.jsonl"), "-n", "2", "--max-tokens", "64",
            "--log", str(tmp_path / "aime.log"), "--output", str(tmp_path / "report.json"), "--num-blocks", "32",
            "--no-progress"]
    args = build_parser().parse_args(argv)
    assert run_eval(args, model_obj=ScriptedModel(ids)) == 0
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["per_item"]["di-aime-1"] == 1.0 and rep["pass@1"] == 0.25 and rep["num_samples"] == 8
    assert rep["settings"]["thinking"] and rep["settings"]["temperature"] == 1.0  # the defaults
    assert json.loads(capsys.readouterr().out) == rep
    assert run_eval(build_parser().parse_args(argv), model_obj=ScriptedModel(ids)) == 0
    assert len((tmp_path / "aime.log").read_text().splitlines()) == 8


def test_cli_bad_data_fails_before_the_model_loads(tmp_path):
    from deepinfer.cli import main

    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "q", "choices": ["a", "b"], "answer": "Z"}\n')
    assert main(["eval", "--task", "gpqa", "--data", str(f), "--model", str(tmp_path / "nowhere")]) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "--task", "mmlu", "--data", str(f)])
