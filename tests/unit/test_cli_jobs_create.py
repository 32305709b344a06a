"""`flywheel jobs create` makes reinforcement jobs: the grader from --grader (a JSON file or
inline JSON) or --env, sent in the body the API takes (checked with jobs.requests), against a
loopback server that records the request."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.jobs.requests import JobRequest

STRING_CHECK = {"type": "string_check", "name": "right", "input": "{{ sample.output_text }}",
                "reference": "{{ item.answer }}", "operation": "like"}


@pytest.fixture
def server():
    """A server that answers POST /v1/fine_tuning/jobs with a queued job; `.bodies` are the requests."""
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            out = json.dumps({"id": "ftjob-1", "object": "fine_tuning.job", "status": "queued",
                              "model": body["model"], "method": body["method"]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.bodies = bodies
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()


def create(server, *args):
    return CliRunner().invoke(app, ["jobs", "create", "--model", "tiny", "--training-file", "file-1",
                                    "--base-url", server.url, *args])


def test_a_reinforcement_job_with_a_grader_file(server, tmp_path):
    path = tmp_path / "grader.json"
    path.write_text(json.dumps(STRING_CHECK))
    out = create(server, "--method", "reinforcement", "--grader", str(path), "--set", "batch_size=2")
    assert out.exit_code == 0, out.output
    assert out.stdout == "ftjob-1  queued\n"
    body = server.bodies[-1]
    assert body["method"] == {"type": "reinforcement",
                              "reinforcement": {"grader": STRING_CHECK, "hyperparameters": {"batch_size": 2}}}
    req = JobRequest.parse(body)  # what the API accepts
    assert req.method_type == "reinforcement" and req.grader == STRING_CHECK


def test_inline_json_and_the_environment_grader_imply_reinforcement(server):
    env_grader = {"type": "flywheel_environment", "env": "calculator", "settings": {"max_digits": 2}}
    assert create(server, "--grader", json.dumps(env_grader)).exit_code == 0
    assert JobRequest.parse(server.bodies[-1]).grader == env_grader
    assert create(server, "--env", "calculator").exit_code == 0
    body = server.bodies[-1]
    assert body["method"]["type"] == "reinforcement"
    assert JobRequest.parse(body).grader == {"type": "flywheel_environment", "env": "calculator"}


def test_supervised_stays_the_default_and_sends_no_grader(server):
    assert create(server).exit_code == 0
    assert server.bodies[-1]["method"] == {"type": "supervised", "supervised": {"hyperparameters": {}}}


@pytest.mark.parametrize("args, message", [
    (["--method", "reinforcement"], "--method reinforcement needs a grader: --grader FILE.json"),
    (["--method", "dpo", "--env", "calculator"], "--grader and --env are for --method reinforcement, not dpo"),
    (["--grader", "{}", "--env", "calculator"], "--grader and --env: choose one"),
    (["--grader", "{not json"], "--grader: not JSON (Expecting property name"),
    (["--grader", '{"name": "x"}'], 'a grader is a JSON object with a "type"'),
    (["--grader", "no-such-file.json"], "--grader no-such-file.json: not inline JSON and not a readable file"),
])
def test_refusals_are_one_line_and_send_nothing(server, args, message):
    out = create(server, *args)
    assert out.exit_code == 2, out.output
    assert out.stderr.startswith("error: ") and message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert server.bodies == []


def test_the_method_choices_include_reinforcement():
    out = CliRunner().invoke(app, ["jobs", "create", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert "supervised|dpo|reinforcement" in out.stdout and "--grader" in out.stdout and "--env" in out.stdout
