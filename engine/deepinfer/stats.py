"""Counters of one ``LLM`` run and their summary (``LLM.last_stats``, the CLI's summary line)."""

from __future__ import annotations

from dataclasses import dataclass, field

NO_THROUGHPUT = "no request finished: tok/s not measured (reported as 0)"


def spec_counts(runner) -> dict | None:
    """The speculative decoder's counters so far, or None with speculation off."""
    st = runner.spec.stats if runner is not None and runner.spec is not None else None
    return None if st is None else {"verifications": st.verifications, "drafted": st.drafted,
                                    "accepted": st.accepted, "plain_steps": st.plain_steps}


@dataclass
class EngineStats:
    """Counters of one ``LLM`` run (prefill/decode times split per step in proportion to their tokens). When no
    request finished (all refused, failed or interrupted), ``summary()`` reports the tok/s figures as 0 and says so
    in ``note`` (otherwise null): steps of requests that never finished measure nothing the output shows."""

    num_requests: int = 0
    num_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefill_tokens: int = 0  # tokens computed in prefill (incl. recompute after preemption)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    wall_time: float = 0.0
    num_steps: int = 0
    num_preemptions: int = 0
    interrupted: bool = False  # KeyboardInterrupt / SIGTERM (CLI) stopped the run: unfinished requests got errors
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    # per step: (decode tokens, prefill tokens, seconds, forward enqueue seconds, host seconds, GPU seconds); a
    # step's seconds run from the previous step's result to its own (the throughput view: with asynchronous
    # scheduling the host prepares a step while the GPU runs the one before), host seconds are the scheduling,
    # enqueue and result handling it took, GPU seconds the CUDA-event time of its forward (0 on the CPU). The
    # medians of pure prefill / pure decode steps are robust to a few steps slowed by the host (GC, other
    # processes), which the means above carry in full
    steps: list[tuple[int, int, float, float, float, float]] = field(default_factory=list)
    # per step, the sequences it scheduled (same order as ``steps``; empty in merged stats: the peak figures are
    # per rank)
    step_seqs: list[int] = field(default_factory=list)
    # speculation on: this run's {"verifications", "drafted", "accepted", "plain_steps"} (``SpecStats``), else None
    spec: dict | None = None

    @classmethod
    def merged(cls, parts: list["EngineStats"]) -> "EngineStats":
        """The stats of data-parallel ranks that ran side by side: counts and per-request / per-step lists added
        up, times and steps the longest rank's (so tok/s are the ranks' sum; step medians are per rank)."""
        out = cls()
        for p in parts:
            for f in ("num_requests", "num_errors", "prompt_tokens", "completion_tokens", "prefill_tokens",
                      "cached_tokens", "decode_tokens", "num_preemptions"):
                setattr(out, f, getattr(out, f) + getattr(p, f))
            for f in ("prefill_time", "decode_time", "wall_time", "num_steps"):
                setattr(out, f, max(getattr(out, f), getattr(p, f)))
            out.interrupted |= p.interrupted
            out.ttft += p.ttft
            out.tpot += p.tpot
            out.steps += p.steps
            if p.spec is not None:
                out.spec = {k: (out.spec or {}).get(k, 0) + v for k, v in p.spec.items()}
        return out

    def summary(self) -> dict:
        # some request finished (or, for stats built from steps alone, there are steps): the rates mean something
        measured = self.num_requests > self.num_errors or (self.num_requests == 0 and bool(self.steps))

        def mean(x: list[float]) -> float:
            return sum(x) / len(x) if x else 0.0

        def median(x: list[float]) -> float:
            x = sorted(x)
            if not x:
                return 0.0
            h = len(x) // 2
            return x[h] if len(x) % 2 else (x[h - 1] + x[h]) / 2

        def median_rate(pure: list[tuple[int, float]]) -> float:
            return median([n / dt for n, dt in pure if dt > 0]) if measured else 0.0

        # the steady state: from the first to the last step at the run's largest batch (a closed run's ramp and
        # drain left out; steps between, held admissions included, count); not measured for merged ranks
        peak = max(self.step_seqs, default=0) if len(self.step_seqs) == len(self.steps) else 0
        at_peak = []
        if peak:
            i0 = self.step_seqs.index(peak)
            i1 = len(self.step_seqs) - 1 - self.step_seqs[::-1].index(peak)
            at_peak = self.steps[i0:i1 + 1]
        peak_tokens = sum(d for d, *_ in at_peak)
        peak_time = sum(dt * d / (d + p) for d, p, dt, *_ in at_peak if d)

        return {
            "requests": self.num_requests, "errors": self.num_errors,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_tok_s": self.prefill_tokens / self.prefill_time if self.prefill_time > 0 and measured else 0.0,
            "decode_tok_s": self.decode_tokens / self.decode_time if self.decode_time > 0 and measured else 0.0,
            "note": None if measured else NO_THROUGHPUT,
            "decode_tok_s_at_peak": peak_tokens / peak_time if peak_time > 0 and measured else 0.0,
            "peak_seqs": peak, "peak_steps": len(at_peak),
            "prefill_tok_s_median": median_rate([(p, dt) for d, p, dt, *_ in self.steps if p and not d]),
            "decode_tok_s_median": median_rate([(d, dt) for d, p, dt, *_ in self.steps if d and not p]),
            "prefill_step_ms_median": 1000 * median([dt for d, p, dt, *_ in self.steps if p and not d]),
            "prefill_gpu_ms_median": 1000 * median([g for d, p, *_, g in self.steps if p and not d]),
            # a pure decode step's median time, host time until its forward was queued, host time in all and
            # GPU time
            "decode_step_ms_median": 1000 * median([dt for d, p, dt, *_ in self.steps if d and not p]),
            "decode_enqueue_ms_median": 1000 * median([eq for d, p, _, eq, *_ in self.steps if d and not p]),
            "decode_host_ms_median": 1000 * median([h for d, p, _, _, h, _ in self.steps if d and not p]),
            "decode_gpu_ms_median": 1000 * median([g for d, p, *_, g in self.steps if d and not p]),
            "ttft_ms": 1000 * mean(self.ttft), "tpot_ms": 1000 * mean(self.tpot),
            "steps": self.num_steps, "preemptions": self.num_preemptions, "wall_s": self.wall_time,
            "speculation": None if self.spec is None else {
                **self.spec, "acceptance_length": 1 + self.spec["accepted"] / self.spec["verifications"]
                if self.spec["verifications"] else None},
        }

    def format(self) -> str:
        s = self.summary()
        rates = (f"prefill {s['prefill_tok_s']:.1f} tok/s | decode {s['decode_tok_s']:.1f} tok/s | "
                 f"TTFT {s['ttft_ms']:.1f} ms | TPOT {s['tpot_ms']:.1f} ms") if s["note"] is None else \
            f"prefill n/a | decode n/a ({s['note']})"
        sp = s["speculation"]
        acc = "n/a" if sp is None or sp["acceptance_length"] is None else f"{sp['acceptance_length']:.2f}"
        spec = "" if sp is None else (f" | speculation: {sp['verifications']} verifications, acceptance {acc}, "
                                      f"{sp['plain_steps']} plain steps")
        return (f"requests {s['requests']} (errors {s['errors']}) | prompt tokens {s['prompt_tokens']} | "
                f"completion tokens {s['completion_tokens']} | {rates} | "
                f"steps {s['steps']} | preemptions {s['preemptions']}{spec} | wall {s['wall_s']:.2f} s")
