"""What the sandbox costs: sandboxed `print(1+1)` on the warm pool against the same pool
without isolation, same run; cold starts and a plain subprocess as context.

Systems:
  warm        `SandboxPool.run_python`: a fork from a server already inside its bwrap sandbox
              (the path environments use);
  warm, bare  the same pool, forced onto its no-isolation backend: the same fork server and
              rlimits, no bwrap (the peer: what the work costs without the sandbox);
  cold        `Sandbox.run_python`, a new bwrap sandbox per call (context);
  plain       `subprocess.run([sys.executable, "-c", CODE])`, no isolation (context).

Each repeat runs `--calls` calls of each system back to back, in turn; the first repeat warms
up and is dropped. p50/p99 are over all kept calls of a system. `ratio` (the sandbox's own
overhead, lower is better, 1.0 = free) is the median over repeats of (warm p50 / warm-bare
p50) in that repeat, so drift of this shared machine between repeats cancels; `vs_plain` is
the same for plain p50 / warm p50, a comparison with a cold interpreter start, labelled as
such. Calls are issued one at a time from one client thread.

The two warm systems are the same server doing the same request, with one difference that
comes with isolation: inside bwrap the server is pid 1 of its own namespace and ends a
request's leftovers with one kill(-1), while the bare server, sharing the host's processes,
finds them by scanning /proc after every request. That scan grows with the machine's process
count, so a ratio below 1 means the bare peer's safety net costs more than bwrap does.
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
import warnings
from pathlib import Path
from unittest import mock

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


def bare_pool(size: int):
    """A SandboxPool on its no-isolation backend though bwrap works here: the backend probe is
    told bwrap is unavailable while the pool starts, and the pool is opted into running bare."""
    from flywheel.sandbox import SandboxPool, probe

    with mock.patch.object(probe, "unavailable_reason", lambda: "bench/sandbox.py: the bare peer"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = SandboxPool(size=size, unsafe=True)
    assert not pool.isolated
    return pool


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
    bare = bare_pool(args.pool_size)

    def plain():
        out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
        assert out.stdout == "2\n"

    def cold_call():
        r = cold.run_python(CODE)
        assert r.ok and r.stdout == "2\n", r

    def warm_call():
        r = pool.run_python(CODE)
        assert r.ok and r.stdout == "2\n", r

    def bare_call():
        r = bare.run_python(CODE)
        assert r.ok and r.stdout == "2\n", r

    systems = {"plain": plain, "cold": cold_call, "warm": warm_call, "bare": bare_call}
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
        bare.close()
    load1 = os.getloadavg()
    ratios = [w / b for w, b in zip(per_rep["warm"], per_rep["bare"])]
    vs_plain = [p / w for p, w in zip(per_rep["plain"], per_rep["warm"])]
    ms = {k: (1e3 * pct(v, 0.5), 1e3 * pct(v, 0.99)) for k, v in calls.items()}
    bw = subprocess.run([probe.find_bwrap(), "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Linux {platform.release()}, Python "
        f"{platform.python_version()}, {bw}; process limit via {probe.process_limit_mode()}; 1 client thread "
        f"issuing calls one at a time; load average {load0[0]:.2f} before, {load1[0]:.2f} after (other "
        f"processes share this machine). {args.repeats} repeats x {args.calls} calls per system after one "
        f"warm-up repeat; pool size {args.pool_size}.", "",
        "| system | p50 ms | p99 ms | p50 / warm-bare p50 |",
        "|---|---|---|---|",
    ]
    names = {"bare": "warm, bare: the same pool without bwrap (the peer)",
             "warm": "**warm: SandboxPool.run_python (fork in a started bwrap sandbox)**",
             "cold": "cold: Sandbox.run_python, bwrap per call (context)",
             "plain": "plain subprocess, no isolation, cold interpreter (context)"}
    for k in ("bare", "warm", "cold", "plain"):
        lines.append(f"| {names[k]} | {ms[k][0]:.2f} | {ms[k][1]:.2f} | {ms[k][0] / ms['bare'][0]:.2f}x |")
    lines += ["", f"ratio (the sandbox's own overhead) = median over repeats of warm p50 / warm-bare p50: "
              f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}). Context, not the "
              f"sandbox's cost: plain cold subprocess p50 / warm p50 = {statistics.median(vs_plain):.1f} "
              f"(range {min(vs_plain):.1f}-{max(vs_plain):.1f}), the gain of forking a started interpreter.",
              "", f"Pool requests served warm: {pool_stats['warm']} of {pool_stats['requests']} "
              f"(warm_share {pool_stats['warm_share']:.3f}; restarted {pool_stats['restarted']}); interpreter "
              f"prefix {sys.prefix}."]
    last = (f"sandbox: ratio={statistics.median(ratios):.2f} ratio_min={min(ratios):.2f} ratio_max={max(ratios):.2f} "
            f"warm_p50_ms={ms['warm'][0]:.2f} bare_p50_ms={ms['bare'][0]:.2f} "
            f"vs_plain={statistics.median(vs_plain):.2f} "
            f"warm_p99_ms={ms['warm'][1]:.2f} cold_p50_ms={ms['cold'][0]:.2f} cold_p99_ms={ms['cold'][1]:.2f} "
            f"plain_p50_ms={ms['plain'][0]:.2f} warm_share={pool_stats['warm_share']:.3f} "
            f"restarted={pool_stats['restarted']} threads=1")
    common.append_report("bench/sandbox.py: sandboxed print(1+1), cold and warm vs plain subprocess",
                         "\n".join(lines), last, write=not args.no_report)


if __name__ == "__main__":
    main()
