"""Expert parallelism in the DeepSeek-V4 model: sharded loading (each rank reads only its experts) and EP + DP
forwards over 2 gloo processes equal to the single-process model (bitwise in batch-invariant mode and on the FP8
path, greedy-identical otherwise), with replicas, uneven prompts and a rank that finishes early (empty steps)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from deepinfer import checkpoint as C
from deepinfer.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.parallel import ExpertPlacement, rebalance
from deepinfer.parallel.config import ParallelConfig, dp_any_work
from deepinfer.parallel.sharding import ExpertParallel, parse_expert_name
from deepinfer.presets import make_checkpoint
from dist_util import run_distributed

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def one_cpu_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    return make_checkpoint("tiny", tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


def _moe_names(cfg) -> list[str]:
    return [f"layers.{i}.ffn" for i in range(cfg.num_hidden_layers)] + \
        [f"mtp.{j}.ffn" for j in range(cfg.num_nextn_predict_layers)]


def _expert_parallel(cfg, rank: int, world: int, **kwargs) -> ExpertParallel:
    """A different redundant placement per MoE layer (synthetic skewed loads), identical on every rank."""
    E = cfg.n_routed_experts
    placements = {}
    for i, name in enumerate(_moe_names(cfg)):
        counts = np.ones((4, E))
        counts[:, (3 * i) % E] = 30
        counts[::2, (5 * i + 1) % E] = 12
        placements[name] = rebalance(counts, world, 2)
    return ExpertParallel(rank, world, default=None, placements=placements, **kwargs)


def test_sharded_load_reads_only_local_experts(tiny_ckpt, monkeypatch):
    cfg = C.load_checkpoint(tiny_ckpt, dequantize=False).config
    full = DeepseekV4ForCausalLM.from_checkpoint(tiny_ckpt, gemm="dequant")
    real_get = C._get
    for rank in range(2):
        ep = _expert_parallel(cfg, rank, 2)
        read: list[str] = []

        def spy(handles, info):
            read.append(info.name)
            return real_get(handles, info)

        monkeypatch.setattr(C, "_get", spy)
        ck = C.load_checkpoint(tiny_ckpt, skip=ep.skip)
        monkeypatch.setattr(C, "_get", real_get)
        for name in _moe_names(cfg):
            local = ep.local_experts(name)
            held = {parse_expert_name(n)[1] for n in ck.params if n.startswith(name + ".experts.")}
            touched = {parse_expert_name(n)[1] for n in read if n.startswith(name + ".experts.")}
            assert held == touched == set(local), (rank, name, held, touched, local)
        others = [n for n in C.list_tensors(tiny_ckpt) if parse_expert_name(n) is None]
        assert all(n in read for n in others if not n.endswith(".scale"))  # replicated weights read on every rank
        model = DeepseekV4ForCausalLM.from_parameters(ck.config, ck.params, gemm="dequant", expert_parallel=ep)
        for i, blk in enumerate(list(model.layers) + list(model.mtp)):
            name = _moe_names(cfg)[i]
            assert blk.ffn.local_experts == ep.local_experts(name)
            assert len(blk.ffn.experts) == ep.placement(name).slots_per_rank
            ref = (list(full.layers) + list(full.mtp))[i].ffn
            for slot, e in enumerate(blk.ffn.local_experts):
                assert torch.equal(blk.ffn.experts[slot].w2.weight, ref.experts[e].w2.weight)
        fp8 = DeepseekV4ForCausalLM.from_checkpoint(tiny_ckpt, gemm="fp8", expert_parallel=ep)
        assert fp8.layers[3].ffn.w13.shape[0] == ep.placement("layers.3.ffn").slots_per_rank


def test_expert_parallel_errors():
    p = ExpertPlacement.contiguous(8, 2)
    with pytest.raises(ValueError, match="rank=2 must be < world_size=2"):
        ExpertParallel(2, 2, default=p)
    with pytest.raises(ValueError, match=r"placements\['layers.0.ffn'\] has num_ranks=2"):
        ExpertParallel(0, 4, placements={"layers.0.ffn": p})
    ep = ExpertParallel(0, 2, placements={"layers.0.ffn": p})
    with pytest.raises(ValueError, match="layout must be"):
        ExpertParallel(0, 2, default=p, layout="ragged")
    with pytest.raises(ValueError, match="no placement for MoE layer 'layers.1.ffn'"):
        ep.skip("layers.1.ffn.experts.3.w1.weight")
    with pytest.raises(ValueError, match="expert 5 of layers.0.ffn is not on EP rank 0"):
        ep.module_name("layers.0.ffn.experts.5.w1.weight")
    assert ep.module_name("layers.0.ffn.experts.2.w1.weight") == "layers.0.ffn.experts.2.w1.weight"
    assert not ep.skip("layers.0.attn.wq_a.weight") and ep.skip("layers.0.ffn.experts.7.w3.weight")
    for kwargs, match in [(dict(expert_parallel_size=3, data_parallel_size=2), "must be 1 or equal"),
                          (dict(data_parallel_size=0), "data_parallel_size"),
                          (dict(backend="mpi"), "backend"),
                          (dict(num_redundant_experts=2), "needs expert_parallel_size")]:
        with pytest.raises(ValueError, match=match):
            ParallelConfig(**kwargs).validate()
    ParallelConfig(data_parallel_size=4, expert_parallel_size=4, num_redundant_experts=4).validate()


class _Greedy:
    """One request decoded greedily step by step through ``model.forward`` over its own cache."""

    def __init__(self, model, prompt: list[int], num_steps: int, batch_invariant: bool):
        self.model, self.tokens, self.left, self.bi = model, list(prompt), num_steps, batch_invariant
        nb = math.ceil((len(prompt) + num_steps) / 128)
        self.cache = model.allocate_cache(nb)
        self.bt = torch.arange(nb, dtype=torch.int32).view(1, -1)
        self.prefilled = False
        self.logits: list[torch.Tensor] = []

    def step(self) -> None:
        q = len(self.tokens) if not self.prefilled else 1
        n = len(self.tokens)
        batch = ForwardBatch(torch.tensor(self.tokens[n - q:]), torch.arange(n - q, n), [q], [n], self.bt,
                             torch.tensor([q - 1]), self.bi)
        logits = self.model.forward(batch, self.cache)
        self.logits.append(logits)
        self.tokens.append(int(logits[-1].argmax()))
        self.prefilled = True
        self.left -= 1

    def idle(self) -> None:
        e = torch.empty(0, dtype=torch.int64)
        self.model.forward(ForwardBatch(e, e, [], [], torch.zeros(0, 1, dtype=torch.int32), e, self.bi), self.cache)


def _prompt(rank: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 129280, (length,), generator=g).tolist()


def _body_forward(rank: int, world: int, path: str, gemm: str, layout: str = "contiguous") -> None:
    cfg = C.load_checkpoint(path, dequantize=False).config
    ep = _expert_parallel(cfg, rank, world, layout=layout)
    ref = DeepseekV4ForCausalLM.from_checkpoint(path, gemm=gemm)
    model = DeepseekV4ForCausalLM.from_checkpoint(path, gemm=gemm, expert_parallel=ep)
    # uneven prompts; both modes
    ids = torch.tensor(_prompt(rank, [9, 5][rank]))
    for bi in (True, False):
        got, want = model.forward_full(ids, batch_invariant=bi), ref.forward_full(ids, batch_invariant=bi)
        if bi or gemm == "fp8":  # batch-invariant expert GEMMs: the other rank's tokens cannot change a bit
            assert torch.equal(got, want), (gemm, bi, (got - want).abs().max())
        else:  # dequant, default mode: torch GEMMs see other row counts
            assert torch.equal(got.argmax(-1), want.argmax(-1))
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # DP decode in lockstep: rank 1 finishes early and runs empty steps until rank 0 is done
    steps = [4, 1][rank]
    g = _Greedy(model, _prompt(rank, [6, 11][rank]), steps, batch_invariant=True)
    idle = 0
    while dp_any_work(g.left > 0):
        if g.left > 0:
            g.step()
        else:
            g.idle()
            idle += 1
    assert idle == [0, 3][rank]
    r = _Greedy(ref, _prompt(rank, [6, 11][rank]), steps, batch_invariant=True)
    while r.left:
        r.step()
    assert g.tokens == r.tokens
    for i, (a, b) in enumerate(zip(g.logits, r.logits)):
        assert torch.equal(a, b), (rank, i, (a - b).abs().max())


@pytest.mark.parametrize("gemm,layout", [("dequant", "contiguous"), ("fp8", "contiguous"), ("fp8", "masked")])
def test_ep_dp_forward_equals_single_process(tiny_ckpt, tmp_path, gemm, layout):
    run_distributed(_body_forward, 2, tmp_path, str(tiny_ckpt), gemm, layout)


def _body_rearrange(rank: int, world: int, path: str, gemm: str) -> None:
    from deepinfer.parallel.rearrange import EPLBController, rearrange_moe

    cfg = C.load_checkpoint(path, dequantize=False).config
    ep = _expert_parallel(cfg, rank, world)
    model = DeepseekV4ForCausalLM.from_checkpoint(path, gemm=gemm, expert_parallel=ep)
    ids = torch.tensor(_prompt(rank, [7, 4][rank]))
    before = model.forward_full(ids, batch_invariant=True)
    # an explicit new placement for every layer: other hot experts
    storages = {n: m.w13.data_ptr() if m.is_fp8 else m.experts[0].w1.weight.data_ptr()
                for n, m in model.named_modules() if getattr(m, "ep", None) is not None}
    moved = 0
    for name, moe in [(n, m) for n, m in model.named_modules() if getattr(m, "ep", None) is not None]:
        counts = np.ones((3, cfg.n_routed_experts))
        counts[:, 7] = 40
        new = rebalance(counts, world, 2)
        moved += rearrange_moe(moe, new, name)
        assert moe.local_experts == new.local_experts(rank)
        assert (moe.w13.data_ptr() if moe.is_fp8 else moe.experts[0].w1.weight.data_ptr()) == storages[name]
    assert moved > 0
    after = model.forward_full(ids, batch_invariant=True)
    assert torch.equal(before, after)
    # the moved weights equal a fresh load with the new placements
    fresh = DeepseekV4ForCausalLM.from_checkpoint(path, gemm=gemm, expert_parallel=model.expert_parallel)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), n
    # the controller: counts from real steps, rebalanced every 2 steps, outputs unchanged
    ctl = EPLBController(model, num_redundant=2, window=4, interval=2)
    for step in range(4):
        out = model.forward_full(ids, batch_invariant=True)
        assert torch.equal(out, before), step
        ctl.after_step()
    assert ctl.window.counts().sum() > 0


@pytest.mark.parametrize("gemm", ["dequant", "fp8"])
def test_eplb_rearrangement_keeps_outputs(tiny_ckpt, tmp_path, gemm):
    run_distributed(_body_rearrange, 2, tmp_path, str(tiny_ckpt), gemm)
