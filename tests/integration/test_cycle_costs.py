"""What a cycle writes to the cost ledger: every training stage its trained tokens, RL also its
rollouts' generated tokens, evaluation its generated tokens, each checked against a count made
here from the stage's data; and the report then prices training and evaluation per 1M tokens.

A tiny untrained model and a handful of failed, corrected arithmetic traces: SFT, DPO and RL
each run a few steps (a few seconds in all on 2 cores)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from flywheel.config import DPODataConfig, SFTDataConfig, validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores, run_cycle
from flywheel.loop.loop_config import LoopConfig

N_TRACES = 16
SFT_EPOCHS = 2
MAX_TOKENS = 4


def _config(data_dir: Path) -> dict:
    quiet = {"log": {"progress": False}, "threads": 1}
    return {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.25},
        "train": {"order": ["sft", "dpo", "rl"], "min_examples": 1, "replay_ratio": 0, "min_replay": 0,
                  "anchor_rows": 0,
                  # batch 1 over whole epochs: every example is trained exactly SFT_EPOCHS times
                  "sft": {"train": {"epochs": SFT_EPOCHS, "batch_size": 1, "micro_batch_size": 1}, **quiet},
                  "dpo": {"train": {"epochs": 1, "batch_size": 1}, **quiet},
                  "rl": {"train": {"steps": 2, "groups_per_step": 2, "group_size": 2},
                         "algo": {"dynamic_sampling": False},  # every group trains: all flat here
                         "sampling": {"max_tokens": MAX_TOKENS}, "eval": {"tasks": 2}, **quiet}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 4, "max_tokens": MAX_TOKENS}},
                 "new_failures_max_tokens": MAX_TOKENS, "new_failures_max": 4},
        "gate": {"min_new_failures": 1},  # a handful of traces: the costs, not the decision, are checked
    }


@pytest.fixture
def cycle_run(tmp_path):
    from flywheel.models import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    cfg = validate(_config(tmp_path / "data"), LoopConfig)
    tasks = load_env("arithmetic").tasks("train", n=N_TRACES, seed=7)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(model).id, "initial")
        fw.traces.add_traces([{
            "id": f"t{i}", "source": "serve", "messages": [{"role": "user", "content": t.prompt}],
            "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
        for i, t in enumerate(tasks):
            fw.traces.add_feedback(f"t{i}", {
                "score": 0.0, "correction": {"role": "assistant", "content": t.answer},
                "verifier": {"env": "arithmetic", "task": dataclasses.asdict(t)}})
        st = run_cycle(fw, log=lambda m: None)
        yield fw, st, model


def test_cycle_records_trained_and_generated_tokens(cycle_run):
    from flywheel.models import load_tokenizer
    from flywheel.train.dpo_data import load_pairs
    from flywheel.train.sft_data import load_sft_examples

    fw, st, model = cycle_run
    assert st.done and [s["stage"] for s in st.stages_run] == ["sft", "dpo", "rl"], st.stages_run
    assert not any("skipped" in s for s in st.stages_run)
    records = {r.stage: r for r in fw.ledger.read() if r.cycle == st.id}
    assert set(records) == {"curation", "sft", "dpo", "rl_rollout", "rl_train", "eval"}
    tok = load_tokenizer(model)

    # SFT: the targets (loss_mask[1:]) of every example of the mix, once per epoch
    mix = [str(fw.folder(st) / "data" / "sft_mix.jsonl")]
    examples, _ = load_sft_examples(mix, tok, SFTDataConfig(train=mix, format="chat"))
    assert len(examples) == st.curation["items"]["sft"]["train"] > 0
    assert records["sft"].tokens_trained == SFT_EPOCHS * sum(sum(e.loss_mask[1:]) for e in examples) > 0
    # DPO: the completion tokens of both sides of every pair, one epoch
    dpo = [st.files["dpo_train"]]
    pairs, _ = load_pairs(dpo, tok, DPODataConfig(train=dpo), log=lambda m: None)
    assert records["dpo"].tokens_trained == sum(sum(p.chosen_mask[1:]) + sum(p.rejected_mask[1:])
                                                for p in pairs) > 0
    # RL, synchronous and without dynamic sampling: every sampled token is trained, once;
    # 2 steps x 2 groups x 2 samples, each 1..MAX_TOKENS tokens
    rollout, train = records["rl_rollout"], records["rl_train"]
    assert rollout.tokens_generated == train.tokens_trained
    assert 2 * 2 * 2 <= rollout.tokens_generated <= 2 * 2 * 2 * MAX_TOKENS
    assert rollout.tokens_trained == 0 and train.tokens_generated == 0
    rl_seconds = next(s["seconds"] for s in st.stages_run if s["stage"] == "rl")
    assert rollout.seconds + train.seconds == pytest.approx(rl_seconds)
    # eval: both models greedy on every suite task, 1..MAX_TOKENS tokens each
    played = 2 * (4 + st.new_failures)
    assert played <= records["eval"].tokens_generated <= played * MAX_TOKENS
    assert all(r.tokens_served == 0 for r in records.values())


def test_report_prices_training_and_eval_per_million_tokens(cycle_run):
    from flywheel.economics.tables import DASH, build_report

    fw, st, _ = cycle_run
    table = build_report(fw.ledger.read()).family_table()
    rows = {r[0]: r for r in table.rows}
    per_m = table.columns.index("USD / 1M tokens")
    for family in ("training", "rollouts", "eval"):
        assert rows[family][per_m] != DASH, rows[family]
        assert not rows[family][table.columns.index("tokens")].startswith("0 "), rows[family]
    assert rows["curation"][per_m] == DASH  # priced per cycle, not per token
