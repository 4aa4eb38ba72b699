"""The ``deepinfer`` command line. Subcommands are added as the engine grows."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-family inference")
    parser.add_subparsers(dest="command", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0) if hasattr(args, "func") else 0


if __name__ == "__main__":
    sys.exit(main())
