"""One fine-tuning job's training, in a process of its own: `python -m flywheel.worker.job_run
JOB_DIR`, started by a worker (worker/job_worker.py).

Reads JOB_DIR/run.json (`{"kind": "sft" | "dpo" | "rl", "config": {...}}`: a flywheel run config),
trains with flywheel's recipe, resuming from the newest checkpoint in the config's
output_dir, and writes JOB_DIR/result.json: `{"final_model", "steps", "tokens_trained",
"interrupted"}`, or `{"error": message}` with exit status 1 when the run failed.
A managed flywheel's cycle is `{"kind": "cycle", "config": a LoopConfig, "scope": its
TraceScope}`: it runs (or resumes) one cycle and writes `{"cycle": the cycle's state,
"production": {"version", "path"}, "cursor": where the production version's new failures
start}`. SIGTERM asks
the run to stop after its step (it checkpoints, `interrupted: true`): how the worker cancels
and pauses. The process dies with its worker (PR_SET_PDEATHSIG). A worker forks it from its
pre-imported zygote (worker/zygote.py) rather than starting this module afresh.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from flywheel.config import ConfigError, DPOConfig, RLConfig, SFTConfig, validate
from flywheel.files import atomic_write
from flywheel.process import die_with_parent
from flywheel.threads import use_threads
from flywheel.train.stop import request_stop

RECIPES = {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig}


def run(job_dir: Path) -> int:
    spec = json.loads((job_dir / "run.json").read_text(encoding="utf-8"))
    kind = spec["kind"]
    if kind == "cycle":
        return _cycle(job_dir, spec)
    try:
        cfg = validate(spec["config"], RECIPES[kind])
        # the worker's --threads, else the CPUs this process may use less those busy (threads.py)
        use_threads(cfg.threads, log=lambda m: print(m, flush=True))
        if kind == "sft":
            from flywheel.train.sft import run_sft as recipe
        elif kind == "dpo":
            from flywheel.train.dpo import run_dpo as recipe
        else:
            from flywheel.train.rl import run_rl as recipe
        result = recipe(cfg, log=lambda m: print(m, flush=True))
    except (ConfigError, ValueError, RuntimeError, OSError) as exc:  # the run's own refusals: a job error
        _write(job_dir, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _write(job_dir, {"final_model": str(result.final_model) if result.final_model else None, "steps": result.steps,
                     "tokens_trained": result.tokens_trained, "interrupted": result.interrupted})
    return 0


def _cycle(job_dir: Path, spec: dict) -> int:
    from dataclasses import asdict

    from flywheel.loop.cycle import CycleError, LoopStores, run_cycle
    from flywheel.loop.loop_config import LoopConfig
    from flywheel.traces.scope import TraceScope

    try:
        cfg = validate(spec["config"], LoopConfig)
        # chosen as for a job; a stage's `threads`, where set, replaces it (train/run_state.py)
        use_threads(None, log=lambda m: print(m, flush=True))
        with LoopStores(cfg, TraceScope.from_dict(spec["scope"])) as fw:
            st = run_cycle(fw, log=lambda m: print(m, flush=True), tag=spec.get("job_id"))
            prod = fw.registry.production()
            window = fw.production_window()
    except (ConfigError, CycleError, ValueError, RuntimeError, OSError) as exc:
        _write(job_dir, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    _write(job_dir, {"cycle": asdict(st), "production": {"version": prod.id, "path": str(prod.path)},
                     "cursor": window[1] if window is not None else None})
    return 0


def _write(job_dir: Path, result: dict) -> None:
    atomic_write(job_dir / "result.json", json.dumps(result).encode())


JOB_NICE = 10  # training's CPU priority below the server's (nice 0): requests are the foreground


def background_priority() -> None:
    """This process as background work: nice JOB_NICE and, where Linux has it, SCHED_BATCH
    (no wake-up preemption of interactive work). When the server and a job both want a core,
    the server gets it; alone, the job still gets all of it."""
    try:
        os.nice(max(0, JOB_NICE - os.nice(0)))  # never raises a priority
    except OSError:
        pass
    if hasattr(os, "SCHED_BATCH"):
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass


def child_main(job_dir: Path) -> int:
    """The training process's life: background priority, it dies with its parent, SIGTERM asks
    for a stop at a checkpoint; returns the exit status (a process of its own, or a fork of
    worker/zygote.py)."""
    background_priority()
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: request_stop())
    return run(job_dir)


def main() -> None:
    sys.exit(child_main(Path(sys.argv[1])))


if __name__ == "__main__":
    main()
