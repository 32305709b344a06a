"""`flywheel loop run` as a user runs it: a live server takes chat requests (recorded as traces)
and traces + feedback over HTTP; enough failures trigger a cycle, whose promotion the server
picks up; SIGTERM stops it cleanly and `flywheel loop status` tells the story."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import validate
from flywheel.envs import load_env
from flywheel.loop.cycle import LoopStores
from flywheel.service.daemon import STATUS_FILE
from flywheel.loop.loop_config import LoopConfig

pytest.importorskip("uvicorn")


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited ({proc.returncode}) while waiting for {what}:\n"
                                 + proc.stdout.read()[-3000:])
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _status(data_dir: Path) -> dict:
    try:
        return json.loads((data_dir / STATUS_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_daemon_serves_ingests_cycles_promotes_and_stops_on_sigterm(tmp_path, untrained_tiny):
    """The machinery, not learning: a 2-step cycle from an untrained model under a gate that
    admits any candidate (delta 0, epsilon 1)."""
    data = tmp_path / "data"
    raw = {
        "data_dir": str(data), "serve": {"port": 0},
        "trigger": {"min_new_failures": 30, "poll_s": 0.3},
        "train": {"order": ["rl"], "rl": {
            "train": {"steps": 2, "groups_per_step": 2, "group_size": 8}, "sampling": {"max_tokens": 6},
            "eval": {"tasks": 4}, "log": {"progress": False}, "threads": 2}},
        "eval": {"suites": {"arith": {"env": "arithmetic", "tasks": 8, "max_tokens": 6}}, "new_failures_max_tokens": 6},
        "gate": {"delta": 0.0, "epsilon": 1.0},
    }
    cfg = validate(raw, LoopConfig)
    with LoopStores(cfg) as fw:
        fw.registry.promote(fw.registry.register(untrained_tiny).id, "initial")
    path = tmp_path / "loop.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "loop", "run", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait(lambda: _status(data).get("url"), 120, "the server", proc)
        with httpx.Client(base_url=url, timeout=60) as http:
            # served requests become traces with the served version
            for _ in range(3):
                r = http.post("/chat/completions", json={"model": "flywheel", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": "12+34="}]})
                assert r.status_code == 200 and r.json()["system_fingerprint"] == "v1"
            # an agent stack's failures arrive as traces, their verdicts later as feedback
            tasks = load_env("arithmetic").tasks("train", n=40, seed=3)
            body = [{"id": f"a{i}", "source": "agent", "messages": [{"role": "user", "content": t.prompt}],
                     "response": {"role": "assistant", "content": "0"}} for i, t in enumerate(tasks)]
            assert http.post("/traces", json=body).json()["added"] == 40
            assert _status(data).get("state") == "idle"
            for i, t in enumerate(tasks):
                r = http.post(f"/traces/a{i}/feedback",
                              json={"score": 0, "verifier": {"env": "arithmetic", "task": dataclasses.asdict(t)}})
                assert r.status_code == 200, r.text
            _wait(lambda: _status(data).get("cycles_run", 0) >= 1, 300, "a cycle", proc)
            last = _status(data)["last_cycle"]
            assert last["outcome"] == "promoted" and last["version"] == "v2", last
            _wait(lambda: http.post("/chat/completions", json={
                "model": "flywheel", "max_tokens": 2, "messages": [{"role": "user", "content": "1+1="}]}
            ).json()["system_fingerprint"] == "v2", 30, "the server to switch to v2", proc)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: stopping" in out and out.rstrip().endswith("stopped")
    assert _status(data)["state"] == "stopped"
    with LoopStores(cfg) as fw:
        assert fw.registry.production().id == "v2"
        assert fw.traces.count(source="serve") >= 4  # 3 checks + the switch probe, recorded by the server
        assert fw.traces.count(source="agent") == 40
    status = CliRunner().invoke(app, ["loop", "status", "--data-dir", str(data)])
    assert status.exit_code == 0, status.output
    status = status.stdout
    assert "daemon: stopped" in status and "production: v2" in status and "c1: promoted v2 from v1" in status
    assert "it last served v2" in status and "http://" not in status  # a stopped daemon serves nothing
    by_config = CliRunner().invoke(app, ["loop", "status", str(path)])  # the config's data_dir
    assert by_config.exit_code == 0 and by_config.stdout == status
