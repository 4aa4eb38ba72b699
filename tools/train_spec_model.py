#!/usr/bin/env python3
"""Train a small DeepSeek-V4 model with its MTP layer on the Python standard library's sources and write a native
checkpoint our engine loads (the draft model for speculative decoding, issue 19).

  python3 tools/train_spec_model.py --out /tmp/spec-model            # the H200 run (docs/train-spec-model.md)
  python3 tools/train_spec_model.py --out /tmp/spec-tiny --tiny      # a CPU smoke run

Writes into ``--out``: the checkpoint (``config.json``, safetensors, ``tokenizer.json``), ``train_spec_model.json``
(corpus, config, loss curve, held-out metrics per checkpoint format, the engine cross-check) and
``heldout_prompts.jsonl`` (prompts from held-out files, for benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_train import data as D  # noqa: E402
from spec_train import model as SM  # noqa: E402

REPORT = "train_spec_model.json"
PROMPTS = "heldout_prompts.jsonl"
#: checkpoint formats: ``write_checkpoint`` options (fp8-fp4 = what DeepSeek ships; fp32 for exact parity tests)
FORMATS = {"fp8-fp4": {"quant": "fp8", "expert_quant": "fp4"},
           "bf16": {"quant": "none", "expert_quant": "none", "dtype": torch.bfloat16},
           "fp32": {"quant": "none", "expert_quant": "none", "dtype": torch.float32}}
#: defaults that differ for ``--tiny`` (full run, tiny run)
RUN_DEFAULTS = {"steps": (900, 6), "batch_size": (32, 2), "seq_len": (512, 64), "warmup": (50, 1),
                "mtp_depth": (3, 2), "max_files": (None, 12), "eval_rows": (64, 4), "lr": (2e-3, 3e-2),
                "num_prompts": (64, 2), "prompt_len": (128, 16)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to create (must not hold weight files)")
    p.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="the tiny preset's shape and a few steps: a CPU smoke run")
    g = p.add_argument_group("budget")
    g.add_argument("--steps", type=int, help="optimizer steps (default 900; --tiny 6)")
    g.add_argument("--minutes", type=float, default=6.0,
                   help="stop training early once this much training time has passed (reported; default 6)")
    g = p.add_argument_group("model shape (defaults: spec_train.model.DEFAULT_SHAPE / TINY_SHAPE)")
    g.add_argument("--hidden", type=int, dest="hidden_size")
    g.add_argument("--layers", type=int, dest="num_hidden_layers", help="V4-Flash layer pattern 0,0,4,128,4,128,...")
    g.add_argument("--experts", type=int, dest="n_routed_experts")
    g.add_argument("--top-k", type=int, dest="num_experts_per_tok")
    g.add_argument("--moe-inter", type=int, dest="moe_intermediate_size")
    g.add_argument("--heads", type=int, dest="num_attention_heads")
    g = p.add_argument_group("training")
    g.add_argument("--batch-size", type=int, help="rows per step (default 32; --tiny 2)")
    g.add_argument("--seq-len", type=int, help="tokens per row (default 512; --tiny 64)")
    g.add_argument("--lr", type=float, help="peak AdamW learning rate (default 2e-3)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, as a share of --lr")
    g.add_argument("--warmup", type=int, help="linear warm-up steps (default 50)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--mtp-depth", type=int, help="chained MTP draft steps trained per position (default 3)")
    g.add_argument("--mtp-weight", type=float, default=0.5, help="loss = LM + w * mean MTP step loss")
    g.add_argument("--balance-rate", type=float, default=1e-2, help="aux-loss-free router bias step (default 1e-2)")
    g.add_argument("--experts-impl", default="dense",
                   help="transformers experts implementation: dense (every expert, no host sync), eager, grouped_mm")
    g = p.add_argument_group("data")
    g.add_argument("--data-root", help="folder of .py files to train on (default: this Python's stdlib)")
    g.add_argument("--heldout-permille", type=int, default=D.DEFAULT_HELDOUT_PERMILLE)
    g.add_argument("--max-files", type=int, help="use only the first N train files (default all; --tiny 12)")
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-rows", type=int, help="held-out rows evaluated (default 64)")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--quant", choices=("auto", *FORMATS), default="auto",
                   help="checkpoint format; auto: fp8-fp4 unless its held-out LM loss is more than\n"
                        "--quant-tolerance above bf16's or its acceptance proxy drops by more than 0.05")
    g.add_argument("--quant-tolerance", type=float, default=0.01, help="relative LM-loss increase allowed (auto)")
    g.add_argument("--no-engine-check", action="store_true", help="skip loading the result with our engine")
    g.add_argument("--num-prompts", type=int)
    g.add_argument("--prompt-len", type=int)
    args = p.parse_args(argv)
    for k, (full, tiny) in RUN_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, tiny if args.tiny else full)
    for k in ("steps", "batch_size", "seq_len", "eval_rows", "num_prompts", "prompt_len"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {getattr(args, k)}")
    if args.mtp_depth < 1:
        p.error(f"--mtp-depth must be >= 1, got {args.mtp_depth}")
    for k in ("lr", "minutes"):
        if not getattr(args, k) > 0:
            p.error(f"--{k} must be > 0, got {getattr(args, k)}")
    for k in ("warmup", "mtp_weight", "weight_decay", "balance_rate"):
        if not getattr(args, k) >= 0:
            p.error(f"--{k.replace('_', '-')} must be >= 0, got {getattr(args, k)}")
    return args


def lr_at(step: int, args) -> float:
    """Linear warm-up to ``args.lr``, then cosine decay to ``min_lr_ratio * lr`` at the last step."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def make_optimizer(model: SM.SpecModel, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (betas 0.9 / 0.95): weight decay on the matrices except the embedding; fused on CUDA."""
    decay, rest = [], []
    for name, prm in model.named_parameters():
        (decay if prm.dim() >= 2 and "embed_tokens" not in name else rest).append(prm)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA; float32 (no autocast) elsewhere."""
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def eval_rows(rows: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` rows spread evenly over ``rows`` (all when there are fewer): a fixed evaluation set."""
    idx = torch.linspace(0, rows.shape[0] - 1, steps=min(n, rows.shape[0])).round().long().unique()
    return rows[idx]


def train(model: SM.SpecModel, corpus: D.Corpus, args, device: torch.device, log=print) -> dict:
    """The training loop. Returns ``{"steps_done", "stopped_by", "train_seconds", "curve": [...]}``."""
    opt = make_optimizer(model, args, device)
    balancer = SM.ExpertBalancer(model, args.balance_rate)
    amp = autocast_for(device)
    rows = corpus.train_rows.to(device)  # indexed on the device: no host sync per step
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(rows.shape[0], generator=g).to(device)
    pos = 0
    curve, stopped = [], "steps"
    model.train()
    t0 = time.perf_counter()
    step = 0
    for step in range(args.steps):
        if time.perf_counter() - t0 > args.minutes * 60:
            stopped = "minutes"
            break
        if pos + args.batch_size > order.numel():
            order, pos = torch.randperm(rows.shape[0], generator=g).to(device), 0
        batch = rows[order[pos:pos + args.batch_size]]
        pos += args.batch_size
        for grp in opt.param_groups:
            grp["lr"] = lr_at(step, args)
        with amp():
            loss, parts = SM.train_loss(model, batch, args.mtp_depth, args.mtp_weight)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        if step % args.log_every == 0 or step == args.steps - 1:  # the only host syncs of the loop
            el = time.perf_counter() - t0
            parts = {k: float(v) for k, v in parts.items()}
            rec = {"step": step, "loss": float(loss.detach()), **parts, "grad_norm": float(gnorm),
                   "lr": lr_at(step, args), "max_expert_load": float(imbalance) if imbalance is not None else None,
                   "seconds": round(el, 2)}
            curve.append(rec)
            log(f"step {step:5d}  loss {rec['loss']:.4f}  lm {parts['lm']:.4f}  "
                + "  ".join(f"{k} {v:.3f}" for k, v in parts.items() if k.startswith("mtp"))
                + f"  |g| {rec['grad_norm']:.2f}  load {rec['max_expert_load'] or 0:.2f}  {el:.0f} s")
            if not math.isfinite(rec["loss"]):
                raise RuntimeError(f"training diverged by step {step}: loss {rec['loss']}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    done = step + 1 if stopped == "steps" else step
    return {"steps_done": done, "stopped_by": stopped, "train_seconds": round(time.perf_counter() - t0, 2),
            "curve": curve}


def write_format(out: Path, cfg: dict, native: dict, fmt: str) -> Path:
    """Write ``native`` in checkpoint format ``fmt`` (:data:`FORMATS`) into the new folder ``out``."""
    from deepinfer.checkpoint import write_checkpoint

    return write_checkpoint(out, cfg, native, **FORMATS[fmt])


def read_back(path: Path) -> dict:
    """The checkpoint's tensors as the engine's loader reads them (dequantised exactly, float32)."""
    from deepinfer.checkpoint import load_checkpoint

    return load_checkpoint(path).params


def choose_format(results: dict, args) -> str:
    """``--quant`` or, for ``auto``, fp8-fp4 when it is within the tolerances of bf16 (see ``--quant``)."""
    if args.quant != "auto":
        return args.quant
    q, b = results["fp8-fp4"], results["bf16"]
    ok = q["lm_loss"] <= b["lm_loss"] * (1 + args.quant_tolerance) and q["accept_len"] >= b["accept_len"] - 0.05
    return "fp8-fp4" if ok else "bf16"


def engine_check(path: Path, model: SM.SpecModel, row: torch.Tensor, device: torch.device) -> dict:
    """Our engine on the written checkpoint against the trained model (holding the checkpoint's weights) on one
    held-out row: main logits at every position and the first MTP step's logits. On the CPU both run in float32
    (gemm path "dequant"); on CUDA the engine runs its production path (bf16, FP8 GEMMs) against bf16 autocast.
    Returns max |diff| / max |ref| and the top-1 agreement for each."""
    from deepinfer.forward_batch import ForwardBatch
    from deepinfer.models.deepseek_v4 import BLOCK_SIZE, DeepseekV4ForCausalLM

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    eng = DeepseekV4ForCausalLM.from_checkpoint(path, dtype=dtype, device=device)
    ids, nxt = row[:-1].to(device), row[1:].to(device)
    S = ids.numel()
    with torch.no_grad(), autocast_for(device)():
        h, hs = model(ids.view(1, -1), nxt.view(1, -1), 1)
        ref = torch.nn.functional.linear(h[0], model.head_weight).float()
        ref_mtp = torch.nn.functional.linear(hs[0][0], model.head_weight).float()
    nb = -(-S // BLOCK_SIZE)
    bt = torch.arange(nb, dtype=torch.int32, device=device).view(1, -1)
    cache = eng.allocate_cache(nb, device)
    every = torch.arange(S, device=device)
    got, streams = eng.forward(ForwardBatch(ids, every, [S], [S], bt, every), cache, return_hidden=True)
    got_mtp = eng.forward_mtp(ForwardBatch(nxt, every, [S], [S], bt, every), cache, streams)

    def cmp(a, b):
        return {"max_rel_err": float((a - b).abs().max() / b.abs().max()),
                "top1_agree": float((a.argmax(-1) == b.argmax(-1)).float().mean())}

    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "gemm": eng.gemm, "tokens": S,
            "main": cmp(got, ref), "mtp": cmp(got_mtp, ref_mtp)}


def run(argv=None) -> tuple[dict, SM.SpecModel, D.Corpus]:
    """Parse ``argv``, train, write the checkpoint and the report. Returns ``(report, trained model holding the
    checkpoint's weights, corpus)``."""
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here")
    out = Path(args.out)
    if out.exists() and any(p.suffix == ".safetensors" for p in out.iterdir()):
        raise SystemExit(f"--out {out}: already holds weight files; use an empty or new folder")
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", flush=True)

    overrides = {k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "n_routed_experts",
                                                "num_experts_per_tok", "moe_intermediate_size",
                                                "num_attention_heads")}
    cfg = SM.model_config(args.tiny, **overrides)
    corpus = D.build_corpus(args.seq_len, root=args.data_root, heldout_permille=args.heldout_permille,
                            max_files=args.max_files,
                            bos_id=int(cfg.get("bos_token_id", 0)))
    log(f"corpus {json.dumps(corpus.summary())}")
    model = SM.SpecModel(cfg, args.seed, args.experts_impl).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f} M parameters on {device}; config {json.dumps(cfg, sort_keys=True)}")

    amp = autocast_for(device)
    held = eval_rows(corpus.heldout_rows, args.eval_rows)
    train_eval = eval_rows(corpus.train_rows, args.eval_rows)
    metrics = {"initial": SM.evaluate(model, train_eval, args.mtp_depth, args.batch_size, device, amp)}
    trained = train(model, corpus, args, device, log)
    log(f"trained {trained['steps_done']} steps in {trained['train_seconds']} s (stopped by {trained['stopped_by']})")
    metrics["train"] = SM.evaluate(model, train_eval, args.mtp_depth, args.batch_size, device, amp)
    native = SM.to_native(model)

    out.mkdir(parents=True, exist_ok=True)
    candidates = list(FORMATS if args.quant == "auto" else [args.quant])
    candidates = [c for c in candidates if c != "fp32" or args.quant == "fp32"]
    per_format = {}
    for fmt in candidates:
        shutil.rmtree(out / f".candidate-{fmt}", ignore_errors=True)  # left by an interrupted run
        d = write_format(out / f".candidate-{fmt}", cfg, native, fmt)
        SM.load_native(model, read_back(d))
        per_format[fmt] = SM.evaluate(model, held, args.mtp_depth, args.batch_size, device, amp)
        per_format[fmt]["bytes"] = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        log(f"held-out, {fmt} checkpoint: {json.dumps(per_format[fmt])}")
    fmt = choose_format(per_format, args)
    for f in (out / f".candidate-{fmt}").iterdir():
        shutil.move(str(f), out / f.name)
    for c in candidates:
        shutil.rmtree(out / f".candidate-{c}", ignore_errors=True)
    SM.load_native(model, read_back(out))  # the model now holds exactly what the checkpoint holds
    metrics["heldout"] = per_format[fmt]
    log(f"wrote {fmt} checkpoint to {out}")

    check = None
    if not args.no_engine_check:
        try:
            check = engine_check(out, model, held[0], device)
        except Exception as e:  # the checkpoint is written: report the failure instead of losing the run
            check = {"error": f"{type(e).__name__}: {e}"}
        log(f"engine check: {json.dumps(check)}")
    prompts = D.heldout_prompts(corpus.heldout_docs, corpus.heldout_files, args.num_prompts, args.prompt_len)
    with open(out / PROMPTS, "w", encoding="utf-8") as f:
        for pr in prompts:
            f.write(json.dumps(pr) + "\n")
    report = {
        "args": {k: v for k, v in vars(args).items()}, "device": str(device),
        "torch": torch.__version__, "python": sys.version.split()[0], "corpus": corpus.summary(), "config": cfg,
        "parameters": n_params, **trained, "format": fmt, "per_format": per_format, "metrics": metrics,
        "engine_check": check, "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
        report["max_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    (out / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    log(f"held-out: LM loss {metrics['heldout']['lm_loss']:.4f}, top-1 {metrics['heldout']['lm_acc']:.3f}; MTP top-1 "
        f"vs t+2 {[round(a, 3) for a in metrics['heldout']['mtp_acc']]}, agreement with the main model "
        f"{[round(a, 3) for a in metrics['heldout']['mtp_agree']]}, acceptance proxy "
        f"{metrics['heldout']['accept_len']:.3f} at k={args.mtp_depth}; report {out / REPORT}")
    return report, model, corpus


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    run()
