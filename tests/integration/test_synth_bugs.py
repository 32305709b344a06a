"""synth-bugs: minimal source edits at AST positions, mutants kept only when a test catches them,
gold patches that re-apply cleanly (also with `patch -p1`), and the CLI on local repositories."""

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app as cli
from flywheel.envs.code_repair import load
from flywheel.envs.grading import grade
from flywheel.envs.patches import apply_patch, materialize, parse_patch
from flywheel.envs.repo import checkout, CodeRepairError, CORPORA, fingerprint, read_instances
from flywheel.envs.synth_bugs import find_mutations, synthesize
from flywheel.rollout.play import play

sandbox = pytest.importorskip("flywheel.sandbox")
if not sandbox.sandbox_available():
    pytest.skip("bubblewrap sandbox not available", allow_module_level=True)

MINILIB = CORPORA / "minilib"
SRC = '''\
def clamp(x, lo, hi):
    """Clamp x."""
    if x < lo:  # too small
        return lo
    return min(x,   hi)  # odd spacing is kept


def total(xs):
    s = 0
    for x in xs:
        s += x * 2
    return s and not False
'''


def test_mutations_edit_the_source_text_in_place(tmp_path):
    (tmp_path / "lib.py").write_text(SRC)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_lib.py").write_text("def test_x():\n    assert 1 + 1 == 2\n")
    muts = find_mutations(tmp_path)
    assert {m.path for m in muts} == {"lib.py"}  # tests are never mutated
    got = {(m.kind, SRC[m.start:m.end], m.replacement) for m in muts}
    for expected in [("compare", "<", "<="), ("binop", "+=", "-="), ("binop", "*", "+"), ("constant", "0", "1"),
                     ("constant", "2", "3"), ("constant", "False", "True"), ("boolop", "and", "or"),
                     ("negate", "not ", ""), ("negate", "x < lo", "not x < lo"), ("remove", "s += x * 2", "pass"),
                     ("remove", "return lo", "pass")]:
        assert expected in got, expected
    assert not any(SRC[m.start:m.end] == '"""Clamp x."""' for m in muts)  # docstrings are left alone
    for m in muts:
        if "\n" in SRC[m.start:m.end]:  # a whole `if` block removed
            continue
        mutant = m.apply(SRC).splitlines()
        changed = [i for i, (a, b) in enumerate(zip(SRC.splitlines(), mutant)) if a != b]
        assert len(mutant) == len(SRC.splitlines()) and len(changed) == 1  # one line, comments kept
        assert "# too small" in m.apply(SRC) and "min(x,   hi)" in m.apply(SRC) or m.kind == "remove"


def test_mutation_offsets_are_exact_with_non_ascii_text(tmp_path):
    (tmp_path / "u.py").write_text('def f(s):\n    return "héllo wörld" + s if len(s) > 2 else s\n')
    muts = find_mutations(tmp_path)
    cmp = next(m for m in muts if m.kind == "compare")
    assert cmp.apply((tmp_path / "u.py").read_text()).endswith('"héllo wörld" + s if len(s) >= 2 else s\n')


@pytest.fixture(scope="module")
def few():
    return synthesize("minilib", max_n=8, seed=1)


def test_synthesized_instances_are_valid(few):
    instances, report = few
    assert len(instances) == 8 and report.kept == 8 and report.tests == 90 and report.failing_before == 0
    for inst in instances:
        f2p, p2p = set(inst.FAIL_TO_PASS), set(inst.PASS_TO_PASS)
        assert f2p and not f2p & p2p and len(f2p | p2p) == 90
        assert inst.repo == "minilib" and inst.base_commit == fingerprint(MINILIB) and inst.test_patch == ""
        assert all(t in inst.problem_statement for t in inst.FAIL_TO_PASS[:5])
        assert "Error" in inst.problem_statement
        (fp,) = parse_patch(inst.patch)  # one file, a/ b/ prefixes
        assert inst.patch.startswith(f"diff --git a/{fp.path} b/{fp.path}\n--- a/{fp.path}\n+++ b/{fp.path}\n")
    assert len({i.instance_id for i in instances}) == 8


def test_gold_patches_reapply_cleanly(few, tmp_path):
    instances, _ = few
    for inst in instances:
        work = tmp_path / inst.instance_id
        materialize(inst, work)
        assert fingerprint(work) != inst.base_commit  # the bug is there
        if shutil.which("patch"):
            dry = subprocess.run(["patch", "-p1", "--dry-run", "--quiet"], input=inst.patch, text=True, cwd=work,
                                 capture_output=True)
            assert dry.returncode == 0, dry.stdout + dry.stderr
        if shutil.which("git"):  # outside a repository `git apply` works on plain files, like patch
            check = subprocess.run(["git", "apply", "--check", "-"], input=inst.patch, text=True, cwd=work,
                                   capture_output=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
            assert check.returncode == 0, check.stderr
        apply_patch(work, inst.patch)
        assert fingerprint(work) == inst.base_commit  # the gold patch restores the original exactly


def test_gold_grades_one_and_the_mutant_fails_its_tests(few, tmp_path):
    inst = few[0][0]
    base, fixed = tmp_path / "base", tmp_path / "fixed"
    materialize(inst, base)
    materialize(inst, fixed)
    assert grade(inst, base, base).fail_to_pass == 0.0
    apply_patch(fixed, inst.patch)
    g = grade(inst, base, fixed)
    assert g.resolved and g.files_changed == 1 and g.diff.startswith("diff --git a/")


def test_bundled_corpus_yields_at_least_50_valid_instances(tmp_path):
    instances, report = synthesize("minilib", max_n=100, seed=0)
    assert len(instances) >= 50, report
    assert len(set(i.extra["synth"]["function"] for i in instances)) >= 30  # spread over the library
    for inst in instances[::7]:  # a sample: the gold patch re-applies and grades 1
        base, fixed = tmp_path / f"b-{inst.instance_id}", tmp_path / f"f-{inst.instance_id}"
        materialize(inst, base)
        checkout(base, "", fixed)
        apply_patch(fixed, inst.patch)
        assert grade(inst, base, fixed).resolved, inst.instance_id


def make_repo(root: Path, failing_test: bool = False) -> Path:
    (root / "shapes").mkdir(parents=True)
    (root / "shapes/__init__.py").write_text("")
    (root / "shapes/area.py").write_text(textwrap.dedent('''\
        def rect(w, h):
            if w < 0 or h < 0:
                raise ValueError("negative side")
            return w * h


        def square(s):
            return rect(s, s)


        def triangle(b, h):
            return b * h / 2
        '''))
    (root / "tests").mkdir()
    (root / "tests/test_area.py").write_text(textwrap.dedent('''\
        from shapes.area import rect, square, triangle


        def test_rect():
            assert rect(2, 3) == 6


        def test_rect_negative():
            try:
                rect(-1, 2)
            except ValueError:
                return
            assert False, "no error"


        def test_square():
            assert square(4) == 16


        class TestTriangle:
            def test_area(self):
                assert triangle(4, 3) == 6
        ''') + ("\n\ndef test_already_broken():\n    assert rect(1, 1) == 2\n" if failing_test else ""))
    return root


def test_cli_on_a_local_folder_and_playing_its_tasks(tmp_path):
    repo = make_repo(tmp_path / "repo", failing_test=True)
    out = tmp_path / "out/tasks.jsonl"
    res = CliRunner().invoke(cli, ["env", "synth-bugs", str(repo), "--out", str(out), "--max", "5", "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("5 instances -> ") and "4 tests" in res.output
    rows = read_instances(out)
    assert all(r.repo == str(repo) for r in rows)
    assert all("tests/test_area.py::test_already_broken" not in r.FAIL_TO_PASS + r.PASS_TO_PASS for r in rows)
    assert any("tests/test_area.py::TestTriangle::test_area" in r.FAIL_TO_PASS + r.PASS_TO_PASS for r in rows)
    env = load(instances=str(out))
    results = asyncio.run(play(env, env.tasks("train") + env.tasks("test"), env.scripted_policy()))
    assert results and all(r.reward == 1.0 for r in results), [(r.task.id, r.metrics, r.error) for r in results]
    (repo / "shapes/area.py").write_text("changed\n")
    with pytest.raises(CodeRepairError, match="changed since the instance was made"):
        materialize(rows[0], tmp_path / "stale")


def test_cli_errors(tmp_path):
    empty = tmp_path / "empty"
    (empty / "pkg").mkdir(parents=True)
    (empty / "pkg/m.py").write_text("def f():\n    return 1\n")
    res = CliRunner().invoke(cli, ["env", "synth-bugs", str(empty), "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "no passing tests found" in res.output
    res = CliRunner().invoke(cli, ["env", "synth-bugs", str(tmp_path / "nope"), "--out", str(tmp_path / "x.jsonl")])
    assert res.exit_code == 2 and "neither a folder nor a bundled corpus" in res.output


@pytest.mark.skipif(shutil.which("git") is None, reason="git not installed")
def test_git_repository_at_a_commit(tmp_path):
    repo = make_repo(tmp_path / "g")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    (repo / "shapes/area.py").write_text("uncommitted garbage\n")  # the commit is used, not the work tree
    instances, _ = synthesize(str(repo), max_n=2, seed=0, rev="HEAD")
    sha = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert instances and all(i.base_commit == sha for i in instances)
    with tempfile.TemporaryDirectory() as d:
        materialize(instances[0], Path(d))
        apply_patch(Path(d), instances[0].patch)
        assert "def triangle" in (Path(d) / "shapes/area.py").read_text()
    rows = [json.loads(json.dumps(i.row())) for i in instances]
    assert all(r["bug_patch"] and r["FAIL_TO_PASS"] for r in rows)


def test_crlf_files_and_odd_line_separators_survive(tmp_path):
    """Offsets, diffs and patches split lines as Python and diff do (not str.splitlines)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "lib.py").write_bytes('def f(x):\r\n    """doc\x0c"""\r\n    s = "\u2028"\r\n    return x + 1\r\n'.encode())
    (tmp_path / "tests/test_lib.py").write_text("from lib import f\n\n\ndef test_f():\n    assert f(1) == 2\n")
    instances, report = synthesize(str(tmp_path), max_n=10)
    assert report.kept == 3 and report.no_failure == 1  # `s = ...` is dead code
    for inst in instances:
        work = tmp_path.parent / f"{tmp_path.name}-{inst.instance_id}"
        materialize(inst, work)
        assert b"\r\n" in (work / "lib.py").read_bytes()
        apply_patch(work, inst.patch)
        assert fingerprint(work) == inst.base_commit
