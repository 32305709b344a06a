"""The fine-tuning API's routes, as OpenAI's: files and jobs, thin over finetuning/fine_tuning.py.

POST   /v1/files                                  multipart: file, purpose=fine-tune
GET    /v1/files                                  ?purpose= &after= &limit= &order=asc|desc
GET    /v1/files/{file_id}    DELETE /v1/files/{file_id}    GET /v1/files/{file_id}/content
POST   /v1/fine_tuning/jobs                       JobCreateRequest
GET    /v1/fine_tuning/jobs                       ?after= &limit= &metadata[k]=v
GET    /v1/fine_tuning/jobs/{id}                  POST .../{id}/cancel | pause | resume
GET    /v1/fine_tuning/jobs/{id}/events           ?after= &limit=   (newest first)
GET    /v1/fine_tuning/jobs/{id}/checkpoints      ?after= &limit=   (newest first)
POST   /v1/fine_tuning/alpha/graders/validate     {grader}
POST   /v1/fine_tuning/alpha/graders/run          {grader, model_sample, item}
POST   /v1/webhooks {url, events?}   GET /v1/webhooks   DELETE /v1/webhooks/{id}   (flywheel's)
Every object belongs to the caller's tenant (serve/deps.py `Tenant`); another tenant's id is a
404. The routes read the fine-tuning core and the webhooks from the app (serve/deps.py). POST /v1/files and POST /v1/fine_tuning/jobs honour an `Idempotency-Key` header: a retry
gets the object the first request made (a 409 when the key came with another request). Store
writes are synchronous and run in a thread; reads run on the event loop where the store says
they are brief (`JobStore.reads_inline`: SQLite), saving a thread hop and the GIL hand-offs of
a thread pool (docs/benchmarks.md, bench/api.py).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from flywheel.jobs import JobStoreError
from flywheel.jobs.objects import checkpoint_object, event_object, file_object, job_object, list_object, unix
from flywheel.errors import OpenAIError
from flywheel.finetuning.fine_tuning import FineTuning, check_grader, run_checked, store_error
from flywheel.serve.deps import FineTuningDep, Tenant, WebhooksDep
from flywheel.serve.ingest import read_json
from flywheel.serve.openapi import route_doc
from flywheel.threads import in_passing_thread

NOT_FOUND = {404: "no such object for this API key's tenant"}
After = Annotated[str | None, Query(description="the id of the last object of the previous page")]


def limit_of(most: int):
    return Annotated[int, Query(ge=1, le=most, description=f"objects per page, at most {most}")]


UPLOAD_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
    "type": "object", "required": ["file", "purpose"],
    "properties": {"file": {"type": "string", "format": "binary", "description": "JSONL, one example per line"},
                   "purpose": {"type": "string", "enum": ["fine-tune"]}}}}}}}


def _metadata_filter(request: Request) -> dict[str, str]:
    return {k[len("metadata["):-1]: v for k, v in request.query_params.items()
            if k.startswith("metadata[") and k.endswith("]")}


router = APIRouter()


async def read(ft: FineTuning, fn, *args, **kwargs) -> Any:
    """The store read fn(*args, **kwargs) of at most a page (100 rows), on the event loop where
    the store reads inline (SQLite), else in a thread; the store's refusals as the API answers them."""
    if not ft.jobs.reads_inline:
        return await call(fn, *args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except JobStoreError as exc:
        raise store_error(exc) from None


async def call(fn, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in a thread; the store's refusals as the API answers them."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except JobStoreError as exc:
        raise store_error(exc) from None


# ------------------------------------------------------------------ files


@router.post("/v1/files", openapi_extra=UPLOAD_BODY,
             **route_doc(ok="FileObject", errors={400: "not JSONL, no rows, or another purpose",
                                                  413: "the file is over the size limit"}))
async def upload(request: Request, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    """Upload a JSONL file for fine-tuning (checked as JSONL here; per method when a job uses it)."""
    try:
        form = await request.form(max_files=1, max_fields=4, max_part_size=ft.max_file_bytes)
    except Exception as exc:  # starlette's parser: a body that is not multipart, or over a limit
        raise OpenAIError(f"expected a multipart/form-data body with file and purpose: {exc}",
                          param="file") from None
    file, purpose = form.get("file"), form.get("purpose")
    if file is None or isinstance(file, str):
        raise OpenAIError("file: a file part is required", param="file")
    if not isinstance(purpose, str):
        raise OpenAIError("purpose: required (fine-tune)", param="purpose")
    try:  # the parser spooled the part to a temporary file: it is checked a line at a time from there
        obj = await asyncio.to_thread(ft.upload, tenant, file.filename or "upload.jsonl", purpose, file.file,
                                      request.headers.get("idempotency-key"))
    finally:
        await file.close()
    return JSONResponse(obj)


@router.get("/v1/files", **route_doc(ok="FileList", errors={400: "a bad limit, order or cursor", **NOT_FOUND}))
async def list_files(tenant: Tenant, ft: FineTuningDep, after: After = None, limit: limit_of(10_000) = 100,
                     order: Literal["asc", "desc"] = "desc", purpose: str | None = None) -> JSONResponse:
    """Your files, newest first (order=asc: oldest first)."""
    rows, more = await call(ft.jobs.list_files, tenant, purpose=purpose, after=after, limit=limit,
                            ascending=order == "asc")
    return JSONResponse(list_object([file_object(r) for r in rows], more))


@router.get("/v1/files/{file_id}", **route_doc(ok="FileObject", errors=NOT_FOUND))
async def get_file(file_id: str, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    return JSONResponse(file_object(await read(ft, ft.jobs.get_file, tenant, file_id)))


@router.get("/v1/files/{file_id}/content", responses={200: {"description": "the file's bytes",
                                                            "content": {"application/jsonl": {}}}})
async def file_content(file_id: str, tenant: Tenant, ft: FineTuningDep) -> Response:
    """The file's bytes as uploaded."""
    path = await call(ft.jobs.file_path, tenant, file_id)
    return Response(await asyncio.to_thread(path.read_bytes), media_type="application/jsonl")


@router.delete("/v1/files/{file_id}", **route_doc(ok="FileDeleted", errors={
    **NOT_FOUND, 409: "a job that has not finished uses the file"}))
async def delete_file(file_id: str, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    await call(ft.jobs.delete_file, tenant, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ------------------------------------------------------------------ jobs


@router.post("/v1/fine_tuning/jobs", **route_doc(
    body="JobCreateRequest", ok="FineTuningJob",
    errors={400: "an invalid field (named in `param`), an unknown model or file"}))
async def create_job(request: Request, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    """Create a job: checked, then queued for a worker (or failed at once with the bad lines
    of its file in `error`)."""
    body = read_json(await request.body())
    return JSONResponse(await asyncio.to_thread(ft.create_job, tenant, body,
                                                request.headers.get("idempotency-key")))


@router.get("/v1/fine_tuning/jobs", **route_doc(ok="JobList", errors={400: "a bad limit", **NOT_FOUND}))
async def list_jobs(request: Request, tenant: Tenant, ft: FineTuningDep, after: After = None,
                    limit: limit_of(100) = 20) -> JSONResponse:
    """Your jobs, newest first; `metadata[k]=v` keeps the jobs whose metadata has k = v."""
    metadata = _metadata_filter(request)  # a filtered listing reads up to 1,000 rows: not on the loop
    rows, more = await (call(ft.jobs.list_jobs, tenant, after=after, limit=limit, metadata=metadata) if metadata
                        else read(ft, ft.jobs.list_jobs, tenant, after=after, limit=limit))
    return JSONResponse(list_object([job_object(r) for r in rows], more))


@router.get("/v1/fine_tuning/jobs/{job_id}", **route_doc(ok="FineTuningJob", errors=NOT_FOUND))
async def get_job(job_id: str, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    return JSONResponse(job_object(await read(ft, ft.jobs.get_job, tenant, job_id)))


def _control(verb: str, text: str) -> None:
    """POST .../{job_id}/{verb}: the job store's method of that name on the caller's job."""
    @router.post(f"/v1/fine_tuning/jobs/{{job_id}}/{verb}", name=f"{verb}_job", description=text,
                 **route_doc(ok="FineTuningJob", errors={**NOT_FOUND, 409: f"the job's status allows no {verb}"}))
    async def act(job_id: str, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
        return JSONResponse(job_object(await call(getattr(ft.jobs, verb), tenant, job_id)))


_control("cancel", "Cancel a job: at once when it is not running, else within seconds "
                   "(its worker stops it after the current step).")
_control("pause", "Pause a job: its worker checkpoints and lets go; resume continues from there.")
_control("resume", "Queue a paused job again; it continues from its last checkpoint.")


@router.get("/v1/fine_tuning/jobs/{job_id}/events", **route_doc(ok="JobEventList", errors=NOT_FOUND))
async def events(job_id: str, tenant: Tenant, ft: FineTuningDep, after: After = None,
                 limit: limit_of(100) = 20) -> JSONResponse:
    """The job's events, newest first: messages, and `metrics` events with step and loss."""
    rows, more = await read(ft, ft.jobs.list_events, tenant, job_id, after=after, limit=limit)
    return JSONResponse(list_object([event_object(r) for r in rows], more))


@router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints", **route_doc(ok="JobCheckpointList", errors=NOT_FOUND))
async def checkpoints(job_id: str, tenant: Tenant, ft: FineTuningDep, after: After = None,
                      limit: limit_of(100) = 10) -> JSONResponse:
    """The job's checkpoints, newest first (one per epoch); each is a model usable at once."""
    rows, more = await read(ft, ft.jobs.list_checkpoints, tenant, job_id, after=after, limit=limit)
    return JSONResponse(list_object([checkpoint_object(r) for r in rows], more))


# ------------------------------------------------------------------ webhooks (flywheel's extension)


def webhook_object(row: dict[str, Any]) -> dict[str, Any]:
    out = {"id": row["id"], "object": "webhook_endpoint", "url": row["url"], "events": row["events"],
           "created_at": unix(row["created_at"])}
    if "secret" in row:
        out["secret"] = row["secret"]
    return out


@router.post("/v1/webhooks", **route_doc(body="WebhookCreateRequest", ok="WebhookEndpoint",
                                         errors={400: "not an http(s) URL, or an unknown event"}))
async def create_webhook(request: Request, tenant: Tenant, hooks: WebhooksDep) -> JSONResponse:
    """Have your jobs' terminal states POSTed to `url`, signed (Standard Webhooks); the secret is
    in this answer only."""
    body = read_json(await request.body())
    if not isinstance(body, dict) or set(body) - {"url", "events"}:
        raise OpenAIError("expected {\"url\", \"events\"?}", param="url")
    try:
        row = await asyncio.to_thread(hooks.create, tenant, body.get("url"), body.get("events"))
    except ValueError as e:
        raise OpenAIError(str(e), param="events" if "event" in str(e) else "url") from None
    return JSONResponse(webhook_object(row))


@router.get("/v1/webhooks", **route_doc(ok="WebhookList", errors={}))
async def list_webhooks(tenant: Tenant, hooks: WebhooksDep) -> JSONResponse:
    rows = await asyncio.to_thread(hooks.list, tenant)
    return JSONResponse(list_object([webhook_object(r) for r in rows], False))


@router.delete("/v1/webhooks/{webhook_id}", **route_doc(ok="WebhookDeleted", errors=NOT_FOUND))
async def delete_webhook(webhook_id: str, tenant: Tenant, hooks: WebhooksDep) -> JSONResponse:
    await call(hooks.delete, tenant, webhook_id)
    return JSONResponse({"id": webhook_id, "object": "webhook_endpoint", "deleted": True})


# ------------------------------------------------------------------ graders


@router.post("/v1/fine_tuning/alpha/graders/validate", **route_doc(
    body="GraderValidateRequest", ok="GraderValidated", errors={400: "an invalid grader (the field is named)"}))
async def validate_grader(request: Request, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    """Check a grader object as a reinforcement job would."""
    body = read_json(await request.body())
    if not isinstance(body, dict) or set(body) != {"grader"}:
        raise OpenAIError("expected {\"grader\": {...}}", param="grader")
    check_grader(body["grader"], where="grader", models=ft.grader_models(tenant, body["grader"]))
    return JSONResponse({"grader": body["grader"]})


@router.post("/v1/fine_tuning/alpha/graders/run", **route_doc(
    body="GraderRunRequest", ok="GraderRunResult",
    errors={400: "an invalid grader, or one that cannot grade this sample (the field is named)"}))
async def run_grader(request: Request, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    """Grade one sample against one item, as a reinforcement job scores its samples."""
    body = read_json(await request.body())
    if not isinstance(body, dict) or not isinstance(body.get("model_sample"), str) or "grader" not in body:
        raise OpenAIError("expected {\"grader\", \"model_sample\": str, \"item\": {...}}", param="model_sample")
    item = body.get("item") or {}
    if not isinstance(item, dict):
        raise OpenAIError("item must be an object", param="item")
    grader = check_grader(body["grader"], where="grader",
                          models=await asyncio.to_thread(ft.grader_models, tenant, body["grader"]))
    # a model grader's forwards: torch work, on a thread that takes its OpenMP team along
    return JSONResponse(await in_passing_thread(run_checked, grader, body["model_sample"], item))
