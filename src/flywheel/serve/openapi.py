"""The app's OpenAPI document (GET /openapi.json): every route's request body and answers,
generated from the models that validate or describe them.

The routes read their raw bodies (app.py's `BodyDep`, ingest.py) so that every error keeps
OpenAI's shape and a trace batch is judged record by record; FastAPI therefore sees no body
model. Each route names its schemas instead (`route_doc`, by component name), and `document`
builds the components in one pydantic pass over `COMPONENTS`: request models in validation
mode (schemas.py, the trace store's TraceIn and FeedbackIn, the Task a verifier carries),
answers in serialization mode (response_schemas.py). A served app adds what only it knows:
the feedback labels of its curation config and the environments a verifier may name.
FastAPI's automatic 422 answers are dropped: this app answers a bad request with a 400 in
OpenAI's error shape, never with FastAPI's.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter
from typing_extensions import TypedDict

from flywheel.envs.verifier_task import TASK_FIELDS
from flywheel.envs.registry import list_envs
from flywheel.jobs.flywheel_request import FlywheelRequest
from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.feedback_check import trusted_env
from flywheel.serve.dashboard import schemas as dash
from flywheel.serve import finetune_schemas as ft
from flywheel.serve.otlp import schemas as otlp_schemas
from flywheel.serve import response_schemas as out
from flywheel.serve.schemas import ChatCompletionRequest, CompletionRequest
from flywheel.traces.schema import FeedbackIn, TraceIn
from flywheel.types import Task

REF = "#/components/schemas/{model}"


class TraceBatchObject(TypedDict):
    """The records under "traces" (other keys are ignored); traces/batch.py's `batch_records`."""

    traces: list[TraceIn]


Mode = Literal["validation", "serialization"]
COMPONENTS: dict[str, tuple[Any, Mode]] = {
    "ChatCompletionRequest": (ChatCompletionRequest, "validation"),
    "CompletionRequest": (CompletionRequest, "validation"),
    "TraceBatch": (list[TraceIn] | TraceBatchObject, "validation"),
    "FeedbackIn": (FeedbackIn, "validation"),
    "Task": (Task, "validation"),
    **{name: (getattr(out, name), "serialization") for name in (
        "ChatCompletion", "TextCompletion", "ChatCompletionChunk", "TextCompletionChunk", "ModelList", "Health",
        "TraceIngestResult", "FeedbackResult", "ErrorResponse")},
    **{name: (getattr(ft, name), "validation") for name in (
        "JobCreateRequest", "GraderValidateRequest", "GraderRunRequest", "WebhookCreateRequest",
        "FlywheelRollbackRequest")},
    "FlywheelCreateRequest": (FlywheelRequest, "validation"),
    **otlp_schemas.COMPONENTS,
    **{name: (getattr(ft, name), "serialization") for name in (
        "FileObject", "FileList", "FileDeleted", "FineTuningJob", "JobList", "JobEventList", "JobCheckpointList",
        "GraderValidated", "GraderRunResult", "ModelDeleted", "WebhookEndpoint", "WebhookList",
        "WebhookDeleted", "Flywheel", "FlywheelList", "FlywheelCycle", "FlywheelCycleList")},
    **{name: (getattr(dash, name), "serialization") for name in ("DashboardSummary", "DashboardJob")},
}

SSE = ("with `stream: true`, server-sent events: one `data: {chunk}` line per event as tokens are generated "
       "(each choice's last chunk carries its finish_reason; with stream_options.include_usage a last chunk "
       "carries the usage), ending with `data: [DONE]`. A refused request gets a JSON error before any event; "
       "a generation that fails mid-stream ends with a `data: {\"error\": ...}` event and no `[DONE]`.")


def ref(name: str) -> dict[str, str]:
    """A reference to component `name`, which must be one of COMPONENTS."""
    if name not in COMPONENTS:
        raise KeyError(f"{name!r} is not an OpenAPI component (serve/openapi.py COMPONENTS)")
    return {"$ref": REF.format(model=name)}


def route_doc(*, ok: str, errors: dict[int, str], body: str | None = None, body_text: str = "",
              stream: str | None = None) -> dict[str, Any]:
    """The documentation arguments of a route (`@app.post(path, **route_doc(...))`): its JSON
    body, component `body` (required; `body_text` says more); its answers, component `ok` on
    200 (and, for a route that streams, server-sent events of `stream` chunks) and
    ErrorResponse on each status of `errors` (status -> when). No response model: the routes
    answer with ready Responses, built where they are made."""
    ok_content: dict[str, Any] = {"application/json": {"schema": ref(ok)}}
    ok_text = f"a {ok}"
    if stream is not None:
        data = {"type": "string", "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [ref(stream), ref("ErrorResponse")]}}
        ok_content["text/event-stream"] = {"itemSchema": {"type": "object", "required": ["data"],
                                                          "properties": {"data": data}, "description": SSE}}
        ok_text += "; " + SSE
    responses: dict[int | str, dict[str, Any]] = {200: {"description": ok_text, "content": ok_content}}
    for status, when in errors.items():
        responses[status] = {"description": when, "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    doc: dict[str, Any] = {"responses": responses, "response_model": None}
    if body is not None:
        request_body = {"required": True, "content": {"application/json": {"schema": ref(body)}}}
        if body_text:
            request_body["description"] = body_text
        doc["openapi_extra"] = {"requestBody": request_body}
    return doc


def components() -> dict[str, Any]:
    """The JSON Schemas of COMPONENTS and of every type they use, keyed by component name."""
    inputs = [(name, mode, TypeAdapter(t)) for name, (t, mode) in COMPONENTS.items()]
    keyed, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)
    schemas = dict(defs.get("$defs", {}))
    for (name, _), schema in keyed.items():
        if schema != ref(name):  # an inline schema (a union) or a differently named model
            schemas[name] = schema
    return schemas


def _verifier_task(schemas: dict[str, Any]) -> None:
    """Task as a verifier sends it: the Task dataclass's types with TASK_FIELDS' texts and
    required fields (envs/base.py) and what `task_from_dict` and the feedback check refuse
    besides (an empty id or prompt, a null answer)."""
    task = schemas["Task"]
    task["required"] = [f.name for f in TASK_FIELDS if f.required]
    task["additionalProperties"] = False
    fields = task["properties"]
    for f in TASK_FIELDS:
        fields[f.name]["description"] = f.text
    fields["id"]["minLength"] = 1
    messages, text = fields["prompt"]["anyOf"]
    messages["minItems"], text["minLength"] = 1, 1
    fields["answer"]["not"] = {"type": "null"}
    fields["answer"].pop("default", None)
    task["description"] = ("The task a verifier's environment replays and grades: `flywheel env show NAME` "
                           "prints NAME's fields (what its `answer` is) and one real task as an example.")
    verifier = schemas["Verifier"]["properties"]
    verifier["task"] = {**ref("Task"), "description": "the task to replay, with the answer to grade against"}


def _served_rules(schemas: dict[str, Any], cfg: CurationConfig) -> None:
    """The rules of this app's curation config: the labels feedback may carry, the
    environments a verifier may name (loop/feedback_check.py refuses others with a 400)."""
    labels = sorted({x.strip().lower() for x in (*cfg.failure_labels, *cfg.success_labels)})
    label = schemas["FeedbackIn"]["properties"]["label"]
    label["anyOf"][0]["enum"] = labels
    label["description"] = (
        f"Failure labels (the trace failed: a DPO rejected response, an RL task when a verifier comes with it): "
        f"{', '.join(cfg.failure_labels)}. Success labels (a good response, rehearsed in SFT): "
        f"{', '.join(cfg.success_labels)}. Matched stripped and case-insensitively; any other label is refused "
        f"with a 400 that lists these (curation.failure_labels / success_labels). A score decides before a "
        f"label: below {cfg.fail_below:g} a failure, at or above {cfg.pass_at:g} a success, neutral between.")
    envs = [n for n in (*list_envs(), *cfg.environments) if trusted_env(n, cfg)]
    env = schemas["Verifier"]["properties"]["env"]
    env["enum"] = list(dict.fromkeys(envs))
    env["description"] = ("the environment that replays and grades the task: a built-in or one listed in the "
                          "loop config's curation.environments")


def document(app: FastAPI, curation: CurationConfig | None) -> dict[str, Any]:
    """The OpenAPI document of `app`; `curation`: the feedback rules of its trace routes (None
    when it has none)."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, description=app.description,
                      routes=app.routes)
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # only the 422 answers used them
        schemas.pop(name, None)
    schemas.update(components())
    _verifier_task(schemas)
    if curation is not None:
        _served_rules(schemas, curation)
    return doc


def install(app: FastAPI, curation: CurationConfig | None) -> None:
    """Serve `document(app, curation)` as the app's /openapi.json (built once, on first use)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app, curation)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]
