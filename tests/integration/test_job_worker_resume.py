"""Fine-tuning jobs survive their workers: a `flywheel worker` killed with SIGKILL mid-job takes
its training process with it, and a second worker resumes the job from its last checkpoint once
the lease runs out; pausing a running job checkpoints it, and resuming finishes it."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.process import pid_alive
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.worker.job_worker import JobWorker

pytestmark = pytest.mark.slow  # worker processes killed and restarted, jobs of 1,000 steps: make test-all

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
        for i in range(100)]
LONG = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 10, "batch_size": 1}}}  # 1,000 steps


@pytest.fixture
def service(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    ft = FineTuning(store, {"tiny": base})
    content = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    f = ft.upload("default", "train.jsonl", "fine-tune", io.BytesIO(content))
    yield tmp_path, base, store, ft, f["id"]
    ft.close()
    store.close()


def until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def descendants(pid: int) -> list[int]:
    """Children, their children, ...: the worker's zygote and the training process it forked."""
    found = children(pid)
    return found + [d for c in found for d in descendants(c)]


def start_worker(root, base):
    return subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "worker", "--data-dir", str(root),
                             "--base-model", f"tiny={base}", "--lease-s", "2", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_a_killed_workers_job_resumes_on_another_worker_from_its_checkpoint(service):
    root, base, store, ft, file_id = service
    job = ft.create_job("default", {"model": "tiny", "training_file": file_id, "method": LONG})
    first = start_worker(root, base)
    try:
        until(lambda: store.checkpoint_steps(job["id"]), 120, "the first checkpoint")
        trainers = descendants(first.pid)
        assert len(trainers) >= 2, "the worker trains in a process forked by its zygote"
        first.send_signal(signal.SIGKILL)
        first.wait()
        until(lambda: not any(pid_alive(p) for p in trainers), 10, "the training process to die with its worker")
        done_before = max(store.checkpoint_steps(job["id"]))
        second = start_worker(root, base)
        try:
            final = until(lambda: (j := store.get_job("default", job["id"]))["status"] in ("succeeded", "failed")
                          and j, 240, "the job to finish on the second worker")
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(30)
    finally:
        if first.poll() is None:
            first.kill()
    assert final["status"] == "succeeded", final["error"]
    assert final["attempts"] == 2
    messages = [e["message"] for e in store.list_events("default", job["id"], limit=1000)[0]]
    assert any("resuming" in m for m in messages)
    log = (root / "jobs" / job["id"] / "train.log").read_text()
    # not from step 0: from the newest checkpoint on disk, which may be one the store had not
    # recorded yet when the first worker died (the job records checkpoints as it finds them)
    resumed = [int(m) for m in re.findall(r"resumed from .* \(step (\d+)\)", log)]
    assert resumed and resumed[-1] >= done_before > 0, log[-2000:]
    steps = sorted(store.checkpoint_steps(job["id"]))
    assert steps[-1] == 1000 and done_before in steps


def test_pause_checkpoints_a_running_job_and_resume_finishes_it(service):
    root, base, store, ft, file_id = service
    job = ft.create_job("default", {"model": "tiny", "training_file": file_id, "method": LONG})
    worker = JobWorker(store, {"tiny": base}, root / "jobs", heartbeat_s=0.2, threads=1, log=lambda m: None)
    thread = threading.Thread(target=worker.run, kwargs={"idle_s": 0.1}, daemon=True)
    thread.start()
    try:
        until(lambda: store.get_job("default", job["id"])["status"] == "running", 60, "the job to start")
        until(lambda: any(e["type"] == "metrics" for e in store.list_events("default", job["id"], limit=100)[0]),
              120, "the first metrics")
        store.pause("default", job["id"])
        paused = until(lambda: (j := store.get_job("default", job["id"]))["status"] == "paused" and j, 60,
                       "the pause")
        assert paused["worker"] is None and paused["finished_at"] is None
        at = [e["message"] for e in store.list_events("default", job["id"], limit=5)[0]][0]
        assert at.startswith("Fine-tuning job paused at step")
        store.resume("default", job["id"])
        final = until(lambda: (j := store.get_job("default", job["id"]))["status"] in ("succeeded", "failed") and j,
                      240, "the resumed job to finish")
    finally:
        worker.stopping.set()
        thread.join(60)
    assert final["status"] == "succeeded", final["error"]
    assert final["attempts"] == 2 and final["fine_tuned_model"]
    assert os.path.isdir(final["model_path"])


def test_queued_jobs_outlive_the_server_that_took_them(tmp_path):
    import openai

    from flywheel.serve.app import create_app
    from flywheel.serve.background import BackgroundServer
    from flywheel.serve.core import OpenAIService

    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    rows = "".join(json.dumps(r) + "\n" for r in ROWS[:8]).encode()

    def server():
        store = JobStore(data_file_url(tmp_path), tmp_path / "files")
        service = OpenAIService(base, name="tiny", default_max_tokens=4)
        srv = BackgroundServer(create_app(service, fine_tuning=FineTuning(store, {"tiny": base}))).start()
        return store, service, srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    def shut(store, service, srv):
        srv.stop()
        service.close()
        store.close()

    store, service, srv, client = server()
    f = client.files.create(file=("t.jsonl", rows), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="kept")
    shut(store, service, srv)

    store, service, srv, client = server()  # a new server process would read the same database
    try:
        # the first server may have stopped before checking the files: the new one checks them
        until(lambda: client.fine_tuning.jobs.retrieve(job.id).status != "validating_files", 60, "the file check")
        assert client.fine_tuning.jobs.retrieve(job.id).status == "queued"
        JobWorker(store, {"tiny": base}, tmp_path / "jobs", heartbeat_s=0.2, threads=1, log=lambda m: None).run_one()
        done = client.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "succeeded" and done.fine_tuned_model.endswith(job.id.removeprefix("ftjob-"))
        reply = client.chat.completions.create(model=done.fine_tuned_model, max_tokens=2,
                                               messages=[{"role": "user", "content": "What is 1 + 1?"}])
        assert reply.model == done.fine_tuned_model
    finally:
        shut(store, service, srv)
