"""Every recipe on families whose module layouts differ: one flywheel cycle per family runs
SFT, DPO and RL from a locally built model, scores incumbent and candidate on a suite and
on the held-out new failures, and decides. Qwen2 and Llama take the lean inference path;
GPT-2 (decoder under `transformer`, tied head, dropout 0.1) and GPT-NeoX (partial rotary)
take Hugging Face's forward (the factory builds all eight families, each in a few seconds)."""

from __future__ import annotations

import dataclasses

import pytest

from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores, run_cycle
from flywheel.loop.loop_config import LoopConfig
from flywheel.models import TinySpec, build_tiny_model
from flywheel.models.tiny import ARCHITECTURES

FAMILIES = list(ARCHITECTURES)  # qwen2 llama mistral qwen3 gpt2 gpt_neox phi gemma


def _loop_config(data_dir) -> dict:
    quiet = {"log": {"progress": False}, "threads": 1}
    return {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.25},
        "train": {"order": ["sft", "dpo", "rl"], "min_examples": 2,
                  "sft": {"train": {"steps": 2, "batch_size": 4, "micro_batch_size": 2}, **quiet},
                  "dpo": {"train": {"steps": 2, "batch_size": 2}, **quiet},
                  "rl": {"train": {"steps": 2, "groups_per_step": 2, "group_size": 2},
                         "sampling": {"max_tokens": 4}, "eval": {"tasks": 4}, "rollout": {"workers": 0}, **quiet}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 8, "max_tokens": 4}},
                 "new_failures_max_tokens": 4},
        # a handful of new failures: the machinery is under test, not a decision
        "gate": {"delta": 0.05, "epsilon": 0.05, "min_new_failures": 1},
    }


def _seed(fw: LoopStores, model, n: int = 24) -> None:
    """Production model v1 and `n` failed traces with a verifier, every other one corrected."""
    tasks = load_env("arithmetic").tasks("train", n=n, seed=3)
    fw.registry.promote(fw.registry.register(model).id, "initial")
    fw.traces.add_traces([{"id": f"t{i}", "source": "serve", "messages": [{"role": "user", "content": t.prompt}],
                           "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)])
    for i, t in enumerate(tasks):
        feedback = {"score": 0.0, "verifier": {"env": "arithmetic", "task": dataclasses.asdict(t)}}
        if i % 2:
            feedback["correction"] = {"role": "assistant", "content": str(t.answer)}
        fw.traces.add_feedback(f"t{i}", feedback)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_cycle_runs_every_recipe_on(arch, tmp_path):
    model = build_tiny_model(tmp_path / arch, TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=512,
                                                       arch=arch))
    cfg = validate(_loop_config(tmp_path / "data"), LoopConfig)
    logs: list[str] = []
    with LoopStores(cfg) as fw:
        _seed(fw, model)
        st = run_cycle(fw, log=logs.append)
        assert st.done, logs
        assert [s["stage"] for s in st.stages_run] == ["sft", "dpo", "rl"]
        assert all("skipped" not in s and s["steps"] == 2 for s in st.stages_run), st.stages_run
        for who in ("incumbent", "candidate"):
            assert set(st.scores[who]) == {"arith", cfg.gate.new_failures}
        assert st.outcome in ("promoted", "rejected") and st.decision["reasons"]
