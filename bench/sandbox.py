"""Sandboxed `print(1+1)`: cold bwrap (a new `Sandbox.run_python` each call) and warm
(`SandboxPool.run_python`, a fork from a server already inside its sandbox) against plain
`subprocess.run([sys.executable, "-c", "print(1+1)"])` with no isolation, same run.

Each repeat runs `--calls` calls of each system back to back (plain, cold, warm, in turn); the
first repeat warms up and is dropped. p50/p99 are over all kept calls of a system; `ratio` is
the median over repeats of (plain p50 / warm p50) in that repeat, so drift of this shared
machine between repeats cancels. Calls are issued one at a time from one client thread.
`warm_share` is the share of pool requests (warm-up repeat included) served by an already-started
sandbox, from `SandboxPool.stats()`: 1.0 unless sandboxes had to be restarted (one that cannot get
clean restarts on every request, see docs/security.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

CODE = "print(1+1)"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=40, help="calls per repeat and system")
    ap.add_argument("--pool-size", type=int, default=2)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()

    from flywheel.sandbox import Sandbox, SandboxPool, probe, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"sandbox unavailable here: {reason}")
    cold = Sandbox()
    pool = SandboxPool(size=args.pool_size)

    def plain():
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
        assert out.stdout == "2\n"

    def cold_call():
        r = cold.run_python(CODE)
        assert r.ok and r.stdout == "2\n", r

    def warm_call():
        r = pool.run_python(CODE)
        assert r.ok and r.stdout == "2\n", r

    systems = {"plain": plain, "cold": cold_call, "warm": warm_call}
    calls: dict[str, list[float]] = {k: [] for k in systems}
    per_rep: dict[str, list[float]] = {k: [] for k in systems}
    load0 = os.getloadavg()
    try:
        for rep in range(args.repeats + 1):
            for name, fn in systems.items():
                ts = timed(fn, args.calls)
                if rep == 0:
                    continue
                calls[name] += ts
                per_rep[name].append(statistics.median(ts))
        pool_stats = pool.stats()
    finally:
        pool.close()
    load1 = os.getloadavg()
    ratios = [p / w for p, w in zip(per_rep["plain"], per_rep["warm"])]
    ms = {k: (1e3 * pct(v, 0.5), 1e3 * pct(v, 0.99)) for k, v in calls.items()}
    bw = subprocess.run([probe.find_bwrap(), "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}, {bw}; process limit via {probe.process_limit_mode()}; 1 client thread "
        f"issuing calls one at a time; load average {load0[0]:.2f} before, {load1[0]:.2f} after (other "
        f"processes share this machine). {args.repeats} repeats x {args.calls} calls per system after one "
        f"warm-up repeat; pool size {args.pool_size}.", "",
        "| system | p50 ms | p99 ms | p50 / warm p50 |",
        "|---|---|---|---|",
    ]
    names = {"plain": "plain subprocess, no isolation", "cold": "cold: Sandbox.run_python (bwrap per call)",
             "warm": "warm: SandboxPool.run_python (fork in a started sandbox)"}
    for k in ("plain", "cold", "warm"):
        lines.append(f"| {names[k]} | {ms[k][0]:.2f} | {ms[k][1]:.2f} | {ms[k][0] / ms['warm'][0]:.1f}x |")
    lines += ["", f"ratio = median over repeats of plain p50 / warm p50: {statistics.median(ratios):.1f} "
              f"(range {min(ratios):.1f}-{max(ratios):.1f}). Targets: warm p50 <= 3 ms, ratio >= 5.",
              "", f"Pool requests served warm: {pool_stats['warm']} of {pool_stats['requests']} "
              f"(warm_share {pool_stats['warm_share']:.3f}; restarted {pool_stats['restarted']}); interpreter "
              f"prefix {sys.prefix}."]
    last = (f"sandbox: warm_p50_ms={ms['warm'][0]:.2f} ratio={statistics.median(ratios):.2f} "
            f"warm_p99_ms={ms['warm'][1]:.2f} cold_p50_ms={ms['cold'][0]:.2f} cold_p99_ms={ms['cold'][1]:.2f} "
            f"plain_p50_ms={ms['plain'][0]:.2f} warm_share={pool_stats['warm_share']:.3f} "
            f"restarted={pool_stats['restarted']} threads=1")
    common.append_report("bench/sandbox.py: sandboxed print(1+1), cold and warm vs plain subprocess",
                         "\n".join(lines), last, write=not args.no_report)


if __name__ == "__main__":
    main()
