"""The ``deepinfer`` command line. Subcommands are added as the engine grows.

``deepinfer generate --model DIR --input requests.jsonl --output results.jsonl``: each input line is a request body
(Chat Completions by default; ``--api messages|responses`` for the others); output line N answers input line N with
the response object or ``{"line": N, "error": {...}}``. ``-`` means stdin / stdout. Without ``--model`` the built-in
tiny checkpoint is used. Progress (tqdm, live tok/s) and the summary go to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys


def _open_in(path: str):
    return contextlib.nullcontext(sys.stdin) if path == "-" else open(path, encoding="utf-8")


def _open_out(path: str):
    return contextlib.nullcontext(sys.stdout) if path == "-" else open(path, "w", encoding="utf-8")


def run_generate(args: argparse.Namespace, model_obj=None) -> int:
    """Run ``generate``; ``model_obj`` replaces ``--model`` with a built model (tests)."""
    from deepinfer.chat import is_error_record
    from deepinfer.config import EngineConfig
    from deepinfer.llm import LLM

    cfg = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       num_blocks=args.num_blocks, max_model_len=args.max_model_len, device=args.device,
                       seed=args.seed, enable_image_fetch=args.enable_image_fetch)
    with _open_in(args.input) as f:
        lines = f.read().splitlines()
    llm = LLM(model_obj if model_obj is not None else (args.model or "tiny"), config=cfg,
              batch_invariant=args.batch_invariant, served_model_name=args.served_model_name,
              tokenizer=args.tokenizer, created=args.created)
    records: list[dict | None] = [None] * len(lines)
    bodies, where = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            records[i] = {"line": i + 1, "error": {"message": "empty line: expected a JSON request body",
                                                   "type": "invalid_request_error", "code": "invalid_json",
                                                   "param": None, "status_code": 400}}
            continue
        try:
            body = json.loads(line)
        except ValueError as e:
            records[i] = {"line": i + 1, "error": {"message": f"malformed JSON: {e}", "type": "invalid_request_error",
                                                   "code": "invalid_json", "param": None, "status_code": 400}}
            continue
        bodies.append(body)
        where.append(i)
    results = llm.chat(bodies, api=args.api, use_tqdm=not args.no_progress)
    for i, res in zip(where, results):
        records[i] = {"line": i + 1, "error": res["error"]} if is_error_record(res) else res
    with _open_out(args.output) as out:
        for rec in records:
            out.write(json.dumps(rec, ensure_ascii=False) + "\n")
    stats = llm.last_stats
    stats.num_requests = len(lines)
    stats.num_errors = sum(1 for r in records if set(r) == {"line", "error"})
    print(stats.format(), file=sys.stderr)
    if args.summary_json:
        with open(args.summary_json, "w", encoding="utf-8") as f:
            json.dump(stats.summary(), f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-family inference")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation for a JSONL file of request bodies")
    g.add_argument("--model", default=None, help="checkpoint directory or preset (default: the built-in tiny checkpoint)")
    g.add_argument("--input", required=True, help="JSONL of request bodies, '-' for stdin")
    g.add_argument("--output", required=True, help="JSONL of responses / error records, '-' for stdout")
    g.add_argument("--api", choices=("chat", "messages", "responses"), default="chat",
                   help="protocol of the request bodies (default: Chat Completions)")
    g.add_argument("--batch-invariant", action="store_true", help="a request's output does not depend on its batch")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    g.add_argument("--num-blocks", type=int, default=None, help="cache blocks of 128 tokens (default: derived)")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--seed", type=int, default=None, help="base for the seeds drawn for requests without one")
    g.add_argument("--served-model-name", default=None, help="model name accepted in requests (default: checkpoint dir name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the checkpoint's)")
    g.add_argument("--created", type=int, default=None, help="fixed 'created' timestamp for reproducible output")
    g.add_argument("--enable-image-fetch", action="store_true",
                   help="allow fetching image URLs (public addresses only, size-limited); off by default")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    g.set_defaults(func=run_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0) if hasattr(args, "func") else 0


if __name__ == "__main__":
    sys.exit(main())
