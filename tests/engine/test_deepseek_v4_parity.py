"""Parity with the reference nobody here wrote: transformers 5.23 ``DeepseekV4ForCausalLM`` loads the SAME built-in
``tiny`` checkpoint files (native format: FP8 dense linears with UE8M0 128x128 block scales, FP4 experts) as our loader,
and both run in float32 on the CPU.

Stated tolerance: ``max |ours - ref| / max |ref| <= 1e-4`` over all logits of prompts of 1, 37, 300 and 600 tokens
(observed ~6e-7), and a 32-token greedy continuation identical token for token.

Ties: the lightning indexer's scores are ``sum_h w_h ReLU(.)``, so entries whose every head is clipped score exactly
0 and tie. transformers breaks ties with ``torch.topk`` (unspecified order), we with the project rule (higher score,
then lower index). Nothing in transformers is patched; instead the tiny preset uses 8 indexer heads (all-zero rows
are rare) and every forward counts the rows whose k-th and (k+1)-th best valid scores are equal
(``last_indexer_boundary_ties``); the tests assert that count is 0, so a tie could never make the comparison
depend on the tie rule. The router has no ties (continuous sqrt-softplus scores plus a random bias).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepinfer.checkpoint import load_checkpoint  # noqa: E402
from deepinfer.presets import make_checkpoint  # noqa: E402
from deepinfer.forward_batch import ForwardBatch  # noqa: E402
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402

PARITY_MAX_REL_ERR = 1e-4
PROMPT_LENS = (1, 37, 300, 600)
GREEDY_PROMPT, GREEDY_NEW = 240, 32  # decode crosses the HCA window / block boundary at 256


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = make_checkpoint("tiny", tmp_path_factory.mktemp("tiny-ckpt"), seed=0)
    ckpt = load_checkpoint(path)
    ours = DeepseekV4ForCausalLM.from_parameters(ckpt.config, ckpt.params)
    hf, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager", output_loading_info=True,
        # dequantise on every machine: with a GPU present transformers would keep the FP8 weights (no .float())
        quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
    )
    for k in ("missing_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(k), f"transformers could not load the tiny checkpoint: {k} = {info.get(k)}"
    # Dequantised, FP8/FP4 weights are bf16 values; those values are exact in bf16 (3 / 1 mantissa bits times a
    # power-of-two scale), so float() gives the same fp32 numbers as our dequantisation.
    hf = hf.float().eval()
    return ckpt, ours, hf


def test_reference_holds_the_same_weights(pair):
    ckpt, _, hf = pair
    p = ckpt.params
    m = hf.model
    checks = {
        "layers.0.attn.wq_a.weight": m.layers[0].self_attn.q_a_proj.weight,
        "layers.1.attn.attn_sink": m.layers[1].self_attn.sinks,
        "layers.1.attn.indexer.compressor.ape": m.layers[1].self_attn.compressor.indexer.position_bias,
        "layers.2.attn.compressor.ape": m.layers[2].self_attn.compressor.position_bias,
        "layers.0.ffn.gate.tid2eid": m.layers[0].mlp.gate.tid2eid,
        "layers.3.ffn.gate.bias": m.layers[3].mlp.gate.e_score_correction_bias,
        "layers.2.hc_ffn_base": m.layers[2].ffn_hc.base,
        "hc_head_fn": m.hc_head.hc_fn,
        "head.weight": hf.lm_head.weight,
    }
    for name, ref in checks.items():
        assert torch.equal(p[name].to(ref.dtype), ref.detach()), name
    gate_up = m.layers[3].mlp.experts.gate_up_proj[5]
    assert torch.equal(torch.cat([p["layers.3.ffn.experts.5.w1.weight"], p["layers.3.ffn.experts.5.w3.weight"]]), gate_up)
    assert p["layers.1.attn.attn_sink"].abs().min() > 0 and p["layers.0.ffn.gate.tid2eid"].max() > 0


@pytest.mark.parametrize("n", PROMPT_LENS)
def test_logits_match_transformers(pair, n):
    ckpt, ours, hf = pair
    ids = torch.randint(0, ckpt.config.vocab_size, (n,), generator=torch.Generator().manual_seed(100 + n))
    with torch.no_grad():
        ref = hf(ids.view(1, -1), use_cache=False).logits[0]
    got = ours.forward_full(ids)
    assert ours.last_indexer_boundary_ties == 0, "indexer top-k boundary tie: comparison would depend on the tie rule"
    assert got.shape == ref.shape and torch.isfinite(got).all()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel <= PARITY_MAX_REL_ERR, f"{n} tokens: relative error {rel:.3g} > {PARITY_MAX_REL_ERR}"


def test_greedy_continuation_matches_transformers(pair):
    ckpt, ours, hf = pair
    ids = torch.randint(0, ckpt.config.vocab_size, (GREEDY_PROMPT,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = hf.generate(ids.view(1, -1), max_new_tokens=GREEDY_NEW, min_new_tokens=GREEDY_NEW, do_sample=False,
                          use_cache=True)[0, GREEDY_PROMPT:]
    cache = ours.allocate_cache(4)
    bt = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    n = GREEDY_PROMPT
    logits = ours.forward(ForwardBatch(ids, torch.arange(n), [n], [n], bt, torch.tensor([n - 1])), cache)
    ties = ours.last_indexer_boundary_ties
    out = []
    for _ in range(GREEDY_NEW):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = ours.forward(ForwardBatch(torch.tensor([tok]), torch.tensor([n]), [1], [n + 1], bt, torch.tensor([0])), cache)
        ties += ours.last_indexer_boundary_ties
        n += 1
    assert ties == 0
    assert out == ref.tolist()
