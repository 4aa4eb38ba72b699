"""No hangs, no leaks: a wedged engine loop turns /health unhealthy, a full queue answers 429, a slow request
times out, 200 concurrent mixed requests with mid-stream disconnects all end properly with every cache block back,
and SIGTERM ends a running server cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
import openai
import pytest

from server_util import RunningServer
from deepinfer import LLM
from deepinfer.server import ServerConfig
from fake_model import FakeConfig, FakeModel

USER = [{"role": "user", "content": "Hello"}]
CHAT = {"messages": USER, "max_tokens": 3, "thinking": {"type": "disabled"}}


class GatedModel(FakeModel):
    """A FakeModel whose forward waits on ``gate`` while ``gate`` is clear: a wedged engine step."""

    def __init__(self) -> None:
        super().__init__(FakeConfig(max_position_embeddings=1024, eos_every=10 ** 9))
        self.gate = threading.Event()
        self.gate.set()

    def forward(self, batch, cache):
        self.gate.wait(60)
        return super().forward(batch, cache)


def _post(url: str, body: dict, timeout: float = 30.0):
    return httpx2.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def test_wedged_loop_health_backpressure_and_timeout(start_server):
    model = GatedModel()
    s = start_server(LLM(model, num_blocks=16, max_num_seqs=1),
                     ServerConfig(max_waiting=1, health_stall_s=0.3, request_timeout=2.0, retry_after_s=3))
    assert httpx2.get(s.url + "/health").status_code == 200
    model.gate.clear()
    results = []
    threads = [threading.Thread(target=lambda: results.append(_post(s.url, {**CHAT, "max_tokens": 4})))
               for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while s.loop.num_open < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    over = _post(s.url, CHAT)  # max_num_seqs (1) + max_waiting (1) are open: refused at once
    assert over.status_code == 429 and over.headers["retry-after"] == "3"
    assert over.json()["error"]["code"] == "rate_limit_exceeded"
    time.sleep(0.5)
    h = httpx2.get(s.url + "/health")
    assert h.status_code == 503 and "no progress" in h.json()["reason"]
    for t in threads:
        t.join(30)
    assert [r.status_code for r in results] == [504, 504]  # the request timeout ended both
    assert results[0].json()["error"]["code"] == "timeout"
    model.gate.set()
    s.wait_idle()
    assert httpx2.get(s.url + "/health").status_code == 200
    assert _post(s.url, CHAT).status_code == 200  # and it still serves


@pytest.fixture(scope="module")
def tiny_server():
    s = RunningServer(LLM("tiny", max_num_seqs=64), ServerConfig(max_waiting=256))
    yield s
    s.close()


async def _one(client: httpx2.AsyncClient, url: str, rng: random.Random, i: int) -> str:
    kind = rng.choice(["ok", "ok", "stream", "stream_cut", "cut", "bad_json", "bad_field", "bad_model"])
    path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/completions"])
    body: dict = {"max_tokens": rng.randint(1, 6), "seed": i, "messages": USER}
    if path == "/v1/completions":
        body = {"prompt": "Hello there", "max_tokens": rng.randint(1, 6), "seed": i}
    if path == "/v1/messages":
        body["model"] = "tiny"
    if kind == "bad_field":
        body["max_tokens"] = -3
    if kind == "bad_model":
        body["model"] = "no-such-model"
    if kind.startswith("stream"):
        body["stream"] = True
    content = b"{broken" if kind == "bad_json" else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if kind == "cut":  # a non-streamed request whose client gives up
        try:
            await client.post(url + path, content=content, headers=headers, timeout=0.05)
        except httpx2.TimeoutException:
            return "cut"
        return "cut-finished"
    async with client.stream("POST", url + path, content=content, headers=headers) as r:
        if kind == "stream_cut" and r.status_code == 200:
            async for _ in r.aiter_lines():
                break  # disconnect after the first line
            return "stream_cut"
        data = await r.aread()
    if kind in ("ok", "stream"):
        assert r.status_code == 200, (r.status_code, data[:300])
        if kind == "stream":
            assert b"error" not in data.split(b"\n")[-3], data[-300:]
        return "ok"
    expected = {"bad_json": 400, "bad_field": 400, "bad_model": 404}[kind]
    assert r.status_code == expected, (kind, path, r.status_code, data[:300])
    assert json.loads(data)  # an error body in the API's format
    return "error"


def test_200_concurrent_mixed_requests_with_disconnects(tiny_server):
    s = tiny_server
    rng = random.Random(0)

    async def main():
        limits = httpx2.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx2.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*[_one(client, s.url, rng, i) for i in range(200)])

    outcomes = asyncio.run(main())
    assert len(outcomes) == 200 and outcomes.count("ok") > 20 and outcomes.count("error") > 20
    assert outcomes.count("stream_cut") > 5 and outcomes.count("cut") > 5
    s.wait_idle()  # every request ended in the engine and every cache block is free
    assert s.loop.snapshot["running"] == 0 and s.loop.snapshot["waiting"] == 0
    metrics = httpx2.get(s.url + "/metrics").text
    aborted = [ln for ln in metrics.splitlines() if ln.startswith('deepinfer_requests_total{outcome="aborted"}')]
    assert aborted and float(aborted[0].split()[-1]) > 0  # disconnects aborted requests inside the engine
    r = _post(s.url, {**CHAT, "model": "tiny"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sigterm_ends_in_flight_requests_and_exits(tmp_path):
    port = _free_port()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "python"), str(root / "engine"),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.cli", "serve", "--model", "tiny", "--port", str(port),
                             "--shutdown-timeout", "1", "--log-level", "warning"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx2.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx2.TransportError:
                time.sleep(0.2)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = oai.chat.completions.create(model="tiny", messages=USER, max_tokens=3000, stream=True)
        first = next(iter(stream))
        assert first.choices
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError) as e:  # the in-flight stream ends with an error event, not a hang
            for _ in stream:
                pass
        assert "shut down" in str(e.value)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_streamed_constraint_that_does_not_compile_is_a_400(start_server):
    """Streamed, it used to be a 200 whose only event was the error; without streaming it was already a 400. A
    constraint that compiles still streams, and a good request after them is answered."""
    srv = start_server(LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), num_blocks=16))
    bad = {**CHAT, "structured_outputs": {"regex": "(a|"}}
    for stream in (False, True):
        r = _post(srv.url, {**bad, "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs.regex", (stream, r.text)
    r = _post(srv.url, {**CHAT, "stream": True, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200 and "data: [DONE]" in r.text and '"error"' not in r.text, r.text
    assert _post(srv.url, CHAT).status_code == 200
