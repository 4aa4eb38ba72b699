"""DeepSeek-V4 on CUDA: the tiny model in bf16 on the GPU (sparse MQA, cache writes, top-k: the native CUDA ops)
against the same checkpoint's float32 forward on the CPU (the ops' CPU implementations), and chunked prefill plus
token-by-token decode on CUDA against the full forward.

Stated tolerances (bf16 on CUDA vs fp32 on CPU; measured on CPU with the bf16 model as the proxy, see the report
of the change that added this file):
  * cosine similarity of all logits of a prompt >= ``MIN_COSINE`` (0.999);
  * ``max |cuda - cpu| / max |cpu| <= MAX_REL_ERR`` (0.05). bf16 keeps 8 significant bits (relative rounding
    2^-9 ~ 0.2 % per op); the tiny model chains 4 blocks of mHC, attention, MoE with FP8/FP4-derived weights and a
    64 -> 129,280 head, and the CSA layers' top-k may pick a different entry where two indexer scores are closer than
    the bf16 error; a few per cent of the largest logit is the expected size of the worst element;
  * the argmax agrees on every row whose fp32 top-2 margin exceeds twice the largest absolute logit error of that
    prompt (where it cannot flip unless the bound above is already violated locally).
Chunked prefill / decode vs the full forward, both bf16 on CUDA: the two differ only in GEMM shapes (cuBLAS may pick
other kernels and split-K) and in which rows share a launch, so they are held to ``MIN_COSINE_CHUNKED`` (0.9999)
and ``MAX_REL_ERR_CHUNKED`` (0.02).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.checkpoint import make_checkpoint
from deepinfer.forward_batch import ForwardBatch
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

MIN_COSINE = 0.999
MAX_REL_ERR = 0.05
MIN_COSINE_CHUNKED = 0.9999
MAX_REL_ERR_CHUNKED = 0.02
PROMPT_LENS = (1, 37, 300, 600)  # 600: 4 CSA/HCA windows of 128, several window slides, 5 blocks
CHUNKS = (100, 77, 123, 100)  # then DECODE tokens one at a time
DECODE = 12  # decode steps at positions 400..411 (CSA window ends at 404, 408, 412)

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("tiny-ckpt"), seed=0)
    cpu = DeepseekV4ForCausalLM.from_checkpoint(path, dtype=torch.float32, device="cpu")
    gpu = DeepseekV4ForCausalLM.from_checkpoint(path, dtype=torch.bfloat16, device="cuda")
    return cpu, gpu


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 129280, (n,), generator=torch.Generator().manual_seed(seed))


def _stats(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(cosine of the flattened logits, max |got - ref| / max |ref|, max |got - ref|)."""
    got, ref = got.double().cpu(), ref.double().cpu()
    cos = torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0).item()
    err = (got - ref).abs().max().item()
    return cos, err / ref.abs().max().item(), err


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_cuda_bf16_matches_cpu_fp32(models, n):
    cpu, gpu = models
    ids = _ids(n, 100 + n)
    ref = cpu.forward_full(ids)
    got = gpu.forward_full(ids.cuda())
    assert got.device.type == "cuda" and got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.isfinite(got).all()
    cos, rel, err = _stats(got, ref)
    assert cos >= MIN_COSINE, f"{n} tokens: cosine {cos:.6f} < {MIN_COSINE}"
    assert rel <= MAX_REL_ERR, f"{n} tokens: max relative error {rel:.3g} > {MAX_REL_ERR}"
    top2 = ref.topk(2, dim=-1).values
    sure = (top2[:, 0] - top2[:, 1]) > 2 * err
    agree = got.cpu().argmax(-1) == ref.argmax(-1)
    assert bool(agree[sure].all()), f"{n} tokens: argmax differs on a row with a top-2 margin > 2 x {err:.3g}"


def _chunked(model: DeepseekV4ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Chunked prefill over CHUNKS then DECODE single-token steps, scattered block ids; logits of every token."""
    dev = torch.device("cuda")
    n = ids.numel()
    bt = torch.tensor([[7, 2, 8, 0, 5]], dtype=torch.int32, device=dev)
    cache = model.allocate_cache(9)
    for t in (l for layer in cache.layers for l in layer.values()):
        t.fill_(float("nan"))  # a read of a slot no step wrote shows up as NaN logits
    steps = list(CHUNKS) + [1] * (n - sum(CHUNKS))
    pos, out = 0, []
    for q in steps:
        batch = ForwardBatch(ids[pos:pos + q].to(dev), torch.arange(pos, pos + q, device=dev), [q], [pos + q], bt,
                             torch.arange(q, device=dev))
        out.append(model.forward(batch, cache))
        pos += q
    return torch.cat(out)


def test_cuda_chunked_prefill_and_decode_match_full(models):
    cpu, gpu = models
    n = sum(CHUNKS) + DECODE
    ids = _ids(n, 5)
    full = gpu.forward_full(ids.cuda())
    chunked = _chunked(gpu, ids)
    assert torch.isfinite(chunked).all()
    cos, rel, _ = _stats(chunked, full)
    assert cos >= MIN_COSINE_CHUNKED, f"chunked vs full on CUDA: cosine {cos:.6f} < {MIN_COSINE_CHUNKED}"
    assert rel <= MAX_REL_ERR_CHUNKED, f"chunked vs full on CUDA: max relative error {rel:.3g} > {MAX_REL_ERR_CHUNKED}"
    # and the incremental CUDA run against the fp32 CPU forward
    cos, rel, _ = _stats(chunked, cpu.forward_full(ids))
    assert cos >= MIN_COSINE and rel <= MAX_REL_ERR, f"chunked CUDA vs CPU fp32: cosine {cos:.6f}, rel {rel:.3g}"


def test_cuda_mixed_batch_matches_single_sequences(models):
    """One step holding a prefill chunk and a decode of another sequence == each sequence on its own (bf16, CUDA:
    the sparse ops are batch-invariant; GEMM shapes differ, hence the chunked tolerance)."""
    _, gpu = models
    dev = torch.device("cuda")
    a, b = _ids(200, 21), _ids(131, 22)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    cache = gpu.allocate_cache(4)
    # step 1: a[:150] and b[:130] as prefills; step 2: a[150:200] (chunk) with b[130] (decode)
    gpu.forward(ForwardBatch(torch.cat([a[:150], b[:130]]).to(dev),
                             torch.cat([torch.arange(150), torch.arange(130)]).to(dev), [150, 130], [150, 130], bt,
                             torch.tensor([0], device=dev)), cache)
    step2 = ForwardBatch(torch.cat([a[150:], b[130:]]).to(dev), torch.cat([torch.arange(150, 200), torch.tensor([130])]).to(dev),
                         [50, 1], [200, 131], bt, torch.tensor([49, 50], device=dev))
    got = gpu.forward(step2, cache)
    ref_a = gpu.forward_full(a.to(dev))[-1]
    ref_b = gpu.forward_full(b.to(dev))[-1]
    cos, rel, _ = _stats(got, torch.stack([ref_a, ref_b]))
    assert cos >= MIN_COSINE_CHUNKED and rel <= MAX_REL_ERR_CHUNKED, f"mixed batch: cosine {cos:.6f}, rel {rel:.3g}"
