"""The learning tests under several seeds and CPU settings: does learning hold on any machine?

Runs `pytest -m slow` on the learning-outcome test files once per setting, each in a fresh
process with the setting's environment and FLYWHEEL_TEST_SEEDS="0 1 2": a test taking
`learning_seed` (tests/integration/conftest.py; the RL learning test) runs once per seed from
the session's shared warm start, the others at their own fixed seeds. Settings:
- default: the machine as it is;
- omp1 / omp2: OMP_NUM_THREADS=1 / 2 (torch's default thread count, where a test sets none);
- avx2: ONEDNN_MAX_CPU_ISA=AVX2, oneDNN's kernels limited to AVX2 as on an older CPU kind (the
  issue's stand-in; on this machine it left the warm start's SFT curve bit-identical, so it
  changes none of these models' arithmetic: bench/sft_curve.py);
- aten-avx2: ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2, torch's own vector
  kernels and MKL's matmuls limited to AVX2: this one does change the float rounding (the
  warm start's SFT jump moved from step 325 to 350), the closer stand-in for another CPU kind.
A test that passes under one setting and fails under another is a defect of the test or of its
recipe. Reported: per setting, the test cases passed / run and which failed, and minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SETTINGS = {"default": {}, "omp1": {"OMP_NUM_THREADS": "1"}, "omp2": {"OMP_NUM_THREADS": "2"},
            "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
            "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
LEARNING_TESTS = ["tests/integration/test_rl_learning.py", "tests/integration/test_rl_calculator.py",
                  "tests/integration/test_sft.py", "tests/integration/test_dpo.py",
                  "tests/integration/test_rl_lora.py"]
_FAILED = re.compile(r"^FAILED (\S+)", re.M)
_COUNTS = re.compile(r"(\d+) (passed|failed|error|errors|skipped)")


def run(setting: str, seeds: list[int], tests: list[str]) -> tuple[int, int, list[str], float]:
    """(passed, run, failed test ids, minutes) of one pytest process."""
    env = {**os.environ, **SETTINGS[setting], "FLYWHEEL_TEST_SEEDS": " ".join(map(str, seeds))}
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "slow", "-p", "no:cacheprovider", *tests],
                          cwd=common.ROOT, env=env, capture_output=True, text=True)
    minutes = (time.perf_counter() - t0) / 60
    tail = done.stdout[-4000:]
    counts = {kind: int(n) for n, kind in _COUNTS.findall(tail.splitlines()[-1] if tail.strip() else "")}
    failed = _FAILED.findall(done.stdout)
    passed = counts.get("passed", 0)
    ran = passed + counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if ran == 0:
        failed = failed or [f"no test ran (pytest exit {done.returncode}): {tail[-300:]!r}"]
    return passed, ran, failed, minutes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--tests", nargs="+", default=LEARNING_TESTS)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    rows, all_passed, all_run = [], 0, 0
    for setting in args.settings:
        passed, ran, failed, minutes = run(setting, args.seeds, args.tests)
        all_passed, all_run = all_passed + passed, all_run + ran
        rows.append(f"| {setting} | {passed}/{ran} | {', '.join(failed) or '-'} | {minutes:.1f} |")
        print(rows[-1], flush=True)
    body = "\n".join([
        f"Machine: {common.machine_line(0).rsplit(',', 1)[0]}. Tests: {', '.join(args.tests)} (`-m slow`). "
        "Settings: " + "; ".join(f"{k}: {' '.join(f'{a}={b}' for a, b in v.items()) or 'as is'}"
                                 for k, v in SETTINGS.items() if k in args.settings) + ".", "",
        f"FLYWHEEL_TEST_SEEDS: {' '.join(map(str, args.seeds))}.", "",
        "| setting | test cases passed / run | failed | minutes |", "|---|---|---|---|", *rows])
    last = (f"learning_matrix: passed={all_passed} run={all_run} settings={len(args.settings)} "
            f"seeds={len(args.seeds)} all_pass={int(all_passed == all_run and all_run > 0)}")
    common.append_report("bench/learning_matrix.py: the learning tests across seeds and CPU settings", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
