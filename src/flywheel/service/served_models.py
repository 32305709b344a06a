"""Which engine answers a request's `model`: the server's own model, or a tenant's fine-tuned
model (or checkpoint), loaded on first use.

Each fine-tuned model gets an OpenAIService of its own (its own engine and batch scheduler)
that records traces into the server's sink, as the base model does; at most `max_loaded` are
kept, the least recently used closed first. (LoRA adapters served side by side on one engine
replace this one-engine-per-model rule.) A name is looked up per tenant, so one tenant cannot
reach another's model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from flywheel.service.core import OpenAIService
from flywheel.service.errors import OpenAIError

# (tenant, model name) -> the model's folder, or None when the tenant has no such model
Resolve = Callable[[str, str], Path | None]


class ServedModels:
    def __init__(self, base: OpenAIService, resolve: Resolve | None = None, *, max_loaded: int = 2,
                 **service_kw: Any):
        """service_kw: OpenAIService options of the fine-tuned models (default_max_tokens, ...)."""
        self.base = base
        self.resolve = resolve
        self.max_loaded = max_loaded
        self.service_kw = service_kw
        self._loaded: OrderedDict[tuple[str, str], OpenAIService] = OrderedDict()
        self._loading: dict[tuple[str, str], Future] = {}  # what is loading now, for whoever asks meanwhile
        self._lock = threading.Lock()

    def get(self, tenant: str, name: Any) -> OpenAIService:
        """The service for `name`: blocking while a model loads (call it in a thread). A model
        loads outside the lock: requests for loaded models are answered meanwhile, and requests
        for the one loading wait for that one load."""
        if name == self.base.name or self.resolve is None or not isinstance(name, str):
            return self.base  # it refuses a wrong name itself, with the field named
        key = (tenant, name)
        with self._lock:
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
        return OpenAIService(Path(path), version=Path(path).name, name=name, trace_sink=self.base.trace_sink,
                             **self.service_kw)

    def forget(self, tenant: str, name: str) -> None:
        """Stop serving a model (it was deleted): its engine closes, a later request is a 404."""
        with self._lock:
            svc = self._loaded.pop((tenant, name), None)
        if svc is not None:
            svc.scheduler.close()

    def close(self) -> None:
        with self._lock:
            for svc in self._loaded.values():
                svc.scheduler.close()
            self._loaded.clear()
