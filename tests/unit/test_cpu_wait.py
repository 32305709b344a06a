"""The oversubscription warning (flywheel/cpu_wait.py): run-queue delay from schedstat, a
fake /proc/self/task tree and a fake clock; and once on this machine's real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from flywheel.cpu_wait import CpuOversubscribed, CpuWait, advice, thread_times, wait_share


class FakeTasks:
    """A /proc/self/task folder whose threads' schedstat the test moves on."""

    def __init__(self, root: Path, threads: int = 2):
        self.root, self.times = root, {str(100 + i): [0, 0] for i in range(threads)}
        self.write()

    def write(self) -> None:
        for tid, (run, wait) in self.times.items():
            (self.root / tid).mkdir(parents=True, exist_ok=True)
            (self.root / tid / "schedstat").write_text(f"{run} {wait} 7\n")

    def advance(self, run: int, wait: int) -> None:
        """Every thread runs `run` ns and waits `wait` ns more."""
        for t in self.times.values():
            t[0] += run
            t[1] += wait
        self.write()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_wait_share_by_hand():
    assert wait_share((0, 0), (300, 100)) == 0.25
    assert wait_share((100, 50), (400, 350)) == 0.5  # 300 ran, 300 waited
    assert wait_share((5, 5), (5, 5)) == 0.0


def test_thread_times_sum_the_threads(tmp_path):
    tasks = FakeTasks(tmp_path, threads=3)
    tasks.advance(run=10, wait=4)
    assert thread_times(tmp_path) == (30, 12)
    assert thread_times(tmp_path / "none") is None


def test_it_warns_once_when_the_threads_wait_a_fifth_of_their_time(tmp_path):
    tasks, clock = FakeTasks(tmp_path), Clock()
    watch = CpuWait(first_steps=3, window_s=10.0, tasks=tmp_path, clock=clock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            tasks.advance(run=900, wait=100)
            watch.after_step(step)
        tasks.advance(run=900, wait=100)
        watch.after_step(3)  # the first check: 10% waiting over steps 1-3, quiet
        assert caught == [] and watch.warned is None
        for step in range(4, 9):  # 70% running, 30% waiting, but the window is not over yet
            clock.now += 1.0
            tasks.advance(run=700, wait=300)
            watch.after_step(step)
        assert caught == []
        clock.now += 10.0
        tasks.advance(run=700, wait=300)
        watch.after_step(9)  # the window 4-9: 30% waiting
        for step in range(10, 40):  # it warned already: once per run
            clock.now += 10.0
            tasks.advance(run=100, wait=900)
            watch.after_step(step)
    assert [w.category for w in caught] == [CpuOversubscribed]
    assert watch.warned == pytest.approx(0.3)
    assert "over steps 4-9 this process's threads waited for a CPU 30% of the time" in str(caught[0].message)


def test_no_schedstat_no_warning(tmp_path):
    watch = CpuWait(first_steps=1, tasks=tmp_path / "missing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(1, 5):
            watch.after_step(step)
    assert watch.warned is None


def test_the_advice_names_the_remedy():
    many = advice(0.4, threads=4, cpus=4, steps=(1, 10))
    assert "4 torch threads, 4 CPUs allowed" in many and "--threads 2" in many and "threads=2" in many
    one = advice(0.4, threads=1, cpus=2, steps=(1, 10))
    assert "--threads" not in one and "stop them" in one


@pytest.mark.skipif(not Path("/proc/self/task").exists() or thread_times() is None, reason="no schedstat here")
def test_a_thread_pool_larger_than_its_cpus_waits():
    """On this kernel: 3 busy threads per allowed CPU (hashing, which releases the GIL) must
    wait about two thirds of their runnable time, whatever else runs."""
    cpus = len(os.sched_getaffinity(0))
    code = ("import hashlib, threading, time\nfrom flywheel.cpu_wait import thread_times, wait_share\n"
            "data = bytes(1 << 20)\n"
            "def spin():\n    t = time.monotonic()\n    while time.monotonic() - t < 1.0: hashlib.sha256(data)\n"
            f"a = thread_times()\nts = [threading.Thread(target=spin) for _ in range({3 * cpus})]\n"
            "[t.start() for t in ts]; [t.join() for t in ts]\nprint(wait_share(a, thread_times()))\n")
    share = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                                 check=True).stdout)
    assert share > 0.4, share  # an idle machine: about 2/3


@pytest.mark.skipif(thread_times() is None, reason="no schedstat here")
def test_the_sft_loop_reports_its_waiting(tmp_path, monkeypatch):
    """run_sft calls the watch after each step: with a threshold of 0 it must warn at step 2."""
    import json

    import flywheel.train.sft as sft
    from flywheel.config import SFTConfig, validate
    from flywheel.models import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path / "m", TinySpec(hidden=16, layers=1, heads=2, ffn=32))
    monkeypatch.setattr(sft, "CpuWait", lambda: CpuWait(first_steps=2, threshold=0.0))
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    cfg = validate({"model": str(model), "output_dir": str(tmp_path / "run"), "data": {"train": [str(data)]},
                    "train": {"steps": 3, "batch_size": 1, "micro_batch_size": 1}, "log": {"progress": False},
                    "threads": 1}, SFTConfig)
    with pytest.warns(CpuOversubscribed, match=r"over steps 1-2 this process's threads waited"):
        sft.run_sft(cfg, log=lambda m: None)
