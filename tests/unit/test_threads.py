"""The thread-count rule (flywheel/threads.py) on hand-worked cases: affinity, cgroup quota
text (v2 and v1), CPUs other processes keep busy, sibling processes, --threads and
OMP_NUM_THREADS."""

from __future__ import annotations

import pytest
import torch

from flywheel.threads import (CpuFacts, _cpu_ticks, cgroup_quota, choose_threads, in_passing_thread, omp_threads,
                              quota_from_cfs, quota_from_cpu_max, use_threads)


@pytest.mark.parametrize("text, cpus", [
    ("max 100000\n", None),  # no quota
    ("150000 100000\n", 1.5),
    ("400000 100000", 4.0),
    ("50000 100000", 0.5),
    ("200000", 2.0),  # the period left out: the kernel's default, 100 ms
    ("", None),
    (None, None),
])
def test_cgroup_v2_cpu_max(text, cpus):
    assert quota_from_cpu_max(text) == cpus


@pytest.mark.parametrize("quota, period, cpus", [
    ("-1\n", "100000\n", None),  # no quota
    ("200000\n", "100000\n", 2.0),
    ("25000", "50000", 0.5),
    (None, "100000", None),  # not readable
])
def test_cgroup_v1_cfs(quota, period, cpus):
    assert quota_from_cfs(quota, period) == cpus


@pytest.mark.parametrize("value, threads", [("4", 4), ("2,1", 2), ("0", None), ("x", None), ("", None), (None, None)])
def test_omp_num_threads_as_torch_reads_it(value, threads):
    assert omp_threads(value) == threads


# (CpuFacts(cpus, quota, busy), processes, explicit, env) -> threads, worked by hand:
CASES = [
    (CpuFacts(8), 1, None, {}, 8),  # an idle 8-CPU machine: all of it
    (CpuFacts(8, quota=2.0), 1, None, {}, 2),  # a container with 2 CPUs of quota on 8
    (CpuFacts(8, quota=1.5), 1, None, {}, 1),  # 1.5 CPUs of quota: floor, as automaxprocs does
    (CpuFacts(8, quota=0.5), 1, None, {}, 1),  # under one CPU: still one thread
    (CpuFacts(4, quota=16.0), 1, None, {}, 4),  # a quota above the affinity set: the affinity set
    (CpuFacts(2, busy=1.0), 1, None, {}, 1),  # 2 CPUs, one kept busy by another process: 1 (the case)
    (CpuFacts(2, busy=0.4), 1, None, {}, 2),  # 0.4 busy: each CPU at least half idle: both
    (CpuFacts(2, busy=0.6), 1, None, {}, 1),  # 2 - 0.6 = 1.4 free rounds to 1
    (CpuFacts(2, busy=3.0), 1, None, {}, 1),  # everything busy: never below 1
    (CpuFacts(64, quota=4.0, busy=50.0), 1, None, {}, 4),  # a busy host, 14 CPUs free: the quota's 4
    (CpuFacts(64, quota=4.0, busy=62.0), 1, None, {}, 2),  # 2 free of the host: 2
    (CpuFacts(8), 3, None, {}, 2),  # 8 shared by 3 siblings: 8 // 3
    (CpuFacts(8, busy=2.0), 2, None, {}, 3),  # 6 free shared by 2
    (CpuFacts(2), 4, None, {}, 1),  # more siblings than CPUs: 1 each
    (CpuFacts(2, busy=2.0), 1, 4, {}, 4),  # --threads wins over everything
    (CpuFacts(8), 1, None, {"OMP_NUM_THREADS": "3"}, 3),  # the environment decides before the machine does
    (CpuFacts(8), 1, 2, {"OMP_NUM_THREADS": "3"}, 2),  # --threads before OMP_NUM_THREADS
    (CpuFacts(8, quota=2.0), 1, None, {"OMP_NUM_THREADS": "junk"}, 2),  # a value torch would not take: ignored
]


@pytest.mark.parametrize("facts, processes, explicit, env, threads", CASES)
def test_choose_threads(facts, processes, explicit, env, threads):
    assert choose_threads(facts, processes, explicit, env).threads == threads


def test_the_reason_says_where_the_count_came_from():
    assert choose_threads(CpuFacts(2, busy=1.0), env={}).reason == "2 CPUs allowed, 1.0 busy with other processes"
    assert choose_threads(CpuFacts(8, quota=2.0), 2, env={}).reason == ("8 CPUs allowed, cgroup quota 2 CPUs, "
                                                                        "shared by 2 processes")
    assert choose_threads(CpuFacts(8), explicit=3, env={}).reason == "as asked"
    assert choose_threads(CpuFacts(8), env={"OMP_NUM_THREADS": "1"}).reason == "from OMP_NUM_THREADS"


def test_cgroup_quota_reads_v2_up_the_tree(tmp_path):
    """The tightest cpu.max of the process's cgroup and its ancestors; a folder the container
    does not see is skipped."""
    (tmp_path / "cg" / "a" / "b").mkdir(parents=True)
    (tmp_path / "cg" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "cg" / "a" / "cpu.max").write_text("300000 100000\n")
    (tmp_path / "cg" / "a" / "b" / "cpu.max").write_text("max 100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("0::/a/b\n")
    assert cgroup_quota(tmp_path / "cg", proc) == 3.0
    proc.write_text("0::/elsewhere/x\n")  # its own folder not mounted here: the root's, no quota
    assert cgroup_quota(tmp_path / "cg", proc) is None


def test_cgroup_quota_reads_v1(tmp_path):
    cpu = tmp_path / "cg" / "cpu,cpuacct"
    cpu.mkdir(parents=True)
    (cpu / "cpu.cfs_quota_us").write_text("150000\n")
    (cpu / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/x\n3:cpu,cpuacct:/\n0::/\n")
    assert cgroup_quota(tmp_path / "cg", proc) == 1.5
    assert cgroup_quota(tmp_path / "cg", tmp_path / "missing") is None


def test_proc_stat_ticks_count_steal_as_busy_and_iowait_as_idle(tmp_path):
    stat = tmp_path / "stat"
    #                user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  9 9 9 9 9 9 9 9 9 9\n"
                    "cpu0 10 1 5 80 4 0 0 0 3 0\n"
                    "cpu1 1 0 1 90 0 0 0 8 0 0\n"
                    "cpu2 50 0 0 50 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    assert _cpu_ticks(stat, {0, 1}) == {0: (16, 100), 1: (10, 100)}  # cpu2: not ours


def test_use_threads_sets_torch_and_says_why(monkeypatch):
    before = torch.get_num_threads()
    said = []
    try:
        assert use_threads(1, log=said.append) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert use_threads(None, log=said.append) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert said == ["torch threads: 1 (as asked)", "torch threads: 2 (from OMP_NUM_THREADS)"]


@pytest.mark.parametrize("settings, workers, worker_threads, learner_threads", [
    ({}, 2, 4, None),  # synchronous, 8 CPUs, 2 workers: 4 each; the learner keeps the entry point's
    ({}, 0, None, None),  # no workers: nothing to split
    ({"max_off_policy_steps": 1}, 2, 1, 6),  # asynchronous: 1 per worker, the learner the 6 left
    ({"max_off_policy_steps": 1, "rollout": {"threads": 2}}, 3, 2, 2),  # 8 - 3 x 2
    ({"threads": 3}, 2, 3, 3),  # `threads` given: as before
])
def test_rl_splits_the_cpus_it_may_use_between_learner_and_workers(monkeypatch, settings, workers, worker_threads,
                                                                   learner_threads):
    """Rollout workers of a synchronous run used torch's default, every core each."""
    from flywheel.config import RLConfig, validate
    from flywheel.train import rl

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(rl, "cpu_facts", lambda measure_busy=True: CpuFacts(16, quota=8.0))
    monkeypatch.setattr(rl, "usable_cpus", lambda: 8)
    cfg = validate({"model": "m", "env": {"name": "calculator"}, **settings}, RLConfig)
    assert rl._worker_threads(cfg, workers) == worker_threads
    assert rl._learner_threads(cfg, workers) == learner_threads


def test_in_passing_thread_returns_raises_and_leaves_no_thread_behind():
    import asyncio
    import threading

    ran_on = []

    def work(x, *, y):
        ran_on.append(threading.current_thread())
        if x < 0:
            raise ValueError(f"x={x}")
        return x + y

    async def main():
        assert await in_passing_thread(work, 2, y=3) == 5
        with pytest.raises(ValueError, match="x=-1"):
            await in_passing_thread(work, -1, y=0)

    asyncio.run(main())
    assert len(ran_on) == 2 and all(t is not threading.main_thread() for t in ran_on)
    for t in ran_on:
        t.join(timeout=5)
        assert not t.is_alive()  # gone, and an OpenMP team it made with it
