"""One loop process per store (loop/store_lock.py): a second holder is refused with the first's
pid and host, a dead holder leaves no stale lock, and the loop's commands refuse a held store
before touching it."""

import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest
import yaml
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.loop.store_lock import StoreLocked, hold_store


def test_a_second_holder_is_refused_with_the_first_ones_pid_and_host(tmp_path):
    with hold_store(tmp_path, "flywheel loop run"):
        with pytest.raises(StoreLocked, match=rf"pid {os.getpid()} on {socket.gethostname()} \(flywheel loop run\)"):
            with hold_store(tmp_path, "flywheel loop cycle"):
                pass
    with hold_store(tmp_path, "flywheel loop cycle"):  # released on exit
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from flywheel.loop.store_lock import hold_store
        with hold_store({str(tmp_path)!r}, "holder"):
            print("held", flush=True)
            time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(StoreLocked, match=rf"pid {child.pid} on .* \(holder\)"):
            with hold_store(tmp_path, "second"):
                pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with hold_store(tmp_path, "after the kill"):
        pass


def test_loop_commands_refuse_a_held_store_before_touching_it(tmp_path, monkeypatch):
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the commands' handlers stay out of pytest
    data = tmp_path / "data"
    config = tmp_path / "loop.yaml"
    config.write_text(yaml.safe_dump({"data_dir": str(data)}))
    with hold_store(data, "flywheel loop run"):
        for command in ("cycle", "run"):
            result = CliRunner().invoke(app, ["loop", command, str(config)])
            assert result.exit_code == 2, result.output
            assert f"is in use by pid {os.getpid()}" in result.stderr and "(flywheel loop run)" in result.stderr
    assert sorted(p.name for p in data.iterdir()) == ["loop.lock"]  # no store, no status file written
