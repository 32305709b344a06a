"""Curation: stored traces -> RL tasks, SFT examples, DPO pairs and replay rows, each split
train / held-out. The rules (outcome, normalised prompt, contamination, split) are in
curation_rules.py; each builder below states what it makes.

- RL: a failed trace with a verifier -> `{"env", "task", "trace_id", "source", "prompt_hash"}`,
  the task's prompt and tools those the trace was served with (a chat trace's messages
  through its last user message and its tools, a raw completion's text), so training and the
  gate replay what production saw.
- SFT: a trace with a correction -> `{"messages": prompt + [correction], "tools"}`, or
  `{"prompt", "completion"}` for a raw-completion trace (train.sft_data).
- DPO: a failed response paired with a preferred one, OpenAI DPO rows (train.dpo_data; chat
  traces only: the format has no raw-completion form).
- Replay: a passing trace -> the SFT row of its prompt and response, the model's own verified
  answer, which a cycle rehearses in SFT so old skills stay while new ones are learned.
In trace `seq` order, one RL, SFT and replay item per prompt hash is kept and one DPO pair per
(prompt hash, bad response hash); an item whose prompt matches an eval prompt is dropped
(`EvalIndex`); every item made from one conversation opening lands on one side of the split.
One unusable record is dropped with its trace id and reason and never stops the others.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from flywheel.envs.replay import task_from_dict
from flywheel.files import atomic_write
from flywheel.loop.curation_rules import (
    CurationConfig,
    EvalIndex,
    Unusable,
    choose_heldout,
    latest,
    opening,
    outcome,
    posed,
    prompt_hash,
    response_hash,
    split_conversation,
    training_messages,
    training_reply,
    training_row,
    with_tools,
)
from flywheel.loop.feedback_check import trusted_env
from flywheel.traces.results import StoredTrace, StoredVerifier
from flywheel.types import prompt_format

KINDS = ("rl", "sft", "dpo", "replay")
SIDES = ("train", "heldout")
MAX_LISTED = 100  # dropped / contaminated entries listed in the report (all are counted)


@dataclass(frozen=True)
class Item:
    """One curated record: `row` is what is written; the rest is provenance."""

    kind: str
    row: dict[str, Any]
    trace_id: str
    source: str
    prompt_hash: str
    seq: int
    root_hash: str = ""  # the conversation's opening (through its first user message): the split key


@dataclass
class Split:
    train: list[Item] = field(default_factory=list)
    heldout: list[Item] = field(default_factory=list)


@dataclass
class CurationReport:
    traces: int = 0
    failures: int = 0  # outcome "fail"
    passes: int = 0  # outcome "pass"
    failures_with_verifier: int = 0
    with_correction: int = 0
    eval_prompts: int = 0  # distinct eval prompt hashes
    items: dict[str, dict[str, int]] = field(default_factory=lambda: {k: dict.fromkeys(SIDES, 0) for k in KINDS})
    duplicates: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    dpo_over_cap: int = 0  # pairs beyond max_pairs_per_prompt
    contaminated: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    contaminated_by_reason: dict[str, int] = field(default_factory=lambda: {"exact": 0, "ngram": 0})
    contaminated_items: list[dict[str, str]] = field(default_factory=list)  # first MAX_LISTED
    dropped_count: int = 0
    dropped: list[dict[str, str]] = field(default_factory=list)  # first MAX_LISTED {trace_id, kind, reason}
    sources: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> distinct prompts per side
    formats: dict[str, int] = field(default_factory=lambda: {"chat": 0, "completion": 0})  # traces as served

    def drop(self, trace_id: str, kind: str, reason: str) -> None:
        self.dropped_count += 1
        if len(self.dropped) < MAX_LISTED:
            self.dropped.append({"trace_id": trace_id, "kind": kind, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def dropped_summary(report: dict[str, Any], limit: int = 3) -> str | None:
    """What curation dropped, for a log line or `loop status`: "5 records dropped: 3 rl:
    <reason>; ..." (the `limit` most common reasons of those listed, with their counts), or
    None when nothing was. `report` is a CurationReport's dict (as a cycle's state keeps it)."""
    total = report.get("dropped_count", 0)
    if not total:
        return None
    counts: dict[str, int] = {}
    for d in report.get("dropped", []):
        key = f"{d['kind']}: {d['reason']}"
        counts[key] = counts.get(key, 0) + 1
    common = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    more = "; ..." if len(counts) > limit else ""
    return (f"{total} record{'s' if total != 1 else ''} dropped: "
            + "; ".join(f"{n} {why}" for why, n in common) + more)


@dataclass
class Curated:
    rl: Split
    sft: Split
    dpo: Split
    replay: Split
    report: CurationReport


@dataclass
class _Seen:
    """What curation needs of one trace."""

    trace: StoredTrace
    prompt: list[dict] | str  # as served: a chat trace's messages, a raw completion's text
    response: dict | None
    hash: str
    root: str  # hash of the messages through the first user message
    outcome: str
    correction: dict | None
    verifier: StoredVerifier | None


@dataclass
class _Candidate:
    item: Item
    hashes: tuple[str, ...]  # compared with eval prompt hashes
    prompts: tuple  # whose user words are compared with eval n-grams


def _read(t: StoredTrace, cfg: CurationConfig) -> _Seen:
    prompt, response = split_conversation(t)
    return _Seen(t, prompt, response, prompt_hash(prompt), prompt_hash(opening(prompt)), outcome(t, cfg),
                 latest(t, "correction"), latest(t, "verifier"))


def _rl(s: _Seen, cfg: CurationConfig) -> _Candidate:
    """A replay task from the trace's newest verifier: its payload checked as a Task (`id`
    defaults to the trace id) and written back with every field, except that the prompt and
    tools are the trace's own as served: the prompt `posed` (through the last user message,
    so the environment plays the agent's turns again), a chat trace's `tools` exactly (none
    if it offered none). The verifier's prompt, when it sent one, is kept as `verifier_prompt`."""
    v, t = s.verifier, s.trace
    if not trusted_env(v.env, cfg):
        raise Unusable(f"verifier env {v.env!r} is neither a built-in environment nor listed in "
                       "curation.environments")
    try:
        given = task_from_dict(v.task, default_id=t.id, default_prompt=s.prompt)
    except ValueError as e:
        raise Unusable(f"verifier task: {e}") from None
    if not s.prompt:
        raise Unusable("no prompt before the response")
    served = None if isinstance(s.prompt, str) else (t.tools or [])
    task = dataclasses.replace(given, prompt=posed(s.prompt), tools=served)
    row = {"env": v.env, "task": dataclasses.asdict(task), "trace_id": t.id, "source": t.source,
           "prompt_hash": s.hash}
    if "prompt" in v.task:
        row["verifier_prompt"] = v.task["prompt"]
    return _Candidate(Item("rl", row, t.id, t.source, s.hash, t.seq, s.root),
                      (s.hash, prompt_hash(given.prompt)), (s.prompt, given.prompt))


def _sft(s: _Seen) -> _Candidate:
    t = s.trace
    row = training_row(s.prompt, s.correction, "correction", t.tools)
    return _Candidate(Item("sft", row, t.id, t.source, s.hash, t.seq, s.root), (s.hash,), (s.prompt,))


def _replay(s: _Seen) -> _Candidate:
    t = s.trace
    row = training_row(s.prompt, s.response, "response", t.tools)
    return _Candidate(Item("replay", row, t.id, t.source, s.hash, t.seq, s.root), (s.hash,), (s.prompt,))


def _dpo(group: list[_Seen], cfg: CurationConfig, report: CurationReport) -> list[_Candidate]:
    """The pairs of one prompt hash: each distinct bad response (a failed trace's response) is
    paired with that trace's own correction, else the group's first correction, else its first
    passing response; at most `max_pairs_per_prompt` pairs, in trace order, and none whose two
    sides normalise equal."""
    corrections = [s.correction for s in group if s.correction is not None]
    passes = [s.response for s in group if s.outcome == "pass" and s.response is not None]
    out: list[_Candidate] = []
    paired: set[str] = set()  # response hashes of the bad responses already paired
    for s in group:
        if s.outcome != "fail" or s.response is None:
            continue
        t = s.trace
        try:
            bad = response_hash(s.response)
            if bad in paired:
                report.duplicates["dpo"] += 1
                continue
            preferred = s.correction or (corrections[0] if corrections else passes[0] if passes else None)
            if preferred is None or response_hash(preferred) == bad:
                continue
            if isinstance(s.prompt, str):
                raise Unusable("a raw-completion trace: DPO rows are chat (input.messages)")
            if len(out) >= cfg.max_pairs_per_prompt:
                report.dpo_over_cap += 1
                continue
            row = {"input": with_tools({"messages": training_messages(s.prompt)}, t.tools),
                   "preferred_output": [training_reply(preferred, "preferred")],
                   "non_preferred_output": [training_reply(s.response, "response")]}
        except (Unusable, AttributeError, KeyError, TypeError) as e:
            report.drop(t.id, "dpo", str(e) if isinstance(e, Unusable) else f"{type(e).__name__}: {e}")
            continue
        paired.add(bad)
        out.append(_Candidate(Item("dpo", row, t.id, t.source, s.hash, t.seq, s.root), (s.hash,), (s.prompt,)))
    return out


def curate(traces: Iterable[StoredTrace], eval_prompts: Iterable[Any] = (),
           cfg: CurationConfig | None = None) -> Curated:
    """RL / SFT / DPO items of `traces`, deduplicated, decontaminated against `eval_prompts`
    (strings, message lists or Tasks) and split train / held-out. Deterministic: the same
    traces (in any order: they are sorted by seq) give the same result."""
    cfg = cfg or CurationConfig()
    index = EvalIndex(eval_prompts, cfg.ngram)
    report = CurationReport(eval_prompts=len(index))
    found: dict[str, list[_Candidate]] = {k: [] for k in KINDS}
    groups: dict[str, list[_Seen]] = {}  # prompt hash -> traces with a response or correction
    replay_in = functools.partial(_rl, cfg=cfg)  # RL tasks replay only environments cfg trusts
    for t in sorted(traces, key=lambda t: t.seq):
        report.traces += 1
        try:
            s = _read(t, cfg)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            report.drop(getattr(t, "id", "?"), "trace", f"malformed trace: {type(e).__name__}: {e}")
            continue
        report.formats[prompt_format(s.prompt)] += 1
        report.failures += s.outcome == "fail"
        report.passes += s.outcome == "pass"
        report.with_correction += s.correction is not None
        for kind, wanted, build in (("rl", s.outcome == "fail" and s.verifier is not None, replay_in),
                                    ("sft", s.correction is not None, _sft),
                                    ("replay", s.outcome == "pass" and s.response is not None, _replay)):
            if not wanted:
                continue
            report.failures_with_verifier += kind == "rl"
            try:
                found[kind].append(build(s))
            except (Unusable, AttributeError, KeyError, TypeError) as e:
                report.drop(t.id, kind, str(e) if isinstance(e, Unusable) else f"{type(e).__name__}: {e}")
        if s.response is not None or s.correction is not None:
            groups.setdefault(s.hash, []).append(s)
    for group in groups.values():
        found["dpo"].extend(_dpo(group, cfg, report))

    kept: list[_Candidate] = []
    verdicts: dict[tuple, str | None] = {}  # contamination is a function of (hashes, prompts): cache it
    for kind in KINDS:
        firsts: set[str] = set()
        for c in found[kind]:
            if kind != "dpo":  # DPO is deduplicated per bad response in _dpo
                if c.item.prompt_hash in firsts:
                    report.duplicates[kind] += 1
                    continue
                firsts.add(c.item.prompt_hash)
            key = c.hashes
            if key not in verdicts:
                verdicts[key] = index.check(c.hashes, c.prompts)
            reason = verdicts[key]
            if reason is not None:
                report.contaminated[kind] += 1
                report.contaminated_by_reason[reason.split(":")[0]] += 1
                if len(report.contaminated_items) < MAX_LISTED:
                    report.contaminated_items.append({"trace_id": c.item.trace_id, "kind": kind, "reason": reason})
                continue
            kept.append(c)

    kept.sort(key=lambda c: (c.item.seq, KINDS.index(c.item.kind)))
    # The split key is the opening, so a correction of turn 1 cannot train the task the gate
    # replays from turn 2's failure; an opening belongs to the source of its first trace.
    home: dict[str, str] = {}  # split key -> the source of its first trace
    for c in kept:
        home.setdefault(c.item.root_hash, c.item.source)
    by_source: dict[str, list[str]] = {}
    for h, source in home.items():
        by_source.setdefault(source, []).append(h)
    held = choose_heldout(by_source, cfg)
    for source in sorted(by_source):
        n_held = sum(h in held for h in by_source[source])
        report.sources[source] = {"train": len(by_source[source]) - n_held, "heldout": n_held}
    splits = {k: Split() for k in KINDS}
    for c in kept:
        side = "heldout" if c.item.root_hash in held else "train"
        getattr(splits[c.item.kind], side).append(c.item)
        report.items[c.item.kind][side] += 1
    return Curated(splits["rl"], splits["sft"], splits["dpo"], splits["replay"], report)


def write_curated(curated: Curated, out_dir: str | Path) -> dict[str, Path]:
    """{kind}_{train,heldout}.jsonl and report.json in `out_dir`; returns name -> path
    ("rl_train", ..., "report"). The same Curated gives the same bytes (sorted keys)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for kind in KINDS:
        for side in SIDES:
            items = getattr(getattr(curated, kind), side)
            text = "".join(json.dumps(i.row, sort_keys=True, ensure_ascii=False) + "\n" for i in items)
            paths[f"{kind}_{side}"] = out / f"{kind}_{side}.jsonl"
            atomic_write(paths[f"{kind}_{side}"], text.encode())
    paths["report"] = out / "report.json"
    atomic_write(paths["report"], (json.dumps(curated.report.to_dict(), indent=2, sort_keys=True) + "\n").encode())
    return paths
