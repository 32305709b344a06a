"""The gate measures what production serves: for a chat-served model, a candidate that is
better through chat and worse through raw completion is promoted; the same candidate judged
on a raw-format frozen suite (the old rule) is rejected, and the cycle warns that the suite
is not played as production calls the model.

The incumbent is the shared arithmetic warm start (SFT on raw `ab+cd=` text: some raw
accuracy, none through chat). The candidate continues it on chat rows with the right sum and
raw rows with a wrong one, so by construction it gains through chat and loses through raw
completion. Production traffic is chat: failed /v1/chat/completions traces with a verifier
that gives only the answer (the gate replays each trace as served). Each cycle runs the real
evaluation, gate and promotion from its "trained" stage on that fixed candidate.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flywheel.config import SFTConfig, validate
from flywheel.envs import load_env
from flywheel.envs.arithmetic import split_pairs
from flywheel.loop.cycle import LoopStores, _curate, run_cycle, start_cycle
from flywheel.loop.loop_config import LoopConfig

pytestmark = pytest.mark.slow  # the candidate is made by training: a learning outcome

N_TRACES = 120  # failed chat traces seeded; about half are held out as the new-failure suite


@pytest.fixture(scope="module")
def chat_candidate(arith_warm_start, tmp_path_factory) -> Path:
    from flywheel.train.sft import run_sft

    root = tmp_path_factory.mktemp("chat-candidate")
    rows = []
    for a, b in split_pairs()[0][:2000]:
        q = f"{a:02d}+{b:02d}="
        rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": str(a + b)}]})
        rows.append({"prompt": q, "completion": str(a + b + 11)})  # wrong through raw completion
    data = root / "mix.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_sft(validate(dict(
        model=str(arith_warm_start), output_dir=str(root / "sft"), data={"train": [str(data)], "format": "auto"},
        train={"steps": 200, "batch_size": 64, "micro_batch_size": 64},
        optim={"lr": 1e-3, "warmup_steps": 10, "min_lr_ratio": 1.0},
        log={"progress": False}, threads=2), SFTConfig), log=lambda m: None)
    return result.final_model


def _world(data_dir: Path, incumbent: Path, suite_format: str | None) -> LoopConfig:
    suite = {"env": "arithmetic", "tasks": 100, "max_tokens": 6}
    if suite_format is not None:
        suite["format"] = suite_format
    cfg = validate({"data_dir": str(data_dir), "curation": {"heldout_fraction": 0.5},
                    "eval": {"suites": {"arith": suite}, "new_failures_max_tokens": 6},
                    "gate": {"delta": 0.05, "epsilon": 0.02}}, LoopConfig)
    tasks = load_env("arithmetic").tasks("train", n=N_TRACES, seed=11)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(incumbent).id, "initial")
        fw.traces.add_traces([{"id": f"t{i}", "source": "serve", "messages": [{"role": "user", "content": t.prompt}],
                               "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
        for i, t in enumerate(tasks):  # the verifier names the env and the answer; the prompt is the trace's
            fw.traces.add_feedback(f"t{i}", {"score": 0.0, "verifier": {"env": "arithmetic", "task": {"answer": t.answer}}})
    return cfg


def _gate(cfg: LoopConfig, candidate: Path):
    """Curate, then take `candidate` as the trained model and run evaluation, gate and finish."""
    logged: list[str] = []
    with LoopStores(cfg) as fw:
        st = start_cycle(fw)
        _curate(fw, st, logged.append)
        st.stages_run = [{"stage": "sft", "examples": 0, "steps": 0, "seconds": 0.0, "final_model": str(candidate)}]
        st.candidate_path, st.stage = str(candidate), "trained"
        fw.save(st)
        st = run_cycle(fw, log=logged.append)
        production = fw.registry.production().id
    return st, production, logged


def test_a_candidate_better_through_chat_is_promoted_for_a_chat_served_model(tmp_path, arith_warm_start,
                                                                               chat_candidate):
    st, production, logged = _gate(_world(tmp_path / "chat", arith_warm_start, "chat"), chat_candidate)
    assert st.new_failures >= 40, st.new_failures
    inc, cand = st.scores["incumbent"], st.scores["candidate"]
    assert cand["new_failures"] >= inc["new_failures"] + 0.1, st.scores  # replayed through chat, as served
    assert cand["arith"] > inc["arith"], st.scores
    assert st.outcome == "promoted" and production == st.version, (st.decision, st.scores)
    assert st.warnings == [] and not any("warning" in m for m in logged)

    raw, _, logged = _gate(_world(tmp_path / "raw", arith_warm_start, None), chat_candidate)
    assert raw.scores["candidate"]["arith"] < raw.scores["incumbent"]["arith"] - 0.02, raw.scores
    assert raw.outcome == "rejected" and any("arith" in r for r in raw.decision["reasons"]), raw.decision
    (warning,) = raw.warnings
    assert "suite 'arith' is played as completion but production is called as chat" in warning
    assert any(m.endswith("warning: " + warning) for m in logged)
