"""code_repair: SWE-style bug fixing in a sandboxed copy of a repository.

An instance is a JSONL row with SWE-bench's field names: instance_id, repo, base_commit,
problem_statement, patch (gold fix), test_patch, FAIL_TO_PASS, PASS_TO_PASS (test ids
"tests/test_x.py::test_name", lists or JSON strings of lists). `repo` is a bundled corpus name
(src/flywheel/envs/corpora/<name>), a git repository or a plain folder (a relative path is taken
from the JSONL file's folder). `base_commit` is a commit of a git repository, or for a folder
the fingerprint `synth-bugs` recorded ("sha256:...", checked) or "". An optional `bug_patch`
(written by `flywheel env synth-bugs`) is applied on top of that to make the buggy state.
An optional `split` ("train" / "test") places an instance; the others go by a hash of their
problem (`assign_sides`: repository name, bug and statement; a fifth test), so one problem is
never on both sides, and a split with no instance is an error rather than all of them.

Episode, as in SWE-bench: the agent works in a fresh copy of the buggy repository with `bash`
(run in the sandbox; timeout; capped output), `read_file`, `str_replace` and `submit`. Grading
uses another fresh copy: the agent's changes to non-test files are carried over, test files
stay as in the base and `test_patch` is applied, then FAIL_TO_PASS + PASS_TO_PASS run in the
sandbox through the lean runner (corpora/_lean_runner.py) forked from a warm SandboxPool, in a
worker thread. Reward 1 iff all of them pass, so editing or deleting tests cannot help;
`fail_to_pass` / `pass_to_pass` (weight 0) are the passing fractions.

The pieces: repo.py (instances, repositories), patches.py (diffs), grading.py (running tests,
grading); here: the agent's tools, the env, the environment and the gold-patch policy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import shutil
import tempfile
import threading
import weakref
import zlib
from pathlib import Path, PurePosixPath

from flywheel.canonical import canonical
from flywheel.envs.base import Env, Environment, Policy, check_split, sample_of
from flywheel.envs.grading import Grade, grade, shared_pool
from flywheel.envs.patches import materialize, parse_patch, split_lines
from flywheel.envs.repo import CodeRepairError, DEFAULT_CORPUS, IGNORED, Instance, copy_tree, parse_instance, precompile, read_instances
from flywheel.envs.rubric import EpisodeState, RewardFn, Rubric
from flywheel.envs.splits import side_of, split_score
from flywheel.envs.synth_bugs import cached_corpus_instances
from flywheel.envs.tool_env import ToolEnv, ToolLimits
from flywheel.envs.tools import EpisodeFinished, Tool, ToolError
from flywheel.sandbox import Limits, Sandbox
from flywheel.types import Task


class RepoTools:
    """The agent's tools on one workspace; paths are relative to the repository root."""

    def __init__(self, root: Path, sandbox, max_bash_timeout_s: int = 60, max_read_lines: int = 300):
        self.root, self.real_root = root, root.resolve()
        self.sandbox, self.max_bash_timeout_s, self.max_read_lines = sandbox, max_bash_timeout_s, max_read_lines
        self.setup_error: str | None = None
        self.output_bytes = 64 << 10  # a command printing more is stopped (the sandbox kills it)

    def _path(self, tool: str, path: str) -> Path:
        if self.setup_error:
            raise ToolError("exception", f"{tool}: the workspace could not be prepared: {self.setup_error}")
        p = PurePosixPath(path.strip())
        if not path.strip():
            raise ToolError("bad_arguments", f"{tool}: empty path")
        if p.is_absolute():
            hint = f" such as {str(p)[len('/workspace/'):]!r}" if str(p).startswith("/workspace/") else ""
            raise ToolError("bad_arguments", f"{tool}: absolute path {path!r} refused; use a path relative to the "
                                             f"repository root{hint}")
        full = (self.root / p).resolve()
        if full != self.real_root and not full.is_relative_to(self.real_root):
            raise ToolError("bad_arguments", f"{tool}: {path!r} is outside the repository")
        return full

    def bash(self, command: str, timeout: int = 10) -> str:
        """Run a bash command in the repository root (the working directory; no network).

        Args:
            command: shell command, e.g. "ls -R", "grep -rn parse src" or "python -m pytest -q tests/test_x.py".
            timeout: seconds before the command is killed (capped by the environment).
        """
        if self.setup_error:
            raise ToolError("exception", f"bash: the workspace could not be prepared: {self.setup_error}")
        t = max(1, min(int(timeout), self.max_bash_timeout_s))
        res = self.sandbox.run(["bash", "-c", "exec 2>&1\n" + command], workspace=str(self.root),
                               limits=Limits(wall_s=float(t), cpu_s=t, memory_mb=1024, output_bytes=self.output_bytes))
        out = (res.stdout or "") + (res.stderr or "")
        status = (f"[killed: timed out after {t} s]" if res.timed_out else
                  f"[killed: more than {self.output_bytes} bytes of output]" if res.truncated else
                  f"[killed: {res.error}]" if res.error else f"[exit code {res.returncode}]")
        return (out.rstrip("\n") + "\n" + status).lstrip("\n")

    def read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Show a file's lines with their numbers.

        Args:
            path: file path relative to the repository root, e.g. "pkg/module.py".
            start_line: first line to show (1-based).
            end_line: last line to show (inclusive); default: to the end, at most 300 lines.
        """
        full = self._path("read_file", path)
        if full.is_dir():
            entries = sorted(e.name + ("/" if e.is_dir() else "") for e in full.iterdir() if e.name not in IGNORED)
            raise ToolError("bad_arguments", f"read_file: {path!r} is a directory; entries: {', '.join(entries)}")
        if not full.is_file():
            raise ToolError("bad_arguments", f"read_file: {path!r} does not exist")
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            raise ToolError("bad_arguments", f"read_file: {path!r} is a binary file")
        lines = [ln.rstrip("\r\n") for ln in split_lines(data.decode("utf-8", errors="replace"))]
        if start_line < 1 or (lines and start_line > len(lines)) or (end_line is not None and end_line < start_line):
            raise ToolError("bad_arguments", f"read_file: bad line range {start_line}-{end_line} "
                                             f"({path!r} has {len(lines)} lines)")
        last = len(lines) if end_line is None else min(end_line, len(lines))
        last = min(last, start_line + self.max_read_lines - 1)
        shown = "\n".join(f"{n:>5}\t{lines[n - 1]}" for n in range(start_line, last + 1))
        cut = last < len(lines) and (end_line is None or last < end_line)  # stopped by max_read_lines
        more = f"; call again with start_line={last + 1} for more" if cut else ""
        return f"{path} (lines {start_line}-{last} of {len(lines)}{more})\n{shown}"

    def str_replace(self, path: str, old: str, new: str) -> str:
        """Edit a file: replace `old`, which must occur exactly once, with `new`.

        Args:
            path: file path relative to the repository root.
            old: the exact text to replace (whitespace and indentation included); add neighbouring lines
                to make it unique.
            new: the replacement text.
        """
        full = self._path("str_replace", path)
        if not full.is_file():
            raise ToolError("bad_arguments", f"str_replace: {path!r} does not exist (create files with bash)")
        if not old:
            raise ToolError("bad_arguments", "str_replace: 'old' is empty")
        try:
            text = full.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError("bad_arguments", f"str_replace: {path!r} is not UTF-8 text") from None
        count = text.count(old)
        if count != 1:
            raise ToolError("bad_arguments", f"str_replace: the old text occurs {count} times in {path!r}; it must "
                            "occur exactly once" + (" (whitespace and indentation must match)" if count == 0 else
                                                    " (include more surrounding lines)"))
        at = text.index(old)
        full.write_bytes(text.replace(old, new, 1).encode("utf-8"))
        first = text.count("\n", 0, at) + 1
        return (f"edited {path}: replaced lines {first}-{first + old.count(chr(10))} with "
                f"{new.count(chr(10)) + 1} line(s)")

    def submit(self) -> str:
        """Submit the current state of the repository for grading; this ends the episode."""
        raise EpisodeFinished(True, "submitted; the change will now be graded by the repository's tests")


# ---------------------------------------------------------------- the environment

SYSTEM = ("You are a software engineer fixing a bug in a Python repository, which is your working directory. "
          "Tools: `bash` runs a shell command there (no network), `read_file` shows numbered lines, "
          "`str_replace` replaces text that occurs exactly once in a file, `submit` ends the episode. "
          "Your change is graded by running the repository's tests; test files are restored before grading, "
          "so fix the code, not the tests.")


class CodeRepairEnv(ToolEnv):
    """One episode: a fresh workspace, the tools on it, grading at the end, then cleanup."""

    def __init__(self, spec: "CodeRepairEnvironment", task: Task):
        self.spec, self.inst = spec, spec.instance_of(task)
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-ws-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.repo_tools = RepoTools(self.root, Sandbox(unsafe=spec.unsafe), spec.max_bash_timeout_s)
        t = self.repo_tools
        tools = [Tool.from_function(t.bash, timeout_s=spec.max_bash_timeout_s + 15.0),
                 Tool.from_function(t.read_file, timeout_s=15.0), Tool.from_function(t.str_replace, timeout_s=15.0),
                 Tool.from_function(t.submit, timeout_s=15.0)]
        super().__init__(task, tools, spec.rubric, spec.limits)
        self.state.scratch.update(env=self)
        self._ready = False

    def _setup(self) -> None:
        try:
            copy_tree(self.spec.base_snapshot(self.inst), self.root, keep_pycache=True)
        except (CodeRepairError, OSError) as e:
            self.repo_tools.setup_error = str(e)
            self.state.metrics["setup_error"] = 1.0

    async def initial_observation(self):
        if not self._ready:
            self._ready = True
            await asyncio.to_thread(self._setup)
        return self.task.prompt

    async def step(self, action: str):
        if not self._ready:
            await self.initial_observation()
        result = await super().step(action)
        if result.done:
            await asyncio.to_thread(self._cleanup)
        return result

    async def graded(self) -> Grade:
        """The grade of this episode (computed once, in a worker thread)."""
        st = self.state
        if "grade" not in st.scratch:
            st.scratch["grade"] = asyncio.ensure_future(asyncio.to_thread(self._grade))
        return await st.scratch["grade"]

    def _grade(self) -> Grade:
        if self.repo_tools.setup_error:
            return Grade(error=f"setup failed: {self.repo_tools.setup_error}")
        try:
            g = grade(self.inst, self.spec.base_snapshot(self.inst), self.root, self.spec.pool(),
                      self.spec.per_test_timeout_s, self.spec.unsafe)
        except Exception as e:  # the grader's own failure ends as reward 0 and a metric, never a crash
            g = Grade(error=f"{type(e).__name__}: {e}")
        m = self.state.metrics
        m.update(files_changed=float(g.files_changed), test_files_touched=float(len(g.test_files_touched)),
                 tests_error=float(g.tests_error is not None), grading_error=float(g.error is not None))
        self.state.scratch["diff"] = g.diff
        return g


def instance_key(repo: str, bug_patch: str, problem_statement: str) -> str:
    """One text per problem: the repository's name, the bug and the statement (not the id, not
    the base commit's fingerprint, so a problem keeps its side across versions of a corpus)."""
    return canonical([PurePosixPath(repo.rstrip("/")).name or repo, bug_patch, problem_statement])


def assign_sides(instances: list[Instance], test_fraction: float) -> dict[str, str]:
    """instance_id -> split. An instance's own `split` wins and binds every instance of the same
    problem (`instance_key`; two of them marked differently is a CodeRepairError); the other
    problems go by hash (envs/splits.py). When that leaves no test (or no train) problem while
    two or more problems are unmarked, the lowest-scoring unmarked train problem moves to test
    (the highest-scoring unmarked test problem to train)."""
    groups: dict[str, list[Instance]] = {}
    for inst in instances:
        groups.setdefault(instance_key(inst.repo, inst.bug_patch, inst.problem_statement), []).append(inst)
    side: dict[str, str] = {}
    unmarked: list[str] = []
    for key, group in groups.items():
        marked = {i.split for i in group if i.split}
        if len(marked) > 1:
            ids = ", ".join(f"{i.instance_id!r} ({i.split})" for i in group if i.split)
            raise CodeRepairError(f"instances {ids} are one problem (same repository, bug and statement) "
                                  "but marked with different splits")
        if marked:
            side[key] = marked.pop()
        else:
            side[key] = side_of("code_repair\0" + key, test_fraction)
            unmarked.append(key)
    for empty, full, pick in (("test", "train", min), ("train", "test", max)):
        movable = [k for k in unmarked if side[k] == full]
        if empty not in side.values() and movable and list(side.values()).count(full) >= 2:
            side[pick(movable, key=lambda k: split_score("code_repair\0" + k))] = empty
    return {i.instance_id: side[k] for k, group in groups.items() for i in group}


class CodeRepairEnvironment(Environment):
    name = "code_repair"
    description = "SWE-style repair: fix a bug in a sandboxed repository until its tests pass (bash, read_file, " \
                  "str_replace, submit)"
    answer_doc = ("the gold patch (a unified diff) that fixes the bug: what the scripted policy applies; the "
                  "grade is the instance's tests, never a comparison with this patch")
    metadata_doc = ("`instance`: the instance row (an instances JSONL line: instance_id, repo, base_commit, "
                    "problem_statement, patch, test_patch, FAIL_TO_PASS, PASS_TO_PASS, bug_patch), from which the "
                    "grader rebuilds the buggy repository and runs its tests")

    def __init__(self, instances: list[Instance], source: str = "", limits: ToolLimits | None = None,
                 max_bash_timeout_s: int = 60, per_test_timeout_s: float = 5.0, unsafe: bool | None = None,
                 test_fraction: float = 0.2):
        if not instances:
            raise CodeRepairError("no instances")
        self.instances, self.source, self.unsafe = instances, source, unsafe
        self.limits = limits or ToolLimits(max_turns=30, max_observation_tokens=4096, episode_timeout_s=900.0)
        self.max_bash_timeout_s, self.per_test_timeout_s = int(max_bash_timeout_s), float(per_test_timeout_s)
        self.test_fraction = test_fraction
        self.rubric = Rubric([RewardFn(self._resolved, 1.0, "resolved"), RewardFn(self._f2p, 0.0, "fail_to_pass"),
                              RewardFn(self._p2p, 0.0, "pass_to_pass")])
        self._snapshots: dict[tuple, Path] = {}
        self._snap_lock = threading.Lock()
        self._snap_root = Path(tempfile.mkdtemp(prefix="flywheel-code-repair-"))
        weakref.finalize(self, shutil.rmtree, str(self._snap_root), True)
        tmp = RepoTools(self._snap_root, None)
        self.tool_schemas = [Tool.from_function(f).schema for f in (tmp.bash, tmp.read_file, tmp.str_replace,
                                                                     tmp.submit)]
        self._by_id = {i.instance_id: i for i in instances}
        self._sides = assign_sides(instances, test_fraction)

    def pool(self):
        return shared_pool(self.unsafe)

    def instance_of(self, task: Task) -> Instance:
        """The task's instance (rebuilt from its metadata when the task came from elsewhere)."""
        inst = self._by_id.get(task.id)
        if inst is None or inst.row() != task.metadata.get("instance"):
            inst = parse_instance(task.metadata.get("instance"), f"task {task.id}")
        return inst

    def base_snapshot(self, inst: Instance) -> Path:
        """The buggy repository of an instance, materialized once per environment (read-only use)."""
        key = (str(inst.repo_path), inst.base_commit, zlib.crc32(inst.bug_patch.encode()), inst.bug_patch)
        with self._snap_lock:
            if key not in self._snapshots:
                dest = self._snap_root / f"s{len(self._snapshots)}"
                try:
                    materialize(inst, dest)
                    precompile(dest)
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    raise
                self._snapshots[key] = dest
            return self._snapshots[key]

    @staticmethod
    async def _resolved(st: EpisodeState) -> float:
        return float((await st.scratch["env"].graded()).resolved)

    @staticmethod
    async def _f2p(st: EpisodeState) -> float:
        return (await st.scratch["env"].graded()).fail_to_pass

    @staticmethod
    async def _p2p(st: EpisodeState) -> float:
        return (await st.scratch["env"].graded()).pass_to_pass

    def split_of(self, inst: Instance) -> str:
        """The instance's split (`assign_sides`): its own `split`, else its problem's hash."""
        return self._sides[inst.instance_id]

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        chosen = [i for i in self.instances if self.split_of(i) == split]
        if not chosen:
            raise CodeRepairError(f"{self.source or 'instances'}: no {split} instance among {len(self.instances)} "
                                  f"(one problem cannot be both trained on and held out); mark instances "
                                  f'with "split": "{split}" or add instances')
        chosen = sample_of(chosen, n, seed)
        return [Task(id=i.instance_id, split=split, answer=i.patch, tools=self.tool_schemas,
                     prompt=[{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{i.problem_statement.strip()}\n\n(repository: "
                                                         f"{Path(i.repo).name})"}],
                     metadata={"instance": i.row(), "repo_path": str(i.repo_path)}) for i in chosen]

    def make_env(self, task: Task) -> Env:
        return CodeRepairEnv(self, task)

    def example_task(self) -> Task:
        """A test task, else (every instance on the train side, e.g. a file of one) a train task."""
        split = "test" if "test" in self._sides.values() else "train"
        return self.tasks(split, n=1)[0]

    def problem_key(self, task: Task) -> str:
        """`instance_key` of the task's instance."""
        row = task.metadata.get("instance")
        if isinstance(row, dict) and all(isinstance(row.get(k), str) for k in ("repo", "problem_statement")):
            return instance_key(row["repo"], row.get("bug_patch") or "", row["problem_statement"])
        return super().problem_key(task)

    def scripted_policy(self) -> Policy:
        return GoldPatchPolicy()

    def info(self) -> dict:
        return {**super().info(), "instances": len(self.instances), "source": self.source,
                "splits": {s: sum(self.split_of(i) == s for i in self.instances) for s in ("train", "test")},
                "tools": self.tool_schemas, "limits": dataclasses.asdict(self.limits),
                "reward": "1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes with the instance's tests; "
                          "metrics fail_to_pass, pass_to_pass (fractions)"}


def edits_from_patch(patch: str) -> list[dict]:
    """Tool calls that make `patch`: one str_replace per hunk of a changed file, bash for created/deleted files."""
    calls = []
    for fp in parse_patch(patch):
        if fp.old is None or fp.new is None:
            if fp.new is None:
                cmd = f"rm -- {shlex.quote(fp.old)}"
            else:
                body = "".join(t for tag, t in fp.hunks[0][2] if tag == "+") if fp.hunks else ""
                cmd = (f"mkdir -p -- {shlex.quote(str(PurePosixPath(fp.new).parent))} && "
                       f"printf %s {shlex.quote(body)} > {shlex.quote(fp.new)}")
            calls.append({"name": "bash", "arguments": {"command": cmd}})
            continue
        for _, _, body in fp.hunks:
            calls.append({"name": "str_replace", "arguments": {
                "path": fp.path, "old": "".join(t for tag, t in body if tag != "+"),
                "new": "".join(t for tag, t in body if tag != "-")}})
    return calls


class GoldPatchPolicy(Policy):
    """Makes the gold patch with str_replace calls (a few per turn), then submits."""

    per_turn = 3

    async def act(self, task, history, tools, episode: int = 0) -> str:
        calls = edits_from_patch(task.answer) + [{"name": "submit", "arguments": {}}]
        done = sum(1 for m in history if isinstance(m, dict) and m.get("role") == "assistant")
        batch = calls[done * self.per_turn:(done + 1) * self.per_turn] or calls[-1:]
        return "Applying the fix.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in batch)


def load(instances: str | None = None, corpus: str = DEFAULT_CORPUS, max_turns: int = 30,
         max_bash_timeout_s: int = 60, per_test_timeout_s: float = 5.0, max_instances: int = 100, seed: int = 0,
         unsafe: bool | None = None, cache_dir: str | None = None, max_observation_tokens: int = 4096,
         episode_timeout_s: float = 900.0) -> CodeRepairEnvironment:
    """instances: a JSONL file; default: up to `max_instances` bugs synthesized (seeded) from the bundled
    `corpus` and cached under cache_dir (default: flywheel's cache, locations.py: $FLYWHEEL_CACHE_DIR,
    else ~/.cache/flywheel)."""
    if instances is not None:
        rows, source = read_instances(instances), str(instances)
    else:
        path = cached_corpus_instances(corpus, max_n=int(max_instances), seed=int(seed), cache_dir=cache_dir,
                                       unsafe=unsafe)
        rows, source = read_instances(path), f"synthesized from corpus {corpus!r} ({path})"
    limits = ToolLimits(max_turns=int(max_turns), max_observation_tokens=int(max_observation_tokens),
                        episode_timeout_s=float(episode_timeout_s))
    return CodeRepairEnvironment(rows, source, limits, max_bash_timeout_s, per_test_timeout_s, unsafe)
