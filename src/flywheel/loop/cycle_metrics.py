"""A finished cycle's figures as one metrics row, to the sinks the loop config's `log` lists.

The row's step is the cycle's number (`c7` -> 7), so W&B, MLflow and TensorBoard chart the
loop over cycles: one run for the data_dir (run name `loop-<data_dir name>` unless
log.run_name), resumed by the next process as a training run is. The JSONL copy is
`<data_dir>/cycle_metrics.jsonl`; a cycle logged twice (a crash before its state said
finished) leaves one row, the later (train/sinks/jsonl.py moves the earlier aside).

Row keys (numbers only reach the sinks; `cycle` and `outcome` are JSONL only):
    gate/promoted 0|1, gate/gain, gate/delta/<suite>, gate/bound/<suite>
    score/incumbent/<suite>, score/candidate/<suite>   (accuracy on each suite)
    stage/<sft|rl|dpo>/{examples,steps,seconds,skipped}, seconds/evaluate, usd, new_failures
"""

from __future__ import annotations

from typing import Any

from flywheel.loop.loop_config import LoopConfig
from flywheel.train.metrics import MetricsWriter

FILE = "cycle_metrics.jsonl"


def cycle_number(cycle_id: str) -> int:
    return int(cycle_id.lstrip("c"))


def cycle_figures(st: Any) -> dict[str, Any]:
    """The row of CycleState `st` (loop/cycle.py), finished or waiting."""
    row: dict[str, Any] = {"cycle": st.id, "outcome": st.outcome, "usd": st.usd, "new_failures": st.new_failures}
    decision = st.decision or {}
    if "promote" in decision:
        row["gate/promoted"] = int(bool(decision["promote"]))
    if isinstance(decision.get("gain"), (int, float)):
        row["gate/gain"] = decision["gain"]
    for kind, key in (("delta", "deltas"), ("bound", "bounds")):
        row.update({f"gate/{kind}/{suite}": v for suite, v in (decision.get(key) or {}).items()})
    for who, scores in st.scores.items():
        row.update({f"score/{who}/{suite}": v for suite, v in scores.items()})
    for stage in st.stages_run:
        name = stage["stage"]
        row[f"stage/{name}/skipped"] = int("skipped" in stage)
        row.update({f"stage/{name}/{k}": stage[k] for k in ("examples", "steps", "seconds") if k in stage})
    row.update({f"seconds/{k}": v for k, v in st.seconds.items()})
    return row


def log_cycle(cfg: LoopConfig, st: Any) -> None:
    """Write `st`'s row when the loop config has a `log` section (none: nothing is written);
    the loop config is the W&B config / MLflow params of the loop's run."""
    if cfg.log is None:
        return
    n = cycle_number(st.id)
    writer = MetricsWriter.for_run(cfg.root / FILE, cfg.log, start_step=n - 1, config=cfg,
                                   run_name=f"loop-{cfg.root.resolve().name}")
    try:
        writer.log(n, **cycle_figures(st))
    finally:
        writer.close()
