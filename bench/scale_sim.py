"""Orchestration at scale, simulated: what a rollout costs flywheel itself, without a model.

A mock Sampler (the Sampler protocol: canned token ids and logprobs after a simulated
latency, a `time.sleep` per `generate` call, i.e. per batched turn) plays the calculator
environment (system prompt with the calc tool's schema, through the tiny model's byte-level
tokenizer and chat template) on the real path: `rollout/play.py` (`play`, `EpisodeLoop`,
`SamplerPolicy`) inside the real rollout sources, `InProcessRollouts` (the synchronous
default, `rollout.workers: 0`) and `ProcessRollouts` with 1, 2 or 4 worker processes
(`orchestrate/worker.py`'s `worker_main`, shared-memory weight transport, results pickled
over the pipes). Only the worker's model load and engine are swapped for the mock. Each
episode: `--tool-calls` turns that call calc (every call sleeps `--tool-latency-ms`), then a
final answer; every assistant turn is `--tokens` tokens.

Measured per run (a fresh driver process per run, its workers fresh too):
  - overhead per trajectory: CPU seconds (user + system) of the driver and every process under
    it over the run, less the mock sampler's own CPU, / trajectories. Sleeps cost no CPU, so
    this is flywheel's orchestration: rendering and tokenizing turns, the env and its tool
    parsing, the episode bookkeeping, pickling results across processes;
  - wall overhead per trajectory: (wall - the latencies the critical path waits) / trajectories;
  - memory per 1,000 in-flight episodes: peak RSS - RSS before the run (sampled every 10 ms),
    summed over the processes that play episodes (the driver for in-process, else its
    workers), per 1,000 episodes; and the learner's own growth as it receives the results.
`play` advances every episode of a work item together (one `generate` call per turn), so a
work item of 10,000 episodes holds 10,000 in flight at once; with N actors the episodes are
split into N items, one per actor (as the feeder does with `items_per_step = workers`).

`--backend ray` measures `RayRollouts` (orchestrate/ray_rollouts.py) the same way on a local
Ray cluster, the mock installed in each Ray worker by a setup hook; without that module (or
Ray) the ray rows say they are not measured. `--smoke`: seconds, writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BENCH = Path(__file__).resolve().parent
ENV_SETTINGS = {"chain_prob": 0.5}  # calculator defaults otherwise: system prompt, tool schema, max_turns 6
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1234 * 5678"}}\n</tool_call>'
ANSWER = "The answer is 7006652."
FILLER = "Let me work through this step by step, carefully. "


@dataclass
class MockSettings:
    sampler_latency_s: float = 0.05  # per generate call: one batched turn of every live episode
    tool_latency_s: float = 0.02  # per calc call (asyncio sleep in the environment)
    tokens: int = 128  # sampled tokens per assistant turn (at least the canned text's length)
    tool_calls: int = 1  # turns that call calc, then one final answer
    prompt_messages: int = 2  # messages of a task's prompt (system, user): the turn is read off the prompt
    cpu_dir: str = ""  # where a mock in another process writes its CPU seconds


class MockSampler:
    """A Sampler (inference/sampler.py) that returns canned turns after `sampler_latency_s`:
    turn k < tool_calls calls calc, the next answers. The turn is the count of <|im_start|>
    in the prompt. `cpu_s`: its own CPU time, which the bench subtracts."""

    def __init__(self, tokenizer, settings: MockSettings, version: int = -1):
        import torch

        self.tokenizer, self.s, self.version = tokenizer, settings, version
        self.device = torch.device("cpu")
        self.start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.turns = [self._canned(CALL), self._canned(ANSWER)]
        self.cpu_s, self.calls = 0.0, 0
        self._cpu_file = (Path(settings.cpu_dir) / f"mock-{os.getpid()}.txt") if settings.cpu_dir else None

    def _canned(self, tail: str) -> tuple[list[int], str]:
        eos = self.tokenizer.eos_token_id
        pad = max(0, self.s.tokens - 1 - len(self.encode(tail)))
        text = (FILLER * (pad // len(FILLER) + 1))[:pad] + tail
        return self.encode(text) + [eos], text

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts, params):
        from flywheel.inference.sampler import Sample

        t0 = time.thread_time()
        out = []
        for i, prompt in enumerate(prompts):
            turn = (prompt.count(self.start_id) - self.s.prompt_messages - 1) // 2
            ids, text = self.turns[0 if turn < self.s.tool_calls else 1]
            out.append([Sample(list(ids), [-0.5] * len(ids), "stop", self.version, i, text=text,
                               prompt_len=len(prompt))])
        self.calls += 1
        self.cpu_s += time.thread_time() - t0
        if self._cpu_file is not None:
            self._cpu_file.write_text(repr(self.cpu_s))
        time.sleep(self.s.sampler_latency_s)
        return out

    def update_weights(self, tensors, version: int) -> None:
        self.version = int(version)

    def receive(self, source) -> bool:
        """What LocalEngine.receive does to the version (the weights themselves are not used)."""
        version = (source.transport if hasattr(source, "bind") else source).version()
        if version <= self.version:
            return False
        self.version = int(version)
        return True


def install_mock(settings: MockSettings) -> None:
    """Make orchestrate/worker.py build a MockSampler instead of loading a model (this process)."""
    import flywheel.orchestrate.worker as worker
    from flywheel.models.tiny import build_tokenizer

    worker.load = lambda model, device="cpu": (None, build_tokenizer())
    worker.LocalEngine = lambda model, tokenizer, **kw: MockSampler(tokenizer, settings)


def worker_entry() -> None:
    """A ProcessRollouts worker with the mock: `... WORKER_ID SOCKET_FD SETTINGS_JSON`."""
    from multiprocessing.connection import Connection

    install_mock(MockSettings(**json.loads(sys.argv[3])))
    import flywheel.orchestrate.worker as worker

    worker.worker_main(int(sys.argv[1]), Connection(int(sys.argv[2])))


def _ray_setup_hook() -> None:
    """Ray's worker_process_setup_hook: the mock in every Ray worker process."""
    install_mock(MockSettings(**json.loads(os.environ["FLYWHEEL_SCALE_SIM_MOCK"])))


def _mock_process_rollouts(spec, n_workers: int, settings: MockSettings):
    """ProcessRollouts whose workers start through `worker_entry` (the mock, then the real
    worker_main); everything else is ProcessRollouts itself."""
    from multiprocessing.connection import Connection

    from flywheel.orchestrate.pool import ProcessRollouts, _Worker

    class MockProcessRollouts(ProcessRollouts):
        def _spawn(self, worker_id: int) -> _Worker:
            here, there = socket.socketpair()
            code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); import scale_sim; scale_sim.worker_entry()"
            proc = subprocess.Popen([sys.executable, "-c", code, str(worker_id), str(there.fileno()),
                                     json.dumps(asdict(settings))], pass_fds=[there.fileno()])
            there.close()
            conn = Connection(here.detach())
            conn.send(self.spec)
            return _Worker(worker_id, proc, conn)

    return MockProcessRollouts(spec, n_workers, max_restarts=0, log=lambda m: None)


class _Probe:
    """CPU and peak RSS of this process and every process under it (workers, a Ray cluster)."""

    def __init__(self, interval_s: float = 0.01):
        import psutil

        self.me, self.interval_s = psutil.Process(), interval_s
        self.base_rss: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _procs(self):
        return [self.me, *self.me.children(recursive=True)]

    def _cpu(self) -> dict[int, float]:
        out = {}
        for p in self._procs():
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except Exception:  # noqa: BLE001 - a process that just ended
                pass
        return out

    def _sample(self) -> None:
        for p in self._procs():
            try:
                rss = p.memory_info().rss
            except Exception:  # noqa: BLE001
                continue
            self.base_rss.setdefault(p.pid, 0 if self._thread is not None else rss)
            self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)

    def start(self) -> None:
        self._sample()
        self.cpu0 = self._cpu()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._sample()
        cpu1 = self._cpu()
        cpu = sum(v - self.cpu0.get(pid, 0.0) for pid, v in cpu1.items())
        grow = {pid: self.peak[pid] - self.base_rss.get(pid, 0) for pid in self.peak}
        mine = grow.pop(self.me.pid, 0)
        return {"cpu_s": cpu, "driver_grow_b": mine, "children_grow_b": sum(grow.values())}


def simulate(episodes: int, actors: int, settings: MockSettings, backend: str = "local",
             group_size: int = 4, seed: int = 0) -> dict:
    """Play `episodes` calculator episodes (`episodes / group_size` tasks) through the rollout
    source of `backend` with `actors` workers (0: in-process, local only); returns the counts
    and the measurements (module docstring)."""
    import torch

    from flywheel.envs import load_env
    from flywheel.models import ChatRenderer
    from flywheel.models.tiny import build_tokenizer
    from flywheel.orchestrate.pool import InProcessRollouts
    from flywheel.orchestrate.worker import WorkerSpec, WorkItem

    if episodes % group_size:
        raise ValueError(f"episodes ({episodes}) must be a multiple of group_size ({group_size})")
    env = load_env("calculator", tool_latency_s=settings.tool_latency_s, **ENV_SETTINGS)
    tasks = env.tasks("train", n=episodes // group_size, seed=seed)
    warm = env.tasks("test", n=max(1, actors), seed=seed)
    params = {"w": torch.zeros(4)}
    tmp = tempfile.TemporaryDirectory(prefix="scale_sim-")
    settings = MockSettings(**{**asdict(settings), "cpu_dir": tmp.name})
    sampling = {"temperature": 1.0, "max_tokens": settings.tokens}
    transport = mock = None
    if actors == 0:
        if backend != "local":
            raise ValueError("actors=0 (in-process) is local only")
        tok = build_tokenizer()
        mock = MockSampler(tok, settings)
        from flywheel.inference import SamplingParams

        source = InProcessRollouts(mock, env, group_size, SamplingParams(**sampling), ChatRenderer(tok))
    elif backend == "local":
        from flywheel.weights import SharedMemoryTransport

        transport = SharedMemoryTransport.create(params, readers=actors)
        spec = WorkerSpec(model="mock", env_name="calculator",
                          env_settings={"tool_latency_s": settings.tool_latency_s, **ENV_SETTINGS},
                          transport_name=transport.name, sampling=sampling, group_size=group_size, threads=1)
        source = _mock_process_rollouts(spec, actors, settings)
    else:
        source = _ray_source(actors, settings, sampling, group_size)
    try:
        source.publish(params, 0)
        for i, t in enumerate(warm):  # start-up (imports, worker spawn) outside the measurement
            source.submit(WorkItem(10 ** 6 + i, [t], 0))
        _drain(source, len(warm))
        mock_cpu0 = _mock_cpu(mock, tmp.name)
        probe = _Probe()
        probe.start()
        t0 = time.perf_counter()
        parts = max(1, actors)
        bounds = [round(i * len(tasks) / parts) for i in range(parts + 1)]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            source.submit(WorkItem(i, tasks[a:b], 0))
        results = _drain(source, parts)
        wall = time.perf_counter() - t0
        measured = probe.stop()
        mock_cpu = _mock_cpu(mock, tmp.name) - mock_cpu0
    finally:
        source.close()
        if transport is not None:
            transport.close()
        if backend == "ray":
            import ray

            ray.shutdown()
        tmp.cleanup()
    groups = [g for r in results for g in r.groups]
    trajs = [t for g in groups for t in g.trajectories]
    turns = settings.tool_calls + 1
    critical = turns * settings.sampler_latency_s + settings.tool_calls * settings.tool_latency_s
    in_flight_b = measured["driver_grow_b"] if actors == 0 else measured["children_grow_b"]
    return {"backend": backend, "actors": actors, "episodes": episodes, "items": sorted(r.item_id for r in results),
            "groups": len(groups), "trajectories": len(trajs),
            "task_ids": sorted({t.task_id for t in trajs}), "tasks": len(tasks),
            "finished": sum(1 for t in trajs if t.metrics.get("turns") == turns),
            "tokens": sum(len(t.ids) for t in trajs), "sampled": sum(sum(t.loss_mask) for t in trajs), "wall_s": wall, "critical_s": critical,
            "cpu_s": measured["cpu_s"] - mock_cpu, "mock_cpu_s": mock_cpu,
            "cpu_ms_per_traj": 1000 * (measured["cpu_s"] - mock_cpu) / max(1, len(trajs)),
            "wall_ms_per_traj": 1000 * (wall - critical) / max(1, len(trajs)),
            "mem_mb_per_1k": in_flight_b / 2 ** 20 / episodes * 1000,
            "learner_mb_per_1k": (measured["driver_grow_b"] / 2 ** 20 / episodes * 1000) if actors else float("nan")}


def _drain(source, n: int, timeout_s: float = 300.0) -> list:
    out, t0 = [], time.perf_counter()
    while len(out) < n:
        out += source.poll(0.05)
        if time.perf_counter() - t0 > timeout_s:
            raise TimeoutError(f"{len(out)} of {n} work items came back in {timeout_s:.0f} s")
    return out


def _mock_cpu(mock: MockSampler | None, cpu_dir: str) -> float:
    if mock is not None:
        return mock.cpu_s
    return sum(float(p.read_text() or 0) for p in Path(cpu_dir).glob("mock-*.txt"))


def ray_missing() -> str | None:
    """Why the ray rows cannot be measured here, or None."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return "Ray is not installed (extra `ray`)"
    try:
        import flywheel.orchestrate.ray_rollouts  # noqa: F401
    except ImportError as e:
        return f"flywheel.orchestrate.ray_rollouts cannot be imported ({e})"
    return None


def _ray_source(actors: int, settings: MockSettings, sampling: dict, group_size: int):
    """RayRollouts on a local Ray cluster this process starts, the mock in every Ray worker."""
    import ray

    from flywheel.config import RayConfig
    from flywheel.orchestrate.ray_rollouts import RayRollouts
    from flywheel.orchestrate.worker import WorkerSpec

    src = str(Path(__file__).resolve().parent.parent / "src")
    # as many logical CPUs as actors (each holds worker_cpus=1), so 4 actors share 2 cores as local processes do
    ray.init(address="local", num_cpus=max(actors + 1, os.cpu_count() or 1), include_dashboard=False,
             log_to_driver=False, runtime_env={
        "worker_process_setup_hook": "scale_sim._ray_setup_hook",
        "env_vars": {"FLYWHEEL_SCALE_SIM_MOCK": json.dumps(asdict(settings)),
                     "PYTHONPATH": os.pathsep.join([str(BENCH), src])}})
    spec = WorkerSpec(model="mock", env_name="calculator",
                      env_settings={"tool_latency_s": settings.tool_latency_s, **ENV_SETTINGS},
                      transport_name="", sampling=sampling, group_size=group_size, threads=1)
    return RayRollouts(spec, actors, RayConfig(), 0, lambda m: None)


# ---------------------------------------------------------------- the sweep


def run_fresh(episodes: int, actors: int, settings: MockSettings, backend: str, threads: int) -> dict:
    """`simulate` in a fresh driver process (no memory left over from an earlier run)."""
    cfg = json.dumps({"episodes": episodes, "actors": actors, "settings": asdict(settings), "backend": backend,
                      "threads": threads})
    proc = subprocess.run([sys.executable, __file__, "--one", cfg], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"scale_sim run {cfg} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(r: dict, group_size: int = 4) -> None:
    """Every episode finished and every trajectory counted once."""
    want = r["episodes"]
    if not (r["trajectories"] == want == r["finished"] and r["groups"] == r["tasks"] == want // group_size
            and len(r["task_ids"]) == r["tasks"] and r["items"] == list(range(max(1, r["actors"])))):
        raise SystemExit(f"counts do not add up: {({k: v for k, v in r.items() if k != 'task_ids'})}")


def _cell(values: list[float], fmt: str) -> str:
    return common.median_range(values, fmt).replace(f", n={len(values)}", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="seconds, small sizes, writes nothing")
    ap.add_argument("--backend", choices=["local", "ray", "both"], default="both",
                    help="rollout sources to measure (ray: RayRollouts on a local Ray cluster, when present)")
    ap.add_argument("--episodes", type=int, nargs="+", default=None)
    ap.add_argument("--actors", type=int, nargs="+", default=None, help="0 = in-process (local only)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sampler-latency-ms", type=float, default=50.0)
    ap.add_argument("--tool-latency-ms", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=128, help="sampled tokens per assistant turn")
    ap.add_argument("--tool-calls", type=int, default=1, help="calc turns per episode before the answer")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        cfg = json.loads(args.one)
        common.set_threads(cfg["threads"])
        import scale_sim  # the module by its name, so Ray workers find the same functions

        print(json.dumps(scale_sim.simulate(cfg["episodes"], cfg["actors"], MockSettings(**cfg["settings"]),
                                            cfg["backend"])))
        return
    common.fill_sizes(args, smoke=dict(episodes=[100], actors=[0, 1], repeats=1),
                      full=dict(episodes=[100, 1000, 10000], actors=[0, 1, 2, 4], repeats=3))
    threads = common.set_threads(args.threads)
    settings = MockSettings(args.sampler_latency_ms / 1000, args.tool_latency_ms / 1000, args.tokens, args.tool_calls)
    backends = ["local", "ray"] if args.backend == "both" else [args.backend]
    if args.smoke and args.backend == "both":
        backends = ["local"]
    ray_note = ray_missing() if "ray" in backends else None
    if ray_note:
        print(f"scale_sim: ray rows not measured yet: {ray_note}")
        backends.remove("ray")
    big, small = max(args.episodes), min(args.episodes)
    # the full grid for local worker processes; in-process, and ray beyond 1 actor, at the largest size only
    configs = [(b, a, e) for b in backends for a in args.actors if not (b == "ray" and a == 0)
               for e in args.episodes if e == big or (a == 1 or (a > 1 and b == "local"))]
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    t_start = time.perf_counter()
    for _ in range(args.repeats):  # configurations interleaved within each repeat
        for b, a, e in configs:
            if b not in backends:
                continue
            try:
                r = run_fresh(e, a, settings, b, 1 if a else threads)
            except RuntimeError as err:
                if b != "ray":
                    raise
                ray_note = "failed here: " + str(err).strip().splitlines()[-1][:200]
                print(f"scale_sim: ray rows not measured: {ray_note}")
                backends.remove("ray")
                runs = {c: rs for c, rs in runs.items() if c[0] != "ray"}
                continue
            check(r)
            runs[(b, a, e)].append(r)
            print(f"  {b} actors={a} episodes={e}: cpu {r['cpu_ms_per_traj']:.3f} ms/traj, "
                  f"wall overhead {r['wall_ms_per_traj']:.3f} ms/traj, {r['mem_mb_per_1k']:.1f} MB/1k", flush=True)
    elapsed = time.perf_counter() - t_start
    rows = ["| backend | rollout actors | episodes | overhead: CPU ms / trajectory | wall overhead ms / trajectory "
            "| in-flight MB / 1k episodes | learner MB / 1k received | mock sampler CPU ms / traj |",
            "|---|---|---|---|---|---|---|---|"]
    for (b, a, e), rs in runs.items():
        rows.append(f"| {b} | {'in-process' if a == 0 else a} | {e:,} | "
                    f"{_cell([r['cpu_ms_per_traj'] for r in rs], '{:.3f}')} | "
                    f"{_cell([r['wall_ms_per_traj'] for r in rs], '{:.3f}')} | "
                    f"{_cell([r['mem_mb_per_1k'] for r in rs], '{:.1f}')} | "
                    + (f"{_cell([r['learner_mb_per_1k'] for r in rs], '{:.1f}')} | " if a else "- | ")
                    + f"{statistics.median(1000 * r['mock_cpu_s'] / r['trajectories'] for r in rs):.3f} |")
    if "ray" not in backends:
        rows.append(f"| ray | - | - | not measured yet ({ray_note or ('not run by --smoke' if args.smoke else 'not asked: --backend local')}) | | | | |")
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("cpu_ms_per_traj", "mem_mb_per_1k",
                                                                "wall_ms_per_traj")} for c, rs in runs.items()}
    head = ("local", 1, big) if ("local", 1, big) in med else next(iter(med))
    tokens = statistics.median(r["tokens"] / r["trajectories"] for r in runs[head])
    growth = (med[head]["cpu_ms_per_traj"] / med[("local", head[1], small)]["cpu_ms_per_traj"]
              if ("local", head[1], small) in med else float("nan"))
    actor_ratio = (med[("local", 4, big)]["cpu_ms_per_traj"] / med[head]["cpu_ms_per_traj"]
                   if ("local", 4, big) in med else float("nan"))
    body = "\n".join([
        f"Machine: {common.machine_line(threads)} (workers 1 torch thread each). Mock sampler: canned turns after "
        f"{args.sampler_latency_ms:g} ms per generate call (one batched turn), {args.tokens} tokens per assistant "
        f"turn; calculator env (system prompt + calc schema, byte-level tiny tokenizer), {args.tool_calls} calc "
        f"call(s) per episode sleeping {args.tool_latency_ms:g} ms, then an answer; {tokens:.0f} tokens per "
        "trajectory; groups of 4. Each run: a fresh driver process (and fresh workers), one warm-up item per actor "
        "outside the clock, then the episodes split into one work item per actor, all in flight at once. "
        "Overhead = CPU (user + system) of the driver and every process under it during the run, less the mock "
        "sampler's own CPU (column beside), / trajectories. Wall overhead = (wall - the simulated latencies on the "
        "critical path) / trajectories. Memory = peak RSS - RSS before the run, of the processes playing the "
        "episodes (in-process: the driver; else the workers, summed), per 1,000 episodes; the learner column is "
        f"the driver's growth while it receives the results. Medians of {args.repeats} runs (range); "
        f"configurations interleaved; the whole sweep took {elapsed:.0f} s.",
        "", *rows, "",
        f"Ratios (same run): overhead per trajectory at {big:,} / at {small:,} episodes (1 actor) {growth:.2f}; "
        f"4 actors / 1 actor at {big:,} episodes {actor_ratio:.2f}; 1-actor overhead at {big:,} / the 1 ms goal "
        f"{med[head]['cpu_ms_per_traj']:.2f}."])
    last = (f"scale_sim: overhead_ms_per_traj={med[head]['cpu_ms_per_traj']:.3f} "
            f"mem_mb_per_1k={med[head]['mem_mb_per_1k']:.1f} episodes={head[2]} actors={head[1]} backend={head[0]} "
            f"overhead_basis=cpu growth_{small}_to_{big}={growth:.2f} actors_4_vs_1={actor_ratio:.2f} "
            f"ray={'measured' if 'ray' in backends else 'not_measured'}")
    common.append_report("Orchestration at scale, simulated (bench/scale_sim.py)", body, last, write=not args.smoke)


if __name__ == "__main__":
    main()
