"""A file with one huge line neither stalls the fine-tuning server nor fills its memory.

Outside testers uploaded a JSONL whose single line held a 50 MB message and created a job on
it: the create call blocked for 386 s and the server grew from 0.58 GB to 9.4 GB, because
every line was tokenized whole in the request. Here a real `flywheel serve --fine-tuning`
process takes a 50 MB and a 400 MB line: the upload is refused naming the line and the
per-line limit, a job on such a file (stored before the limit existed) is created at once
and fails naming the line, other requests keep answering meanwhile, and the peak memory of
the server and every process it started stays under 1 GB.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.jsonl import MAX_LINE_BYTES
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.background import free_port

# a real server process taking 50 MB and 400 MB lines (~16 s on 2 cores): make test-all; the
# per-line limit itself is unit-tested (tests/unit/test_jsonl.py)
pytestmark = pytest.mark.slow

GB = 2 ** 30
HEAD = b'{"messages": [{"role": "user", "content": "'
TAIL = b'"}, {"role": "assistant", "content": "ok"}]}\n'


class OneLongLine:
    """A file-like JSONL of one row whose user message is `size` bytes of 'a', made as it is
    read (the test itself never holds it)."""

    def __init__(self, size: int):
        self.parts = [HEAD, size, TAIL]

    def read(self, n: int = -1) -> bytes:
        while self.parts:
            part = self.parts[0]
            if isinstance(part, bytes):
                self.parts.pop(0)
                return part
            take = part if n < 0 else min(n, part)
            self.parts[0] = part - take
            if self.parts[0] == 0:
                self.parts.pop(0)
            return b"a" * take
        return b""


def peak_rss(pid: int) -> int:
    """The highest resident memory (VmHWM) of `pid` and of each process below it, in bytes."""
    peak = 0
    for p in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except FileNotFoundError:
            continue
        kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        peak = max(peak, kb * 1024)
    return peak


def descendants(pid: int) -> list[int]:
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []
    return children + [d for c in children for d in descendants(c)]


class Prober:
    """GET /v1/models every 50 ms on a thread; the slowest answer while it ran."""

    def __init__(self, url: str):
        self.url, self.slowest, self.answers = url, 0.0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                assert client.get(self.url + "/v1/models").status_code == 200
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.answers += 1
                self.stop.wait(0.05)

    def __enter__(self) -> "Prober":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("huge")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "serve", "--model", str(base),
                             "--name", "tiny", "--port", str(port), "--no-traces", "--fine-tuning",
                             "--data-dir", str(root / "data"), "--threads", "1", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not start: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.2)
    yield url, proc, root / "data"
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.mark.parametrize("size", [50 * 10 ** 6, 400 * 10 ** 6])
def test_an_upload_with_a_huge_line_is_refused_naming_it(server, size):
    url, proc, _ = server
    with Prober(url) as prober, httpx.Client(timeout=600) as client:
        r = client.post(url + "/v1/files", data={"purpose": "fine-tune"},
                        files={"file": ("huge.jsonl", OneLongLine(size), "application/jsonl")})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "file"
    assert f"line 1 is {size + len(HEAD) + len(TAIL) - 1:,} bytes, over the limit of {MAX_LINE_BYTES:,} bytes " \
           "per line" in error["message"]
    assert prober.answers > 0 and prober.slowest < 1.0, f"other requests waited {prober.slowest:.2f} s"
    assert peak_rss(proc.pid) < GB, f"the server's memory peaked at {peak_rss(proc.pid) / GB:.2f} GB"
    assert httpx.get(url + "/v1/files").json()["data"] == []  # nothing stored


def test_a_job_on_a_stored_file_with_a_huge_line_is_created_at_once_and_fails_naming_it(server):
    """A file stored before the per-line limit existed (staged here with a larger one)."""
    url, proc, data_dir = server
    source = data_dir / "old.jsonl"
    with source.open("wb") as out:
        line = OneLongLine(50 * 10 ** 6)
        while chunk := line.read(2 ** 20):
            out.write(chunk)
    store = JobStore(data_file_url(data_dir), data_dir / "files")
    try:
        with source.open("rb") as f:
            staged = store.stage(f, "old.jsonl", "fine-tune", max_bytes=2 ** 30, max_line_bytes=2 ** 27)
        file_id = store.add_file("default", "old.jsonl", "fine-tune", staged)["id"]
    finally:
        store.close()
        source.unlink()
    with Prober(url) as prober, httpx.Client(timeout=600) as client:
        start = time.monotonic()
        r = client.post(url + "/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id})
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        job = r.json()
        assert job["status"] in ("validating_files", "failed") and took < 1.0, f"create took {took:.2f} s"
        deadline = time.monotonic() + 120
        while job["status"] == "validating_files" and time.monotonic() < deadline:
            time.sleep(0.1)
            job = client.get(f"{url}/v1/fine_tuning/jobs/{job['id']}").json()
    assert job["status"] == "failed", job
    assert job["error"]["code"] == "invalid_training_file"
    assert f"line 1: {50 * 10 ** 6 + len(HEAD) + len(TAIL) - 1:,} bytes, over the limit of {MAX_LINE_BYTES:,} bytes per line" in job["error"]["message"]
    assert prober.slowest < 1.0, f"other requests waited {prober.slowest:.2f} s"
    assert peak_rss(proc.pid) < GB, f"memory peaked at {peak_rss(proc.pid) / GB:.2f} GB"
