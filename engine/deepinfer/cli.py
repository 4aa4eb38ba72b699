"""The ``deepinfer`` command line. Subcommands are added as the engine grows."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-family inference")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_make_checkpoint(sub)
    return parser


def _add_make_checkpoint(sub) -> None:
    p = sub.add_parser(
        "make-checkpoint",
        help="write a deterministic random checkpoint in the native DeepSeek-V4 format",
        description="Write a deterministic random DeepSeek-V4 checkpoint (native format: FP8 dense weights with 128x128 "
        "UE8M0 block scales, FP4 experts; the real V4 tokenizer). Presets: tiny (the built-in test model) and "
        "v4-flash-shapes (real V4-Flash dimensions at reduced depth, for GPU benchmarks).",
    )
    p.add_argument("--preset", required=True, choices=("tiny", "v4-flash-shapes"))
    p.add_argument("--out", required=True, help="output folder (must hold no weight files yet)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quant", choices=("fp8", "none"), default="fp8", help="dense linear format (default fp8)")
    p.add_argument("--expert-quant", choices=("fp4", "fp8", "none"), default=None,
                   help="routed expert format (default fp4, or none when --quant none)")
    p.add_argument("--scale-fmt", choices=("ue8m0", "float"), default="ue8m0", help="FP8 block scale storage")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="storage of unquantised floats (default bfloat16 when quantised, float32 otherwise)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--num-experts", type=int, default=None, help="override the preset's routed expert count")
    p.add_argument("--shard-size-mb", type=int, default=None, help="shard size in MiB")
    p.set_defaults(func=_run_make_checkpoint)


def _run_make_checkpoint(args: argparse.Namespace) -> int:
    import torch

    from .checkpoint import make_checkpoint

    expert_quant = args.expert_quant or ("none" if args.quant == "none" else "fp4")
    out = make_checkpoint(
        args.preset,
        args.out,
        args.seed,
        quant=args.quant,
        expert_quant=expert_quant,
        scale_fmt=args.scale_fmt,
        dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype),
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        shard_size=args.shard_size_mb * 1024**2 if args.shard_size_mb else None,
    )
    print(out)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0) if hasattr(args, "func") else 0


if __name__ == "__main__":
    sys.exit(main())
