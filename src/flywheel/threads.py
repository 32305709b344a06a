"""How many torch threads a process uses: the CPUs it may really use, less what other
processes keep busy, shared among the siblings started together.

A torch (OpenMP) thread pool larger than the CPUs it gets is not a little slower but several
times slower: the threads of a parallel region wait for each other at its end, and a thread
that shares its core with another busy process arrives late every time (the demo's base-model
SFT step: 1.1 s with 2 threads beside one busy process on 2 cores, 0.11 s with 1 thread;
docs/benchmarks.md). torch's default is every core of the machine, whoever else uses them.

`choose_threads` is the rule (pure), in this order:
1. an explicit count (`--threads`, a config's `threads`) as given; else $OMP_NUM_THREADS
   (what torch itself honours, and what a parent sets for the children it shares CPUs with);
2. else the CPUs the process may use: its affinity set (os.sched_getaffinity), capped by the
   cgroup CPU quota (v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us) rounded down, at
   least 1 (as Go's automaxprocs does: a thread pool over the quota is throttled as a whole);
3. less the CPUs other processes kept busy over a short sample at start (/proc/stat over the
   allowed CPUs, this process's own use taken out), a CPU counting as free when at least half
   idle: undersubscribing costs at most the busy share, oversubscribing costs several-fold;
4. shared among `processes` siblings (each at least 1).
A busy machine that turns busy later is the oversubscription warning's part (cpu_wait.py).

And on which thread: one. torch's CPU ops run on libgomp (OpenMP), which keeps a team of worker
threads for every thread that ever ran a parallel op, for as long as that thread lives. Once it
manages more threads than there are CPUs (a second such thread on a 2-core machine), it cuts
every worker's spin-wait to ~100 iterations, so each parallel op after that pays a futex
wake-up: a decode step served from a scheduler thread after the main thread built the kernels,
most of all one with LoRA adapters, and a training step beside another thread's idle team both
run measurably slower (bench/openmp_teams.py, figures in docs/benchmarks.md). So a process
runs its parallel torch work on one thread: an engine builds its kernels and lays out its
adapters on the thread that runs its forwards (inference/decoder.py, adapters.py), a rollout
plays on the thread that built its engine (rollout/play.py), and torch work that must run
elsewhere, off a server's event loop, runs `in_passing_thread`: a thread that ends with it,
taking its team along; an idle batch scheduler's thread ends too (inference/scheduler.py).
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

CGROUP = Path("/sys/fs/cgroup")
SAMPLE_S = 0.25  # the busy-CPU sample at start: 25 clock ticks per CPU at 100 Hz


@dataclass(frozen=True)
class CpuFacts:
    """What a process may use: `cpus` in its affinity set, the cgroup `quota` in CPUs (None: no
    quota), and `busy`: CPUs' worth of the allowed ones other processes used when sampled."""

    cpus: int
    quota: float | None = None
    busy: float = 0.0


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # for the log line: where the count came from


def quota_from_cpu_max(text: str | None) -> float | None:
    """cgroup v2 cpu.max ("QUOTA PERIOD" in microseconds, QUOTA "max" for none) -> CPUs.
    "max 100000" -> None; "150000 100000" -> 1.5; "" or None -> None."""
    parts = (text or "").split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return int(parts[0]) / period if period > 0 else None


def quota_from_cfs(quota_us: str | None, period_us: str | None) -> float | None:
    """cgroup v1 cpu.cfs_quota_us and cpu.cfs_period_us -> CPUs; a quota of -1 is none.
    ("-1", "100000") -> None; ("200000", "100000") -> 2.0."""
    if not quota_us or not period_us:
        return None
    quota, period = int(quota_us.strip()), int(period_us.strip())
    return quota / period if quota > 0 and period > 0 else None


def omp_threads(value: str | None) -> int | None:
    """$OMP_NUM_THREADS as torch reads it: the first of a comma list, a positive integer; else None."""
    head = (value or "").split(",")[0].strip()
    return int(head) if head.isdigit() and int(head) > 0 else None


def choose_threads(facts: CpuFacts, processes: int = 1, explicit: int | None = None,
                   env: Mapping[str, str] | None = None) -> ThreadChoice:
    """The thread count of one process (the module docstring's rule); `env` defaults to os.environ."""
    if explicit:
        return ThreadChoice(explicit, "as asked")
    from_env = omp_threads((os.environ if env is None else env).get("OMP_NUM_THREADS"))
    if from_env:
        return ThreadChoice(from_env, "from OMP_NUM_THREADS")
    usable = facts.cpus if facts.quota is None else max(1, min(facts.cpus, math.floor(facts.quota)))
    free = max(1, min(usable, math.floor(facts.cpus - facts.busy + 0.5)))
    threads = max(1, free // max(1, processes))
    why = [f"{facts.cpus} CPUs allowed"]
    if facts.quota is not None:
        why.append(f"cgroup quota {facts.quota:g} CPUs")
    if facts.busy >= 0.05:
        why.append(f"{facts.busy:.1f} busy with other processes")
    if processes > 1:
        why.append(f"shared by {processes} processes")
    return ThreadChoice(threads, ", ".join(why))


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on (all of them where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cgroup_quota(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota over this process's cgroup and its ancestors (v2 cpu.max, else v1
    cfs files), in CPUs; None when there is none or nothing is readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            for folder in _ancestors(root, path):
                quotas.append(quota_from_cpu_max(_read(folder / "cpu.max")))
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu, cpu,cpuacct or cpuacct,cpu
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for folder in _ancestors(mount, path):
                    quotas.append(quota_from_cfs(_read(folder / "cpu.cfs_quota_us"),
                                                 _read(folder / "cpu.cfs_period_us")))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """mount/path and each folder above it up to mount (a container sees its own cgroup as
    the mount's root, so the folder named by /proc/self/cgroup may not exist there)."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def busy_cpus(cpus: set[int], seconds: float = SAMPLE_S, stat: Path = Path("/proc/stat")) -> float:
    """CPUs' worth of `cpus` that other processes used over `seconds` (this process sleeps
    meanwhile; its own CPU time is taken out). 0.0 when /proc/stat is unreadable."""
    before, own0, t0 = _cpu_ticks(stat, cpus), _own_seconds(), time.monotonic()
    if not before:
        return 0.0
    time.sleep(seconds)
    after, own1, wall = _cpu_ticks(stat, cpus), _own_seconds(), time.monotonic() - t0
    busy = 0.0
    for cpu, (used0, total0) in before.items():
        used1, total1 = after.get(cpu, (used0, total0))
        if total1 > total0:
            busy += (used1 - used0) / (total1 - total0)
    return max(0.0, busy - (own1 - own0) / max(wall, 1e-6))


def _cpu_ticks(stat: Path, cpus: set[int]) -> dict[int, tuple[int, int]]:
    """cpu -> (busy ticks, all ticks) from /proc/stat; idle and iowait are not busy, steal is
    (the hypervisor gave the CPU to someone else); guest time is inside user already."""
    out = {}
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        out[int(name[3:])] = (sum(ticks) - ticks[3] - ticks[4], sum(ticks))
    return out


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def cpu_facts(measure_busy: bool = True) -> CpuFacts:
    """This process's CpuFacts, read now (measure_busy: sample /proc/stat for SAMPLE_S)."""
    cpus = affinity_cpus()
    return CpuFacts(len(cpus), cgroup_quota(), busy_cpus(cpus) if measure_busy else 0.0)


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity set capped by the cgroup quota (no sampling)."""
    return choose_threads(cpu_facts(measure_busy=False), env={}).threads


def use_threads(explicit: int | None = None, processes: int = 1,
                log: Callable[[str], None] | None = None) -> int:
    """Choose this process's torch thread count, set it, say why through `log`; returns it.
    Measures the busy CPUs only when neither `explicit` nor $OMP_NUM_THREADS decides."""
    import torch

    decided = explicit or omp_threads(os.environ.get("OMP_NUM_THREADS"))
    choice = choose_threads(cpu_facts(measure_busy=not decided), processes, explicit)
    torch.set_num_threads(choice.threads)
    if log is not None:
        log(f"torch threads: {choice.threads} ({choice.reason})")
    return choice.threads


async def in_passing_thread(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Await `fn(*args, **kwargs)` run on a thread started for it, which ends when it returns:
    torch work off the event loop (loading or merging a model) that leaves no OpenMP team
    behind, as `asyncio.to_thread`'s long-lived pool threads would (the module docstring)."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="flywheel-passing")
    try:
        return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))
    finally:
        executor.shutdown(wait=False)  # the thread exits once `fn` returns, even if we were cancelled
