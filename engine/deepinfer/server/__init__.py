"""``deepinfer serve``: an OpenAI- and Anthropic-compatible HTTP server over one engine loop (see docs/serving.md)."""

from __future__ import annotations

import asyncio
import time

from deepinfer.server.app import ServerConfig, create_app


def run_server(llm, host: str = "127.0.0.1", port: int = 8000, config: ServerConfig | None = None,
               shutdown_timeout: float = 10.0, log_level: str = "info") -> None:
    """Serve ``llm`` until SIGINT / SIGTERM. On a signal, new requests get 503 while open ones have up to
    ``shutdown_timeout`` seconds to finish; the rest end with a ``server_shutdown`` error (an error event for a
    stream), then the server closes."""
    import uvicorn

    app = create_app(llm, config)
    loop = app.state.loop

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            loop.drain()
            deadline = time.monotonic() + shutdown_timeout
            while loop.num_open and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.to_thread(loop.stop)
            await super().shutdown(sockets)

    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="on")).run()


__all__ = ["ServerConfig", "create_app", "run_server"]
