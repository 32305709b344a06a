"""Retention: what a loop's data_dir keeps once work is done, so that its disk use stays bounded.

Three things fill a data_dir: the checkpoints of training stages (weights plus trainer state:
optimizer, scheduler, RNG, data cursor; AdamW alone holds two moments per weight), the model
folders of finished cycles' stages, and the registry's copy of every candidate. The `retention`
section of the loop config (RetentionConfig) bounds each:

- a running stage keeps `keep_checkpoints` checkpoints (unless its own `checkpoint.keep` is set;
  `stage_config` applies it). Each one is complete by construction (written, then renamed), so
  one is enough to resume;
- once a stage has finished (it is in the saved cycle state's `stages_run`, so no resume runs it
  again), `drop_optimizer_state` deletes the trainer state from its checkpoints (`after_stage`).
  Its `final/` model stays: the next stage starts from it, and the last one is the candidate
  that evaluation reads and `_finish` registers;
- once a cycle has finished (its state saved as finished, the candidate in the registry), its
  stage folders lose their model folders, `checkpoints/` and `final/`, unless
  `keep_stage_models` (`after_cycle`). What stays: state.json, data/ (what was curated and
  trained on), each stage's metrics.jsonl, rollouts.jsonl and logs;
- rejected versions beyond the newest `keep_rejected` lose their model files in the registry
  (`Registry.prune`): their record, scores, reasons, lineage and history stay, marked pruned.
  Production, the version a rollback would restore, an unfinished cycle's incumbent and any
  version not rejected keep theirs.

Crash safety: each pass runs only after the state that makes it safe is on disk, deletes only
what no resume reads, renames a folder to a hidden `.tmp-*` name before removing it, and looks
at every finished stage or cycle, not only the latest: a pass killed midway is completed by the
next one. A file that cannot be removed is logged and left for the next pass (disk is no reason
to stop a loop whose cycle is done). The rules are the pure functions below; the passes apply
them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

from pydantic import Field

from flywheel.config import Config

STAGE_MODEL_DIRS = ("checkpoints", "final")  # what a finished cycle's stage folder loses


class RetentionConfig(Config):
    keep_checkpoints: int = Field(1, ge=1, description=(
        "checkpoints a running stage keeps (train.<stage>.checkpoint.keep wins where set); each is "
        "complete on disk, so one is enough to resume"))
    drop_optimizer_state: bool = Field(True, description=(
        "once a stage has finished, delete the trainer state (optimizer, scheduler, RNG) from its "
        "checkpoints: nothing resumes a finished stage"))
    keep_stage_models: bool = Field(False, description=(
        "keep a finished cycle's stage models (checkpoints/, final/); false: the registry's copy of "
        "the candidate is the one kept, with the stages' metrics, logs, curated data and state"))
    keep_rejected: int | None = Field(3, ge=0, description=(
        "rejected versions whose model files the registry keeps, newest first; older ones are pruned "
        "(record, scores, lineage and history stay); null: keep them all"))


# ---------------------------------------------------------------------------- the rules (pure)


def with_checkpoint_keep(stage: Mapping[str, Any], keep: int) -> dict[str, Any]:
    """A stage's config mapping with `checkpoint.keep = keep`, unless it sets its own (or its
    `checkpoint` is not a mapping, which validation then names)."""
    ckpt = stage.get("checkpoint", {})
    if not isinstance(ckpt, Mapping) or "keep" in ckpt:
        return dict(stage)
    return {**stage, "checkpoint": {**ckpt, "keep": keep}}


def finished_stages(stages_run: Iterable[Mapping[str, Any]]) -> list[str]:
    """The stages of a cycle state's `stages_run` that ran to the end (not the skipped ones)."""
    return [s["stage"] for s in stages_run if "skipped" not in s]


def stage_model_dirs(cycle_dir: Path, stages: Iterable[str]) -> list[Path]:
    """The model folders of a finished cycle's `stages` (every stage its state names, skipped
    ones too: a stage started, cut short and then skipped for budget has a folder), whether
    they exist or not."""
    return [Path(cycle_dir) / stage / name for stage in sorted(stages) for name in STAGE_MODEL_DIRS]


def rejected_to_prune(versions: Sequence[tuple[str, str]], keep: int, protected: Collection[str]) -> list[str]:
    """Ids to prune: the rejected versions older than the newest `keep` rejected ones, less the
    `protected` ids. `versions`: (id, status) in registration order."""
    rejected = [vid for vid, status in versions if status == "rejected"]
    older = rejected[:len(rejected) - keep] if keep else rejected
    return [vid for vid in older if vid not in protected]


# ---------------------------------------------------------------------------- measuring


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (or of the file), each hard-linked file counted once;
    0 when it does not exist."""
    path, seen, total = Path(path), set(), 0
    if path.is_file():
        return path.stat().st_size
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed while we walked
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def human_bytes(n: int) -> str:
    """`n` bytes as `532 B`, `17.3 MB`, `1.20 GB` (powers of 1000)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------- the passes


def remove(path: Path) -> int:
    """Delete a folder (renamed to a hidden `.tmp-*` name first, so a half-removed folder never
    keeps its name) or a file; returns the bytes freed, 0 when it is not there."""
    path = Path(path)
    if not path.exists():
        return 0
    freed = tree_bytes(path)
    if path.is_dir():
        hidden = path.parent / f".tmp-retention-{path.name}"
        shutil.rmtree(hidden, ignore_errors=True)
        os.rename(path, hidden)
        shutil.rmtree(hidden)
    else:
        path.unlink()
    return freed


def _removed(path: Path, log: Callable[[str], None]) -> int:
    try:
        return remove(path)
    except OSError as e:
        log(f"retention: cannot remove {path} ({e}); the next pass tries again")
        return 0


def after_stage(cfg: RetentionConfig, cycle_dir: Path, stages_run: Sequence[Mapping[str, Any]],
                log: Callable[[str], None]) -> int:
    """Drop the trainer state of every finished stage's checkpoints (`drop_optimizer_state`);
    call it once the cycle state recording the stage as finished is saved. Returns bytes freed."""
    from flywheel.train.checkpoint import STATE_FILE

    if not cfg.drop_optimizer_state:
        return 0
    freed = sum(_removed(f, log) for stage in finished_stages(stages_run)
                for f in sorted((Path(cycle_dir) / stage / "checkpoints").glob(f"step_*/{STATE_FILE}")))
    _log(log, Path(cycle_dir).name, {"optimizer state": freed})
    return freed


def after_cycle(cfg: RetentionConfig, cycles_dir: Path, states: Sequence[Any], registry,
                log: Callable[[str], None]) -> dict[str, int]:
    """Slim every finished cycle's stage folders (unless `keep_stage_models`) and prune the
    registry's rejected versions beyond `keep_rejected`; call it once the latest cycle's state is
    saved as finished. `states`: the CycleStates (their `id`, `done`, `stages_run`, `incumbent`;
    an unfinished cycle's incumbent is never pruned). Returns the bytes freed by kind ("stage
    models", "rejected models")."""
    freed = {"stage models": 0, "rejected models": 0}
    if not cfg.keep_stage_models:
        for st in (st for st in states if st.done):
            folder = Path(cycles_dir) / st.id
            stages = {s["stage"] for s in st.stages_run}
            leftovers = [p for stage in sorted(stages) for p in (folder / stage).glob(".tmp-*")]
            freed["stage models"] += sum(_removed(p, log) for p in stage_model_dirs(folder, stages) + leftovers)
    if cfg.keep_rejected is not None:
        running = {st.incumbent for st in states if not st.done}
        freed["rejected models"] = prune_rejected(registry, cfg.keep_rejected, running, log)
    _log(log, states[-1].id if states else "", freed)
    return freed


def prune_rejected(registry, keep: int, protect: Collection[str] = (), log: Callable[[str], None] = print) -> int:
    """Prune the registry's rejected versions beyond the newest `keep` (`rejected_to_prune`),
    never production, the version a rollback would restore or those in `protect`; a pruned
    version whose folder a crash left behind is pruned again. Returns the bytes freed."""
    versions = registry.list()
    prod = registry.production()
    protected = {v for v in (prod.id if prod else None, registry.rollback_target(), *protect) if v}
    by_id = {v.id: v for v in versions}
    freed = 0
    for vid in rejected_to_prune([(v.id, v.status) for v in versions], keep, protected):
        v = by_id[vid]
        if v.pruned and not v.path.exists():
            continue
        on_disk = tree_bytes(v.path)
        try:
            registry.prune(vid, f"retention.keep_rejected={keep}: older than the newest {keep} rejected versions")
        except OSError as e:
            log(f"retention: cannot remove the files of {vid} ({e}); the next pass tries again")
            continue
        freed += on_disk
    return freed


def _log(log: Callable[[str], None], cycle: str, freed: Mapping[str, int]) -> None:
    if any(freed.values()):
        log(f"{cycle}: retention freed " + ", ".join(f"{human_bytes(n)} of {kind}" for kind, n in freed.items() if n))
