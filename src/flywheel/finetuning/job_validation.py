"""Checking a new job's files away from the request that created it.

POST /v1/fine_tuning/jobs answers at once with the job in `validating_files`, as OpenAI's
does. A `JobValidator` then checks its files against the method's row format
(jobs/file_check.py) and counts the training file's tokens under the base model's tokenizer
(the tenant's `max_job_tokens`) in a process of its own, at a lower CPU priority, one job at a
time and one line at a time: neither the server's memory nor its other requests feel a
500 MB file (a line over `max_line_bytes` is a bad line, never read whole). The job then
moves to `queued` with its "auto" hyperparameters resolved, or to `failed` with an error
naming the bad lines. Jobs a stopped server left in `validating_files` are checked again by
the next one (`resume`). If the checking process dies, the job fails saying so.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import orjson

from flywheel.jobs import JobRequest, JobStore
from flywheel.jobs.file_check import FileReport, check_file, check_rows
from flywheel.jobs.hyperparameters import resolve
from flywheel.jobs.limits import TenantLimits
from flywheel.jsonl import read_lines
from flywheel.process import worker_context

log = logging.getLogger(__name__)

ENV_GRADER = "flywheel_environment"  # flywheel's extension: {"type", "env", "settings"}, rows are its tasks
TOKEN_PIECE_CHARS = 32_768  # texts are tokenized in pieces this long: memory stays bounded whatever a line holds
NICE = 10  # the checking process's CPU priority below the server's


@dataclass(frozen=True)
class FileCheck:
    """What the checking process needs to check one job's files (plain, picklable data)."""

    files: tuple[tuple[str, str, str], ...]  # (param, file id, path): training_file first
    method_type: str
    environment: bool  # rows are a flywheel environment's tasks, not the method's format
    tokenizer_path: str  # the base model's folder
    max_line_bytes: int


@dataclass(frozen=True)
class FileCheckResult:
    error: dict[str, Any] | None  # the job's error (code, param, message), or None
    training_rows: int = 0
    training_tokens: int = 0  # tokens of the training file's texts (one epoch)


def check_job_files(check: FileCheck) -> FileCheckResult:
    """Each file's rows against the format, then the training file's tokens (in the checking process)."""
    rows = 0
    for param, file_id, path in check.files:
        with open(path, "rb") as f:
            report = _report(f, check)
        if not report.ok:
            return FileCheckResult({"code": f"invalid_{param}", "param": param,
                                    "message": report.message(f"{param} {file_id} ({check.method_type} format)")})
        if param == "training_file":
            rows = report.rows
    return FileCheckResult(None, rows, count_tokens(Path(check.files[0][2]), check.tokenizer_path,
                                                    check.max_line_bytes))


def _report(f, check: FileCheck) -> FileReport:
    if check.environment:
        return check_rows(f, environment_task_problem, check.max_line_bytes)
    return check_file(f, check.method_type, check.max_line_bytes)


def count_tokens(path: Path, tokenizer_path: str, max_line_bytes: int) -> int:
    """Tokens of every row's texts (row_texts), tokenized TOKEN_PIECE_CHARS at a time. Where a
    piece boundary splits what would be one token the count is a token higher: an upper bound,
    which is the side a limit should err on."""
    from flywheel.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    total = 0
    with open(path, "rb") as f:
        for line in read_lines(f, max_line_bytes):
            if line.is_blank() or line.too_long:
                continue
            text = row_texts(orjson.loads(line.data))
            for start in range(0, len(text), TOKEN_PIECE_CHARS):
                total += len(tokenizer.encode(text[start:start + TOKEN_PIECE_CHARS], add_special_tokens=False))
    return total


def row_texts(row: Any) -> str:
    """Every string in a row (message contents, tool calls, DPO outputs), joined: what a job trains on."""
    if isinstance(row, str):
        return row
    if isinstance(row, dict):
        return "\n".join(row_texts(v) for v in row.values())
    if isinstance(row, list):
        return "\n".join(row_texts(v) for v in row)
    return ""


def environment_task_problem(row: dict[str, Any]) -> str | None:
    """What is wrong with a row of an environment job (`{"task": {Task fields}}`), or None."""
    from flywheel.envs.replay import task_from_dict

    if not isinstance(row.get("task"), dict):
        return 'a row must be {"task": {prompt, answer, ...}}'
    try:
        task_from_dict(row["task"], default_id="row")
    except ValueError as e:
        return f"task: {e}"
    return None


def _start_checker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the server stops its checker
    os.nice(NICE)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


class JobValidator:
    """Checks jobs' files in one low-priority process; `submit` returns at once."""

    def __init__(self, jobs: JobStore, limits: TenantLimits, model_path: Callable[[str, str], Path]):
        """model_path(tenant, model name): the model folder whose tokenizer counts the tokens."""
        self.jobs, self.limits, self.model_path = jobs, limits, model_path
        self._executor: ProcessPoolExecutor | None = None
        self._pending: set[Future] = set()  # checks submitted and not yet recorded
        self._lock = threading.Lock()
        self._recorded = threading.Condition(self._lock)

    def start(self) -> None:
        """Start the checking process now rather than with the first job: the first start also
        starts the process's forkserver (most of a second), which a create call should not wait for."""
        self._pool().submit(os.getpid).result()

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(1, mp_context=worker_context(), initializer=_start_checker)
            return self._executor

    def submit(self, job_id: str, tenant: str, req: JobRequest) -> None:
        """Check the job's files; the job leaves `validating_files` when the check is done."""
        files = tuple((param, file_id, str(self.jobs.file_path(tenant, file_id)))
                      for param in ("training_file", "validation_file")
                      if (file_id := getattr(req, param)) is not None)
        check = FileCheck(files, req.method_type, (req.grader or {}).get("type") == ENV_GRADER,
                          str(self.model_path(tenant, req.model)), self.limits.max_line_bytes)
        executor = self._pool()
        with self._lock:
            future = executor.submit(check_job_files, check)
            self._pending.add(future)
        future.add_done_callback(lambda done: self._finish(done, job_id, req))

    def resume(self) -> int:
        """Check again the jobs left in `validating_files` (a server stopped while checking them)."""
        left = self.jobs.validating()
        for job in left:
            req = JobRequest.parse({"model": job["model"], "training_file": job["training_file"],
                                    "validation_file": job["validation_file"], "method": job["method"]})
            self.submit(job["id"], job["tenant"], req)
        return len(left)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every check submitted so far; False if some were still running at `timeout`."""
        with self._recorded:
            return self._recorded.wait_for(lambda: not self._pending, timeout)

    def close(self) -> None:
        self._drop(wait=True)

    def _finish(self, done: Future, job_id: str, req: JobRequest) -> None:
        try:
            if done.cancelled():
                return  # the server is stopping: the next one checks the job again (resume)
            try:
                result = done.result()
            except Exception as exc:  # noqa: BLE001 - the checker died or raised: the job fails saying why
                log.exception("checking the files of job %s failed", job_id)
                if isinstance(exc, BrokenProcessPool):
                    self._drop(wait=False)  # its process died: the next submit starts another
                result = FileCheckResult({"code": "validation_error", "param": "training_file",
                                          "message": f"the files could not be checked: {type(exc).__name__}: {exc}"})
            self._record(job_id, req, result)
        finally:
            with self._recorded:
                self._pending.discard(done)
                self._recorded.notify_all()

    def _drop(self, wait: bool) -> None:
        """Shut the checking process down (queued checks cancelled); a later submit starts another."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=True)

    def _record(self, job_id: str, req: JobRequest, result: FileCheckResult) -> None:
        if result.error is not None:
            self.jobs.set_validated(job_id, error=result.error, hyperparameters=None)
            return
        resolved = resolve(req.method_type, req.hyperparameters, result.training_rows)
        tokens = resolved["n_epochs"] * result.training_tokens
        if tokens > self.limits.max_job_tokens:
            error = {"code": "too_many_tokens", "param": "training_file",
                     "message": f"the job would train on {tokens:,} tokens ({resolved['n_epochs']} epochs of the "
                                f"training file); this tenant's limit is {self.limits.max_job_tokens:,}"}
            self.jobs.set_validated(job_id, error=error, hyperparameters=None)
            return
        self.jobs.set_validated(job_id, error=None, hyperparameters=resolved, method=req.method(resolved))
