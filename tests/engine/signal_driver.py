"""Runs ``deepinfer generate`` in a subprocess for the signal tests (test_cli_signals.py). It prints a marker line on
stderr when it reaches a phase, then waits there so the test can send a signal:

- ``import``: the first ``import torch`` (start-up) prints ``phase: import`` and waits for a signal;
- ``load``: loading the tiny checkpoint prints ``phase: load`` and sleeps;
- ``run``: each forward of a fake model prints ``phase: run`` and sleeps 0.2 s;
- ``write``: like ``run``, and writing the output prints ``phase: write`` and waits for a signal first;
- ``after``: like ``run``, and once the output is written prints ``phase: after`` and waits for a signal.

Usage: ``python signal_driver.py PHASE -- GENERATE_ARGS...``.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))


def say(phase: str) -> None:
    print(f"phase: {phase}", file=sys.stderr, flush=True)


def say_and_wait(phase: str, seconds: float = 60) -> None:
    """Print the phase's marker, then sleep until the CLI's handler counts one more signal than before the marker
    (a handler that does not raise lets ``time.sleep`` go on), or ``seconds``. The count is read first: the test
    signals as soon as it reads the marker."""
    cli = sys.modules.get("deepinfer.cli")
    handler = lambda: getattr(cli, "_HANDLER", None)  # noqa: E731
    start = handler().count if handler() else 0
    say(phase)
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (handler() and handler().count > start):
        time.sleep(0.05)


class _SlowTorchImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            say_and_wait("import")
        return None


def main() -> int:
    phase, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    if phase == "import":
        assert "torch" not in sys.modules
        sys.meta_path.insert(0, _SlowTorchImport())
        from deepinfer import cli

        return cli.main(argv)
    from deepinfer import cli, llm

    if phase == "load":
        def slow_load(*args, **kwargs):
            say("load")
            time.sleep(60)

        llm._load_checkpoint = slow_load
        return cli.main(argv)
    from fake_model import FakeConfig, FakeModel

    class Slow(FakeModel):
        def forward(self, *args, **kwargs):
            say("run")
            time.sleep(0.2)
            return super().forward(*args, **kwargs)

    run_generate = cli.run_generate
    cli.run_generate = lambda args: run_generate(args, model_obj=Slow(FakeConfig(max_position_embeddings=1024,
                                                                               eos_every=10**9)))
    if phase in ("write", "after"):
        write = cli._Output.write

        def slow_write(self, records):
            if phase == "write":
                say_and_wait("write")
            write(self, records)
            if phase == "after":
                cli._phase("done")  # as run_generate does next
                say_and_wait("after")

        cli._Output.write = slow_write
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
