"""DP attention + EP through the ``LLM`` API and the CLI (issue 24): one process per rank (gloo), results equal to
one process (bitwise in batch-invariant mode) with uneven requests per rank, zero-token ranks, ranks finishing
early, EPLB rearrangements during generation, the shared prefill budget, and a crashed rank ending the run with an
error instead of a hang. Also the pure parts: the prefill allocation and the scheduler's prefill limit. Serving:
``tests/server/test_dp_serve.py``."""

from __future__ import annotations

import json
import os
import random
import signal
import threading

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.cli import build_parser, engine_config, main
from deepinfer.config import EngineConfig
from deepinfer.parallel.config import allocate_prefill
from deepinfer.parallel.launch import DataParallelError
from deepinfer.presets import make_checkpoint

BUDGET = 128  # the DP prefill budget of the 2-rank engine (= the chunk alignment in batch-invariant mode)


# ---------------------------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("seed", range(6))
def test_allocate_prefill_bound_and_fairness(seed):
    rng = random.Random(seed)
    for _ in range(200):
        R = rng.randint(1, 6)
        q = rng.choice([1, 1, 16, 128])
        demands = [rng.choice([0, 0, rng.randint(1, 5), rng.randint(1, 3000)]) for _ in range(R)]
        budget = q * rng.randint(1, 24) + rng.randint(0, q - 1)
        got = allocate_prefill(demands, budget, q, rng.randint(0, 100))
        want = [-(-d // q) * q for d in demands]
        assert sum(got) <= budget and all(g % q == 0 for g in got)
        assert all(0 <= g <= w for g, w in zip(got, want))
        if sum(want) <= budget:
            assert got == want
        else:  # max-min fair: a rank short of its demand has at least any other rank's share minus one quantum
            assert sum(got) > budget - q
            for r in range(R):
                if got[r] < want[r]:
                    assert all(got[r] >= g - q for g in got), (demands, budget, q, got)


def test_allocate_prefill_rotates_a_single_quantum():
    winners = [allocate_prefill([500, 500, 500], 128, 128, step).index(128) for step in range(6)]
    assert sorted(winners[:3]) == [0, 1, 2] and winners[3:] == winners[:3]
    assert allocate_prefill([0, 0], 256, 128, 0) == [0, 0]
    assert allocate_prefill([1, 129], 256, 128, 0) == [128, 128]  # a short last chunk takes a whole quantum


def test_assign_requests_balances_tokens():
    from deepinfer.parallel.launch import assign_requests

    assert assign_requests([], 3) == [[], [], []] and assign_requests([5], 2) == [[0], []]
    assert assign_requests([300, 10, 10, 10], 2) == [[0], [1, 2, 3]]
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.randint(1, 500) for _ in range(rng.randint(1, 30))]
        R = rng.randint(1, 5)
        shares = assign_requests(costs, R)
        assert sorted(i for s in shares for i in s) == list(range(len(costs)))
        loads = [sum(costs[i] for i in s) for s in shares]
        assert max(loads) - min(loads) <= max(costs)  # LPT: within one request of balance
        assert assign_requests(costs, R) == shares


def test_scheduler_prefill_limit():
    llm = LLM("tiny", max_num_batched_tokens=512, batch_invariant=True, num_blocks=8)
    sched, engine = llm.scheduler, llm.engine
    seqs = llm._make_seqs([[3] * 5, [4] * 300], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                                                 for m in (10, 1)])
    engine.add_request(seqs[0])
    engine.step()  # the short prompt's prefill
    engine.add_request(seqs[1])
    for budget in (0, 0, 128, 128):  # a withheld prefill is no "no progress" error; decodes never wait for it
        sched.prefill_budget = budget
        engine.step()
        assert sched.last_prefill_tokens == budget and sched.last_num_tokens == budget + 1
        assert sched.prefill_demand() == 300 - seqs[1].num_computed_tokens
    sched.prefill_budget = 100  # less than the alignment: the prompt's last 44 tokens still fit
    engine.step()
    assert sched.last_prefill_tokens == 44 and sched.prefill_demand() == 0
    sched.prefill_budget = None
    while engine.has_unfinished_requests():
        engine.step()
    assert [len(s.output_token_ids) for s in seqs] == [10, 1]


def test_parallel_settings_are_checked():
    for kwargs, match in [(dict(data_parallel_size=2, expert_parallel_size=3), "must be 1 or equal"),
                          (dict(eplb_interval=4), "eplb_interval needs expert_parallel_size"),
                          (dict(dist_timeout_s=0), "timeout_s"),
                          (dict(batch_invariant=True, dp_prefill_budget=64), "dp_prefill_budget"),
                          (dict(data_parallel_size=2, expert_parallel_size=2, speculative_method="mtp"),
                           "speculative_method")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kwargs).validate()
    args = build_parser().parse_args(["generate", "--input", "-", "--output", "-", "--data-parallel-size", "4",
                                      "--expert-parallel-size", "4", "--num-redundant-experts", "4",
                                      "--eplb-interval", "32", "--dp-prefill-budget", "1024", "--dist-backend",
                                      "gloo", "--dist-timeout", "30"])
    cfg = engine_config(args)
    assert (cfg.data_parallel_size, cfg.expert_parallel_size, cfg.num_redundant_experts, cfg.eplb_interval,
            cfg.dp_prefill_budget, cfg.dist_backend, cfg.dist_timeout_s) == (4, 4, 4, 32, 1024, "gloo", 30.0)
    assert cfg.parallel.resolved_backend("cuda") == "gloo"
    with pytest.raises(ValueError, match="built"):
        LLM(object.__new__(type("M", (), {"forward": lambda self: None})), data_parallel_size=2)
    # checked before any rank starts: 8 experts + 1 redundant slot do not split over 2 ranks
    with pytest.raises(ValueError, match="num_redundant_experts=1"):
        LLM("tiny", data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=1)
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        LLM("/nonexistent/ckpt", data_parallel_size=2)


# ---------------------------------------------------------------------------------------------- 2 ranks, EP
def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(129280) for _ in range(rng.choice([3, 9, 17, 40]))] for _ in range(n)]


@pytest.fixture(scope="module")
def engines():
    kw = dict(batch_invariant=True, max_num_batched_tokens=256, seed=7, num_blocks=24)
    ref = LLM("tiny", **kw)
    dp = LLM("tiny", data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=2,
             eplb_window=8, dp_prefill_budget=BUDGET, **kw)
    yield ref, dp
    dp.close()


def _same(a, b) -> None:
    assert (a.index, a.prompt_token_ids, a.error) == (b.index, b.prompt_token_ids, b.error)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.seed == b.seed, a.index
    assert (a.finish_reason, a.text) == (b.finish_reason, b.text)


def test_ep_dp_generate_equals_one_process(engines):
    ref, dp = engines
    assert dp.startup["data_parallel_size"] == 2 and len(dp.startup["ranks"]) == 2
    # 5 requests: 3 on rank 0, 2 on rank 1; different lengths finish at different steps; one sampled request
    # (seed drawn by the caller in request order, as one process draws it); one refused
    prompts = _prompts(5, 0) + [[129280 + 5]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (7, 2, 11, 1, 4)]
    params[2] = SamplingParams(temperature=1.0, max_tokens=11, ignore_eos=True)
    params.append(SamplingParams(max_tokens=3))
    want, got = ref.generate(prompts, params), dp.generate(prompts, params)
    assert [g.index for g in got] == list(range(6)) and got[5].error["code"] == "invalid_request_error"
    for a, b in zip(want, got):
        _same(a, b)
    st = dp.rank_stats
    assert all(s["num_rebalances"] >= 3 for s in st)  # rearranged every 2 steps, while generating
    assert st[0]["placements"] == st[1]["placements"] != {}
    assert dp.last_stats.num_requests == 6 and dp.last_stats.completion_tokens == sum((7, 2, 11, 1, 4))
    # ranks finished early ran empty steps: every rank ran as many iterations
    assert len(st[0]["steps"]) == len(st[1]["steps"])
    # a zero-token rank (1 request for 2 ranks), then no request at all
    one = _prompts(1, 1)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    _same(ref.generate(one, sp)[0], dp.generate(one, sp)[0])
    idle = dp.rank_stats[1]
    assert all(n == 0 for _, _, n in idle["steps"]) and len(idle["steps"]) >= 6
    assert dp.generate([], sp) == []


def test_ep_dp_prefill_budget_bounds_the_others_decode(engines):
    ref, dp = engines
    long, short = (_prompts(1, 2)[0] * 100)[:300], [5, 6, 7]  # 300 tokens on rank 0, a decode on rank 1
    sp = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    got = dp.generate([long, short], sp)
    for a, b in zip(ref.generate([long, short], sp), got):
        _same(a, b)
    s0, s1 = (s["steps"] for s in dp.rank_stats)
    assert len(s0) == len(s1)
    # every step: the ranks' prefill tokens together within the budget, each within its allowance
    for (a0, p0, _), (a1, p1, _) in zip(s0, s1):
        assert p0 <= a0 and p1 <= a1 and a0 + a1 <= BUDGET and p0 + p1 <= BUDGET
    # rank 1's request starts within 2 iterations (one quantum of budget goes round the ranks), then runs a step at
    # every iteration until it is done: the long prompt never stalls its decode
    k = next(i for i, (_, _, n) in enumerate(s1) if n)
    assert k < 2 and all(n > 0 for _, _, n in s1[k:k + 12]), (s0, s1)
    assert sum(p for _, p, _ in s0) >= len(long) and max(p for _, p, _ in s0) <= BUDGET


def test_ep_dp_chat_in_order(engines):
    ref, dp = engines
    bodies = [{"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 5, "temperature": 0}
              for i in range(2)]
    bodies.insert(1, {"messages": []})
    want, got = ref.chat(bodies), dp.chat(bodies)
    assert "error" in got[1] and "error" in want[1]
    for i in (0, 2):
        assert got[i]["choices"] == want[i]["choices"] and got[i]["usage"] == want[i]["usage"]


# ---------------------------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """A small multi-expert checkpoint: 16 routed experts (4 per rank), 2 layers."""
    return make_checkpoint("tiny", tmp_path_factory.mktemp("small") / "ckpt", seed=3, num_experts=16, num_layers=2)


def test_ep4_greedy_identical_and_a_killed_rank_fails_the_run(small_ckpt):
    prompts = _prompts(3, 4)  # rank 3 gets none
    sp = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 1, 3)]
    want = LLM(str(small_ckpt), num_blocks=40).generate(prompts, sp)
    dp = LLM(str(small_ckpt), data_parallel_size=4, expert_parallel_size=4, num_blocks=40)
    try:
        got = dp.generate(prompts, sp)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]  # default mode: greedy-identical
        assert len({len(s["steps"]) for s in dp.rank_stats}) == 1 and len(dp.rank_stats[3]["steps"]) >= 5
        # a rank killed while the ranks generate: the call fails naming the trouble, every rank is stopped
        pids = dp._dp_group.pids()
        threading.Timer(1.0, os.kill, (pids[2], signal.SIGKILL)).start()
        with pytest.raises(DataParallelError, match="data-parallel rank"):
            dp.generate(prompts, SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
        assert not any(p.is_alive() for p in dp._dp_group._procs)
        with pytest.raises(DataParallelError, match="stopped"):
            dp.generate(prompts, sp)
    finally:
        dp.close()


# ---------------------------------------------------------------------------------------------- the CLI
def test_cli_generate_data_parallel(tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 3, "temperature": 0})
             for i in range(3)]
    inp.write_text("\n".join(lines[:1] + ["{not json"] + lines[1:]) + "\n", encoding="utf-8")
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--no-progress", "--created", "0",
               "--data-parallel-size", "2", "--num-blocks", "8"])  # DP alone: each rank holds every expert
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(l) for l in out.read_text(encoding="utf-8").splitlines()]
    assert len(recs) == 4 and recs[1]["error"]["code"] and recs[1]["line"] == 2
    assert all(r["object"] == "chat.completion" for r in recs[:1] + recs[2:])
    assert '"data_parallel_size": 2' in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- NCCL (several GPUs)
@pytest.mark.cuda
def test_ep_dp_nccl_greedy_identical():
    """The same through NCCL, one GPU per rank (runs on a machine with 2 GPUs or more; FP8 path)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (nvidia-h200-x2 or larger)")
    kw = dict(batch_invariant=True, device="cuda", num_blocks=24)
    prompts = _prompts(5, 9)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 2, 9, 1, 4)]
    want = LLM("tiny", **kw).generate(prompts, params)
    with LLM("tiny", data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=2,
             **kw) as dp:
        got = dp.generate(prompts, params)
        assert all(s["num_rebalances"] >= 2 for s in dp.rank_stats)
        assert [r["device"] for r in dp.startup["ranks"]] == ["cuda:0", "cuda:1"]
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids, a.index
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-3, a.index
