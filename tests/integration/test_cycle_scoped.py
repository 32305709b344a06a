"""A cycle that reads one tenant's traces of one model name (a managed flywheel's scope) and
trains LoRA stages: curation sees only the traces in scope, the candidate is an adapter folder
that the registry stores, the gate evaluates (merged) and the cycle promotes it. The machinery:
an untrained model under a gate that admits any candidate."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores, run_cycle
from flywheel.loop.loop_config import LoopConfig
from flywheel.models.loading import is_adapter_folder
from flywheel.traces.scope import TraceScope
from flywheel.traces.store import TraceStore

LORA = {"rank": 4, "alpha": 8}
SCOPE = TraceScope("acme", ("acme-prod",))


def _config(data_dir: Path) -> dict:
    return {
        "data_dir": str(data_dir),
        "curation": {"heldout_fraction": 0.25},
        "train": {"order": ["sft", "rl"], "min_examples": 1, "min_replay": 0,
                  "sft": {"train": {"steps": 2, "batch_size": 4, "micro_batch_size": 4, "lora": LORA},
                          "log": {"progress": False}},
                  "rl": {"train": {"steps": 2, "groups_per_step": 2, "group_size": 4, "lora": LORA},
                         "sampling": {"temperature": 1.0, "max_tokens": 6}, "eval": {"tasks": 4},
                         "log": {"progress": False}, "threads": 2}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 8, "max_tokens": 6}}, "new_failures_max_tokens": 6},
        "gate": {"delta": 0.0, "epsilon": 1.0, "min_new_failures": 1},
    }


def _traces(store: TraceStore, tenant: str, model: str, tasks, prefix: str, correct: bool = False) -> None:
    store.add_traces([{"id": f"{prefix}{i}", "source": "serve", "model": model, "prompt": t.prompt,
                       "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)], tenant=tenant)
    for i, t in enumerate(tasks):
        store.add_feedback(f"{prefix}{i}", {"score": 0.0, "verifier": {"env": "arithmetic",
                                                                       "task": dataclasses.asdict(t)}}, tenant=tenant)
        if correct:
            store.add_feedback(f"{prefix}{i}", {"correction": {"role": "assistant", "content": t.answer}},
                               tenant=tenant)


@pytest.mark.slow  # a whole cycle; tests/service/test_flywheels.py's cycles run scoped and LoRA too
def test_a_scoped_lora_cycle_reads_only_its_traces_and_promotes_an_adapter(tmp_path, untrained_tiny):
    cfg = validate(_config(tmp_path / "data"), LoopConfig)
    tasks = load_env("arithmetic").tasks("train", n=60, seed=7)
    with TraceStore(cfg.trace_url) as store:
        _traces(store, "acme", "acme-prod", tasks[:40], "a", correct=True)
        _traces(store, "acme", "other-model", tasks[40:50], "o")  # the tenant's other model
        _traces(store, "beta", "acme-prod", tasks[50:], "b")  # another tenant naming the same model
    with LoopStores(cfg, SCOPE) as fw:
        assert fw.traces.count() == 40
        fw.registry.promote(fw.registry.register(untrained_tiny).id, "initial")
        st = run_cycle(fw, log=lambda m: None)
        assert st.curation["traces"] == 40, st.curation
        assert [s["stage"] for s in st.stages_run if "skipped" not in s] == ["sft", "rl"], st.stages_run
        assert st.outcome == "promoted" and st.version == "v2", (st.outcome, st.decision)
        prod = fw.registry.production()
        assert prod.id == "v2" and is_adapter_folder(prod.path)
        assert json.loads((prod.path / "adapter_config.json").read_text())["r"] == 4
    with LoopStores(cfg, SCOPE) as fw:  # a rerun of the cycle's job (same tag) reports it and starts none
        assert run_cycle(fw, log=lambda m: None, tag="job-1").id == "c2"
        assert run_cycle(fw, log=lambda m: None, tag="job-1").id == "c2" and len(fw.states()) == 2
