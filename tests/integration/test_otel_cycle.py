"""OpenTelemetry traffic alone drives a loop cycle (docs/loop.md, "Bring your agent's
OpenTelemetry traffic"): examples/otel_agent.py, an agent instrumented with the opentelemetry
SDK, asks the daemon's model calculator questions through the official `openai` client and
sends its spans over OTLP/HTTP protobuf only (no POST /v1/traces, no feedback call). Each
run's `gen_ai.evaluation.result` event, with flywheel's verifier attributes, becomes the
trace's feedback: its failures fill the trigger, curation makes RL tasks of them, the
held-out ones are the gate's new-failure suite, and the cycle decides. The machinery, not
learning: an untrained model under a gate that admits any candidate, as
tests/integration/test_loop_walkthrough.py runs the walkthrough."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from test_loop_walkthrough import REPO, SMALL, _status, _stop, _wait, flywheel  # noqa: E402

# the walkthrough's small overrides, with an RL stage instead of SFT: OTLP runs carry verifiers, no corrections
RL_ONLY = [o for o in SMALL if not o.startswith("train.")] + [
    "train.order=[rl]", "train.rl_keep=always", "train.rl.train.steps=2", "train.rl.train.groups_per_step=2",
    "train.rl.train.group_size=2", "train.rl.sampling.max_tokens=8", "train.rl.eval.tasks=2"]
REQUESTS = 24  # every answer of the untrained model is wrong: 20 of them start the cycle


def test_the_example_agent_has_the_same_tool_as_the_calculator_environment():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import otel_agent
    finally:
        sys.path.remove(str(REPO / "examples"))
    from flywheel.envs import load_env

    assert otel_agent.TOOLS == load_env("calculator").info()["tools"]
    assert otel_agent.otlp_endpoint("http://h:8000/v1") == "http://h:8000/otlp/v1/traces"
    assert otel_agent.calc("(512 - 38) * 2") == "948"


@pytest.mark.slow  # a daemon process, 24 agent runs and a cycle (~40 s on 2 cores): make test-all
def test_otlp_traffic_alone_drives_a_cycle(tmp_path):
    from flywheel.demo.base import BASE_RECIPE
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.traces import TraceStore

    model = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=512,
                                                         template=BASE_RECIPE.template))
    data = tmp_path / "loop"
    flywheel("registry", "register", str(model), "--data-dir", str(data))
    flywheel("registry", "promote", "v1", "--data-dir", str(data))
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "loop", "run",
                             str(REPO / "configs" / "loop_calculator.yaml"), f"data_dir={data}", *RL_ONLY],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    try:
        url = _wait(lambda: (_status(data)["daemon"] or {}).get("url"), 120, "the server", proc)
        agent = subprocess.run([sys.executable, str(REPO / "examples" / "otel_agent.py"), "--base-url", url,
                                "--requests", str(REQUESTS), "--seed", "3", "--max-tokens", "8"],
                               capture_output=True, text=True, timeout=300)
        assert agent.returncode == 0, agent.stderr[-3000:]
        assert agent.stdout.strip() == f"otel_agent: requests={REQUESTS} plus_solved=0/12 minus_solved=0/12", \
            agent.stdout
        cycle = _wait(lambda: next((c for c in _status(data)["cycles"] if c["outcome"]), None), 300, "a cycle", proc)
    finally:
        if proc.poll() is None:
            out = _stop(proc)

    # what the OTLP endpoint stored: one trace per run, each with its evaluation as a verifier feedback
    store = TraceStore(f"sqlite:///{data / 'traces.db'}")
    try:
        everything = list(store.iter_traces())
    finally:
        store.close()
    # the server also stores each chat completion it answered (source "serve", no outcome): the
    # agent's OTLP runs are what carry one
    traces = [t for t in everything if t.source == "otlp:calc-agent"]
    assert len(traces) == REQUESTS and not [fb for t in everything if t not in traces for fb in t.feedback]
    assert all(t.metadata["otel"]["agent_name"] == "calculator" and t.messages[0]["role"] == "user"
               for t in traces)
    feedback = [fb for t in traces for fb in t.feedback]
    assert len(feedback) == REQUESTS and all(fb.source == "user" and fb.score == 0.0 and fb.label == "wrong"
                                             and fb.verifier.env == "calculator" for fb in feedback)
    asked = {t.messages[0]["content"]: t.feedback[0].verifier.task["answer"] for t in traces}
    assert all(str(eval(q.removeprefix("What is ").rstrip("?").replace("minus", "-"))) == a  # noqa: S307
               for q, a in asked.items())

    # the cycle: started by those failures, curated into RL tasks, gated on the held-out ones
    assert cycle["outcome"] == "promoted" and cycle["version"] == "v2", cycle
    assert cycle["new_failures"] > 0, cycle
    folder = data / "cycles" / cycle["id"]
    state = json.loads((folder / "state.json").read_text())
    rl = state["curation"]["items"]["rl"]
    assert rl["train"] + rl["heldout"] >= 20 and rl["heldout"] == cycle["new_failures"], state["curation"]
    new_failures = [json.loads(line) for line in Path(state["files"]["new_failures"]).read_text().splitlines()]
    assert len(new_failures) == cycle["new_failures"]
    assert "new_failures" in state["scores"]["candidate"], state["scores"]
    assert f"{cycle['id']}: promoted (v2)" in out, out[-3000:]
    print(f"cycle {cycle['id']}: rl {rl['train']}+{rl['heldout']}, {cycle['new_failures']} new failures, "
          f"{cycle['outcome']} {cycle['version']}")
