"""Speculative decoding through the engine on the tiny model (random weights, CPU): greedy outputs equal speculation
off, stops and max_tokens inside an accepted block, usage, preemption with drafts, a draining batch.

With random weights the MTP layer's drafts are almost always rejected, so most tests also run an oracle drafter
(the spec-off output, with some drafts deliberately wrong): blocks of several accepted drafts, partial rejections
and their rollback."""

from __future__ import annotations

import random
import types

import pytest
import torch

import deepinfer.spec_cost as sc
import deepinfer.spec_decode as sd
from deepinfer.config import EngineConfig
from deepinfer.engine import OutputProcessor
from deepinfer.llm import LLM
from deepinfer.scheduler import Scheduler
from deepinfer.sequence import SamplingParams, Sequence

pytestmark = pytest.mark.usefixtures("one_cpu_thread", "cpu_accelerator")

PROMPTS = [[(7 * i + 3 * j) % 1000 + 10 for j in range(5 + 9 * i)] for i in range(4)]
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    llm = LLM("tiny", max_num_seqs=8)
    return {tuple(p): o for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


def _spec(k: int, schedule: str = "fixed", graphs: bool = False, **kw) -> LLM:
    """A speculating engine on the tiny model; ``graphs``: its decode steps through ``SpecGraphs`` (off CUDA,
    eager replays over the graphs' static buffers; contexts up to 512 positions)."""
    llm = LLM("tiny", speculative_method="mtp", num_speculative_tokens=k, spec_schedule=schedule,
              **{"max_num_seqs": 8, **kw})
    if graphs:
        from deepinfer.spec_graphs import SpecGraphs, spec_buckets

        llm.runner.spec.graphs = SpecGraphs(llm.runner, k, spec_buckets(llm.config.max_num_seqs), 512)
    return llm


@pytest.fixture
def oracle(monkeypatch, reference):
    """Drafts from the spec-off greedy output: right except where ``(output index + prompt length) % 3 == 0``."""
    refs = {p: o.token_ids for p, o in reference.items()}
    _use_oracle(monkeypatch, refs)
    return refs


def _use_oracle(monkeypatch, refs: dict) -> None:
    """Make the drafter propose ``refs[prompt]`` (output tokens by index), every third one wrong."""
    real = sd.SpecDecoder._draw

    def draw(self, logits, states, counters, greedy_pre=None):
        toks, conf, probs = real(self, logits, states, counters, greedy_pre)
        for n, (st, c) in enumerate(zip(states, counters)):
            ref = refs.get(tuple(st.token_ids[:st.num_prompt_tokens]))
            if ref is not None and c < len(ref):
                wrong = (c + st.num_prompt_tokens) % 3 == 0
                toks[n] = (ref[c] + 1) % 1000 if wrong else ref[c]
                if conf is not None:  # the confidence schedule's
                    conf[n] = 0.2 if wrong else 0.9
                if probs[n] is not None:
                    probs[n] = torch.nn.functional.one_hot(toks[n].clone(), probs[n].numel()).float()
        return toks, conf, probs

    monkeypatch.setattr(sd.SpecDecoder, "_draw", draw)


def _greedy_equals_reference(llm: LLM, reference: dict):
    """Greedy outputs of ``llm`` over PROMPTS equal the spec-off ones (tokens; logprobs to 1e-4), with whole blocks
    accepted and partial rejections; returns the speculation counters."""
    outs = llm.generate(PROMPTS, GREEDY)
    for p, o in zip(PROMPTS, outs):
        ref = reference[tuple(p)]
        assert o.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=1e-4)
    stats = llm.runner.spec.stats
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # whole blocks and partial rejections
    return stats


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_speculation_off_alone_and_batched(reference, k):
    llm = _spec(k)
    batched = llm.generate(PROMPTS, GREEDY)
    alone = [llm.generate([p], GREEDY)[0] for p in PROMPTS[:2]]
    for p, o in zip(PROMPTS, batched):
        assert o.token_ids == reference[tuple(p)].token_ids and o.finish_reason == "length"
    for p, o in zip(PROMPTS, alone):
        assert o.token_ids == reference[tuple(p)].token_ids
    assert llm.runner.spec.stats.verifications > 0


@pytest.mark.parametrize("k,schedule", [(1, "fixed"), (3, "confidence"), (5, "fixed")])
def test_greedy_with_accepted_blocks_equals_speculation_off(reference, oracle, k, schedule):
    llm = _spec(k, schedule)
    stats = _greedy_equals_reference(llm, reference)
    if k > 1:
        assert stats.accepted_at[1] > 0


def test_stop_token_inside_an_accepted_block(reference, oracle):
    p = PROMPTS[2]
    ref = reference[tuple(p)].token_ids
    stop = ref[6]
    cut = ref.index(stop)
    out = _spec(3).generate([p], SamplingParams(max_tokens=14, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop" and out.stop_token_id == stop


@pytest.mark.parametrize("graphs", [False, True])
def test_max_tokens_inside_a_block(reference, oracle, graphs):
    llm = _spec(3, graphs=graphs)
    for n in (1, 2, 5):
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for p, o in zip(PROMPTS, outs):
            assert o.token_ids == reference[tuple(p)].token_ids[:n] and o.finish_reason == "length"
        assert llm.last_stats.completion_tokens == n * len(PROMPTS)


def test_postprocess_truncates_a_block_at_max_tokens_and_rolls_back():
    cfg = EngineConfig(num_blocks=4, block_size=128, speculative_method="mtp", num_speculative_tokens=3)
    from deepinfer.block_manager import BlockManager

    sched = Scheduler(cfg, BlockManager(4, 128), 1024, eos_token_ids=(0,))
    a = Sequence(1, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=False), seed=0)
    b = Sequence(2, [5, 6, 7], SamplingParams(max_tokens=10), seed=0)
    for s in (a, b):
        sched.add(s)
    sched.postprocess(sched.schedule(), [11, 11], [-0.5, -0.5])  # prefills: one token each
    out = sched.schedule()
    assert [r.num_draft_tokens for r in out.scheduled] == [1, 3]  # a: max_tokens leaves room for 1 draft
    assert [r.num_new_tokens for r in out.scheduled] == [2, 4]
    # a gets a longer block than it may keep; b's block holds EOS after 2 tokens
    sched.postprocess(out, [[12, 13, 14], [21, 22, 0, 23]], [[-1.0] * 3, [-1.0] * 4], [[[]] * 3, [[]] * 4])
    assert a.output_token_ids == [11, 12, 13] and a.finish_reason == "length"
    assert b.output_token_ids == [11, 21, 22] and b.finish_reason == "stop" and b.stop_token_id == 0
    assert sched.num_generated_tokens == 6
    c = Sequence(3, [5, 6, 7], SamplingParams(max_tokens=10), seed=0)
    sched.add(c)
    sched.postprocess(sched.schedule(), [11], [-0.5])
    out = sched.schedule()
    sched.postprocess(out, [[31, 32]], [[-1.0, -1.0]], [[[], []]])  # one draft accepted of 3
    assert c.num_computed_tokens == 3 + 2 and c.num_tokens == 6  # the rejected positions no longer count


def test_stop_string_inside_a_block_ends_the_output_there(reference, oracle):
    llm = _spec(3)
    eng = llm.engine
    out = OutputProcessor(eng)
    p = PROMPTS[1]
    seq = Sequence(900, list(p), SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), seed=0)
    seen: list[int] = []

    def stop_at_5(t, lp, top):
        seen.append(t)
        return len(seen) == 5

    eng.add_request(seq)
    out.add(seq, stop_at_5)
    generated0 = llm.scheduler.num_generated_tokens
    while eng.has_unfinished_requests():
        out.process(eng.step())
    assert seq.finish_reason == "stop" and seq.output_token_ids == seen == reference[tuple(p)].token_ids[:5]
    assert len(seq.output_logprobs) == len(seq.output_top_logprobs) == 5
    assert llm.scheduler.num_generated_tokens - generated0 == 5  # usage counts what is kept
    assert llm.runner.spec.stats.accepted > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_with_drafts_in_flight(reference, oracle, graphs):
    # 3 blocks for 4 requests of up to 150 positions: requests are preempted and recomputed mid-decode
    llm = _spec(3, num_blocks=3, max_num_batched_tokens=256, graphs=graphs)
    long = [list(p) + [11] * 120 for p in PROMPTS]
    ref_llm = LLM("tiny", max_num_seqs=8)
    sp = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    refs = ref_llm.generate(long, sp)
    outs = llm.generate(long, sp)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert not graphs or llm.runner.spec.stats.graph_steps > 0


def test_a_batch_draining_to_one_request_completes(reference):
    llm = _spec(3, max_num_seqs=10)
    prompts = [[(5 * i + j) % 900 + 20 for j in range(3 + i)] for i in range(10)]
    params = [SamplingParams(max_tokens=1 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [1 + 2 * i for i in range(10)]
    assert all(o.finish_reason == "length" for o in outs)
    assert not llm.engine.has_unfinished_requests() and llm.block_manager.num_free_blocks == llm.config.num_blocks


def test_sampled_requests_are_batch_invariant_and_reproducible():
    # (top-k / top-p filtering of the target and drafter distributions: test_speculative.py)
    llm = _spec(3, batch_invariant=True)
    sps = [SamplingParams(max_tokens=8, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(3)]
    batched = llm.generate(PROMPTS[:3], sps)
    alone = [llm.generate([p], sp)[0] for p, sp in zip(PROMPTS[:3], sps)]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert all(len(o.token_ids) == 8 for o in batched)


def test_requests_that_cannot_speculate_decode_plainly_next_to_ones_that_do(reference):
    llm = _spec(2)
    penal = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=0.5)
    outs = llm.generate(PROMPTS[:2], [penal, GREEDY])
    plain = LLM("tiny", max_num_seqs=8).generate([PROMPTS[0]], penal)[0]
    assert outs[0].token_ids == plain.token_ids
    assert outs[1].token_ids == reference[tuple(PROMPTS[1])].token_ids


@pytest.mark.parametrize("field,value,match", [
    ("speculative_method", "eagle", "speculative_method"),
    ("num_speculative_tokens", 0, "num_speculative_tokens"),
    ("num_speculative_tokens", 6, "num_speculative_tokens"),
    ("num_speculative_tokens", 2.0, "num_speculative_tokens"),
    ("spec_schedule", "adaptive", "spec_schedule"),
])
def test_bad_settings_name_the_field(field, value, match):
    cfg = EngineConfig(speculative_method="mtp")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_choose_lengths_maximises_expected_tokens_per_cost():
    flat = lambda ks: 1.0  # noqa: E731 - a step that costs the same for any number of drafts
    assert sc.choose_lengths([[0.9, 0.5, 0.1], [0.2]], flat)[0] == [3, 1]
    steep = lambda ks: 1.0 + sum(ks)  # noqa: E731 - every draft costs a whole step
    assert sc.choose_lengths([[0.9, 0.9], [0.6]], steep)[0] == [0, 0]
    mid = lambda ks: 1.0 + 0.25 * sum(ks)  # noqa: E731
    # survivals 0.9, 0.81, 0.2: the first two pay for their cost, the third does not
    assert sc.choose_lengths([[0.9, 0.9], [0.2]], mid)[0] == [2, 0]
    assert sc.choose_lengths([], flat)[0] == []
    # a graph-shaped cost (set by the longest): survivals 0.95, 0.9025, 0.857 / 0.5; cap 1 gives 3.45 / 1.5 = 2.3,
    # better than any set of the largest survivals ([3, 1]: 5.21 / 2.5) or no draft (2 / 1)
    longest = lambda ks: 1.0 + 0.5 * max(ks, default=0)  # noqa: E731
    assert sc.choose_lengths([[0.95, 0.95, 0.95], [0.5]], longest)[0] == [1, 1]
    # survivals 0.9, 0.81, 0.729 / 0.9, 0.81: cap 2 (5.42 / 2) beats cap 1 (3.8 / 1.5) and cap 3 (6.15 / 2.5)
    assert sc.choose_lengths([[0.9, 0.9, 0.9], [0.9, 0.9]], longest)[0] == [2, 2]



def test_choose_lengths_cost_classes_match_the_full_search():
    """A CostByLongest (caps only) reaches the same expected tokens per cost as the full search over the same
    cost given as a plain function, and a CostByTokens the same choice, on random confidences and costs."""
    rng = random.Random(3)

    def rate(conf, lengths, cost):
        e = len(conf)
        for cs, m in zip(conf, lengths):
            s = 1.0
            for c in cs[:m]:
                s *= c
                e += s
        return e / cost(lengths)

    for _ in range(300):
        n, k = rng.randint(1, 9), rng.randint(1, 5)
        conf = [[rng.random() for _ in range(rng.randint(0, k))] for _ in range(n)]
        per = sorted(rng.uniform(0.5, 3.0) for _ in range(k + 1))
        fast, fast_rate = sc.choose_lengths(conf, sc.CostByLongest(per))
        full, _ = sc.choose_lengths(conf, lambda ks: per[max(ks, default=0)])
        assert all(0 <= m <= len(cs) for m, cs in zip(fast, conf))
        assert rate(conf, fast, lambda ks: per[max(ks, default=0)]) == pytest.approx(
            rate(conf, full, lambda ks: per[max(ks, default=0)]), rel=1e-12)
        # the returned rate is the choice's expected tokens per cost
        assert fast_rate == pytest.approx(rate(conf, fast, lambda ks: per[max(ks, default=0)]), rel=1e-12)
        # a cost by tokens: the running draft total gives the plain function's choice
        by_tokens = sc.CostByTokens(lambda n, t: 1.0 + t / 7.0, n, n)
        got, got_rate = sc.choose_lengths(conf, by_tokens)
        want, want_rate = sc.choose_lengths(conf, lambda ks: 1.0 + (n + sum(ks)) / 7.0)
        assert got == want and got_rate == pytest.approx(want_rate, rel=1e-12)

def _recording(llm: LLM) -> dict:
    """``{prompt ids: output ids}`` of the requests ``llm`` runs from now on (filled as they finish)."""
    seen: list[Sequence] = []
    new_seq = llm._new_seq

    def record(prompt_ids, params):
        seq = new_seq(prompt_ids, params)
        seen.append(seq)
        return seq

    llm._new_seq = record
    return seen


def test_chat_with_speculation_equals_speculation_off(monkeypatch):
    """Stop strings inside accepted blocks and the usage of LLM.chat (completion and reasoning tokens) are those
    of speculation off."""
    user = {"role": "user", "content": "Tell me about Paris."}
    base = {"messages": [user], "max_tokens": 16, "temperature": 0, "seed": 1}
    off = LLM("tiny", created=0)
    seen = _recording(off)
    free = off.chat([dict(base, thinking={"type": "disabled"}), dict(base, thinking={"type": "enabled"})])
    refs = {tuple(s.prompt_token_ids): s.output_token_ids for s in seen}
    text = free[0]["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip()
    real = sd.SpecDecoder._draw

    def draw(self, logits, states, counters, greedy_pre=None):  # drafts from speculation off, every third one wrong
        toks, conf, probs = real(self, logits, states, counters, greedy_pre)
        for n, (st, c) in enumerate(zip(states, counters)):
            ref = refs.get(tuple(st.token_ids[:st.num_prompt_tokens]), [])
            if c < len(ref):
                toks[n] = ref[c] if c % 3 else (ref[c] + 1) % 1000
                if probs[n] is not None:  # a sampled request: the draft was drawn from a point mass
                    probs[n] = torch.nn.functional.one_hot(toks[n].clone(), probs[n].numel()).float()
        return toks, conf, probs

    monkeypatch.setattr(sd.SpecDecoder, "_draw", draw)
    reqs = [dict(base, thinking={"type": "disabled"}, stop=[stop]), dict(base, thinking={"type": "enabled"})]
    want = off.chat(reqs)
    llm = LLM("tiny", created=0, speculative_method="mtp", num_speculative_tokens=3, spec_schedule="fixed")
    got = llm.chat(reqs)
    assert llm.runner.spec.stats.accepted > 0
    # greedy: the same text and usage; thinking mode samples (temperature is ignored there), so only the usage rules
    assert got[0]["choices"] == want[0]["choices"] and got[0]["usage"] == want[0]["usage"]
    assert got[0]["choices"][0]["finish_reason"] == "stop"
    assert got[0]["usage"]["completion_tokens"] < 16
    u = got[1]["usage"]
    assert u["completion_tokens_details"]["reasoning_tokens"] <= u["completion_tokens"] == 16


def test_step_cost_table_is_profiled_and_interpolated():
    llm = _spec(2, max_num_seqs=4)
    table = sc.profile_step_cost(llm.runner, [1, 4], 2, repeats=1)
    assert sorted(table.points) == [1, 4] and [t for t, _ in table.points[4]] == [4, 8, 12]
    assert all(c > 0 for pts in table.points.values() for _, c in pts)
    t = sc.StepCostTable({1: [(1, 1.0), (3, 2.0)], 8: [(8, 4.0), (16, 8.0)]})
    assert t(1, 2) == 1.5 and t(2, 12) == 6.0 and t(100, 8) == 4.0 and t(1, 5) == 3.0
    with pytest.raises(ValueError, match="points"):
        sc.StepCostTable({})
    # the engine's outputs do not depend on the cost model (greedy)
    llm.runner.spec.cost = table
    assert llm.generate([PROMPTS[0]], GREEDY)[0].token_ids == LLM("tiny").generate([PROMPTS[0]], GREEDY)[0].token_ids


def test_a_model_without_an_mtp_drafter_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="speculative_method"):
        LLM("tiny-v41", speculative_method="mtp")


@pytest.mark.parametrize("graphs", [False, True])
def test_prefix_cache_hits_chunked_prefill_and_top_logprobs(monkeypatch, graphs):
    """Requests sharing a 260-token prefix (prefix-cache hits, replayed window), prompts prefilled in chunks
    next to verifications, top logprobs of emitted tokens: all as with speculation off."""
    shared = [(13 * j) % 997 + 3 for j in range(260)]
    prompts = [shared + [500 + i] * (3 + i) for i in range(3)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, top_logprobs=2)
    run = lambda llm: [o for p in (prompts[:1], prompts[1:]) for o in llm.generate(p, sp)]  # noqa: E731
    refs = run(LLM("tiny", max_num_batched_tokens=96))
    _use_oracle(monkeypatch, {tuple(p): r.token_ids for p, r in zip(prompts, refs)})
    llm = _spec(3, max_num_batched_tokens=96, graphs=graphs)
    outs = run(llm)
    assert not graphs or llm.runner.spec.stats.graph_steps > 0
    assert llm.block_manager.prefix_stats.hits > 0 and llm.runner.spec.stats.accepted > 0
    for o, r in zip(outs, refs):
        assert o.token_ids == r.token_ids
        assert [[t for t, _ in top] for top in o.top_logprobs] == [[t for t, _ in top] for top in r.top_logprobs]
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=1e-4)


def test_sampled_acceptance_with_a_one_token_target_is_greedy(reference, oracle):
    """top_k = 1 makes the target a point mass at its argmax: speculative sampling (acceptance ratios, residual
    resamples, each verified row's target distribution at its own position) must give the greedy output."""
    llm = _spec(3)
    sps = [SamplingParams(max_tokens=14, temperature=1.0, top_k=1, seed=7 + i, ignore_eos=True) for i in range(4)]
    outs = llm.generate(PROMPTS, sps)
    assert [o.token_ids for o in outs] == [reference[tuple(p)].token_ids for p in PROMPTS]
    stats = llm.runner.spec.stats
    assert 0 < stats.accepted < stats.drafted


def test_batch_invariant_greedy_is_bitwise_speculation_off(oracle):
    off = LLM("tiny", batch_invariant=True, max_num_seqs=8).generate(PROMPTS[:2], GREEDY)
    on = _spec(3, batch_invariant=True).generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert [o.logprobs for o in on] == [o.logprobs for o in off]


def test_cli_options_reach_the_engine_config():
    from deepinfer.cli import build_parser, engine_config

    args = build_parser().parse_args(["generate", "--input", "a", "--output", "b", "--speculative-method", "mtp",
                                      "--num-speculative-tokens", "2", "--spec-schedule", "fixed",
                                      "--spec-admit-hold", "0"])
    cfg = engine_config(args)
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.spec_schedule, cfg.num_drafts,
            cfg.spec_admit_hold) == ("mtp", 2, "fixed", 2, 0)
    off = engine_config(build_parser().parse_args(["generate", "--input", "a", "--output", "b"]))
    assert off.speculative_method is None and off.num_drafts == 0 and off.spec_admit_hold == 8
    bad = engine_config(build_parser().parse_args(["generate", "--input", "a", "--output", "b",
                                                   "--speculative-method", "mtp", "--num-speculative-tokens", "9"]))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        bad.validate()
    for flag, value in (("--num-speculative-tokens", "2"), ("--spec-schedule", "fixed"), ("--spec-admit-hold", "4")):
        with pytest.raises(ValueError, match=f"{flag}: needs --speculative-method mtp"):
            engine_config(build_parser().parse_args(["generate", "--input", "a", "--output", "b", flag, value]))


@pytest.mark.parametrize("graphs", [False, True])
def test_confidence_schedule_stops_verifying_an_unconfident_request(reference, oracle, monkeypatch, graphs):
    """With a cost that makes a draft of confidence 0.2 not worth its token, a request whose drafts all come
    with 0.2 verifies nothing once its first verification read them, while the others (0.95) verify every
    step; the choice is made before the chain, so the unconfident request drafts nothing past its first draft;
    the greedy outputs equal speculation off."""
    low = tuple(PROMPTS[1])
    draw = sd.SpecDecoder._draw

    def confident_draw(self, logits, states, counters, greedy_pre=None):
        toks, conf, probs = draw(self, logits, states, counters, greedy_pre)
        for n, st in enumerate(states):
            conf[n] = 0.2 if tuple(st.token_ids[:st.num_prompt_tokens]) == low else 0.95
        return toks, conf, probs

    monkeypatch.setattr(sd.SpecDecoder, "_draw", confident_draw)
    chosen: dict[tuple, list[int]] = {}
    lengths = sd.SpecDecoder._lengths

    def record(self, items, nv):
        out = lengths(self, items, nv)
        for it, k in zip(items, out):
            st = self.runner.requests[it.req_id]
            if it.num_draft_tokens:
                chosen.setdefault(tuple(st.token_ids[:st.num_prompt_tokens]), []).append(k)
        return out

    monkeypatch.setattr(sd.SpecDecoder, "_lengths", record)
    llm = _spec(3, "confidence", graphs=graphs)
    llm.runner.spec.cost = lambda n, t: 1.0 + 0.5 * t  # noqa: E731 - half a step per token
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)].token_ids for p in PROMPTS]
    assert chosen[low][0] == 3 and set(chosen[low][1:]) == {0}, chosen[low]  # verified once, with nothing known
    for p in PROMPTS:
        if tuple(p) != low:
            assert min(chosen[tuple(p)]) >= 1, chosen[tuple(p)]
    assert (llm.runner.spec.stats.graph_steps > 0) == graphs


def test_confidences_read_for_the_next_choice_stop_at_the_first_rejection():
    """The schedule reads, per verification, its drafts' confidences up to the first rejected one (later ones
    depend on a rejected draw); the first draft's alone without a verification; unknown depths fall back to
    the measured acceptance rate (1 before any)."""
    spec = _spec(3, "confidence").runner.spec
    assert [spec._seen(3, e) for e in (1, 2, 3, 4)] == [1, 2, 3, 3]
    assert spec._seen(0, None) == spec._seen(2, None) == 1
    spec.confidences[7] = [0.5]
    spec.accept_rate = [0.9, 0.8, None]
    assert spec.expected_confidences(7, 3) == [0.5, 0.8, 1.0]
    assert spec.expected_confidences(8, 2) == [0.9, 0.8]


def test_confidences_are_calibrated_by_measured_acceptance():
    """The schedule reads a confidence through its depth and bin's measured acceptance: raw confidences of 0.3 at
    depth 0 whose drafts were always accepted read near 1 after a few dozen verifications, other bins and depths
    keep their raw value; a verification counts only the depths whose earlier drafts were accepted."""
    spec = _spec(3, "confidence").runner.spec
    assert spec.calibrated(0, 0.3) == pytest.approx(0.3)  # nothing measured: the raw confidence
    item = types.SimpleNamespace(req_id=5)
    for _ in range(40):
        spec._cal_bins[5] = [spec._bin(0.3), spec._bin(0.3), spec._bin(0.3)]
        spec._calibrate([item], [3], [2], [1])  # 3 verified, the first accepted, the second rejected
    assert spec.calibrated(0, 0.31) > 0.9 and spec.calibrated(0, 0.9) == pytest.approx(0.9)
    assert spec.calibrated(1, 0.3) < 0.1  # depth 1: verified and rejected every time
    assert spec.calibrated(2, 0.3) == pytest.approx(0.3)  # depth 2: never verified after an accepted depth 1
    spec.confidences[5] = [0.3, 0.3]
    spec.accept_rate = [0.5, 0.5, 0.5]
    got = spec.expected_confidences(5, 3)
    assert got[0] > 0.9 and got[1] < 0.1 and got[2] == 0.5


def test_run_stats_report_this_runs_verifications(oracle):
    llm = _spec(3)
    llm.generate(PROMPTS[:2], GREEDY)
    first = llm.last_stats.summary()["speculation"]
    llm.generate(PROMPTS, GREEDY)
    sp = llm.last_stats.summary()["speculation"]
    st = llm.runner.spec.stats
    assert sp["verifications"] == st.verifications - first["verifications"] > 0  # this run's counts only
    assert sp["acceptance_length"] == pytest.approx(1 + sp["accepted"] / sp["verifications"]) and sp["accepted"] > 0
    assert f"{sp['verifications']} verifications, acceptance {sp['acceptance_length']:.2f}" in llm.last_stats.format()
    off = LLM("tiny", max_num_seqs=8)
    off.generate(PROMPTS[:1], GREEDY)
    assert off.last_stats.summary()["speculation"] is None and "speculation" not in off.last_stats.format()


def test_step_records_count_emitted_decode_tokens(oracle):
    llm = _spec(3)
    outs = llm.generate(PROMPTS, GREEDY)
    st = llm.last_stats
    assert st.prefill_tokens == sum(len(p) for p in PROMPTS)
    # every output token but each request's first (sampled by its prefill) is a decode token
    assert st.decode_tokens == sum(len(o.token_ids) - 1 for o in outs)


@pytest.mark.parametrize("confidences", [True, False])
def test_draft_graphs_draw_greedy_drafts_themselves(monkeypatch, reference, confidences):
    """The draft and MTP graphs compute greedy drafts (argmax, and with ``confidences`` its probability) after
    their forward; a greedy step copies those instead of drawing again: the same tokens and confidences as an
    eager draw of the same logits, unaffected by the graph's next replay; greedy outputs equal speculation off."""
    from deepinfer.spec_graphs import SpecGraphs, spec_buckets

    llm = _spec(3, "confidence")
    llm.runner.spec.graphs = SpecGraphs(llm.runner, 3, spec_buckets(8), 512, confidences=confidences)
    seen = []
    real = sd.SpecDecoder._draw

    def draw(self, logits, states, counters, greedy_pre=None):
        out = real(self, logits, states, counters, greedy_pre)
        if greedy_pre is not None:
            eager = sd.greedy_draws(logits, True)
            assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
            assert out[0].data_ptr() != greedy_pre[0].data_ptr()  # a copy: the next replay rewrites the graph's
            seen.append(greedy_pre[1] is not None)
        return out

    monkeypatch.setattr(sd.SpecDecoder, "_draw", draw)
    _use_oracle(monkeypatch, {p: o.token_ids for p, o in reference.items()})  # on top: drafts that get accepted
    _greedy_equals_reference(llm, reference)
    assert seen and all(c == confidences for c in seen)


def test_greedy_draft_confidence_is_the_drafters_probability():
    llm = _spec(2, "confidence")
    spec = llm.runner.spec
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])

    class St:
        params = SamplingParams(temperature=0.0)
        seed = 1

    toks, conf, probs = spec._draw(logits, [St(), St()], [0, 0])
    assert toks.tolist() == [1, 0] and probs == [None, None]
    torch.testing.assert_close(conf, torch.softmax(logits, -1).max(-1).values)

    class Sampled:
        params = SamplingParams(temperature=1.0)
        seed = 1

    # a sampled draft's confidence does not depend on which token was drawn (lossless scheduling)
    confs = set()
    for c in range(20):
        toks, conf, probs = spec._draw(logits[:1], [Sampled()], [c])
        confs.add(round(float(conf[0]), 6))
        torch.testing.assert_close(probs[0], torch.softmax(logits[0], -1))
    q = torch.softmax(logits[0], -1)
    assert confs == {round(float((q * q).sum()), 6)}
    assert _spec(2, "confidence", batch_invariant=True).runner.spec.schedule == "fixed"
    fixed = _spec(2).runner.spec  # "fixed" reads no confidence: the drafts stay on the device
    toks, conf, _ = fixed._draw(logits, [St(), St()], [0, 0])
    assert fixed.schedule == "fixed" and conf is None and toks.tolist() == [1, 0]


def test_expert_parallel_models_are_refused():
    llm = _spec(2)
    llm.model.expert_parallel = object()
    try:
        with pytest.raises(ValueError, match="speculative_method.*expert parallelism"):
            sd.SpecDecoder(llm.runner, 2)
    finally:
        llm.model.expert_parallel = None


def test_structured_requests_decode_plainly_next_to_speculating_ones(reference):
    from deepinfer.structured import StructuredOutputsParams

    choice = SamplingParams(max_tokens=20, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(choice=("yes", "no", "maybe later")))
    llm = _spec(3)
    outs = llm.generate(PROMPTS[:2], [choice, GREEDY])
    plain = LLM("tiny", max_num_seqs=8).generate([PROMPTS[0]], choice)[0]
    assert outs[0].error is None and outs[0].token_ids == plain.token_ids
    assert outs[0].text in ("yes", "no", "maybe later")
    assert outs[1].token_ids == reference[tuple(PROMPTS[1])].token_ids


def test_nan_logits_inside_a_verification_fail_that_request_alone(reference, oracle, monkeypatch):
    llm = _spec(3)
    forward = llm.model.forward
    calls = {"verify": 0}

    def poisoned(plan, cache, return_hidden=False):
        out = forward(plan, cache, return_hidden=return_hidden)
        if plan.num_logits > 4 and calls["verify"] == 0:  # the first verification step: request 0 row 0
            calls["verify"] += 1
            out[0][0] = float("nan")
        return out

    monkeypatch.setattr(llm.model, "forward", poisoned)
    outs = llm.generate(PROMPTS, GREEDY)
    assert calls["verify"] == 1
    failed = [o for o in outs if o.error is not None]
    assert len(failed) == 1 and failed[0].error["code"] == "nan_logits"
    for p, o in zip(PROMPTS, outs):
        if o.error is None:
            assert o.token_ids == reference[tuple(p)].token_ids


@pytest.mark.parametrize("k,schedule", [(1, "fixed"), (3, "confidence")])
def test_graph_steps_equal_speculation_off(reference, oracle, monkeypatch, k, schedule):
    """The speculative step through its graphs' static buffers (``SpecGraphs``; off CUDA a replay runs the forward
    over them): verification at ``q`` tokens per sequence of the bucket, the draft chain and the MTP pass padded
    the same way. Greedy outputs and logprobs equal speculation off, with accepted blocks and partial rejections
    rolled back through them; prefill steps stay eager."""
    from deepinfer.spec_graphs import SpecGraph, SpecGraphs

    replays = []
    real = SpecGraph.replay

    def replay(self):
        replays.append((self.kind, self.bucket, self.q))
        real(self)

    monkeypatch.setattr(SpecGraph, "replay", replay)
    llm = _spec(k, schedule, max_model_len=128)
    graphs = SpecGraphs(llm.runner, k, [1, 2, 4], 128)
    assert len(graphs) == 3 * (k + 1) + 6
    llm.runner.spec.graphs = graphs
    with pytest.raises(ValueError, match="max_len"):
        SpecGraphs(llm.runner, k, [1], k)
    verify_calls = []
    real_forward = type(llm.model).forward

    def forward(self, plan, *a, **kw):
        verify_calls.append(plan.graph)
        return real_forward(self, plan, *a, **kw)

    monkeypatch.setattr(type(llm.model), "forward", forward)
    _greedy_equals_reference(llm, reference)
    kinds = {kind for kind, _, _ in replays}
    assert kinds == ({"verify", "draft", "mtp"} if k > 1 else {"verify", "mtp"})
    assert any(q > 1 for kind, _, q in replays if kind == "verify")
    assert True in verify_calls and False in verify_calls  # decode steps replay the graph, prefill steps eager


@pytest.mark.parametrize("graphs", [False, True])
def test_mtp_pass_before_the_read_keeps_the_state_of_the_pass_after_it(reference, oracle, monkeypatch, graphs):
    """A decode step runs its MTP pass over every verification row before its read and keeps each request's last
    kept row: the next drafts' positions and hidden streams equal those of the pass over the kept rows alone
    (after the read), with accepted blocks and rejections; outputs equal speculation off either way."""
    def run(early: bool):
        kept, calls = [], []
        real_init, real_rows = sd.DraftState.__init__, sd.SpecDecoder._mtp_rows

        def init(self, position, token, probs, conf, hidden):
            kept.append((position, hidden[0][hidden[1]].float().clone()))
            real_init(self, position, token, probs, conf, hidden)

        def rows(self, *a):
            calls.append(1)
            return real_rows(self, *a)

        with monkeypatch.context() as m:
            m.setattr(sd.DraftState, "__init__", init)
            m.setattr(sd.SpecDecoder, "_mtp_rows", rows)
            if not early:
                m.setattr(sd.SpecDecoder, "_mtp_early", lambda self, *a: False)
            _greedy_equals_reference(_spec(3, graphs=graphs), reference)
        return kept, len(calls)

    early, n_early = run(True)
    late, n_late = run(False)
    assert n_early > 0 and n_late == 0
    assert [p for p, _ in early] == [p for p, _ in late]
    for (_, a), (_, b) in zip(early, late):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("schedule", ["fixed", "confidence"])
def test_a_long_prompt_chunk_beside_a_verification(monkeypatch, schedule):
    """A prompt chunk longer than a cache block (300 tokens) in the same step as another request's verification:
    the step's ring state is committed in parts of a block (a commit keeps at most ``block_size`` tokens per
    sequence); greedy outputs equal speculation off."""
    prompts = [[11 + i % 50 for i in range(20)], [17 + i % 40 for i in range(10)], [13 + i % 70 for i in range(300)]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 2, 5)]
    ref = [o.token_ids for o in LLM("tiny", max_num_seqs=2).generate(prompts, params)]
    _use_oracle(monkeypatch, {tuple(p): r for p, r in zip(prompts, ref)})
    llm = _spec(3, schedule, max_num_seqs=2, max_num_batched_tokens=512)
    mixed = []
    real = sd.SpecDecoder.execute

    def execute(self, output):
        mixed.append(any(it.num_draft_tokens for it in output.scheduled)
                     and any(it.num_new_tokens > llm.cache.block_size for it in output.scheduled))
        return real(self, output)

    monkeypatch.setattr(sd.SpecDecoder, "execute", execute)
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref and not any(o.error for o in outs)
    assert any(mixed)
    assert llm.block_manager.num_free_blocks == llm.config.num_blocks
