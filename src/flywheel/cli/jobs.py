"""`flywheel files ...` and `flywheel jobs ...`: the fine-tuning API from the shell, over the
SDK (flywheel.client), against --base-url / FLYWHEEL_BASE_URL with FLYWHEEL_API_KEY."""

from __future__ import annotations

import contextlib
import json
import sys
from enum import Enum
from pathlib import Path

import typer

files_app = typer.Typer(help="Files for fine-tuning jobs on a flywheel server.", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs on a flywheel server.", no_args_is_help=True)

BASE_URL = typer.Option(None, "--base-url", envvar="FLYWHEEL_BASE_URL",
                        help="the server (default http://127.0.0.1:8000)")
ENV_GRADER = "flywheel_environment"


class Method(str, Enum):
    supervised = "supervised"
    dpo = "dpo"
    reinforcement = "reinforcement"


@contextlib.contextmanager
def client(base_url: str | None):
    """The SDK client; a refusal is one line on stderr and exit status 1."""
    from flywheel.client import Flywheel, FlywheelError

    try:
        with Flywheel(base_url) as fw:
            yield fw
    except FlywheelError as e:
        print(f"error: {e}" + (f" (param: {e.param})" if e.param else ""), file=sys.stderr)
        raise typer.Exit(1) from None


def _row(*cells) -> None:
    typer.echo("  ".join(str(c) for c in cells))


@files_app.command("upload")
def upload(path: Path = typer.Argument(..., exists=True, dir_okay=False),
           purpose: str = typer.Option("fine-tune"), base_url: str = BASE_URL) -> None:
    """Upload a JSONL file; prints its id."""
    with client(base_url) as fw:
        f = fw.files.upload(path, purpose=purpose)
    _row(f.id, f.filename, f"{f.bytes} bytes")


@files_app.command("list")
def list_files(base_url: str = BASE_URL, limit: int = typer.Option(100, min=1)) -> None:
    """Your files, newest first: id, purpose, bytes, name."""
    with client(base_url) as fw:
        for f in fw.files.list(limit=limit):
            _row(f.id, f.purpose, f.bytes, f.filename)


@jobs_app.command("create")
def create(model: str = typer.Option(..., help="a base model the server offers, or a fine-tuned one"),
           training_file: str = typer.Option(..., help="a file id (flywheel files upload)"),
           method: Method = typer.Option(None, help="default: reinforcement with --grader or --env, else "
                                                     "supervised"),
           grader: str = typer.Option(None, "--grader", help="reinforcement: the grader, a JSON file or inline "
                                      "JSON: an OpenAI grader (string_check, python, multi, ...) or "
                                      f'{{"type": "{ENV_GRADER}", "env": NAME, "settings": {{...}}}}'),
           env: str = typer.Option(None, "--env", help="reinforcement: grade with this flywheel environment (a "
                                   "built-in name or package.module:load), the training file's rows being "
                                   '{"task": {...}}; --grader with settings for more'),
           validation_file: str = typer.Option(None), suffix: str = typer.Option(None),
           seed: int = typer.Option(None),
           hyper: list[str] = typer.Option([], "--set", help="a hyperparameter, NAME=VALUE (n_epochs=3, beta=0.1)"),
           lora_rank: int = typer.Option(None, "--lora-rank", min=1, help="train a LoRA adapter of this rank "
                                                                           "(alpha twice the rank)"),
           full: bool = typer.Option(False, "--full", help="train every weight (no LoRA adapter)"),
           wait: bool = typer.Option(False, help="follow the job with a progress bar until it ends"),
           base_url: str = BASE_URL) -> None:
    """Create a job; prints its id and status (with --wait, its end). A reinforcement job needs
    a grader: --grader (a JSON file or inline JSON) or --env NAME."""
    if lora_rank is not None and full:
        _refuse("--lora-rank and --full: choose one")
    kind, grader_spec = _method_and_grader(method, grader, env)
    hyperparameters: dict = {}
    if lora_rank is not None:
        hyperparameters["lora"] = {"rank": lora_rank, "alpha": 2 * lora_rank}
    elif full:
        hyperparameters["lora"] = "full"
    for item in hyper:
        name, sep, value = item.partition("=")
        if not sep:
            print(f"error: --set {item!r}: expected NAME=VALUE", file=sys.stderr)
            raise typer.Exit(2)
        with contextlib.suppress(ValueError):
            value = json.loads(value)  # numbers as numbers; "auto" and other words stay text
        hyperparameters[name] = value
    with client(base_url) as fw:
        job = fw.jobs.create(model=model, training_file=training_file, method=kind, validation_file=validation_file,
                             suffix=suffix, seed=seed, grader=grader_spec, **hyperparameters)
        _row(job.id, job.status)
        if wait:
            _end(fw.jobs.wait(job.id))


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _method_and_grader(method: Method | None, grader: str | None, env: str | None) -> tuple[str, dict | None]:
    """The job's method type and grader object from the flags; refuses (exit 2) a grader
    without reinforcement, reinforcement without one, or one that is not a JSON object."""
    if grader is not None and env is not None:
        _refuse("--grader and --env: choose one (--grader takes an environment's settings)")
    kind = method.value if method is not None else ("reinforcement" if grader or env else "supervised")
    if kind != "reinforcement":
        if grader is not None or env is not None:
            _refuse(f"--grader and --env are for --method reinforcement, not {kind}")
        return kind, None
    if env is not None:
        return kind, {"type": ENV_GRADER, "env": env}
    if grader is None:
        _refuse("--method reinforcement needs a grader: --grader FILE.json, --grader '{...}' (inline JSON) or "
                "--env NAME (a flywheel environment)")
    text, where = grader, "--grader"
    if not grader.lstrip().startswith("{"):
        try:
            text, where = Path(grader).read_text(encoding="utf-8"), f"--grader {grader}"
        except OSError as e:
            _refuse(f"--grader {grader}: not inline JSON and not a readable file ({e.strerror})")
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        _refuse(f"{where}: not JSON ({e.msg} at line {e.lineno} column {e.colno})")
    if not isinstance(spec, dict) or not spec.get("type"):
        _refuse(f"{where}: a grader is a JSON object with a \"type\" (string_check, python, multi, {ENV_GRADER}, ...)")
    return kind, spec


def _end(job) -> None:
    _row(job.id, job.status, job.fine_tuned_model or "")
    if job.error:
        print(f"error: {job.error['message']}", file=sys.stderr)
        raise typer.Exit(1)


@jobs_app.command("list")
def list_jobs(base_url: str = BASE_URL, limit: int = typer.Option(20, min=1, max=100)) -> None:
    """Your jobs, newest first: id, status, model, fine-tuned model."""
    with client(base_url) as fw:
        for j in fw.jobs.list(limit=limit):
            _row(j.id, j.status, j.model, j.fine_tuned_model or "")


@jobs_app.command("show")
def show(job_id: str, base_url: str = BASE_URL) -> None:
    """The job as the server returns it (JSON)."""
    with client(base_url) as fw:
        typer.echo(json.dumps(fw.jobs.get(job_id).raw, indent=2))


@jobs_app.command("events")
def events(job_id: str, base_url: str = BASE_URL, limit: int = typer.Option(20, min=1, max=100)) -> None:
    """The job's events, oldest of the page first."""
    with client(base_url) as fw:
        for e in reversed(fw.jobs.events(job_id, limit=limit).data):
            _row(e.created_at, e.level, e.message)


@jobs_app.command("checkpoints")
def checkpoints(job_id: str, base_url: str = BASE_URL) -> None:
    """The job's checkpoints, newest first: step, model name, metrics."""
    with client(base_url) as fw:
        for c in fw.jobs.checkpoints(job_id):
            _row(c.step_number, c.fine_tuned_model_checkpoint, json.dumps(c.metrics))


def _control(verb: str):
    def command(job_id: str, base_url: str = BASE_URL) -> None:
        with client(base_url) as fw:
            job = getattr(fw.jobs, verb)(job_id)
        _row(job.id, job.status)
    command.__doc__ = f"{verb.capitalize()} a job."
    return command


for _verb in ("cancel", "pause", "resume"):
    jobs_app.command(_verb)(_control(_verb))


@jobs_app.command("wait")
def wait(job_id: str, base_url: str = BASE_URL) -> None:
    """Follow a job with a progress bar until it ends; exit status 1 when it failed."""
    with client(base_url) as fw:
        _end(fw.jobs.wait(job_id))


@jobs_app.command("download")
def download(model: str = typer.Argument(..., help="a fine-tuned model or checkpoint name (jobs show / checkpoints)"),
             out: Path = typer.Option(Path("."), "--out", help="the folder to unpack it into"),
             merged: bool = typer.Option(False, "--merged", help="a LoRA fine-tune merged into its base"),
             base_url: str = BASE_URL) -> None:
    """Download a fine-tuned model or checkpoint (a LoRA fine-tune: its peft adapter folder, or
    with --merged a plain Hugging Face folder); prints the folder."""
    with client(base_url) as fw:
        typer.echo(fw.models.download(model, out, merged=merged))
