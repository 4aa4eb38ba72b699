"""Serving benchmark: a request-rate or concurrency sweep against `deepinfer serve` (after vLLM's benchmark_serving).

Usage (from the repository root, PYTHONPATH=python:engine):
    python bench/bench_serve.py                      # GPU default: makes a v4-flash-shapes checkpoint, serves it, sweeps
    python bench/bench_serve.py --url http://127.0.0.1:8000 --request-rates 1,4,16,inf
    python bench/bench_serve.py --model /tmp/v4fs --concurrency 1,16,64,256 --serve-args "--max-num-seqs 256"
    python bench/bench_serve.py --smoke              # CPU: the tiny preset, a few short requests
    python bench/plot_curves.py bench/results/h200   # the PNG plots (matplotlib)

Server: --url drives a running server; otherwise the script starts `deepinfer serve` on 127.0.0.1 at a free port in a
subprocess (the load generator must not share the server's interpreter), waits for /health and stops it (SIGTERM)
at the end. --serve-args goes to that server as it is.

Prompts: --dataset random (default) sends token-id prompts of --input-len tokens (+- --range-ratio) to
/v1/completions with max_tokens = --output-len and ignore_eos, so every request has its stated lengths. A JSONL file
instead: each line is {"prompt": text or token ids, "max_tokens"?} (/v1/completions) or {"messages": [...],
"max_tokens"?} (/v1/chat/completions); a line without max_tokens gets --output-len.

Sweep: each point runs --num-prompts requests (default: 4 x its concurrency, at least 16); a point is one request rate (Poisson arrivals, or gamma with
--burstiness; inf = all at once) with at most --max-concurrency open requests, or one concurrency (--concurrency:
rate inf, at most N open). Both lists given: every pair. One warm-up request runs before the first point.

Per request (streamed, usage from the last chunk): TTFT = first content chunk - send; ITL = gaps between content
chunks; TPOT = (end - first chunk) / (output tokens - 1); E2EL = end - send. Per point: mean / median / p50 / p90 /
p99 of each (ms), request and token throughput over the point's wall time, and goodput (requests per second that
met every --goodput SLO). Writes bench/results/<gpu>/bench_serve.json (rows op=serve, "us" = 1e6 / output tok/s, as
bench_engine's) and bench_serve_requests.jsonl (one line per request); --results-name renames both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PERCENTILES = (50, 90, 99)
TOKEN_ID_RANGE = (1000, 100000)  # random prompts: ordinary tokens of the V4 vocabulary (no special ones)
SMOKE = dict(model="tiny", input_len=16, output_len=4, num_prompts=6, concurrency="1,3", request_rates=None,
             serve_args="--device cpu --max-num-seqs 4 --max-num-batched-tokens 256 --num-blocks 32")


@dataclass
class BenchRequest:
    """One request to send: ``body`` without ``model`` / ``stream``; ``api`` is ``completions`` or ``chat``."""

    api: str
    body: dict
    input_len: int | None  # prompt tokens when known before sending (token-id prompts)
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    start_s: float = 0.0  # send time from the point's start
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    connect_retries: int = 0  # connection errors before the request reached the server (each retried)
    itl_ms: list[float] = field(default_factory=list)


# ---------------------------------------------------------------------------- requests
def random_requests(n: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    """``n`` token-id prompts of ``input_len`` (x [1 - range_ratio, 1 + range_ratio]) tokens, run to ``output_len``
    tokens each (``ignore_eos``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        lo, hi = max(1, round(input_len * (1 - range_ratio))), max(1, round(input_len * (1 + range_ratio)))
        m = rng.randint(lo, hi)
        ids = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(m)]
        out.append(BenchRequest("completions", {"prompt": ids, "max_tokens": output_len, "ignore_eos": True,
                                                "temperature": 0}, m, output_len))
    return out


def jsonl_requests(path: str, n: int, output_len: int, seed: int) -> list[BenchRequest]:
    """Requests from a JSONL file (see the module docstring), cycled or shuffled to ``n``; bad lines are errors
    naming the line and the field."""
    items = []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ValueError(f"--dataset {path}: line {no}: malformed JSON: {e}") from None
            if not isinstance(rec, dict) or ("prompt" in rec) == ("messages" in rec):
                raise ValueError(f"--dataset {path}: line {no}: expected an object with 'prompt' or 'messages'")
            mt = rec.get("max_tokens", output_len)
            if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
                raise ValueError(f"--dataset {path}: line {no}: max_tokens must be a positive integer, got {mt!r}")
            body = {k: v for k, v in rec.items() if k not in ("model", "stream", "stream_options")}
            body["max_tokens"] = mt
            if "prompt" in rec:
                ids = rec["prompt"] if isinstance(rec["prompt"], list) else None
                items.append(BenchRequest("completions", body, len(ids) if ids else None, mt))
            else:
                items.append(BenchRequest("chat", body, None, mt))
    if not items:
        raise ValueError(f"--dataset {path}: no requests in the file")
    rng = random.Random(seed)
    order = [items[i % len(items)] for i in range(n)]
    rng.shuffle(order)
    return order


# ---------------------------------------------------------------------------- one request, one point
async def _open_stream(client, model: str, req: BenchRequest, res: RequestResult, connect_retries: int):
    """The request's stream; a connection error before any response (a full listen backlog when hundreds of
    clients connect at once) is retried up to ``connect_retries`` times and counted in ``res``."""
    import openai

    kw = dict(model=model, stream=True, stream_options={"include_usage": True})
    while True:
        try:
            if req.api == "completions":
                body = dict(req.body)
                extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
                return await client.completions.create(**kw, **body, extra_body=extra or None)
            return await client.chat.completions.create(**kw, **req.body)
        except openai.APITimeoutError:
            raise
        except openai.APIConnectionError:
            if res.connect_retries >= connect_retries:
                raise
            res.connect_retries += 1
            await asyncio.sleep(0.05 * res.connect_retries)


async def send(client, model: str, req: BenchRequest, t0: float, connect_retries: int = 0) -> RequestResult:
    """Stream one request with the official ``openai`` client and time its chunks (from the first try)."""
    res = RequestResult(start_s=time.perf_counter() - t0)
    start = time.perf_counter()
    last = None
    try:
        stream = await _open_stream(client, model, req, res, connect_retries)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                res.prompt_tokens, res.output_tokens = chunk.usage.prompt_tokens, chunk.usage.completion_tokens
            text = "".join((c.text if req.api == "completions" else (
                (c.delta.content or "") + (getattr(c.delta, "reasoning_content", None) or ""))) or ""
                for c in chunk.choices)
            if not text:
                continue
            if last is None:
                res.ttft_ms = 1e3 * (now - start)
            else:
                res.itl_ms.append(1e3 * (now - last))
            last = now
        end = time.perf_counter()
        res.e2el_ms = 1e3 * (end - start)
        if res.ttft_ms is None:  # no visible text (e.g. all whitespace-free special tokens): first byte is the end
            res.ttft_ms = res.e2el_ms
        if res.output_tokens > 1 and last is not None:
            res.tpot_ms = (1e3 * (end - start) - res.ttft_ms) / (res.output_tokens - 1)
        res.ok = res.output_tokens > 0
        if not res.ok:
            res.error = "the stream carried no usage (no output tokens counted)"
    except Exception as e:  # noqa: BLE001 - one failed request is a counted failure, never the run's end
        cause = e.__cause__ or e.__context__
        res.error = (f"{type(e).__name__}: {e}" + (f" ({type(cause).__name__}: {cause})" if cause else ""))[:500]
    return res


async def run_point(client, model: str, requests: list[BenchRequest], rate: float, max_concurrency: int | None,
                    burstiness: float, seed: int, connect_retries: int = 0) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at ``rate`` requests/s (inf: at once), at most ``max_concurrency`` open; returns the
    results (in send order) and the wall time of the point in seconds."""
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req):
        if sem is None:
            return await send(client, model, req, t0, connect_retries)
        async with sem:
            return await send(client, model, req, t0, connect_retries)

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(requests):
        tasks.append(asyncio.ensure_future(one(req)))
        if math.isfinite(rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------------------- metrics
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default method); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(results: list[RequestResult], duration_s: float, goodput: dict[str, float]) -> dict:
    """The metrics of one sweep point (times in ms, throughputs per second of wall time)."""
    ok = [r for r in results if r.ok]
    out = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": round(duration_s, 4),
           "total_input_tokens": sum(r.prompt_tokens for r in ok),
           "total_output_tokens": sum(r.output_tokens for r in ok),
           "connect_retries": sum(r.connect_retries for r in results)}
    d = max(duration_s, 1e-9)
    out["request_throughput"] = round(len(ok) / d, 4)
    out["input_throughput"] = round(out["total_input_tokens"] / d, 3)
    out["output_throughput"] = round(out["total_output_tokens"] / d, 3)
    out["total_token_throughput"] = round((out["total_input_tokens"] + out["total_output_tokens"]) / d, 3)
    series = {"ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
              "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
              "itl": [x for r in ok for x in r.itl_ms], "e2el": [r.e2el_ms for r in ok if r.e2el_ms is not None]}
    for name, vals in series.items():
        out[f"mean_{name}_ms"] = round(sum(vals) / len(vals), 4) if vals else None
        out[f"median_{name}_ms"] = _round(percentile(vals, 50))
        for q in PERCENTILES:
            out[f"p{q}_{name}_ms"] = _round(percentile(vals, q))
    # tok/s per user: the decode speed one request sees (1000 / median TPOT)
    tpot = out["median_tpot_ms"]
    out["output_tok_s_per_user"] = round(1e3 / tpot, 3) if tpot else None
    if goodput:
        good = sum(1 for r in ok if all(_meets(getattr(r, f"{k}_ms"), v, k) for k, v in goodput.items()))
        out["goodput"] = round(good / d, 4)
        out["goodput_slo_ms"] = dict(goodput)
    errors = sorted({r.error for r in results if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def _meets(value_ms: float | None, limit_ms: float, metric: str) -> bool:
    """A request meets an SLO; a one-token answer has no TPOT and meets any TPOT limit."""
    return value_ms <= limit_ms if value_ms is not None else metric == "tpot"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (ms; keys ttft, tpot, e2el)."""
    out = {}
    for item in items or []:
        key, _, val = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: the metric must be ttft, tpot or e2el")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: expected METRIC:MILLISECONDS") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the limit must be a positive number of milliseconds")
        out[key] = ms
    return out


def _numbers(flag: str, text: str | None, kind=float) -> list:
    if text is None:
        return []
    try:
        vals = [kind(x) if x.strip() != "inf" else math.inf for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not v > 0 for v in vals):
        raise ValueError(f"{flag}: every value must be positive, got {text!r}")
    return vals


def sweep_points(args) -> list[tuple[float, int | None]]:
    """``[(request rate, max concurrency)]`` of the sweep."""
    rates = _numbers("--request-rates", args.request_rates)
    concs = [int(c) for c in _numbers("--concurrency", args.concurrency, int)]
    if rates and concs:
        return [(r, c) for c in concs for r in rates]
    if concs:
        return [(math.inf, c) for c in concs]
    return [(r, args.max_concurrency) for r in (rates or [math.inf])]


def num_prompts(args, rate: float, conc: int | None) -> int:
    """Requests of one sweep point: ``--num-prompts``, else 4 waves of the concurrency (at least 16), else 256."""
    if args.num_prompts is not None:
        return args.num_prompts
    return max(16, 4 * conc) if conc else 256


# ---------------------------------------------------------------------------- the server
class ServeProcess:
    """``deepinfer serve`` in a subprocess on 127.0.0.1 at a free port; ``url`` once /health answers ok."""

    def __init__(self, model: str, serve_args: str, start_timeout_s: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "deepinfer.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning", *shlex.split(serve_args or "")]
        print("starting:", shlex.join(cmd), flush=True)
        self.log = tempfile.TemporaryFile()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "python"), str(ROOT / "engine"),
                                             *filter(None, [env.get("PYTHONPATH")])])
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(start_timeout_s)

    def _tail(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")[-3000:]

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx2

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"deepinfer serve exited with status {self.proc.returncode}:\n{self._tail()}")
            try:
                if httpx2.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"deepinfer serve did not become healthy within {timeout_s:g} s "
                                   f"(--server-start-timeout):\n{self._tail()}")
            time.sleep(0.5)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# ---------------------------------------------------------------------------- main
async def bench(url: str, api_key: str, model: str | None, requests: list[BenchRequest], points, args) -> tuple:
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                timeout=args.request_timeout)
    try:
        if model is None:
            model = (await client.models.list()).data[0].id
        warm = await send(client, model, requests[0], time.perf_counter())
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
        goodput = parse_goodput(args.goodput)
        rows, per_request = [], []
        for k, (rate, conc) in enumerate(points):
            reqs = requests[:num_prompts(args, rate, conc)]
            results, duration = await run_point(client, model, reqs, rate, conc, args.burstiness, args.seed + k,
                                                args.connect_retries)
            stats = summarize(results, duration, goodput)
            shape = {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": conc,
                     "num_prompts": len(reqs), "dataset": args.dataset,
                     "input_len": args.input_len if args.dataset == "random" else None,
                     "output_len": args.output_len, "burstiness": args.burstiness, "model": model,
                     "checkpoint": args.checkpoint or model}
            thr = stats["output_throughput"]
            rows.append({"op": "serve", "shape": shape, "us": round(1e6 / thr, 3) if thr else float("nan"), **stats})
            print(json.dumps(rows[-1]), flush=True)
            per_request += [{"point": k, **{k2: v for k2, v in asdict(r).items() if k2 != "itl_ms"},
                             "itl_ms_mean": _round(sum(r.itl_ms) / len(r.itl_ms)) if r.itl_ms else None,
                             "itl_ms_max": _round(max(r.itl_ms)) if r.itl_ms else None} for r in results]
        return rows, per_request
    finally:
        await client.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=None, help="a running server (default: start one with --model)")
    p.add_argument("--api-key", default="EMPTY", help="the server's --api-key")
    p.add_argument("--model", default=None,
                   help="checkpoint folder or preset to serve; default: a v4-flash-shapes checkpoint made in a temp "
                   "dir (deleted after). With --url: the model name to request (default: the server's)")
    p.add_argument("--num-layers", type=int, default=None, help="depth of the generated checkpoint")
    p.add_argument("--num-experts", type=int, default=64, help="routed experts of the generated checkpoint")
    p.add_argument("--work-dir", default=None, help="where the generated checkpoint goes")
    p.add_argument("--serve-args", default=None,
                   help="extra arguments of the started `deepinfer serve` (default: --max-num-seqs = the largest "
                   "concurrency (at least 256), --max-num-batched-tokens 8192, --max-model-len = the longest "
                   "request + 128)")
    p.add_argument("--server-start-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    p.add_argument("--dataset", default="random", help="random, or a JSONL file of prompts (see the docstring)")
    p.add_argument("--input-len", type=int, default=1024, help="random prompts: tokens per prompt")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos for random)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random prompts: input length spread (0..1)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per sweep point (default: 4 x the point's concurrency, at least 16; 256 for a "
                   "request-rate point without a cap)")
    p.add_argument("--request-rates", default=None, help="comma list of requests/s (inf: all at once)")
    p.add_argument("--concurrency", default="1,4,16,64,256", help="comma list of most open requests")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap of a request-rate sweep")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    p.add_argument("--goodput", nargs="*", default=None, metavar="METRIC:MS",
                   help="SLOs of goodput, e.g. ttft:2000 tpot:50 (metrics ttft, tpot, e2el)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="client timeout per request (s)")
    p.add_argument("--connect-retries", type=int, default=2,
                   help="retries of a connection error before any response (counted per point as connect_retries)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: the tiny preset, 6 short requests, "
                   "concurrency 1 and 3")
    p.add_argument("--out-dir", type=Path, default=None, help="folder for the JSON (default bench/results/<gpu>)")
    p.add_argument("--results-name", default="bench_serve")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the written document's rows and paths (tests)."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    if args.request_rates is not None and args.concurrency == p.get_default("concurrency"):
        args.concurrency = None  # a rate sweep: the default concurrency list is not crossed with it
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if not 0 <= args.range_ratio < 1:
        p.error(f"--range-ratio: expected 0 <= r < 1, got {args.range_ratio}")
    if not args.burstiness > 0:
        p.error(f"--burstiness: expected > 0, got {args.burstiness}")
    if args.connect_retries < 0:
        p.error(f"--connect-retries: expected >= 0, got {args.connect_retries}")
    try:
        points = sweep_points(args)
        parse_goodput(args.goodput)
        n = max(num_prompts(args, rate, conc) for rate, conc in points)
        if args.dataset == "random":
            requests = random_requests(n, args.input_len, args.output_len, args.range_ratio, args.seed)
        else:
            requests = jsonl_requests(args.dataset, n, args.output_len, args.seed)
    except ValueError as e:
        p.error(str(e))
    if args.serve_args is None:
        longest = round(args.input_len * (1 + args.range_ratio)) + args.output_len
        if args.dataset != "random":
            longest = 0  # unknown: the model's own limit
        most = max([c for _, c in points if c] + [256])
        args.serve_args = f"--max-num-seqs {most} --max-num-batched-tokens 8192" + (
            f" --max-model-len {longest + 128}" if longest else "")
    server, tmp, model = None, None, args.model
    args.checkpoint = model
    try:
        if args.url is None:
            if model is None:
                from deepinfer.presets import make_checkpoint

                tmp = tempfile.mkdtemp(prefix="bench-serve-v4fs-", dir=args.work_dir)
                make_checkpoint("v4-flash-shapes", tmp, 0, num_layers=args.num_layers, num_experts=args.num_experts,
                                progress=False)
                model, args.checkpoint = tmp, "v4-flash-shapes"
            server = ServeProcess(model, args.serve_args, args.server_start_timeout)
            url, name = server.url, None
        else:
            url, name = args.url, model
        rows, per_request = asyncio.run(bench(url, args.api_key, name, requests, points, args))
    finally:
        if server is not None:
            server.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    from bench.timer import write_results

    path = write_results(args.results_name, rows, args.out_dir)
    req_path = path.with_name(f"{args.results_name}_requests.jsonl")
    with open(req_path, "w", encoding="utf-8") as f:
        for rec in per_request:
            f.write(json.dumps(rec) + "\n")
    print(f"wrote {req_path}")
    return {"rows": rows, "json": path, "requests": req_path}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
