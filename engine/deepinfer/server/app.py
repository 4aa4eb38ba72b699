"""The HTTP application: OpenAI Chat Completions, Completions and Responses, Anthropic Messages, models, health and
metrics, over one ``EngineLoop``. Error bodies follow each API's own format."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deepinfer.chat import RequestError
from deepinfer.server.completions import prepare_completion
from deepinfer.server.loop import EngineLoop, Overloaded, RequestHandle, Unavailable
from deepinfer.server.metrics import ServerMetrics
from deepinfer.structured import GrammarError


@dataclass
class ServerConfig:
    """Settings of the HTTP layer.

    Attributes:
        api_key: required as ``Authorization: Bearer KEY`` or ``x-api-key: KEY`` on ``/v1/*`` (None: no auth).
        max_waiting: open requests accepted beyond the engine's ``max_num_seqs`` before 429.
        max_request_bytes: largest request body; larger ones get 413.
        request_timeout: seconds a request may take end to end (queueing included) before it is aborted (504).
        health_stall_s: ``/health`` reports unhealthy when the engine loop made no progress for this many seconds
            while work was pending.
        retry_after_s: the ``Retry-After`` value of 429 / 503 answers.
    """

    api_key: str | None = None
    max_waiting: int = 256
    max_request_bytes: int = 4 * 1024 * 1024
    request_timeout: float = 600.0
    health_stall_s: float = 30.0
    retry_after_s: int = 1

    def validate(self) -> None:
        for name in ("max_waiting", "max_request_bytes", "retry_after_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "max_waiting" else 1):
                raise ValueError(f"ServerConfig.{name} must be a positive integer, got {v!r}")
        for name in ("request_timeout", "health_stall_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"ServerConfig.{name} must be a positive number of seconds, got {v!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key must not be empty")


ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
          "/v1/responses": "responses"}

# ---------------------------------------------------------------------------- errors, per API
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error", 504: "server_error"}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 504: "timeout_error"}


def error_record(message: str, status: int, code: str, param: str | None = None) -> dict:
    """An engine-style error record (the format ``LLM.chat`` returns)."""
    return {"message": message, "type": OPENAI_TYPES.get(status, "server_error"), "param": param, "code": code,
            "status_code": status}


def error_body(api: str, record: dict) -> tuple[int, dict]:
    """``(HTTP status, body)`` of an error record in ``api``'s format (``"messages"``: Anthropic's)."""
    status = int(record.get("status_code") or (400 if record.get("type") == "invalid_request_error" else 500))
    if api == "messages":
        return status, {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                                   "message": record.get("message", "")}}
    return status, {"error": {"message": record.get("message", ""),
                              "type": record.get("type") or OPENAI_TYPES.get(status, "server_error"),
                              "param": record.get("param"), "code": record.get("code")}}


def error_response(api: str, record: dict, retry_after: int | None = None) -> JSONResponse:
    status, body = error_body(api, record)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(body, status_code=status, headers=headers)


class _Refused(Exception):
    def __init__(self, record: dict, retry_after: int | None = None) -> None:
        super().__init__(record["message"])
        self.record = record
        self.retry_after = retry_after


# ---------------------------------------------------------------------------- SSE
def sse_frame(api: str, name: str | None, data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"


def sse_error(api: str, record: dict) -> str:
    _, body = error_body(api, record)
    if api == "messages":
        return sse_frame(api, "error", body)
    if api == "responses":
        return sse_frame(api, "error", {"type": "error", "code": record.get("code"),
                                        "message": record.get("message", ""), "param": record.get("param")})
    return sse_frame(api, None, body)


class _EventStream(StreamingResponse):
    """An SSE response that aborts its request in the engine when it ends unfinished (client gone, server
    stopping), whichever way the stream was torn down."""

    def __init__(self, content, loop: EngineLoop, handle: RequestHandle) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._loop, self._handle = loop, handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._handle.finished:
                self._loop.abort(self._handle)


# ---------------------------------------------------------------------------- the app
def create_app(llm, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app over ``llm`` (a ``deepinfer.LLM``); the engine loop starts and stops with the app's
    lifespan. ``app.state.loop`` is the ``EngineLoop``, ``app.state.metrics`` the ``ServerMetrics``."""
    config = config or ServerConfig()
    config.validate()
    fe = llm.frontend  # built once, on this thread: requests are converted on the event loop
    metrics = ServerMetrics(lambda: loop.snapshot)
    loop = EngineLoop(llm, config.max_waiting, metrics)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(loop.stop)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.loop = loop
    app.state.metrics = metrics
    app.state.config = config
    accepted = {name for name, v in fe.options.model_versions_by_name.items() if v == fe.model_version}

    def check_auth(request: Request, api: str) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(key.encode(), config.api_key.encode()):
            raise _Refused(error_record("invalid or missing API key (send Authorization: Bearer KEY or "
                                        "x-api-key: KEY)", 401, "invalid_api_key"))

    async def read_json(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_request_bytes:
            raise _Refused(error_record(f"the request body ({declared} bytes) is larger than the limit "
                                        f"({config.max_request_bytes} bytes)", 413, "request_too_large"))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > config.max_request_bytes:
                raise _Refused(error_record(f"the request body is larger than the limit ({config.max_request_bytes}"
                                            " bytes)", 413, "request_too_large"))
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as e:
            raise _Refused(error_record(f"malformed JSON body: {e}"[:500], 400, "invalid_json")) from None
        if not isinstance(body, dict):
            raise _Refused(error_record(f"the request body must be a JSON object, got {type(body).__name__}", 400,
                                        "invalid_request_error"))
        return body

    def check_model(body: dict) -> None:
        name = body.get("model")
        if not isinstance(name, str):  # absent (the served model), or refused by check_request
            return
        if name not in accepted:
            raise _Refused(error_record(f"the model {name!r} does not exist; this server serves "
                                        f"{fe.served_model_name!r}", 404, "model_not_found", "model"))

    def prepare(api: str, body: dict, stream: bool):
        try:
            if api == "completions":
                return prepare_completion(llm, body, stream)
            return fe.prepare(body, api=api, seed_source=llm._draw_seed, stream=stream)
        except RequestError as e:
            raise _Refused(e.record) from None
        except Exception as e:  # noqa: BLE001 - one body's failure is its own 400, never the server's
            raise _Refused(error_record(f"invalid request: {type(e).__name__}: {e}"[:1000], 400,
                                        "invalid_request")) from None

    async def compile_first(pc) -> None:
        """Compile a streamed request's output constraint before its stream opens, so one that does not compile is
        a 400 naming the field, as without streaming (the engine then finds it in the compiler's cache). A
        compilation still running at the compiler's timeout is left to the engine's own deadline."""
        spec = getattr(getattr(pc, "params", None), "structured_outputs", None)
        if spec is None or llm.grammars is None:
            return
        future = asyncio.wrap_future(llm.grammars.submit(spec))
        try:  # shielded: the compilation is shared with the engine's submission of the same constraint
            await asyncio.wait_for(asyncio.shield(future), llm.grammars.timeout_s)
        except GrammarError as e:
            pc.close()
            raise _Refused(error_record(str(e), 400, "invalid_request", e.param)) from None
        except asyncio.TimeoutError:
            pass

    def submit(pc) -> RequestHandle:
        handle = RequestHandle(pc, asyncio.get_running_loop())
        try:
            loop.submit(handle)
        except Overloaded as e:
            pc.close()
            raise _Refused(error_record(str(e), 429, "rate_limit_exceeded"), config.retry_after_s) from None
        except Unavailable as e:
            pc.close()
            raise _Refused(error_record(str(e), 503, "unavailable"), config.retry_after_s) from None
        return handle

    async def serve(request: Request, api: str):
        try:
            check_auth(request, api)
            body = await read_json(request)
            check_model(body)
            stream = body.get("stream") is True  # any other non-null value is refused by check_request
            pc = prepare(api, body, stream)
            if stream:
                await compile_first(pc)
            handle = submit(pc)
        except _Refused as e:
            return error_response(api, e.record, e.retry_after)
        deadline = time.monotonic() + config.request_timeout
        if stream:
            options = body.get("stream_options")
            include_usage = api not in ("chat", "completions") or (
                isinstance(options, dict) and options.get("include_usage") is True)
            return _EventStream(events(api, handle, deadline, include_usage), loop, handle)
        return await complete(request, api, handle, deadline)

    async def next_item(handle: RequestHandle, deadline: float):
        try:
            return await asyncio.wait_for(handle.events.get(), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            record = error_record(f"the request did not finish within {config.request_timeout:g} s", 504,
                                  "timeout")
            loop.abort(handle, dict(record))
            return ("error", record)

    async def complete(request: Request, api: str, handle: RequestHandle, deadline: float):
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            while True:
                getter = asyncio.ensure_future(next_item(handle, deadline))
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():  # the client left: free its blocks; nobody reads the answer
                    getter.cancel()
                    loop.abort(handle)
                    return Response(status_code=499)
                kind, payload = getter.result()
                if kind == "done":
                    return JSONResponse(payload)
                if kind == "error":
                    return error_response(api, payload)
        finally:
            watcher.cancel()
            if not handle.finished:
                loop.abort(handle)

    async def events(api: str, handle: RequestHandle, deadline: float, include_usage: bool):
        done_data = type(handle.prepared.response).sse_done_data() if api != "completions" else "[DONE]"
        while True:
            kind, payload = await next_item(handle, deadline)
            if kind == "events":
                for name, data in payload:
                    if not include_usage:
                        data.pop("usage", None)
                    yield sse_frame(api, name, data)
            elif kind == "done":
                if done_data:
                    yield sse_frame(api, None, done_data)
                return
            else:
                yield sse_error(api, payload)
                if done_data:
                    yield sse_frame(api, None, done_data)
                return

    def endpoint(api: str):
        async def handler(request: Request):
            return await serve(request, api)
        return handler

    for path, api in ROUTES.items():
        app.add_api_route(path, endpoint(api), methods=["POST"], name=api)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            check_auth(request, "chat")
        except _Refused as e:
            return error_response("chat", e.record)
        return {"object": "list", "data": [{"id": fe.served_model_name, "object": "model", "created": created,
                                            "owned_by": "deepinfer", "max_model_len": fe.max_model_len}]}

    @app.get("/health")
    async def health():
        stalled = loop.stalled_for()
        if not loop.thread.is_alive():
            return JSONResponse({"status": "unhealthy", "reason": "the engine loop is not running"}, 503)
        if stalled > config.health_stall_s:
            return JSONResponse({"status": "unhealthy", "reason": f"the engine loop made no progress for "
                                 f"{stalled:.1f} s with work pending"}, 503)
        return {"status": "ok", "open_requests": loop.num_open}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return error_response("messages" if request.url.path.startswith("/v1/messages") else "chat",
                              error_record(f"no route {request.method} {request.url.path}", 404, "not_found"))

    return app
