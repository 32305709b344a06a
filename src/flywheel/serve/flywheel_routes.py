"""Managed flywheels' routes (flywheel's extension, in the fine-tuning objects' style), thin
over finetuning/managed_flywheels.py:

POST /v1/flywheels                      FlywheelCreateRequest (Idempotency-Key honoured)
GET  /v1/flywheels                      ?after= &limit=   (newest first)
GET  /v1/flywheels/{id}
GET  /v1/flywheels/{id}/cycles          each cycle's job, gate decision with reasons, scores, cost
POST /v1/flywheels/{id}/cycles          start a cycle now (409 while one is unfinished)
POST /v1/flywheels/{id}/rollback        {to?}: production back one promotion (or to `to`); a retry with
                                        its Idempotency-Key rolls back once
Every flywheel belongs to the caller's tenant; another tenant's id is a 404.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from flywheel.jobs.objects import list_object
from flywheel.errors import OpenAIError
from flywheel.serve.deps import FlywheelsDep, Tenant
from flywheel.serve.finetune_routes import NOT_FOUND, After, limit_of
from flywheel.serve.ingest import read_json
from flywheel.serve.openapi import route_doc


router = APIRouter()


@router.post("/v1/flywheels", **route_doc(body="FlywheelCreateRequest", ok="Flywheel", errors={
    400: "an invalid field (named in param)", 404: "no such model for this API key's tenant",
    409: "a flywheel with this alias exists, or the Idempotency-Key came with another request"}))
async def create(request: Request, tenant: Tenant, flywheels: FlywheelsDep) -> JSONResponse:
    """Make a managed flywheel: your model's continuous loop, served under its production alias."""
    body = read_json(await request.body())
    return JSONResponse(await asyncio.to_thread(flywheels.create, tenant, body,
                                                request.headers.get("idempotency-key")))


@router.get("/v1/flywheels", **route_doc(ok="FlywheelList", errors={400: "a bad limit or cursor", **NOT_FOUND}))
async def list_flywheels(tenant: Tenant, flywheels: FlywheelsDep, after: After = None,
                         limit: limit_of(100) = 20) -> JSONResponse:
    """Your flywheels, newest first."""
    rows, more = await asyncio.to_thread(flywheels.list, tenant, after, limit)
    return JSONResponse(list_object(rows, more))


@router.get("/v1/flywheels/{flywheel_id}", **route_doc(ok="Flywheel", errors=NOT_FOUND))
async def get_flywheel(flywheel_id: str, tenant: Tenant, flywheels: FlywheelsDep) -> JSONResponse:
    return JSONResponse(await asyncio.to_thread(flywheels.get, tenant, flywheel_id))


@router.get("/v1/flywheels/{flywheel_id}/cycles", **route_doc(ok="FlywheelCycleList", errors=NOT_FOUND))
async def cycles(flywheel_id: str, tenant: Tenant, flywheels: FlywheelsDep) -> JSONResponse:
    """The flywheel's cycles, newest first: each one's job, the gate's decision and reasons, cost."""
    return JSONResponse(list_object(await asyncio.to_thread(flywheels.cycles, tenant, flywheel_id), False))


@router.post("/v1/flywheels/{flywheel_id}/cycles", **route_doc(ok="FlywheelCycle", errors={
    **NOT_FOUND, 409: "a cycle of this flywheel has not finished"}))
async def run_cycle(flywheel_id: str, tenant: Tenant, flywheels: FlywheelsDep) -> JSONResponse:
    """Start a cycle now, whatever the trigger says."""
    return JSONResponse(await asyncio.to_thread(flywheels.run_cycle, tenant, flywheel_id))


@router.post("/v1/flywheels/{flywheel_id}/rollback", **route_doc(
        body="FlywheelRollbackRequest", ok="Flywheel",
        errors={400: "an invalid body", **NOT_FOUND, 409: "nothing to roll back to, or `to` was never in production"}))
async def rollback(flywheel_id: str, request: Request, tenant: Tenant, flywheels: FlywheelsDep) -> JSONResponse:
    """Put the version production replaced back (or `to`); the alias follows within a second."""
    raw = await request.body()
    body = read_json(raw) if raw.strip() else {}
    if not isinstance(body, dict) or set(body) - {"to"} or not isinstance(body.get("to", ""), (str, type(None))):
        raise OpenAIError("the body is {\"to\": a version id (optional)}", param="to")
    return JSONResponse(await asyncio.to_thread(flywheels.rollback, tenant, flywheel_id, body.get("to"),
                                                request.headers.get("idempotency-key")))
