"""`Flywheel` and `AsyncFlywheel`: the SDK of a flywheel server (docs/api.md).

    from flywheel.client import Flywheel
    fw = Flywheel()                       # FLYWHEEL_BASE_URL, FLYWHEEL_API_KEY, or the arguments
    f = fw.files.upload("train.jsonl")
    job = fw.jobs.create(model="tiny", training_file=f.id, n_epochs=3)
    job = fw.jobs.wait(job.id)            # a progress bar of steps and loss until it ends
    fw.traces.feedback(trace_id, label="bad")
    wheel = fw.flywheels.create(model="tiny", suffix="calc", gate={"delta": 0.02})
    fw.flywheels.run_cycle(wheel.id)      # a cycle now; fw.flywheels.cycles(wheel.id) shows each decision

Each resource method describes its request once (`Call`); the sync client runs it and returns
the object, the async client returns a coroutine of it, so the two cannot drift apart. Only
`jobs.wait` (a polling loop) is written for each.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from flywheel.client.http import AsyncHTTP, SyncHTTP
from flywheel.client.objects import Checkpoint, File, FlywheelCycle, Job, JobEvent, ManagedFlywheel, Model


@dataclass
class Call:
    method: str
    path: str
    kw: dict[str, Any] = field(default_factory=dict)
    parse: Callable[[httpx.Response], Any] = lambda r: r.json()


@dataclass(frozen=True)
class Page:
    data: list[Any]
    has_more: bool

    def __iter__(self):
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def _page(cls) -> Callable[[httpx.Response], Page]:
    def parse(r: httpx.Response) -> Page:
        body = r.json()
        return Page([cls.from_json(x) for x in body["data"]], bool(body.get("has_more")))
    return parse


def _one(cls) -> Callable[[httpx.Response], Any]:
    return lambda r: cls.from_json(r.json())


def _unpack(tar_bytes: bytes, out: Path) -> Path:
    """The one folder of a model tar, extracted under `out` (tarfile's "data" filter: no paths
    outside it, no links out, no special files)."""
    import io
    import tarfile

    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        names = {m.name.split("/")[0] for m in tar.getmembers()}
        tar.extractall(out, filter="data")
    (top,) = names
    return out / top


def _query(**params: Any) -> dict[str, Any]:
    return {"params": {k: v for k, v in params.items() if v is not None}}


class Files:
    def __init__(self, run):
        self._run = run

    def upload(self, file: str | Path | bytes, purpose: str = "fine-tune", filename: str | None = None):
        """Upload a JSONL file (a path, or its bytes with `filename`)."""
        if isinstance(file, (str, Path)):
            content, filename = Path(file).read_bytes(), filename or Path(file).name
        else:
            content, filename = file, filename or "upload.jsonl"
        return self._run(Call("POST", "/v1/files", {"files": {"file": (filename, content, "application/jsonl")},
                                                    "data": {"purpose": purpose}}, _one(File)))

    def list(self, *, purpose: str | None = None, after: str | None = None, limit: int | None = None):
        return self._run(Call("GET", "/v1/files", _query(purpose=purpose, after=after, limit=limit), _page(File)))

    def get(self, file_id: str):
        return self._run(Call("GET", f"/v1/files/{file_id}", parse=_one(File)))

    def content(self, file_id: str):
        return self._run(Call("GET", f"/v1/files/{file_id}/content", parse=lambda r: r.content))

    def delete(self, file_id: str):
        return self._run(Call("DELETE", f"/v1/files/{file_id}", parse=lambda r: r.json()["deleted"]))


class Jobs:
    def __init__(self, run):
        self._run = run

    def create(self, *, model: str, training_file: str, method: str = "supervised",
               validation_file: str | None = None, suffix: str | None = None, seed: int | None = None,
               metadata: dict[str, str] | None = None, grader: dict[str, Any] | None = None,
               **hyperparameters: Any):
        """A job of `method` (supervised, dpo, reinforcement: with its `grader`, an OpenAI grader
        or {"type": "flywheel_environment", "env": ...}); hyperparameters as keywords (n_epochs=3)."""
        inner: dict[str, Any] = {"hyperparameters": hyperparameters}
        if grader is not None:
            inner["grader"] = grader
        body = {"model": model, "training_file": training_file, "validation_file": validation_file,
                "suffix": suffix, "seed": seed, "metadata": metadata, "method": {"type": method, method: inner}}
        return self._run(Call("POST", "/v1/fine_tuning/jobs", {"json": {k: v for k, v in body.items() if v is not None}},
                              _one(Job)))

    def list(self, *, after: str | None = None, limit: int | None = None):
        return self._run(Call("GET", "/v1/fine_tuning/jobs", _query(after=after, limit=limit), _page(Job)))

    def get(self, job_id: str):
        return self._run(Call("GET", f"/v1/fine_tuning/jobs/{job_id}", parse=_one(Job)))

    def cancel(self, job_id: str):
        return self._run(Call("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel", parse=_one(Job)))

    def pause(self, job_id: str):
        return self._run(Call("POST", f"/v1/fine_tuning/jobs/{job_id}/pause", parse=_one(Job)))

    def resume(self, job_id: str):
        return self._run(Call("POST", f"/v1/fine_tuning/jobs/{job_id}/resume", parse=_one(Job)))

    def events(self, job_id: str, *, after: str | None = None, limit: int | None = None):
        """Newest first."""
        return self._run(Call("GET", f"/v1/fine_tuning/jobs/{job_id}/events", _query(after=after, limit=limit),
                              _page(JobEvent)))

    def checkpoints(self, job_id: str, *, after: str | None = None, limit: int | None = None):
        """Newest first; each `fine_tuned_model_checkpoint` is a model name usable at once."""
        return self._run(Call("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints", _query(after=after, limit=limit),
                              _page(Checkpoint)))

    def wait(self, job_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None, progress: bool = True) -> Job:
        """Poll until the job ends; with `progress`, a bar of steps and training loss."""
        with _Bar(progress) as bar:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                job = self.get(job_id)
                bar.show(job, self.events(job_id, limit=20))
                if job.done:
                    return job
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} is still {job.status} after {timeout_s} s")
                time.sleep(poll_s)


class AsyncJobs(Jobs):
    async def wait(self, job_id: str, *, poll_s: float = 1.0, timeout_s: float | None = None,
                   progress: bool = False) -> Job:
        with _Bar(progress) as bar:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while True:
                job = await self.get(job_id)
                bar.show(job, await self.events(job_id, limit=20))
                if job.done:
                    return job
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} is still {job.status} after {timeout_s} s")
                await asyncio.sleep(poll_s)


class Models:
    def __init__(self, run):
        self._run = run

    def list(self):
        return self._run(Call("GET", "/v1/models", parse=lambda r: [Model.from_json(x) for x in r.json()["data"]]))

    def delete(self, model: str):
        """Delete one of your fine-tuned models (its job and checkpoints stay)."""
        return self._run(Call("DELETE", f"/v1/models/{model}", parse=lambda r: r.json()["deleted"]))

    def download(self, model: str, out: str | Path, *, merged: bool = False):
        """A fine-tuned model or checkpoint unpacked into `out`; the folder. A LoRA fine-tune is
        its peft adapter folder, or with `merged` its base with the adapter merged in (a plain
        Hugging Face folder)."""
        return self._run(Call("GET", f"/v1/models/{model}/content", _query(format="merged" if merged else None),
                              parse=lambda r: _unpack(r.content, Path(out))))


class Traces:
    def __init__(self, run):
        self._run = run

    def add(self, records: list[dict[str, Any]]):
        """Store traces; the server's per-record results ({"added", "duplicates", "results"})."""
        return self._run(Call("POST", "/v1/traces", {"json": records}))

    def feedback(self, trace_id: str, **feedback: Any):
        """Report an outcome (score, label, correction, text, verifier); the feedback's id."""
        return self._run(Call("POST", f"/v1/traces/{trace_id}/feedback", {"json": feedback},
                              lambda r: r.json()["id"]))


class Flywheels:
    """Managed flywheels (flywheel's extension): a continuous loop for one of your models, run
    by the server, its production alias following each promotion."""

    def __init__(self, run):
        self._run = run

    def create(self, *, model: str, **fields: Any):
        """A flywheel of `model`; the rest of the body as keywords (suffix, traces, training,
        curation, eval, gate, trigger, budget_usd, metadata; docs/api.md). None values are
        left out (the server's defaults)."""
        body = {"model": model, **fields}
        return self._run(Call("POST", "/v1/flywheels", {"json": {k: v for k, v in body.items() if v is not None}},
                              _one(ManagedFlywheel)))

    def retrieve(self, flywheel_id: str):
        return self._run(Call("GET", f"/v1/flywheels/{flywheel_id}", parse=_one(ManagedFlywheel)))

    def list(self, *, after: str | None = None, limit: int | None = 20):
        """Newest first."""
        return self._run(Call("GET", "/v1/flywheels", _query(after=after, limit=limit), _page(ManagedFlywheel)))

    def cycles(self, flywheel_id: str):
        """The flywheel's cycles, newest first: each one's job, the gate's decision, cost."""
        return self._run(Call("GET", f"/v1/flywheels/{flywheel_id}/cycles", parse=_page(FlywheelCycle)))

    def run_cycle(self, flywheel_id: str):
        """Queue a cycle now, whatever the trigger says (refused, 409, while one is unfinished)."""
        return self._run(Call("POST", f"/v1/flywheels/{flywheel_id}/cycles", parse=_one(FlywheelCycle)))

    def rollback(self, flywheel_id: str, to: str | None = None):
        """Production back to the version it replaced (or to `to`, a version that was in
        production); the flywheel, its new production included."""
        return self._run(Call("POST", f"/v1/flywheels/{flywheel_id}/rollback",
                              {"json": {} if to is None else {"to": to}}, _one(ManagedFlywheel)))


class Flywheel:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0,
                 max_retries: int = 3):
        self._http = SyncHTTP(base_url, api_key, timeout, max_retries)
        self.files, self.jobs = Files(self._run), Jobs(self._run)
        self.models, self.traces = Models(self._run), Traces(self._run)
        self.flywheels = Flywheels(self._run)

    def _run(self, call: Call) -> Any:
        return call.parse(self._http.request(call.method, call.path, **call.kw))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Flywheel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncFlywheel:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, *, timeout: float = 60.0,
                 max_retries: int = 3):
        self._http = AsyncHTTP(base_url, api_key, timeout, max_retries)
        self.files, self.jobs = Files(self._run), AsyncJobs(self._run)
        self.models, self.traces = Models(self._run), Traces(self._run)
        self.flywheels = Flywheels(self._run)

    async def _run(self, call: Call) -> Any:
        return call.parse(await self._http.request(call.method, call.path, **call.kw))

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncFlywheel:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class _Bar:
    """A rich progress bar of a job's steps (from its newest metrics event) and loss; nothing
    when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.progress = self.task = None

    def __enter__(self) -> _Bar:
        if self.enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TimeElapsedColumn(), transient=False)
            self.progress.start()
            self.task = self.progress.add_task("queued", total=None)
        return self

    def show(self, job: Job, events: Page) -> None:
        if self.progress is None:
            return
        metrics = next((e.data for e in events if e.type == "metrics"), None)
        text = job.status if metrics is None else f"{job.status} loss {metrics['train_loss']:.4f}"
        if metrics is not None:
            self.progress.update(self.task, total=metrics["total_steps"], completed=metrics["step"], description=text)
        else:
            self.progress.update(self.task, description=text)

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()
