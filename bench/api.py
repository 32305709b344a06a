"""The fine-tuning API under load: 50 concurrent clients listing jobs, retrieving a job and
reading its events, while a job trains on the same machine, against the same load on an idle
server, in one run.

Processes: `flywheel serve --fine-tuning` (the tiny model, its own process), one `flywheel
worker` (training a long supervised job of the tiny model: the "busy" phase only), and the
load generator: wrk with 50 keep-alive connections, each sending its next request as soon as
the last is answered, cycling GET /v1/fine_tuning/jobs?limit=20, GET /v1/fine_tuning/jobs/{id},
GET .../events?limit=20. Phases alternate idle / busy for `--repeats` rounds of `--seconds`
each, after a warm-up; each round's p50 and p99 are over its requests, and each figure is the
median of the rounds with their range; an error is any non-2xx answer or a socket error. The
goal is p99 <= 50 ms with no errors while a job trains.

While a job trains, each busy round also counts its training steps in windows of the same
length with no load just before and just after the loaded one (the job's metrics.jsonl, step
rows by their time): the loaded window's steps/s over the quiet windows' mean is the training
kept under the load (issue 40: no more than 15 % lost). Two quiet windows, because a job's
steps/s drifts as it runs and after its worker restarts.

Then job start: `--starts` short supervised jobs, one after another, for the worker already
running (idle, its zygote warm). Each one's start is the time from the worker's claim (the
job row's `started_at`, written by the claim) to the end of its first training step (step
1's row in the job's metrics.jsonl, written by the training process); both clocks are this
machine's. The goal is <= 2 s, the median of 5.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from datetime import timezone
from pathlib import Path

import httpx
from sqlalchemy import create_engine, select

from flywheel.jobs.store import data_file_url
from flywheel.jobs.tables import JobRow

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(200)]


WRK_SCRIPT = """
local paths, i = {}, 0
init = function(args) for _, p in ipairs(args) do paths[#paths + 1] = p end end
request = function() i = i + 1; return wrk.format("GET", paths[i % #paths + 1]) end
"""


def load(url: str, job_id: str, clients: int, seconds: float) -> dict[str, float]:
    """One wrk run of `clients` connections for `seconds`: {"p50_ms", "p99_ms", "rps", "requests", "errors"}.

    wrk (C, one thread, epoll) keeps every connection busy: the next request goes as soon as the
    last is answered. Latency percentiles are wrk's, over every request of the run; errors are
    non-2xx answers plus socket errors (connect, read, write, timeout)."""
    script = common.WORK / "api" / "cycle.lua"
    script.write_text(WRK_SCRIPT)
    paths = ["/v1/fine_tuning/jobs?limit=20", f"/v1/fine_tuning/jobs/{job_id}",
             f"/v1/fine_tuning/jobs/{job_id}/events?limit=20"]
    out = subprocess.run(["wrk", "-t1", f"-c{clients}", f"-d{seconds:g}s", "--latency", "--timeout", "10s",
                          "-s", str(script), url, "--", *paths], capture_output=True, text=True, check=True).stdout
    return parse_wrk(out)


_UNIT_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}


def parse_wrk(out: str) -> dict[str, float]:
    """The figures of wrk's --latency report."""
    def ms(text: str) -> float:
        m = re.fullmatch(r"([0-9.]+)(us|ms|s|m)", text)
        return float(m.group(1)) * _UNIT_MS[m.group(2)]

    pct = {float(p): ms(v) for p, v in re.findall(r"^\s+([0-9.]+)%\s+(\S+)$", out, re.M)}
    requests = int(re.search(r"^\s+(\d+) requests in", out, re.M).group(1))
    errors = sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors += int(non2xx.group(1)) if non2xx else 0
    return {"p50_ms": pct[50.0], "p99_ms": pct[99.0], "rps": float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1)),
            "requests": requests, "errors": errors}


def step_times(root: Path, job_id: str) -> list[float]:
    """The unix times of the training steps in the job's metrics.jsonl (every attempt's lines)."""
    path = next(root.rglob(f"{job_id}/**/metrics.jsonl"))
    return [r["time"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def job_start_s(url: str, root: Path, file_id: str) -> float:
    """Submit one short supervised job, wait for it to succeed, and return the seconds from its
    claim to the end of its first training step (see the module's docstring)."""
    job = httpx.post(url + "/v1/fine_tuning/jobs", json={
        "model": "tiny", "training_file": file_id,
        "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 8}}}},
    ).json()
    deadline = time.monotonic() + 300
    while (status := httpx.get(f"{url}/v1/fine_tuning/jobs/{job['id']}").json()["status"]) != "succeeded":
        if status in ("failed", "cancelled") or time.monotonic() > deadline:
            raise RuntimeError(f"job {job['id']} ended {status}")
        time.sleep(0.2)
    engine = create_engine(data_file_url(root))
    with engine.connect() as conn:
        started = conn.execute(select(JobRow.started_at).where(JobRow.id == job["id"])).scalar_one()
    engine.dispose()
    metrics = next(root.rglob(f"{job['id']}/**/metrics.jsonl"))
    first = next(r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r)
    assert first["step"] == 1, f"{metrics}: the first training row is step {first['step']}, not 1"
    return first["time"] - started.replace(tzinfo=timezone.utc).timestamp()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--repeats", type=int, default=3, help="idle / busy rounds")
    ap.add_argument("--starts", type=int, default=5, help="short jobs timed from claim to first step")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("bench/api.py needs wrk, the HTTP load generator: apt-get install wrk (make bench installs it)")
    root = common.WORK / "api"
    subprocess.run(["rm", "-rf", str(root)], check=True)
    root.mkdir(parents=True)
    model = common.tiny_model()
    port = 18000 + os.getpid() % 1000
    url = f"http://127.0.0.1:{port}"
    fw = [sys.executable, "-m", "flywheel.cli.main"]
    server = subprocess.Popen([*fw, "serve", "--model", str(model), "--name", "tiny", "--fine-tuning", "--data-dir",
                               str(root), "--port", str(port), "--no-traces", "--threads", "1", "--log-level",
                               "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        data = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        f = httpx.post(url + "/v1/files", files={"file": ("t.jsonl", data)}, data={"purpose": "fine-tune"}).json()
        job = httpx.post(url + "/v1/fine_tuning/jobs", json={
            "model": "tiny", "training_file": f["id"],
            "method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}}},
        ).json()
        load(url, job["id"], args.clients, 3.0)  # warm-up
        rounds: dict[str, list[dict[str, float]]] = {"idle": [], "busy": []}
        kept: list[float] = []  # per busy round: training steps/s under the load over the quiet windows' mean
        for rnd in range(args.repeats):
            for phase in ("idle", "busy"):
                if phase == "busy" and worker is None:
                    worker = subprocess.Popen([*fw, "worker", "--data-dir", str(root), "--base-model", f"tiny={model}",
                                               "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    while httpx.get(f"{url}/v1/fine_tuning/jobs/{job['id']}").json()["status"] != "running":
                        time.sleep(0.5)
                    time.sleep(5)  # training under way
                if phase == "idle" and worker is not None:
                    httpx.post(f"{url}/v1/fine_tuning/jobs/{job['id']}/pause")
                    while httpx.get(f"{url}/v1/fine_tuning/jobs/{job['id']}").json()["status"] != "paused":
                        time.sleep(0.5)
                    worker.send_signal(signal.SIGTERM)
                    worker.wait(60)
                    worker = None
                    httpx.post(f"{url}/v1/fine_tuning/jobs/{job['id']}/resume")
                if phase == "busy":
                    t0 = time.time()
                    time.sleep(args.seconds)
                    t1 = time.time()
                rounds[phase].append(load(url, job["id"], args.clients, args.seconds))
                if phase == "busy":
                    t2 = time.time()
                    time.sleep(args.seconds)
                    t3 = time.time()
                    time.sleep(2)  # the worker writes metrics.jsonl as it goes; let the last lines land
                    times = step_times(root, job["id"])
                    rate = [sum(a <= t < b for t in times) / (b - a) for a, b in ((t0, t1), (t1, t2), (t2, t3))]
                    kept.append(rate[1] / ((rate[0] + rate[2]) / 2))
        httpx.post(f"{url}/v1/fine_tuning/jobs/{job['id']}/cancel")
        starts = [job_start_s(url, root, f["id"]) for _ in range(args.starts)]
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()

    report(args, rounds, kept, starts)


def report(args: argparse.Namespace, rounds: dict[str, list[dict[str, float]]], kept: list[float],
           starts: list[float]) -> None:
    """The table and the last line, appended to docs/benchmarks.md unless --no-write."""

    def fig(phase: str, key: str, digits: int = 1) -> str:
        values = [r[key] for r in rounds[phase]]
        return (f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})")

    def med(phase: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[phase])

    lines = [f"Machine: {common.machine_line(1)} (server 1 torch thread; the worker's training process 1). "
             f"wrk: {args.clients} connections, 1 thread, {args.repeats} rounds of {args.seconds:.0f} s per phase "
             "after a 3 s warm-up, cycling GET /v1/fine_tuning/jobs?limit=20, /jobs/{id}, /jobs/{id}/events?limit=20; "
             "busy = a supervised job of the tiny model training on the same machine. Each figure: the median of "
             "the rounds (range).",
             "", f"Job start, claim to the end of the first training step, {args.starts} short supervised jobs "
             f"in turn for the running worker: {common.median_range(starts)} s (per job: "
             f"{', '.join(f'{x:.2f}' for x in starts)}).",
             "", f"Training under the load: the job's steps/s while wrk ran over its mean steps/s in the "
             f"{args.seconds:.0f} s before and after, per busy round: {', '.join(f'{x:.2f}' for x in kept)}; median {statistics.median(kept):.2f}.",
             "", "| phase | requests | requests/s | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for phase in ("idle", "busy"):
        lines.append(f"| {phase} | {sum(r['requests'] for r in rounds[phase]):.0f} | {fig(phase, 'rps', 0)} "
                     f"| {fig(phase, 'p50_ms')} | {fig(phase, 'p99_ms')} "
                     f"| {sum(r['errors'] for r in rounds[phase]):.0f} |")
    errors = sum(r["errors"] for r in rounds["busy"])
    last = (f"api: p50_ms={med('busy', 'p50_ms'):.1f} p99_ms={med('busy', 'p99_ms'):.1f} errors={errors:.0f} "
            f"clients={args.clients} idle_p50_ms={med('idle', 'p50_ms'):.1f} idle_p99_ms={med('idle', 'p99_ms'):.1f} "
            f"busy_rps={med('busy', 'rps'):.0f} idle_rps={med('idle', 'rps'):.0f} "
            f"job_start_s={statistics.median(starts):.2f} train_kept={statistics.median(kept):.2f}")
    common.append_report("bench/api.py: the fine-tuning API under 50 concurrent clients, idle and while a job trains",
                         "\n".join(lines), last, write=not args.no_write)


if __name__ == "__main__":
    main()
