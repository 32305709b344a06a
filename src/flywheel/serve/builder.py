"""The one way a server is put together (`build_server`), for `flywheel serve`, the loop daemon
(`flywheel loop run`), the demo and the tests.

A server serves either a model folder as it is (`model`: one version, never switched; it says
so in its startup log) or the production version of a registry (`follow`), switching to each
newly promoted version without failing the requests in flight (serve/production.py). With a
trace store it records every response as a trace and takes POST /v1/traces and feedback; with
the fine-tuning core (finetuning/) the fine-tuning API, and with both the managed flywheels,
whose production aliases it follows the same way (serve/aliases.py), whichever of the two a
server serves. `Server.start()` runs it on a background thread (the daemon, the demo, tests);
`Server.serve_forever()` in the foreground (`flywheel serve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.loop.curation_rules import CurationConfig
from flywheel.serve.app import create_app, single_tenant
from flywheel.serve.background import EVENT_LOOP, BackgroundServer
from flywheel.serve.core import OpenAIService
from flywheel.serve.ingest_pool import IngestPool
from flywheel.serve.production import ProductionFollower, registry_lookup
from flywheel.serve.traces import TraceStoreSink


class NothingToServe(ValueError):
    """A registry followed has no production version yet (the message says how to make one)."""


@dataclass
class ServerConfig:
    model: str | Path | None = None  # a model folder, served as it is
    follow: Any = None  # or a Registry (registry/registry.py): its production version, switched on promotion
    service: OpenAIService | None = None  # or a service the caller made and closes (tests): served as it is
    name: str = "flywheel"  # the model name clients put in `model`
    version: str | None = None  # `model`'s version label (default: its folder's name)
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    trace_store: Any = None  # a TraceStore: record every response, take traces and feedback; None: neither
    curation: CurationConfig | None = None  # the rules feedback is checked against (default: the defaults)
    ingest_workers: int = 0  # processes preparing POST /v1/traces batches (0: a thread of the server)
    max_batch: int = 64  # most sample rows (sum of n) per forward batch
    window_s: float = 0.002  # how long a batch waits for more requests
    default_max_tokens: int = 512  # the budget of a chat request that sets none
    dtype: str = "float32"
    device: str = "cpu"
    fine_tuning: FineTuning | None = None  # the fine-tuning API (and, with a trace store, managed flywheels)
    tenant_of: Callable = single_tenant  # the caller's tenant (serve/auth.py KeyAuth with API keys)
    follow_poll_s: float = 1.0  # how often a followed registry is read
    log_level: str = "warning"


class Server:
    """A built server: its app, the service behind it and what feeds it. `url` ends in /v1
    once started."""

    def __init__(self, cfg: ServerConfig, app, service: OpenAIService, sink: TraceStoreSink | None,
                 follower: ProductionFollower | None):
        # a service the caller passed in (cfg.service) is the caller's to close
        self.cfg, self.app, self.service, self.sink, self.follower = cfg, app, service, sink, follower
        self._background: BackgroundServer | None = None
        self.url: str | None = None

    @property
    def version(self) -> str:
        return self.service.version

    def start(self) -> "Server":
        """Serve on a background thread (port 0: a free one) until close()."""
        self._background = BackgroundServer(self.app, host=self.cfg.host, port=self.cfg.port or None,
                                            log_level=self.cfg.log_level).start()
        self.url = self._background.url + "/v1"
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (SIGINT / SIGTERM), then close."""
        import uvicorn

        try:
            uvicorn.run(self.app, host=self.cfg.host, port=self.cfg.port, log_level=self.cfg.log_level, loop=EVENT_LOOP)
        finally:
            self.close()

    def switch_now(self) -> bool:
        """Follow a promotion at once instead of at the next poll; True if it switched."""
        return self.follower is not None and self.follower.check_now()

    def close(self) -> None:
        if self._background is not None:
            self._background.stop()  # uvicorn drains the requests in flight
            self._background = None
        if self.follower is not None:
            self.follower.close()
        if self.sink is not None:
            self.sink.close()
        if self.cfg.service is None:
            self.service.close()


def build_server(cfg: ServerConfig, log: Callable[[str], None] = lambda m: None) -> Server:
    """The server `cfg` describes (not yet serving: start() or serve_forever()). NothingToServe
    when a followed registry has no production version; ValueError for a config that names
    none or more than one of `model`, `follow` and `service`."""
    if sum(x is not None for x in (cfg.model, cfg.follow, cfg.service)) != 1:
        raise ValueError("a server serves a model folder (model), a registry's production version (follow) or a "
                         "service made already (service), one of the three")
    if cfg.service is not None:
        log(f"serving {cfg.service.version}: this server will not switch versions")
        return _assemble(cfg, cfg.service, None, None)
    if cfg.follow is not None:
        prod = cfg.follow.production()
        if prod is None:
            raise NothingToServe(f"the registry {cfg.follow.root} has no production version yet: register and "
                                 "promote one (`flywheel registry register DIR`, `flywheel registry promote ID`)")
        model, version = prod.path, prod.id
    else:
        model, version = cfg.model, cfg.version or Path(cfg.model).resolve().name
    sink = TraceStoreSink(cfg.trace_store) if cfg.trace_store is not None else None
    service = OpenAIService(model, version=version, name=cfg.name, max_batch=cfg.max_batch, window_s=cfg.window_s,
                            default_max_tokens=cfg.default_max_tokens, trace_sink=sink, dtype=cfg.dtype,
                            device=cfg.device)
    follower = None
    try:
        if cfg.follow is not None:
            follower = ProductionFollower(service, registry_lookup(cfg.follow), interval_s=cfg.follow_poll_s).start()
            log(f"serving {version}, the production version of {cfg.follow.root}; a promotion or rollback "
                "switches it without failing requests in flight")
        else:
            log(f"serving {model} as {version}: this server will not switch versions (--follow serves a "
                "registry's production version and follows its promotions)")
        return _assemble(cfg, service, sink, follower)
    except BaseException:
        if follower is not None:
            follower.close()
        if sink is not None:
            sink.close()
        service.close()
        raise


def _assemble(cfg: ServerConfig, service: OpenAIService, sink: TraceStoreSink | None,
              follower: ProductionFollower | None) -> Server:
    """The app over `service` (the traces, the fine-tuning API and managed flywheels as `cfg`
    asks) and the Server that runs it."""
    app = create_app(service, trace_store=cfg.trace_store, curation=cfg.curation,
                     ingest_pool=IngestPool(cfg.ingest_workers) if cfg.trace_store is not None else None,
                     fine_tuning=cfg.fine_tuning, tenant_of=cfg.tenant_of)
    return Server(cfg, app, service, sink, follower)


def serve_loop(fw, host: str = "127.0.0.1", port: int = 0) -> Server:
    """A loop's production version served on a background thread, following its promotions and
    recording traces in its store (the daemon's and the demo's server); CycleError, naming the
    registry and the commands that fix it, when nothing is in production yet."""
    from flywheel.loop.cycle import CycleError

    if fw.registry.production() is None:
        raise CycleError(fw.no_production())
    cfg = ServerConfig(follow=fw.registry, trace_store=fw.traces, curation=fw.cfg.curation, host=host, port=port)
    return build_server(cfg).start()
