"""The workspace reaches the host only after the run, all or nothing (copyback.py): exactly what
the run changed (the cold Sandbox's overlay: whiteouts, opaque directories; the copy mode and the
pool: a mirror), symlinks recreated and never followed, and nothing at all when the copy-back
cannot finish within wall_s + quota.COPY_BACK_S."""

from __future__ import annotations

import os
import time

import pytest

from flywheel.sandbox import copyback, probe, quota

EDIT = r"""
set -e
test "$(cat keep.txt)" = keep          # the run sees the host's files
echo changed > change.txt
rm gone.txt
rm -rf wholedir
rm -rf replaced && mkdir replaced && echo y > replaced/y   # an opaque directory in the overlay
rm partdir/a
mkdir -p new/deep && echo f > new/deep/f
ln -s /etc/passwd evil
rm link && mkdir link && echo inner > link/inner           # a symlink replaced by a directory
rm file_to_dir && mkdir file_to_dir
chmod 755 script.sh
"""


def _seed(ws, outside) -> None:
    for name, text in (("keep.txt", "keep"), ("change.txt", "old"), ("gone.txt", "gone"), ("script.sh", "echo")):
        (ws / name).write_text(text)
    os.chmod(ws / "script.sh", 0o644)
    for d, files in (("wholedir", ("a", "b")), ("replaced", ("x", "z")), ("partdir", ("a", "b"))):
        (ws / d).mkdir()
        for f in files:
            (ws / d / f).write_text(f)
    (ws / "link").symlink_to(outside)
    (ws / "file_to_dir").write_text("file")


def _tree(ws) -> dict[str, str]:
    out = {}
    for root, dirs, files in os.walk(ws):
        for name in dirs + files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, ws)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "<dir>"
            else:
                out[rel] = open(p).read()
    return out


EXPECTED = {"keep.txt": "keep", "change.txt": "changed\n", "script.sh": "echo", "replaced": "<dir>",
            "replaced/y": "y\n", "partdir": "<dir>", "partdir/b": "b", "new": "<dir>", "new/deep": "<dir>",
            "new/deep/f": "f\n", "evil": "-> /etc/passwd", "link": "<dir>", "link/inner": "inner\n",
            "file_to_dir": "<dir>"}


@pytest.mark.parametrize("mode", ["overlay", "copy"])
def test_cold_copy_back_is_exact(sandbox, tmp_path, monkeypatch, mode):
    if mode == "overlay" and probe.quota_mode() != "overlay":
        pytest.skip("no overlayfs in a user namespace here")
    monkeypatch.setattr(probe, "quota_mode", lambda: mode)
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    _seed(ws, outside)
    keep_mtime = (ws / "keep.txt").stat().st_mtime_ns
    r = sandbox.run(["/bin/sh", "-c", EDIT], workspace=ws)
    assert r.ok, r
    assert _tree(ws) == EXPECTED
    assert not outside.exists()  # nothing was written through the old symlink
    assert (ws / "script.sh").stat().st_mode & 0o777 == 0o755
    assert (ws / "keep.txt").stat().st_mtime_ns == keep_mtime  # untouched
    assert not [n for n in os.listdir(ws) if n.startswith(".flywheel-copyback-")]


def test_pool_copy_back_is_exact(pool, tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "outside"
    ws.mkdir()
    _seed(ws, outside)
    r = pool.run_python(f"import subprocess, sys\nsys.exit(subprocess.run(['/bin/sh', '-c', {EDIT!r}]).returncode)",
                        workspace=ws)
    assert r.ok, r
    assert _tree(ws) == EXPECTED and not outside.exists()


WRITE = "open('new.txt', 'w').write('new')\nopen('keep.txt', 'w').write('changed')"


def test_no_time_left_means_nothing_copied_back(sandbox, pool, tmp_path, monkeypatch):
    monkeypatch.setattr(quota, "COPY_BACK_S", -60.0)  # the copy-back deadline has passed when the run ends
    (tmp_path / "keep.txt").write_text("keep")
    for run in (lambda: sandbox.run_python(WRITE, workspace=tmp_path), lambda: pool.run_python(WRITE, workspace=tmp_path)):
        r = run()
        assert r.returncode == 0 and r.error == "workspace copy-back timeout", r
        assert "could not be copied back within the time limit" in r.stderr
        assert os.listdir(tmp_path) == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "keep"
    assert pool.run_python("import os; print(os.listdir())").stdout == "[]\n"  # the pool's copy was emptied


def test_deadline_during_staging_leaves_destination_as_it_was(tmp_path, monkeypatch):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir(), dst.mkdir()
    for i in range(20):
        (src / f"f{i}").write_text(f"new {i}")
        (dst / f"f{i}").write_text(f"old {i}")
    (dst / "extra").write_text("stays")
    real = copyback._copy_file

    def slow(*a):
        time.sleep(0.02)
        return real(*a)

    monkeypatch.setattr(copyback, "_copy_file", slow)
    with pytest.raises(copyback.CopyBackTimeout):
        copyback.copy_back(str(src), str(dst), deadline=time.monotonic() + 0.1)
    assert sorted(os.listdir(dst)) == sorted([f"f{i}" for i in range(20)] + ["extra"])  # no staging dir left
    assert all((dst / f"f{i}").read_text() == f"old {i}" for i in range(20))
    copyback.copy_back(str(src), str(dst), deadline=time.monotonic() + 30)
    assert sorted(os.listdir(dst)) == sorted(f"f{i}" for i in range(20))
    assert (dst / "f3").read_text() == "new 3"
