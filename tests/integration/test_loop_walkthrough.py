"""docs/loop.md's walkthrough, through the public faces only: the `flywheel` CLI to register,
promote, run and watch the loop, and HTTP for everything else (the official `openai` client
chats with the calculator's `tools=`, as the walkthrough shows; examples/loop_traffic.py sends
chat traffic with that client and feedback with plain HTTP; another agent
stack's traces arrive by POST /v1/traces). A cycle
promotes, the server switches, SIGTERM stops the daemon, and a restarted daemon serves the
promoted version. The machinery, not learning: an untrained model (with the demo base's chat
template, whose tools block fits its context) under a gate that admits
any candidate (delta 0, epsilon 1, one new failure enough to decide), with the walkthrough's
config made small by overrides."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
SMALL = ["serve.port=0", "trigger.min_new_failures=20", "trigger.poll_s=0.3", "train.order=[sft]",
         "train.min_replay=0", "train.sft.train.steps=2", "eval.suites.add.tasks=4", "eval.suites.subtract.tasks=4",
         "eval.suites.add.max_tokens=8", "eval.suites.subtract.max_tokens=8", "eval.new_failures_max_tokens=8",
         # the cycle the 20th failure starts holds about 5 held-out new failures: the machinery, not the decision
         "gate.delta=0", "gate.epsilon=1", "gate.min_new_failures=1"]


def flywheel(*args: str):
    """`flywheel ARGS` in this process (the daemon alone runs as a process of its own)."""
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    done = CliRunner().invoke(app, list(args), terminal_width=200)
    assert done.exit_code == 0, done.output
    return done


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({proc.returncode}) while waiting for {what}:\n"
                                 + proc.stdout.read()[-3000:])
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def _status(data: Path) -> dict:
    return json.loads(flywheel("loop", "status", "--data-dir", str(data), "--json").stdout)


def _daemon(data: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "loop", "run",
                             str(REPO / "configs" / "loop_calculator.yaml"), f"data_dir={data}", *SMALL],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _served_version(url: str) -> str:
    r = httpx.post(url + "/chat/completions", json={"model": "flywheel", "max_tokens": 2,
                                                    "messages": [{"role": "user", "content": "What is 1 + 1?"}]})
    return r.json()["system_fingerprint"]


def _chat_with_tools(url: str) -> None:
    """docs/loop.md section 4: the official client passes the calculator's tools (what `flywheel
    env show calculator` prints); the response's id is a trace id that takes feedback with a
    verifier (the untrained model's reply is noise: only the faces are checked here;
    tests/integration/test_demo_base_client_tools.py checks the demo base's replies)."""
    from openai import OpenAI

    from flywheel.envs import load_env

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="flywheel", messages=[{"role": "user", "content": "What is 123 + 45?"}],
                                       tools=load_env("calculator").info()["tools"], temperature=0, max_tokens=8)
    assert r.system_fingerprint == "v1" and r.choices[0].finish_reason in ("length", "stop", "tool_calls")
    feedback = {"score": 0.0, "verifier": {"env": "calculator", "task": {"answer": "168"}}}
    assert httpx.post(f"{url}/traces/{r.id}/feedback", json=feedback).status_code == 200


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.rstrip().endswith("stopped"), out[-3000:]
    return out


@pytest.mark.slow  # processes killed and restarted, or the whole flow end to end: make test-all
def test_the_walkthrough_through_the_public_faces(tmp_path):
    from flywheel.demo.base import BASE_RECIPE
    from flywheel.models import TinySpec, build_tiny_model

    # untrained, with the demo base's chat template: a tools= prompt fits its 512 positions
    model = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=512,
                                                         template=BASE_RECIPE.template))
    data = tmp_path / "loop"
    assert "registered v1" in flywheel("registry", "register", str(model), "--data-dir", str(data)).stdout
    assert "promoted v1" in flywheel("registry", "promote", "v1", "--data-dir", str(data)).stdout
    proc = _daemon(data)
    try:
        url = _wait(lambda: (_status(data)["daemon"] or {}).get("url"), 120, "the server", proc)
        assert _served_version(url) == "v1"
        _chat_with_tools(url)
        traffic = subprocess.run([sys.executable, str(REPO / "examples" / "loop_traffic.py"), "--url", url,
                                  "--episodes", "30", "--max-tokens", "8",
                                  # a correction with every failure: the cycle that the 20th failure starts has
                                  # SFT rows however far the traffic has got by then
                                  "--correction-rate", "1"], capture_output=True, text=True, timeout=300)
        assert traffic.returncode == 0, traffic.stderr
        assert traffic.stdout.startswith("loop_traffic: episodes=30 plus_solved="), traffic.stdout
        # another agent stack's episodes arrive as traces (chat or raw completion), judged later
        agent = [{"id": "agent-1", "source": "agent", "messages": [{"role": "user", "content": "What is 5 + 7?"}],
                  "response": {"role": "assistant", "content": "13"}},
                 {"id": "agent-2", "source": "agent", "prompt": "5+7=", "response": {"role": "assistant", "content": "13"}}]
        assert httpx.post(url + "/traces", json=agent).json()["added"] == 2
        cycle = _wait(lambda: next((c for c in _status(data)["cycles"] if c["outcome"]), None), 300, "a cycle", proc)
        assert cycle["outcome"] == "promoted" and cycle["version"] == "v2", cycle
        assert cycle["new_failures"] > 0 and cycle["warnings"] == []
        _wait(lambda: _served_version(url) == "v2", 30, "the server to switch to v2", proc)
    finally:
        if proc.poll() is None and proc.returncode is None:
            out = _stop(proc)
    assert "c1: promoted (v2)" in out
    status = flywheel("loop", "status", "--data-dir", str(data)).stdout
    assert "daemon: stopped" in status and "production: v2" in status and "c1: promoted v2 from v1" in status
    assert "it last served v2" in status and "http://" not in status  # a stopped daemon serves nothing

    again = _daemon(data)  # a restart serves what was promoted, and takes feedback as before
    try:
        url = _wait(lambda: (s := _status(data)["daemon"] or {}).get("state") == "idle" and s.get("url"), 120,
                    "the restarted server", again)
        assert _served_version(url) == "v2"
        r = httpx.post(url + "/chat/completions", json={"model": "flywheel", "max_tokens": 2,
                                                        "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
        bad = httpx.post(f"{url}/traces/{r.json()['id']}/feedback", json={"label": "thumbs-down"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "label", bad.text
        ok = httpx.post(f"{url}/traces/{r.json()['id']}/feedback",
                        json={"label": "thumbs_down", "verifier": {"env": "calculator", "task": {"answer": "4"}}})
        assert ok.status_code == 200, ok.text
    finally:
        if again.poll() is None:
            _stop(again)
