"""The fine-tuning API under load: 50 concurrent clients listing jobs, retrieving a job and
reading its events, while a job trains on the same machine, against the same load on an idle
server, in one run.

Processes: `flywheel serve --fine-tuning` (the tiny model, its own process), one `flywheel
worker` (training a long supervised job of the tiny model: the "busy" phase only), and the
load generator: 2 processes of 25 asyncio clients each (httpx, one keep-alive connection a
client), each client sending its next request as soon as the last is answered, cycling
GET /v1/fine_tuning/jobs?limit=20, GET /v1/fine_tuning/jobs/{id}, GET .../events?limit=20.
Phases alternate idle / busy for `--repeats` rounds of `--seconds` each, after a warm-up;
latency p50 and p99 are over every request of a phase kind; an error is any non-200 answer
or a failed request. The goal is p99 <= 50 ms with no errors while a job trains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(200)]


def client_process(url: str, job_id: str, clients: int, seconds: float, out) -> None:
    async def one(http: httpx.AsyncClient, latencies: list[float], errors: list[int], deadline: float):
        paths = ["/v1/fine_tuning/jobs?limit=20", f"/v1/fine_tuning/jobs/{job_id}",
                 f"/v1/fine_tuning/jobs/{job_id}/events?limit=20"]
        i = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            try:
                r = await http.get(paths[i % 3])
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t0)
            errors[0] += not ok
            i += 1

    async def main():
        latencies, errors = [], [0]
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
            deadline = time.perf_counter() + seconds
            await asyncio.gather(*(one(http, latencies, errors, deadline) for _ in range(clients)))
        return latencies, errors[0]

    out.put(asyncio.run(main()))


def load(url: str, job_id: str, clients: int, processes: int, seconds: float) -> tuple[list[float], int]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=client_process, args=(url, job_id, clients // processes, seconds, queue))
             for _ in range(processes)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return [x for lat, _ in results for x in lat], sum(e for _, e in results)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--processes", type=int, default=2, help="load generator processes")
    ap.add_argument("--seconds", type=float, default=10.0, help="per phase")
    ap.add_argument("--repeats", type=int, default=3, help="idle / busy rounds")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
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
        load(url, job["id"], args.clients, args.processes, 3.0)  # warm-up
        phases = {"idle": [], "busy": []}
        errors = {"idle": 0, "busy": 0}
        rates = {"idle": [], "busy": []}
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
                lat, err = load(url, job["id"], args.clients, args.processes, args.seconds)
                phases[phase] += lat
                errors[phase] += err
                rates[phase].append(len(lat) / args.seconds)
    finally:
        for p in (worker, server):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()

    def ms(values, q):
        return percentile(values, q) * 1e3

    lines = [f"Machine: {common.machine_line(1)} (server 1 torch thread; the worker's training process 1). "
             f"{args.clients} clients in {args.processes} processes, {args.repeats} rounds of {args.seconds:.0f} s "
             "per phase after a 3 s warm-up; busy = a supervised job of the tiny model training on the same machine.",
             "", "| phase | requests | requests/s (median of rounds) | p50 ms | p99 ms | errors |", "|---|---|---|---|---|---|"]
    for phase in ("idle", "busy"):
        lat = phases[phase]
        lines.append(f"| {phase} | {len(lat)} | {statistics.median(rates[phase]):.0f} | {ms(lat, 0.5):.1f} "
                     f"| {ms(lat, 0.99):.1f} | {errors[phase]} |")
    busy = phases["busy"]
    last = (f"api: p50_ms={ms(busy, 0.5):.1f} p99_ms={ms(busy, 0.99):.1f} errors={errors['busy']} clients={args.clients} "
            f"idle_p50_ms={ms(phases['idle'], 0.5):.1f} idle_p99_ms={ms(phases['idle'], 0.99):.1f} "
            f"busy_rps={statistics.median(rates['busy']):.0f} idle_rps={statistics.median(rates['idle']):.0f}")
    common.append_report("bench/api.py: the fine-tuning API under 50 concurrent clients, idle and while a job trains",
                         "\n".join(lines), last, write=not args.no_write)


if __name__ == "__main__":
    main()
