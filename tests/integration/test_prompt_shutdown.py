"""SIGTERM stops a stage at its next step or batch boundary, says where, and the resume is
unchanged: a training run checkpoints and writes no final model; a cycle's evaluation stops
between chunks of tasks and reruns on resume. Each run here would take far longer than the
test waits if the signal were left to the end of the stage."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from flywheel.config import SFTConfig, validate
from flywheel.loop.cycle import LoopStores
from flywheel.loop.loop_config import LoopConfig
from flywheel.train.checkpoint import list_checkpoints

from test_cycle import _config, _seed_world


def _wait_for(condition, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_sigterm_interrupts_sft_at_a_step_and_the_resume_continues_there(tmp_path, untrained_tiny, forked_cli):
    import signal

    from flywheel.train.sft import run_sft

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(64)))
    cfg = {"model": str(untrained_tiny), "output_dir": str(tmp_path / "run"), "data": {"train": [str(data)]},
           "train": {"steps": 100_000, "batch_size": 8, "micro_batch_size": 8}, "log": {"progress": False},
           "threads": 1}
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    child = forked_cli(["sft", path])
    _wait_for(lambda: _lines(tmp_path / "run" / "metrics.jsonl") >= 3 or child.poll() is not None)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 3, child.output[-2000:]
    out = child.output
    assert "SIGTERM: stopping after the current step" in out and "done:" not in out, out[-2000:]
    (said,) = [line for line in out.splitlines() if line.startswith("interrupted at step ")]
    step = int(said.split()[3])
    assert said.endswith("resume=true continues from it") and f"of 100000; checkpoint {tmp_path / 'run'}" in said
    assert 3 <= step < 100_000 and not (tmp_path / "run" / "final").exists()
    assert str(list_checkpoints(tmp_path / "run")[-1]) in said
    resumed = run_sft(validate({**cfg, "resume": True, "train": {**cfg["train"], "steps": step + 2}}, SFTConfig),
                      log=lambda m: None)
    assert resumed.resumed_from == step and resumed.steps == step + 2 and not resumed.interrupted
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, step + 3))  # each step logged once across the interruption


def test_sigterm_stops_a_cycle_in_evaluation_between_chunks(tmp_path, untrained_tiny, forked_cli):
    import signal

    cfg = _config(tmp_path / "data", quick=True, delta=0.0, epsilon=1.0, min_new_failures=1)
    cfg["train"]["order"] = ["sft"]
    cfg["train"]["sft"] = {"train": {"steps": 2, "batch_size": 4, "micro_batch_size": 4}, "log": {"progress": False}}
    cfg["curation"]["heldout_fraction"] = 0.0
    cfg["eval"]["suites"]["arith"].update(tasks=4000, settings={"operators": "-", "digits": 3, "heldout": 6000})
    # 4,000 tasks, ~60 chunks a model: far longer to play through than the test waits
    world = validate(cfg, LoopConfig)
    _seed_world(world, untrained_tiny, n=12)
    with LoopStores(world) as fw:  # corrections, so the SFT stage has examples
        for i in range(12):
            fw.traces.add_feedback(f"t{i}", {"correction": {"role": "assistant", "content": "4"}})
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(world.model_dump(mode="json")))
    child = forked_cli(["loop", "cycle", path])
    _wait_for(lambda: (child.log.exists() and "evaluating incumbent and candidate" in child.output)
              or child.poll() is not None)
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 3, child.output[-2000:]
    assert "c1: evaluation interrupted; it reruns on the next run" in child.output, child.output[-2000:]
    assert "c1: stopped after stage 'trained'" in child.output
    with LoopStores(world) as fw:
        (st,) = fw.states()
        assert st.stage == "trained" and not any(r.stage == "eval" for r in fw.ledger.read())
