"""Loading native DeepSeek-V4 tensors into a built model: dequantised or FP8 weights, stacked FP8 experts, fused
input projections (all at load time; the forward never rewires a parameter)."""

from __future__ import annotations

import torch
from torch import nn

from .layers import FP8_BLOCK, fp8_block_weight, resolve_gemm
from .moe import MoE
from .params import expected_parameters


def load_native(model, tensors: dict, device: torch.device | str | None = None) -> None:
    """Take over native tensors as the parameters of a freshly built model.

    Args:
        tensors: every name of ``expected_parameters(config)`` (strict: missing / unexpected names and shape
            mismatches raise ValueError naming the tensor); values are float tensors or, for quantised linears,
            ``deepinfer.quantization.QuantizedWeight`` (logical shape checked).
        device: where the parameters go (default: where each tensor is; ``"auto"`` resolves on the device of
            ``embed.weight``).
    Path ``"dequant"``: quantised weights are dequantised exactly, integer ``tid2eid`` becomes int64,
    float32-kind tensors stay float32, the rest is cast to the model dtype. Path ``"fp8"``: every
    ``dense_linear`` / ``expert_linear`` weight becomes FP8 with float32 128x128 block scales
    (:func:`fp8_block_weight`), the routed experts of each MoE stacked (:meth:`MoE.set_fp8_experts`), the other
    tensors as in path ``"dequant"``. ``wo_a`` stays dequantised when its groups straddle 128-row scale blocks.
    Expert parallelism (``model.expert_parallel``): ``tensors`` holds only this rank's routed experts (the names
    of :meth:`ExpertParallel.skip` left out) and each lands in its local slot.
    """
    from deepinfer.quantization import QuantizedWeight

    cfg = model.config
    spec = expected_parameters(cfg)
    ep = getattr(model, "expert_parallel", None)
    if ep is not None:
        spec = {k: v for k, v in spec.items() if not ep.skip(k)}
    missing = [k for k in spec if k not in tensors]
    extra = [k for k in tensors if k not in spec]
    if missing or extra:
        raise ValueError(f"load_native: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
                         f"unexpected tensors {extra[:8]}{'...' if len(extra) > 8 else ''}")
    for k, t in tensors.items():
        if tuple(t.shape) != tuple(spec[k][0]):
            raise ValueError(f"load_native: tensor {k} has shape {tuple(t.shape)}, expected {tuple(spec[k][0])}")
    if model.gemm == "fp8":
        raise ValueError("load_native: the model already holds FP8 weights; build a new model to load again")

    def where(t):
        return (t.data if isinstance(t, QuantizedWeight) else t).device

    dev = torch.device(device) if device is not None else None
    gemm = resolve_gemm(model.requested_gemm, dev if dev is not None else where(tensors["embed.weight"]))
    olr, G = cfg.o_lora_rank, cfg.o_groups
    wo_a_ok = all((g * olr) % FP8_BLOCK == 0 or (g * olr) // FP8_BLOCK == ((g + 1) * olr - 1) // FP8_BLOCK
                  for g in range(G))
    moes: dict[str, None] = {}  # MoE modules whose experts are stacked after the loop (insertion-ordered)
    for k, (_, kind) in spec.items():
        mod_name, _, leaf = k.rpartition(".")
        t = tensors[k]
        if gemm == "fp8" and kind == "expert_linear":
            moes[mod_name.split(".experts.")[0]] = None
            continue
        if ep is not None and kind == "expert_linear":
            mod_name = ep.module_name(k).rpartition(".")[0]
        mod = model.get_submodule(mod_name) if mod_name else model
        if gemm == "fp8" and kind == "dense_linear" and (wo_a_ok or not k.endswith("attn.wo_a.weight")):
            mod.set_fp8(*fp8_block_weight(t, dev))
            continue
        if isinstance(t, QuantizedWeight):  # exact float32 where it is stored, then cast and moved
            t = t.dequantize()
        t = t.detach()
        if not t.is_floating_point():
            t = t.to(device=dev, dtype=torch.int64)
        else:
            t = t.to(device=dev, dtype=torch.float32 if kind == "fp32" else model.dtype)
        if leaf in mod._parameters:
            mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[leaf] = t
    for moe_name in moes:
        _load_fp8_experts(model, model.get_submodule(moe_name), moe_name, tensors, dev)
    model.gemm = gemm
    fuse_weights(model)


def fuse_weights(model) -> None:
    """Load-time weight fusion: each compressed layer's dequantised input projections become views of one tensor
    (:meth:`Attention.fuse_x_projections`). Call again after replacing one of those weights."""
    for mod in model.modules():
        if hasattr(mod, "fuse_x_projections"):
            mod.fuse_x_projections()

def _load_fp8_experts(model, moe: MoE, prefix: str, tensors: dict, dev: torch.device | None) -> None:
    """Stack the routed experts ``{prefix}.experts.E.w{1,2,3}.weight`` into FP8 ``w13`` / ``w2`` (+ scales),
    filled expert by expert (no second copy of the experts). ``I`` is padded to ``I'`` = a multiple of 128 with
    zero rows (``w13``) / columns (``w2``) so that the gate and up halves keep their own scale blocks; padded
    gate / up outputs are 0, their SwiGLU is 0 and meets zero ``w2`` columns: the result is unchanged."""
    cfg = model.config
    E, I, D = len(moe.local_experts), cfg.moe_intermediate_size, cfg.hidden_size
    nb_i = -(-I // FP8_BLOCK)
    Ip, kb_d = nb_i * FP8_BLOCK, -(-D // FP8_BLOCK)
    from deepinfer.quantization import QuantizedWeight

    first = tensors[f"{prefix}.experts.{moe.local_experts[0]}.w1.weight"]
    d = dev if dev is not None else (first.data if isinstance(first, QuantizedWeight) else first).device
    # FP8 bytes handled as uint8 (zero byte = +0.0 in e4m3): plain fills and copies on every backend
    w13 = torch.zeros(E, 2 * Ip, D, dtype=torch.uint8, device=d)
    w13_scale = torch.ones(E, 2 * nb_i, kb_d, dtype=torch.float32, device=d)
    w2 = torch.zeros(E, D, Ip, dtype=torch.uint8, device=d)
    w2_scale = torch.ones(E, kb_d, nb_i, dtype=torch.float32, device=d)
    for e, logical in enumerate(moe.local_experts):  # slot e holds logical expert `logical` (EP: local slots only)
        name = f"{prefix}.experts.{logical}."
        q, s = fp8_block_weight(tensors[name + "w1.weight"], d)
        w13[e, :I], w13_scale[e, :nb_i] = q.view(torch.uint8), s
        q, s = fp8_block_weight(tensors[name + "w3.weight"], d)
        w13[e, Ip:Ip + I], w13_scale[e, nb_i:] = q.view(torch.uint8), s
        q, s = fp8_block_weight(tensors[name + "w2.weight"], d)
        w2[e, :, :I], w2_scale[e] = q.view(torch.uint8), s
    moe.set_fp8_experts(w13.view(torch.float8_e4m3fn), w13_scale, w2.view(torch.float8_e4m3fn), w2_scale)

