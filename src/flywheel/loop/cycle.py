"""One flywheel cycle, from the production model to a promoted or rejected candidate.

    started   -> the incumbent (production version) and the trace cursor are fixed
    curated   -> traces with seq <= cursor curated into RL / SFT / DPO files (curation.py);
                 held-out RL tasks from traces after the incumbent's own cursor are the
                 *new-failure* suite (failures of the model now serving). Fewer than
                 gate.min_new_failures of them: finished, "waiting for more traffic" (nothing
                 is trained; the next cycle's suite holds these failures and the newer ones)
    trained   -> SFT -> RL -> DPO (configurable order), each from the previous model
    evaluated -> incumbent and candidate scored on the regression suites + new failures,
                 task by task (the per-task outcomes are kept in the state)
    decided   -> the gate (gate.py), also against the best score a promoted version reached
                 on each frozen suite (best_scores.py, from the registry's records)
    finished  -> candidate registered (idempotent key) with both models' scores and per-task
                 outcomes, promoted or rejected, outcome logged

The state is one JSON file per cycle (`<data_dir>/cycles/<id>/state.json`), replaced
atomically after each stage, so a SIGKILL anywhere leaves the last finished stage on disk.
`run_cycle` resumes an unfinished cycle before it starts a new one (and, given the `tag` of
a cycle that already finished last, returns that one): training stages resume
from their checkpoints, evaluation reruns, registration is keyed, and promotion checks the
registry's history first, so no step is done twice and no trace is lost (traces are only
read; the cursor only decides which ones a cycle sees).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from flywheel.clock import utc_now
from flywheel.closing import Closing
from flywheel.crash_points import crash_point
from flywheel.economics.catalog import load_catalog
from flywheel.economics.ledger import Ledger, append_line
from flywheel.economics.reports import CycleOutcome
from flywheel.envs.replay import ReplayEnvironment
from flywheel.files import atomic_write
from flywheel.loop.curation import curate, dropped_summary, write_curated
from flywheel.loop.cycle_metrics import log_cycle
from flywheel.loop.evaluation import Suite, evaluate_model, format_warnings, suite_from_config
from flywheel.loop.failure_counter import FailureCounter
from flywheel.loop.best_scores import best_promoted
from flywheel.loop.gate import decide, too_few
from flywheel.loop.paired import Outcomes
from flywheel.loop.loop_config import LoopConfig, stage_config
from flywheel.loop.retention import after_cycle, after_stage
from flywheel.registry.registry import Registry
from flywheel.traces.scope import ScopedTraces, TraceScope
from flywheel.traces.store import TraceStore
from flywheel.train.dpo import run_dpo
from flywheel.train.rl import run_rl
from flywheel.train.sft import run_sft
from flywheel.train.stop import stop_requested

STAGES = ("started", "curated", "trained", "evaluated", "decided", "finished")
NEW_FAILURES_FILE = "new_failures.jsonl"
WAITING = "waiting for more traffic"  # the outcome of a cycle with too few new failures to decide


class CycleError(RuntimeError):
    """A cycle cannot start or go on; the message says why and what to do."""


@dataclass
class CycleState:
    id: str
    stage: str
    started_at: str
    incumbent: str  # registry version id of the production model at the start
    incumbent_path: str
    trace_cursor: int  # this cycle reads traces with seq <= trace_cursor
    since_cursor: int  # failures after this seq are the incumbent's own ("new")
    curation: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    new_failures: int = 0
    stages_run: list[dict[str, Any]] = field(default_factory=list)
    candidate_path: str | None = None
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # "incumbent" / "candidate" -> suite -> acc
    # "incumbent" / "candidate" -> suite -> paired.Outcomes.record (pass/fail per task, one bit each)
    outcomes: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    task_ids: dict[str, list[str]] = field(default_factory=dict)  # suite -> task ids, in the outcomes' order
    decision: dict[str, Any] = field(default_factory=dict)
    version: str | None = None  # the registered candidate
    outcome: str | None = None  # promoted | rejected | nothing to train | waiting for more traffic
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall seconds
    usd: float = 0.0
    finished_at: str | None = None
    warnings: list[str] = field(default_factory=list)  # what a user should know of this cycle's evidence
    tag: str | None = None  # who started it (a managed flywheel's cycle: its job id)

    @property
    def done(self) -> bool:
        return self.stage == "finished"


def read_states(cycles_dir: Path) -> list[CycleState]:
    """Every cycle's state under `cycles_dir`, in cycle order (c1, c2, ... c10)."""
    out = []
    for path in sorted(Path(cycles_dir).glob("c*/state.json"), key=lambda p: int(p.parent.name[1:])):
        try:
            out.append(CycleState(**json.loads(path.read_text(encoding="utf-8"))))
        except (ValueError, TypeError) as e:
            raise CycleError(f"{path}: unreadable cycle state ({e}); move the folder aside to go on") from None
    return out


WINDOW_FILE = "production-window.json"  # {"version", "cursor"}: LoopStores.observe_production


class LoopStores(Closing):
    """The loop's state stores, opened from a LoopConfig: traces, registry, ledger, cycles.
    `scope`: the traces the loop sees (a managed flywheel's: one tenant's, of its model
    names); None, every trace of the store (the single-tenant daemon)."""

    def __init__(self, cfg: LoopConfig, scope: TraceScope | None = None):

        # read once, when the loop opens: a bad anchor file fails here, not in every cycle
        self.anchor = read_anchor_rows(cfg.train.anchor_data) if cfg.train.anchor_rows else []
        self.cfg = cfg
        self.root = cfg.root
        self.cycles_dir = self.root / "cycles"
        self.cycles_dir.mkdir(parents=True, exist_ok=True)
        self._stack = ExitStack()
        store = TraceStore(cfg.trace_url)
        self.traces = store if scope is None else ScopedTraces(store, scope)
        self._stack.callback(store.close)
        self.registry = Registry(self.root / "registry")
        self._stack.callback(self.registry.close)
        self.ledger = Ledger(self.root / "ledger.jsonl")
        self.outcomes_path = self.root / "cycles.jsonl"

    def close(self) -> None:
        self._stack.close()

    # ---- cycle states

    def states(self) -> list[CycleState]:
        return read_states(self.cycles_dir)

    def save(self, st: CycleState) -> None:
        folder = self.cycles_dir / st.id
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "state.json", (json.dumps(asdict(st), indent=2, sort_keys=True) + "\n").encode())

    def folder(self, st: CycleState) -> Path:
        return self.cycles_dir / st.id

    def since_cursor(self, incumbent: str) -> int:
        """Where `incumbent`'s own failures start: the trace cursor when it was first seen in
        production (`observe_production`), whoever promoted it; for the first version observed,
        or one never observed, the cursor of the cycle that produced it (0 for a model from
        outside)."""
        window = self.production_window()
        if window is not None and window[0] == incumbent:
            return window[1]
        return self._cycle_cursor(incumbent)

    def _cycle_cursor(self, version: str) -> int:
        for st in reversed(self.states()):
            if st.version == version:
                return st.trace_cursor
        return 0

    def no_production(self) -> str:
        """The error for a store with nothing in production, naming the registry it read."""
        r, d = self.registry.root, self.root.resolve()
        return (f"no production model in the registry {r}: register one and promote it first "
                f"(flywheel registry register DIR --data-dir {d}, then flywheel registry promote v1 "
                f"--data-dir {d})")

    def production_window(self) -> tuple[str, int] | None:
        """(version, trace cursor) recorded when that version was first seen in production."""
        path = self.root / WINDOW_FILE
        if not path.exists():
            return None
        w = json.loads(path.read_text())
        return w["version"], int(w["cursor"])

    def observe_production(self) -> str | None:
        """Record where the production version's new-failure window starts the first time it is
        seen in production (after a cycle's promotion, a manual promote or a rollback); returns
        what changed, or None."""
        prod = self.registry.production()
        window = self.production_window()
        if prod is None or (window is not None and window[0] == prod.id):
            return None
        # the first version ever observed keeps the older rule: when it was promoted is unknown
        cursor = self._cycle_cursor(prod.id) if window is None else self.traces.max_seq()
        atomic_write(self.root / WINDOW_FILE,
                     (json.dumps({"version": prod.id, "cursor": cursor}) + "\n").encode())
        return (f"production is {prod.id} (was {window[0] if window else 'not recorded'}): "
                f"its new failures count from trace #{cursor + 1}")

    def new_failures_since(self, cursor: int) -> int:
        """Failed traces (curation's outcome rule) with seq > cursor, counted afresh (a poller
        keeps a `FailureCounter` instead, which reads only what is new)."""
        return FailureCounter(self.cfg.curation, cursor).update(self.traces)


# ---------------------------------------------------------------------------- the stages


def start_cycle(fw: LoopStores, tag: str | None = None) -> CycleState:
    fw.observe_production()  # a version promoted by hand since: its window starts now at the latest
    prod = fw.registry.production()
    if prod is None:
        raise CycleError(fw.no_production())
    states = fw.states()
    n = int(states[-1].id[1:]) + 1 if states else 1
    st = CycleState(id=f"c{n}", stage="started", started_at=utc_now().isoformat(timespec="seconds"),
                    incumbent=prod.id, incumbent_path=str(prod.path), trace_cursor=fw.traces.max_seq(),
                    since_cursor=fw.since_cursor(prod.id), tag=tag)
    fw.save(st)
    return st


def _regression_suites(fw: LoopStores):

    return [suite_from_config(name, s) for name, s in fw.cfg.eval.suites.items()]


def _curate(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    traces = itertools.takewhile(lambda t: t.seq <= st.trace_cursor, fw.traces.iter_traces())
    suites = _regression_suites(fw)
    eval_prompts = [t.prompt for s in suites for t in s.tasks]
    curated = curate(traces, eval_prompts, fw.cfg.curation)
    folder = fw.folder(st) / "data"
    files = {k: str(v) for k, v in write_curated(curated, folder).items()}
    new = [i.row for i in curated.rl.heldout if i.seq > st.since_cursor][:fw.cfg.eval.new_failures_max]
    files["new_failures"] = str(folder / NEW_FAILURES_FILE)
    atomic_write(files["new_failures"], "".join(json.dumps(r, sort_keys=True) + "\n" for r in new).encode())
    st.curation = curated.report.to_dict()
    st.files, st.new_failures = files, len(new)
    st.seconds["curate"] = time.perf_counter() - t0
    items = st.curation["items"]
    log(f"{st.id}: curated {st.curation['traces']} traces: "
        + ", ".join(f"{k} {v['train']}+{v['heldout']}" for k, v in items.items())
        + f" (train+held-out); {len(new)} new failures to gate on")
    dropped = dropped_summary(st.curation)
    if dropped:
        log(f"{st.id}: {dropped} (all listed in {files['report']})")
    st.warnings = format_warnings(suites, curated.report.formats)
    for w in st.warnings:
        log(f"{st.id}: warning: {w}")
    _record_cost(fw, st, "curation", st.seconds["curate"])


def _count_lines(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


def replay_count(n_sft: int, available: int, ratio: float, minimum: int = 0) -> int:
    """Replay rows to mix into an SFT stage of `n_sft` examples: `ratio` per example, at least
    `minimum` (a handful of corrections trained for a fixed number of steps is overfit unless
    rehearsal outweighs it), at most what is `available`."""
    return min(available, max(int(ratio * n_sft), minimum))


def _sft_mix(files: dict[str, str], n_sft: int, mix, anchor: list[str], out: Path,
             seed: str) -> tuple[str, dict[str, int]]:
    """sft_train.jsonl plus replay rows (replay_count of them) and `mix.anchor_rows` of the
    `anchor` rows (seeded samples; each marked `"distill": true` when mix.anchor_loss is
    "distill"), shuffled together. Returns (path, rows per part)."""

    rows = [r for r in Path(files["sft_train"]).read_text(encoding="utf-8").splitlines() if r.strip()]
    replay = [r for r in Path(files["replay_train"]).read_text(encoding="utf-8").splitlines() if r.strip()]
    rng = random.Random(seed)
    replayed = rng.sample(replay, replay_count(n_sft, len(replay), mix.replay_ratio, mix.min_replay))
    anchored = rng.sample(anchor, min(len(anchor), mix.anchor_rows))
    if mix.anchor_loss == "distill":
        anchored = [json.dumps({**json.loads(r), "distill": True}) for r in anchored]
    parts = {"sft": len(rows), "replay": len(replayed), "anchor": len(anchored)}
    rows += replayed + anchored
    rng.shuffle(rows)
    atomic_write(out, "".join(r + "\n" for r in rows).encode())
    return str(out), parts


def read_anchor_rows(paths: list[str]) -> list[str]:
    """The non-empty lines of the anchor files, each checked to be an SFT row, chat (a JSON
    object with a `messages` list) or raw completion (string `prompt` and `completion`);
    run_sft validates the rest. CycleError names the file and line of the first that is
    neither, or the file that cannot be read."""
    rows: list[str] = []
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CycleError(f"train.anchor_data: cannot read {path!r}: {e}") from None
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            chat = isinstance(row, dict) and isinstance(row.get("messages"), list)
            raw = isinstance(row, dict) and isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str)
            if not (chat or raw):
                raise CycleError(f"train.anchor_data: {path}:{i} is not an SFT row (a JSON object with a "
                                 "'messages' list, or with 'prompt' and 'completion' strings)")
            rows.append(line)
    return rows


def _budget_seconds(fw: LoopStores, st: CycleState) -> float | None:
    """What is left of the cycle's training budget (seconds, the dollar budget converted at
    the catalog price of `hardware`); None = unbounded."""

    tm = fw.cfg.train
    limits = [tm.max_seconds] if tm.max_seconds else []
    if tm.max_usd:
        limits.append(tm.max_usd / load_catalog().get(fw.cfg.hardware).usd_per_hour * 3600.0)
    if not limits:
        return None
    spent = sum(s["seconds"] for s in st.stages_run)
    return max(min(limits) - spent, 0.0)


def _train(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> bool:
    """Run the stages not run yet; False when a stop request interrupted one."""
    files, folder = st.files, fw.folder(st)
    current = st.stages_run[-1]["final_model"] if st.stages_run else st.incumbent_path
    done = {s["stage"] for s in st.stages_run}
    for stage in fw.cfg.train.order:
        if stage in done:
            continue
        check = None
        n = _count_lines(files[f"{stage}_train"])
        budget = _budget_seconds(fw, st)
        if n < fw.cfg.train.min_examples or budget == 0.0:
            why = "budget spent" if budget == 0.0 else f"{n} curated examples < min_examples {fw.cfg.train.min_examples}"
            st.stages_run.append({"stage": stage, "skipped": why, "seconds": 0.0, "final_model": current})
            fw.save(st)
            log(f"{st.id}: {stage} skipped ({why})")
            continue
        out = folder / stage  # resume only a stage a killed cycle had started
        common = dict(model=current, output_dir=str(out), resume=out.exists(), max_seconds=budget)
        log(f"{st.id}: {stage} on {n} examples from {Path(current).name}")
        t0 = time.perf_counter()
        if stage == "sft":
            data, parts = _sft_mix(files, n, fw.cfg.train, fw.anchor, folder / "data" / "sft_mix.jsonl", st.id)
            log(f"{st.id}: sft mix: " + ", ".join(f"{v} {k}" for k, v in parts.items()))
            # "auto": chat rows and raw-completion rows (from /v1/completions traces) each in their own format
            result = run_sft(stage_config(fw.cfg, "sft", **common, data={"train": [data], "format": "auto"}), log=log)
        elif stage == "dpo":
            result = run_dpo(stage_config(fw.cfg, "dpo", **common, data={"train": [files["dpo_train"]]}), log=log)
        else:
            env, extra, check = _rl_stage_data(fw, st, files, folder, log)
            result = run_rl(stage_config(fw.cfg, "rl", **common, env=env, **extra), log=log)
        seconds = time.perf_counter() - t0
        if result.interrupted:  # cut short: not done; a resumed cycle continues from its checkpoint
            _record_train_cost(fw, st, stage, seconds, result)  # the resumed run counts only its own steps
            fw.save(st)
            log(f"{st.id}: {stage} interrupted at step {result.steps}; the next run resumes it")
            return False
        record = {"stage": stage, "examples": n, "steps": result.steps, "seconds": seconds,
                  "final_model": str(result.final_model)}
        left_out = _rl_left_out(result) if stage == "rl" and check is not None else None
        if left_out:
            record.update(final_model=current, left_out=left_out)  # the candidate stays the model before rl
            log(f"{st.id}: rl left out: {left_out}; the candidate is the model before it")
        current = record["final_model"]
        st.stages_run.append(record)
        _record_train_cost(fw, st, stage, seconds, result)
        fw.save(st)
        crash_point(f"train:{stage}")
        after_stage(fw.cfg.retention, folder, st.stages_run, log)  # finished and saved: never resumed
    ran = [s for s in st.stages_run if "skipped" not in s]
    st.candidate_path = current if ran else None
    return True


def _rl_stage_data(fw: LoopStores, st: CycleState, files: dict[str, str], folder: Path,
                   log: Callable[[str], None]) -> tuple[dict, dict, tuple[str, str] | None]:
    """(env, extra stage settings, check split) of the rl stage: with train.rl_keep=if_better
    and enough tasks, the fit/check split (the check tasks are its eval); else every curated
    RL task, evaluated on the first held-out set that has tasks."""
    tm = fw.cfg.train
    check = _rl_check_split(files, tm, folder / "data") if tm.rl_keep == "if_better" else None
    if check is not None:
        tasks = min(_count_lines(check[1]), tm.rl_check_max)
        log(f"{st.id}: rl trains on {_count_lines(check[0])} tasks and is checked on {tasks} others "
            "(train.rl_keep=if_better)")
        return ({"name": "replay", "settings": {"train": check[0], "test": check[1]}},
                {"eval": {"tasks": tasks}}, check)  # merged onto train.rl.eval (stage_config)
    eval_from = next((k for k in ("new_failures", "rl_heldout", "rl_train") if _count_lines(files[k])), None)
    if eval_from == "rl_train":
        log(f"{st.id}: warning: no held-out RL tasks; the rl stage's own evaluations are on its train "
            "tasks (a progress signal only: the gate decides on its suites)")
    test = files[eval_from] if eval_from else None
    return {"name": "replay", "settings": {"train": files["rl_train"], "test": test}}, {}, None


RL_CHECK_MIN = 8  # fewer check tasks than this: rl trains on every task and is kept (nothing to measure on)


def _rl_check_split(files: dict[str, str], tm, folder: Path) -> tuple[str, str] | None:
    """(fit, check) JSONL paths: the curated RL train tasks split by a hash of each record's
    prompt_hash (of the line where it has none), about
    `tm.rl_check_fraction` of them into check; None when check would hold < RL_CHECK_MIN tasks.
    Deterministic, so a resumed cycle splits the same way. The check tasks are curation's
    train side: the gate's held-out new failures are never among them."""
    lines = [ln for ln in Path(files["rl_train"]).read_text(encoding="utf-8").splitlines() if ln.strip()]

    def bucket(line: str) -> float:  # by the record's prompt_hash: a prompt asked twice stays on one side
        key = json.loads(line).get("prompt_hash") or line
        return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0x100000000

    check = [ln for ln in lines if bucket(ln) < tm.rl_check_fraction]
    if len(check) < RL_CHECK_MIN:
        return None
    fit = [ln for ln in lines if bucket(ln) >= tm.rl_check_fraction]
    paths = folder / "rl_fit.jsonl", folder / "rl_check.jsonl"
    for path, part in zip(paths, (fit, check)):
        atomic_write(path, "".join(ln + "\n" for ln in part).encode())
    return str(paths[0]), str(paths[1])


def _rl_left_out(result) -> str | None:
    """Why the rl stage's model is not kept (its greedy success on the check tasks did not rise
    from its first evaluation to its last), or None to keep it."""
    evals = [e for e in result.evals if "eval/greedy_accuracy" in e]
    if len(evals) < 2:
        return None
    first, last = evals[0]["eval/greedy_accuracy"], evals[-1]["eval/greedy_accuracy"]
    if last > first:
        return None
    return f"greedy success on its check tasks {first:.3f} -> {last:.3f} in {result.steps} steps (no gain)"


def _evaluate(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> bool:
    """Score incumbent and candidate; False when a stop request interrupted it (nothing is
    kept: evaluation reruns whole on resume)."""
    suites = _regression_suites(fw)
    if st.new_failures:
        env = ReplayEnvironment(Path(st.files["new_failures"]))
        suites.append(Suite(fw.cfg.gate.new_failures, env, env.tasks("train"), fw.cfg.eval.new_failures_max_tokens))
    seconds, generated = 0.0, 0
    log(f"{st.id}: evaluating incumbent and candidate on " + ", ".join(f"{s.name} ({len(s.tasks)})" for s in suites))
    for who, path in (("incumbent", st.incumbent_path), ("candidate", st.candidate_path)):
        result = evaluate_model(path, suites, stop=stop_requested)
        if result is None:
            log(f"{st.id}: evaluation interrupted; it reruns on the next run")
            return False
        st.scores[who] = result.scores
        st.outcomes[who] = {k: o.record() for k, o in result.outcomes.items()}
        st.task_ids = result.task_ids
        seconds += result.seconds
        generated += result.tokens_generated
        log(f"{st.id}: {who}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.scores.items()))
    st.seconds["evaluate"] = seconds
    _record_cost(fw, st, "eval", seconds, tokens_generated=generated)
    return True


def _measured(st: CycleState, who: str) -> dict[str, float | Outcomes]:
    """A model's scores for the gate: per-task Outcomes where the state kept them."""
    records = st.outcomes.get(who, {})
    return {k: Outcomes.from_record(records[k]) if k in records else v for k, v in st.scores[who].items()}


def _decide(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> None:
    incumbent, candidate = _measured(st, "incumbent"), _measured(st, "candidate")
    frozen = {k: v.tasks if isinstance(v, Outcomes) else None for k, v in candidate.items()
              if k != fw.cfg.gate.new_failures}
    d = decide(incumbent, candidate, fw.cfg.gate, best=best_promoted(fw.registry, frozen))
    st.decision = {"promote": d.promote, "reasons": d.reasons, "gain": d.gain, "deltas": d.deltas,
                   "bounds": d.bounds, "below_best": d.below_best}
    log(f"{st.id}: gate: {d.summary()}")


def _wait(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> None:
    """Too few new failures to decide: train nothing, finish, say so. Nothing is registered and
    no cursor moves: the next cycle's new-failure suite holds these failures and the newer ones."""
    st.outcome = WAITING
    st.decision = {"promote": False, "reasons": [f"{too_few(st.new_failures, fw.cfg.gate)}; {WAITING}"]}
    st.finished_at = utc_now().isoformat(timespec="seconds")
    log(f"{st.id}: {st.decision['reasons'][0]}")


def _was_promoted(fw: LoopStores, version: str) -> bool:
    return any(e.version == version and e.action == "promote" for e in fw.registry.history())


def _finish(fw: LoopStores, st: CycleState, log: Callable[[str], None]) -> None:
    reg = fw.registry
    if st.candidate_path is None:
        st.outcome = "nothing to train"
    else:
        counts = {k: v for k, v in st.curation.get("items", {}).items()}
        v = reg.register(st.candidate_path, parent=st.incumbent, cycle=st.id, key=f"cycle:{st.id}:{st.started_at}",
                         data_counts={**counts, "new_failures": st.new_failures},
                         config={"stages": [s["stage"] for s in st.stages_run if "skipped" not in s]},
                         eval_scores={**st.scores, "outcomes": st.outcomes}, cost={"usd": st.usd},
                         notes="; ".join(st.decision["reasons"]))
        st.version = v.id
        crash_point("finish:registered")
        prod = reg.production()
        if not st.decision["promote"]:
            reg.reject(v.id, st.decision["reasons"])
            st.outcome = "rejected"
        elif _was_promoted(fw, v.id):
            st.outcome = "promoted"  # a resumed cycle: the promotion had committed before the kill
        elif prod is None or prod.id != st.incumbent:
            reason = (f"production changed during the cycle ({st.incumbent} -> {prod.id if prod else 'none'}); "
                      f"the gate compared against {st.incumbent}")
            reg.reject(v.id, [reason])
            st.decision["reasons"].append(reason)
            st.outcome = "rejected"
        else:
            reg.promote(v.id, reason="gate: " + "; ".join(st.decision["reasons"]))
            crash_point("finish:promoted")
            fw.observe_production()
            st.outcome = "promoted"
        _log_outcome(fw, st)
    st.finished_at = utc_now().isoformat(timespec="seconds")
    log(f"{st.id}: {st.outcome}" + (f" ({st.version})" if st.version else ""))


def _log_outcome(fw: LoopStores, st: CycleState) -> None:
    """One line per cycle in cycles.jsonl (what `flywheel economics report --cycles` reads)."""

    if fw.outcomes_path.exists() and any(
            json.loads(line).get("cycle") == st.id for line in fw.outcomes_path.read_text().splitlines() if line.strip()):
        return
    name = fw.cfg.gate.new_failures
    before, after = st.scores["incumbent"].get(name), st.scores["candidate"].get(name)
    if before is None or after is None:
        return  # no new-failure score: nothing to put on the intelligence-per-dollar curve
    outcome = CycleOutcome(cycle=st.id, accuracy_before=before, accuracy_after=after,
                           promoted=st.outcome == "promoted", reason="; ".join(st.decision["reasons"]),
                           extra={"version": st.version, "scores": st.scores})
    append_line(fw.outcomes_path, outcome.model_dump_json())


def _record_cost(fw: LoopStores, st: CycleState, stage: str, seconds: float, piece: str = "", **tokens: int) -> None:
    """One ledger record, keyed by cycle, stage and piece: a stage retried after a crash (its
    record written, the cycle's state not yet) is not counted twice."""
    key = f"{st.id}/{stage}" + (f"/{piece}" if piece else "")
    rec = fw.ledger.record(stage, hardware=fw.cfg.hardware, seconds=seconds, cycle=st.id, key=key, **tokens)
    crash_point(f"cost:{key}")
    st.usd += rec.usd  # a retried stage's state never held the first record's cost: counted once


def train_cost_entries(stage: str, seconds: float, result) -> list[tuple[str, float, dict[str, int]]]:
    """The ledger records of one training stage run: (ledger stage, seconds, token counts).

    SFT and DPO: one record, `tokens_trained`. RL: `rl_rollout` with the seconds the learner
    waited for rollouts and the tokens they sampled, and `rl_train` with the rest of the stage's
    seconds (updates, weight sync, its held-out evaluations) and the loss tokens; together they
    cost what the stage held. Counts are the run's own (a resumed run's exclude what the run it
    resumed counted), so a stage cut short and resumed is recorded in pieces that never overlap."""
    if stage != "rl":
        return [(stage, seconds, {"tokens_trained": result.tokens_trained})]
    wait = min(max(result.rollout_seconds, 0.0), seconds)
    return [("rl_rollout", wait, {"tokens_generated": result.tokens_generated}),
            ("rl_train", seconds - wait, {"tokens_trained": result.tokens_trained})]


def _record_train_cost(fw: LoopStores, st: CycleState, stage: str, seconds: float, result) -> None:
    for name, secs, tokens in train_cost_entries(stage, seconds, result):
        _record_cost(fw, st, name, secs, piece=f"to-step-{result.steps}", **tokens)  # a run's pieces end apart


# ---------------------------------------------------------------------------- driving a cycle

_STEPS: dict[str, tuple[str, Callable]] = {  # stage reached -> (next stage, what gets there)
    "started": ("curated", _curate),
    "curated": ("trained", _train),
    "trained": ("evaluated", _evaluate),
    "evaluated": ("decided", _decide),
    "decided": ("finished", _finish),
}


def pending_cycle(fw: LoopStores) -> CycleState | None:
    states = fw.states()
    return states[-1] if states and not states[-1].done else None


def abandon_cycle(fw: LoopStores, outcome: str, reason: str) -> CycleState | None:
    """Finish the unfinished cycle as it stands, as `outcome` (a cancelled or failed managed
    cycle): the next run_cycle starts a new one instead of resuming it. Nothing is registered."""
    st = pending_cycle(fw)
    if st is None:
        return None
    st.stage, st.outcome = "finished", outcome
    st.decision = {**st.decision, "promote": False, "reasons": [*st.decision.get("reasons", []), reason]}
    st.finished_at = utc_now().isoformat(timespec="seconds")
    fw.save(st)
    return st


def run_cycle(fw: LoopStores, log: Callable[[str], None] = print, tag: str | None = None) -> CycleState:
    """Resume the unfinished cycle if there is one, else start one; run it to the end, or
    until a stop is requested (train.run_state.request_stop: the state on disk is resumable).
    Finished work is then trimmed as the config's `retention` says (retention.py)."""
    states = fw.states()
    if tag is not None and states and states[-1].tag == tag and states[-1].done:
        log(f"{states[-1].id}: already finished ({states[-1].outcome})")
        return states[-1]  # `tag`'s cycle ran to its end before; a rerun reports it, never starts another
    st = pending_cycle(fw)
    if st is not None:
        log(f"{st.id}: resuming after stage {st.stage!r}")
    else:
        st = start_cycle(fw, tag)
        log(f"{st.id}: started from {st.incumbent} with traces up to #{st.trace_cursor}")
    while not st.done:
        if stop_requested():
            log(f"{st.id}: stopping after stage {st.stage!r}; `flywheel loop run` resumes it")
            return st
        nxt, step = _STEPS[st.stage]
        if st.stage == "curated" and too_few(st.new_failures, fw.cfg.gate):
            nxt, step = "finished", _wait  # checked before training: no compute on an undecidable cycle
        elif st.stage == "trained" and st.candidate_path is None:
            nxt, step = "finished", _finish  # nothing was trained: nothing to evaluate
        if step(fw, st, log) is False:  # a stop request cut the stage short: it resumes next time
            log(f"{st.id}: stopped before stage {nxt!r} was reached; `flywheel loop run` resumes from {st.stage!r}")
            return st
        st.stage = nxt
        fw.save(st)
        crash_point(f"stage:{nxt}")
    log_cycle(fw.cfg, st)  # its figures to the loop's metric sinks, when the config has a `log`
    after_cycle(fw.cfg.retention, fw.cycles_dir, fw.states(), fw.registry, log)  # saved as finished
    return st
