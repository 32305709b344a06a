"""Which engine answers a request's `model`: the server's own model, or a tenant's fine-tuned
model (or checkpoint), loaded on first use.

- A LoRA adapter over the server's own model (the same folder, or a copy of it such as a
  managed flywheel's registry holds) is served side by side with it: the adapter is
  registered with the base engine's AdapterPool and requests go to a view of the base service
  (`OpenAIService.with_adapter`), so its rows decode in the same batches as everyone's and
  100 fine-tuned models cost 100 adapters, not 100 model copies.
- A full model, or an adapter the base engine cannot take (over another base, or a base on
  the HF fallback runner), gets an OpenAIService of its own (its own engine and batch
  scheduler) recording traces into the server's sink; at most `max_loaded` are kept, the
  least recently used closed first.

A name is looked up per tenant, so one tenant cannot reach another's model; an adapter is
registered under "<tenant>/<name>". A managed flywheel's production alias (`aliases`,
serve/aliases.py) answers as the alias with the service of the model it stands for now.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from flywheel.inference.lora import AdapterError, adapter_base, is_adapter_folder
from flywheel.models.loading import same_model
from flywheel.serve.core import OpenAIService
from flywheel.errors import OpenAIError

# (tenant, model name) -> the model's folder, or None when the tenant has no such model
Resolve = Callable[[str, str], Path | None]
# (tenant, model name) -> the model name it is an alias of now, or None when it is no alias
Aliases = Callable[[str, str], str | None]


class ServedModels:
    def __init__(self, base: OpenAIService, resolve: Resolve | None = None, *, max_loaded: int = 2,
                 aliases: Aliases | None = None, **service_kw: Any):
        """service_kw: OpenAIService options of the fine-tuned models (default_max_tokens, ...)."""
        self.base = base
        self.resolve = resolve
        self.aliases = aliases
        self.max_loaded = max_loaded
        self.service_kw = service_kw
        self._loaded: OrderedDict[tuple[str, str], OpenAIService] = OrderedDict()  # full models, LRU-bounded
        self._views: dict[tuple[str, str], OpenAIService] = {}  # adapters on the base (their pool bounds memory)
        self._loading: dict[tuple[str, str], Future] = {}  # what is loading now, for whoever asks meanwhile
        self._lock = threading.Lock()

    def get(self, tenant: str, name: Any) -> OpenAIService:
        """The service for `name`: blocking while a model loads (call it in a thread). A model
        loads outside the lock: requests for loaded models are answered meanwhile, and requests
        for the one loading wait for that one load."""
        if name == self.base.name or self.resolve is None or not isinstance(name, str):
            return self.base  # it refuses a wrong name itself, with the field named
        target = self.aliases(tenant, name) if self.aliases is not None else None
        if target is not None:
            return self.get(tenant, target).renamed(name, label=target)
        key = (tenant, name)
        with self._lock:
            if key in self._views:
                return self._views[key]
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
            loading = self._loading.get(key)
            first = loading is None
            if first:
                loading = self._loading[key] = Future()
        if not first:
            return loading.result()  # the load another request started (or its error)
        try:
            svc = self._load(tenant, name)
        except BaseException as e:
            with self._lock:
                del self._loading[key]
            loading.set_exception(e)
            raise
        with self._lock:
            del self._loading[key]
            evicted = []
            if svc.scheduler is self.base.scheduler:  # an adapter on the base's engine
                self._views[key] = svc
            else:
                self._loaded[key] = svc
                evicted = [self._loaded.popitem(last=False)[1] for _ in range(len(self._loaded) - self.max_loaded)]
        for old in evicted:
            old.scheduler.close()  # not old.close(): the trace sink is the server's
        loading.set_result(svc)
        return svc

    def _load(self, tenant: str, name: str) -> OpenAIService:
        path = self.resolve(tenant, name)
        if path is None:
            raise OpenAIError(f"model: unknown model {name!r}", param="model", code="model_not_found")
        path = Path(path)
        if not is_adapter_folder(path):
            return OpenAIService(path, version=path.name, name=name, trace_sink=self.base.trace_sink,
                                 **self.service_kw)
        pool_name = f"{tenant}/{name}"
        host = None
        try:
            base = Path(adapter_base(path)).resolve()
            on_base = self.base.model_path is not None and same_model(base, self.base.model_path)
            if on_base and getattr(self.base.engine, "adapters", None) is not None:
                host = self.base
            else:  # an adapter over another model (or a base the lean decoder cannot run): an engine of its own
                host = OpenAIService(base, version=path.name, name=name, trace_sink=self.base.trace_sink,
                                     **self.service_kw)
            if host.engine.adapters is None:
                raise AdapterError(f"{path}: its base {base} cannot serve LoRA rows: {host.engine.no_adapters}")
            host.engine.adapters.register(pool_name, path)
        except AdapterError as e:
            if host is not None and host is not self.base:
                host.scheduler.close()
            raise OpenAIError(f"model {name!r} cannot be served: {e}", param="model", status=500,
                              type="server_error") from None
        return host.with_adapter(name, pool_name)

    def forget(self, tenant: str, name: str) -> None:
        """Stop serving a model (it was deleted): its engine closes, a later request is a 404."""
        with self._lock:
            view = self._views.pop((tenant, name), None)
            svc = self._loaded.pop((tenant, name), None)
        if view is not None:
            view.engine.adapters.unregister(view.adapter)  # rows decoding with it finish on its tensors
        if svc is not None:
            svc.scheduler.close()

    def close(self) -> None:
        with self._lock:
            for svc in self._loaded.values():
                svc.scheduler.close()
            self._loaded.clear()
            self._views.clear()
