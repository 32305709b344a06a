"""A view of a trace store limited to one tenant's traces of some model names: what a managed
flywheel reads (its served model's traffic and the traces posted naming it), and nothing of
another tenant's or another model's. It offers the readers the loop uses (`iter_traces`,
`feedback_after`, `count`, `max_seq`); a scope of None fields reads what the store holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TraceScope:
    tenant: str | None = None
    models: tuple[str, ...] | None = None  # model names the traces were served as (or posted naming)

    def to_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "models": list(self.models) if self.models is not None else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "TraceScope":
        d = d or {}
        models = d.get("models")
        return cls(d.get("tenant"), tuple(models) if models is not None else None)


class ScopedTraces:
    def __init__(self, store, scope: TraceScope):
        self.store, self.scope = store, scope

    def _kw(self) -> dict[str, Any]:
        return {"tenant": self.scope.tenant, "models": self.scope.models}

    def iter_traces(self, **kw: Any):
        return self.store.iter_traces(**kw, **self._kw())

    def feedback_after(self, *args: Any, **kw: Any):
        return self.store.feedback_after(*args, **kw, **self._kw())

    def count(self, **kw: Any) -> int:
        return self.store.count(**kw, **self._kw())

    def max_seq(self) -> int:
        """The store's newest seq (a cursor over every trace, in scope or not)."""
        return self.store.max_seq()

    def close(self) -> None:
        self.store.close()
