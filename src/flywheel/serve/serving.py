"""Serving the registry's production version with trace capture, for the loop daemon and the
demo: the OpenAI-compatible app on a background uvicorn thread, a follower that switches to a
newly promoted version (requests in flight finish on the old one), every response recorded
as a trace in the loop's store, and POST /v1/traces + feedback on the same store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flywheel.loop.cycle import CycleError
from flywheel.serve import OpenAIService
from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer
from flywheel.serve.production import ProductionFollower, registry_lookup
from flywheel.serve.traces import TraceStoreSink


@dataclass
class Serving:
    url: str  # ends in /v1
    server: Any
    follower: Any
    service: Any
    sink: Any

    @property
    def version(self) -> str:
        return self.service.version

    def switch_now(self) -> bool:
        """Follow a promotion at once instead of at the next poll; True if it switched."""
        return self.follower.check_now()

    def close(self) -> None:
        self.server.stop()  # uvicorn drains the requests in flight
        self.follower.close()
        self.sink.close()
        self.service.close()


def serve_production(fw, host: str = "127.0.0.1", port: int = 0, *, max_batch: int = 64,
                     poll_s: float = 1.0) -> Serving:
    """Start serving `fw.registry`'s production version (port 0: a free one); CycleError, naming
    the registry and the commands that fix it, when there is none."""
    prod = fw.registry.production()
    if prod is None:
        raise CycleError(fw.no_production())
    sink = TraceStoreSink(fw.traces)
    service = OpenAIService(prod.path, version=prod.id, trace_sink=sink, max_batch=max_batch)
    follower = ProductionFollower(service, registry_lookup(fw.registry), interval_s=poll_s).start()
    try:
        app = create_app(service, trace_store=fw.traces, curation=fw.cfg.curation)
        server = BackgroundServer(app, host=host, port=port or None).start()
    except BaseException:
        follower.close()
        sink.close()
        service.close()
        raise
    return Serving(server.url + "/v1", server, follower, service, sink)
