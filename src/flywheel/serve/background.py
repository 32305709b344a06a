"""Run a uvicorn server on a background thread (tests, the demo, the loop daemon)."""

from __future__ import annotations

import socket
import threading
import time

# asyncio's own loop, not uvloop (uvicorn's "auto" picks uvloop when it is installed): on a
# saturated server uvloop answered a few connections many times later than the rest, where
# asyncio's loop kept the tail close to the median at the same throughput (docs/benchmarks.md,
# bench/api.py).
EVENT_LOOP = "asyncio"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """`with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        import uvicorn  # the `serve` extra; free_port works without it

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level=log_level,
                                                    lifespan="on", loop=EVENT_LOOP))
        self.thread = threading.Thread(target=self.server.run, name="flywheel-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
