"""The live dashboard's routes, thin over serve/dashboard/data.py:

GET /dashboard                    the page: a static shell with no data in it (public)
GET /dashboard/jobs/{job_id}      the same shell; its script shows that job
GET /dashboard/assets/{name}      dashboard.js, dashboard.css (shipped in the package; no CDN)
GET /v1/dashboard/summary         the caller's tenant: traffic, flywheels and cycles, jobs, live metrics
GET /v1/dashboard/jobs/{job_id}   one job of the caller's tenant: events, metric series, checkpoints, cycle

How a browser authenticates. The API takes `Authorization: Bearer <key>`, which a browser
does not send when it navigates, so the page holds no data: it asks for the key once (a
form), keeps it in the tab's sessionStorage (gone when the tab closes, never in a cookie, so
no other site can make the browser send it: no CSRF), and calls the JSON routes with the
header, every 2 s. They are the API's routes: the same keys, rate limits and tenancy
(another tenant's job is a 404). A server without keys (one tenant, loopback) answers them
without one. The page is sent with a Content-Security-Policy that allows only its own
scripts and styles and connections to this origin, so an injected string cannot run code.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from flywheel.clock import utc_now
from flywheel.errors import OpenAIError
from flywheel.finetuning.fine_tuning import store_error
from flywheel.jobs.store import JobStoreError
from flywheel.serve.dashboard.data import DashboardConfig, Sources, job_detail, summary
from flywheel.serve.deps import Tenant
from flywheel.serve.openapi import route_doc

router = APIRouter()
ASSETS = Path(__file__).with_name("static")  # index.html, dashboard.js, dashboard.css
MEDIA = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
KEY_ERRORS = {401: "no API key, or an unknown or revoked one", 429: "this key's rate limit"}
PAGE = {"description": "the dashboard's HTML shell (no data; its script asks for an API key and polls "
                       "/v1/dashboard/summary)", "content": {"text/html": {}}}


def sources(app: FastAPI) -> Sources:
    """What the app serves: its trace store (POST /v1/traces), fine-tuning jobs, managed flywheels."""
    intake, ft, flywheels = getattr(app.state, "intake", None), app.state.fine_tuning, app.state.flywheels
    return Sources(traces=None if intake is None else intake.store,
                   curation=intake.curation if intake is not None else None,
                   jobs=None if ft is None else ft.jobs, flywheels=None if flywheels is None else flywheels.store)


def config(app: FastAPI) -> DashboardConfig:
    """`app.state.dashboard` (flywheel serve --hardware sets it), else the defaults."""
    return getattr(app.state, "dashboard", None) or DashboardConfig()


@router.get("/dashboard", responses={200: PAGE})
async def page() -> FileResponse:
    """The live dashboard (docs/dashboard.md)."""
    return FileResponse(ASSETS / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)


@router.get("/dashboard/jobs/{job_id}", responses={200: PAGE})
async def job_page(job_id: str) -> FileResponse:
    """The dashboard's view of one job (the shell; its data comes from /v1/dashboard/jobs/{job_id})."""
    return await page()


@router.get("/dashboard/assets/{name}", responses={
    200: {"description": "the dashboard's script or style sheet", "content": {"text/javascript": {}, "text/css": {}}},
    404: {"description": "no such asset", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/ErrorResponse"}}}}})
async def asset(name: str) -> FileResponse:
    if name not in MEDIA:
        raise OpenAIError(f"no dashboard asset {name!r}", param="name", status=404, type="not_found_error")
    return FileResponse(ASSETS / name, media_type=MEDIA[name], headers=HEADERS)


@router.get("/v1/dashboard/summary", **route_doc(ok="DashboardSummary", errors=KEY_ERRORS))
async def dashboard_summary(request: Request, tenant: Tenant) -> JSONResponse:
    """Your production traffic, managed flywheels with their cycles, fine-tuning jobs and their live
    training metrics: what the dashboard polls."""
    answer = await asyncio.to_thread(summary, sources(request.app), tenant, config(request.app), utc_now())
    return JSONResponse(answer.model_dump(mode="json"), headers={"cache-control": "no-store"})


@router.get("/v1/dashboard/jobs/{job_id}", **route_doc(ok="DashboardJob", errors={
    **KEY_ERRORS, 404: "no such fine-tuning job for this API key's tenant"}))
async def dashboard_job(job_id: str, request: Request, tenant: Tenant) -> JSONResponse:
    """One of your jobs: its events, its metrics as series, its checkpoints and (a cycle's job) its cycle."""
    try:
        answer = await asyncio.to_thread(job_detail, sources(request.app), tenant, job_id, config(request.app))
    except JobStoreError as exc:
        raise store_error(exc) from None
    return JSONResponse(answer.model_dump(mode="json"), headers={"cache-control": "no-store"})
