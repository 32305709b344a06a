"""Store rows as the OpenAI API's objects (`file`, `fine_tuning.job`, `fine_tuning.job.event`,
`fine_tuning.job.checkpoint`, and the cursor `list`), field names as OpenAI's; times are unix
seconds. Pure functions of a row (a dict of the table's columns)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from flywheel.clock import utc_aware
from flywheel.jobs.flywheel_request import FlywheelSpec


def unix(t: datetime | None) -> int | None:
    return None if t is None else int(utc_aware(t).timestamp())


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": unix(row["created_at"]),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


def job_object(row: dict[str, Any]) -> dict[str, Any]:
    method = row["method"]
    return {
        "id": row["id"], "object": "fine_tuning.job", "model": row["model"],
        "created_at": unix(row["created_at"]), "finished_at": unix(row["finished_at"]),
        "fine_tuned_model": row["fine_tuned_model"], "organization_id": row["tenant"],
        "result_files": [], "status": row["status"], "training_file": row["training_file"],
        "validation_file": row["validation_file"],
        "hyperparameters": method.get(method["type"], {}).get("hyperparameters", {}),
        "trained_tokens": row["trained_tokens"], "error": row["error"], "user_provided_suffix": row["suffix"],
        "seed": row["seed"], "estimated_finish": None, "integrations": [], "metadata": row["metadata"] or None,
        "method": method,
        "usage": {"trained_tokens": row["trained_tokens"], "estimated_cost": row["estimated_cost"],
                  "attempts": row["attempts"]},
    }


def event_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "fine_tuning.job.event", "created_at": unix(row["created_at"]),
            "level": row["level"], "message": row["message"], "data": row["data"] or {}, "type": row["type"]}


def checkpoint_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "fine_tuning.job.checkpoint", "created_at": unix(row["created_at"]),
            "fine_tuned_model_checkpoint": row["fine_tuned_model_checkpoint"], "fine_tuning_job_id": row["job_id"],
            "metrics": {"step": row["step"], **row["metrics"]}, "step_number": row["step"]}


def list_object(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "has_more": has_more,
            "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None}


def fine_tuned_model_name(base: str, tenant: str, suffix: str | None, job_id: str, step: int | None = None) -> str:
    """`ft:<base>:<tenant>:<suffix>:<job id without its prefix>` as OpenAI names fine-tuned
    models (`ft:gpt-4o-mini:org:suffix:id`); a checkpoint's adds `:ckpt-step-<step>`."""
    name = f"ft:{base}:{tenant}:{suffix or ''}:{job_id.removeprefix('ftjob-')}"
    return name if step is None else f"{name}:ckpt-step-{step}"


def production_alias(model: str, tenant: str, suffix: str) -> str:
    """The model name a managed flywheel's clients call: `ft:<model>:<tenant>:<suffix>:production`,
    whichever version serves it now."""
    return f"ft:{model}:{tenant}:{suffix}:production"


def flywheel_object(row: dict[str, Any]) -> dict[str, Any]:
    """A managed flywheel (flywheel's extension), in the fine-tuning objects' style."""
    spec = FlywheelSpec.model_validate(row["spec"])
    wire = spec.model_dump(mode="json", include={"training", "curation", "gate", "trigger", "budget_usd"})
    eval_ = spec.eval.model_dump(mode="json", exclude={"suites": {name: {"path"} for name in spec.eval.suites}})
    return {"id": row["id"], "object": "flywheel", "created_at": unix(row["created_at"]), "model": row["model"],
            "suffix": row["suffix"], "status": row["status"], "organization_id": row["tenant"],
            "production_model": row["alias"],
            "production": {"model": row["production_model"], "version": row["production_version"],
                           "generation": row["generation"]},
            "traces": {"models": spec.trace_models, "failures_after_seq": row["cursor"]},
            **wire, "eval": eval_,  # no server paths
            "metadata": row["metadata"] or None}


def flywheel_cycle_object(row: dict[str, Any]) -> dict[str, Any]:
    """One cycle: its job, why it started, and (once decided) the gate's decision with its
    reasons, both models' scores, what it cost and what it registered."""
    decision = row["decision"] or {}
    return {"id": row["id"], "object": "flywheel.cycle", "flywheel_id": row["flywheel_id"], "number": row["number"],
            "fine_tuning_job_id": row["job_id"], "status": row["job_status"], "reason": row["reason"],
            "outcome": row["outcome"], "promoted": bool(decision.get("promote")) and row["outcome"] == "promoted",
            "decision": decision or None, "scores": row["scores"], "new_failures": row["new_failures"],
            "trace_cursor": row["trace_cursor"], "version": row["version"],
            "fine_tuned_model": row["fine_tuned_model"], "error": row["job_error"],
            "estimated_cost": row["estimated_cost"] if row["estimated_cost"] is not None else row["usd"],
            "created_at": unix(row["created_at"]), "finished_at": unix(row["finished_at"])}
