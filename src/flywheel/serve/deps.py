"""What routes take from the app that serves them, as FastAPI dependencies: create_app (app.py)
puts each on `app.state`; a route names what it needs (`tenant: Tenant`, `ft: FineTuningDep`)
and the routers stay plain module-level `APIRouter`s.

They are `async def`: FastAPI runs a plain `def` dependency in its thread pool, a thread hop
and a GIL hand-off per dependency and request (docs/benchmarks.md, bench/api.py). None of them waits: KeyAuth answers from its cache and reads
the key store once per key per `cache_s`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.finetuning.managed_flywheels import ManagedFlywheels
from flywheel.jobs.webhooks import Webhooks
from flywheel.serve.core import OpenAIService


async def tenant_of_request(request: Request) -> str:
    """The caller's tenant (`app.state.tenant_of`: serve/auth.py's KeyAuth, or the one tenant of a
    server without keys), or the refusal it raises (401, 429)."""
    return request.app.state.tenant_of(request)


async def service_of_app(request: Request) -> OpenAIService:
    return request.app.state.service


async def fine_tuning_of_app(request: Request) -> FineTuning:
    return request.app.state.fine_tuning


async def webhooks_of_app(request: Request) -> Webhooks:
    return request.app.state.webhooks


async def flywheels_of_app(request: Request) -> ManagedFlywheels:
    return request.app.state.flywheels


Tenant = Annotated[str, Depends(tenant_of_request)]
ServiceDep = Annotated[OpenAIService, Depends(service_of_app)]
FineTuningDep = Annotated[FineTuning, Depends(fine_tuning_of_app)]
WebhooksDep = Annotated[Webhooks, Depends(webhooks_of_app)]
FlywheelsDep = Annotated[ManagedFlywheels, Depends(flywheels_of_app)]
