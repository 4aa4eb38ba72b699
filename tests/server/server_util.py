"""A real uvicorn server on 127.0.0.1 at a free port, in a thread of the test process (imported by the server
tests and their conftest)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time


class RunningServer:
    """``url`` (``http://127.0.0.1:PORT``), ``app`` and ``loop`` (the ``EngineLoop``) of a server in a thread."""

    def __init__(self, llm, config=None) -> None:
        import uvicorn

        from deepinfer.server import create_app

        self.app = create_app(llm, config)
        self.loop = self.app.state.loop
        self.llm = llm
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[sock])), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no request is open and every cache block is free (or fail)."""
        deadline = time.monotonic() + timeout
        bm = self.llm.block_manager
        while self.loop.num_open or self.loop.snapshot["cache_used_blocks"] or bm.num_free_blocks != bm.num_blocks:
            assert time.monotonic() < deadline, (f"not idle: {self.loop.num_open} open, "
                                                 f"{bm.num_blocks - bm.num_free_blocks} blocks in use")
            time.sleep(0.02)
