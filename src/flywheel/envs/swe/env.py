"""The `swe` environment: an agent fixes a SWE-style instance with one tool, bash.

An episode, as mini-swe-agent runs one: the instance's base in a fresh workspace (hard links,
workspace.py); each `bash` call runs in the bubblewrap sandbox on it (no network, a per-command
timeout, output capped), with a linear history (every call and its output stay in the
conversation, cut to the observation limit). The episode ends when the agent runs `submit`
(alone on its line) or answers without a tool call. The submission is the workspace's diff
against the base; the reward is the harness's "resolved" for that diff (harness.py: a fresh
workspace, test paths reset, FAIL_TO_PASS + PASS_TO_PASS by pytest in the sandbox).

Instances: the shipped ones (synthesize.py's files, instances/*.jsonl), or a SWE-bench JSONL
(`instances=FILE`, e.g. from `flywheel swe import`). Splits: an instance's own `split`, else a
hash of its problem (repository, bug, statement: `problem_key`), so one problem is never on
both sides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import shutil
import weakref
from pathlib import Path

from flywheel.canonical import canonical
from flywheel.envs.base import Env, Environment, Policy, check_split, sample_of
from flywheel.envs.rubric import EpisodeState, RewardFn, Rubric
from flywheel.envs.splits import side_of
from flywheel.envs.swe.harness import Evaluation, evaluate, sandbox
from flywheel.envs.swe.instance import SWEFormatError, SWEInstance, parse_instance, read_instances
from flywheel.envs.swe.sources import SourceError
from flywheel.envs.swe.synthesize import shipped_files
from flywheel.envs.swe.workspace import diff_against_base, instance_base, new_workspace
from flywheel.envs.tool_env import ToolEnv, ToolLimits
from flywheel.envs.tools import EpisodeFinished, Tool, ToolError
from flywheel.sandbox import Limits
from flywheel.types import Task

SUBMIT = "submit"
SYSTEM = ("You are a software engineer fixing a bug in a Python repository, which is your working directory. "
          "Your only tool is `bash`: each call runs one shell command there (no network; a timeout; long output "
          "is cut). Explore, edit files (sed, python, cat with a heredoc, patch) and run the tests with "
          "`python -m pytest`. When the fix is done, run the command `submit` alone: the repository's diff is "
          "then graded by its tests, with test files restored first, so fix the library, not the tests.")


class BashTool:
    """`bash` on one workspace, run in the sandbox."""

    def __init__(self, root: Path, python_bin: Path | None, env_root: Path | None, unsafe: bool | None,
                 max_timeout_s: int = 60, output_bytes: int = 32 << 10):
        self.root, self.python_bin, self.env_root = root, python_bin, env_root
        self.box = sandbox(unsafe)
        self.max_timeout_s, self.output_bytes = max_timeout_s, output_bytes
        self.setup_error: str | None = None
        self.commands = 0

    def bash(self, command: str, timeout: int = 30) -> str:
        """Run a bash command in the repository root (the working directory; no network).

        Args:
            command: a shell command, e.g. "grep -rn 'def chunked' .", "sed -n 1,40p pkg/mod.py",
                "python -m pytest -q tests/test_x.py", or `submit` alone to finish.
            timeout: seconds before the command is killed (capped by the environment).
        """
        if command.strip() == SUBMIT:
            raise EpisodeFinished(True, "submitted; the repository's diff will now be graded by its tests")
        if self.setup_error:
            raise ToolError("exception", f"bash: the workspace could not be prepared: {self.setup_error}")
        t = max(1, min(int(timeout), self.max_timeout_s))
        self.commands += 1
        path = f"{self.python_bin}:/usr/bin:/bin" if self.python_bin else "/usr/bin:/bin"
        res = self.box.run(["bash", "-c", "exec 2>&1\n" + command], workspace=str(self.root),
                           env={"PATH": path, "PYTHONDONTWRITEBYTECODE": "1"},
                           limits=Limits(wall_s=float(t), cpu_s=t, memory_mb=1024, processes=64,
                                         output_bytes=self.output_bytes, workspace_mb=256),
                           read_only=(str(self.env_root),) if self.env_root else ())
        out = (res.stdout or "") + (res.stderr or "")
        status = (f"[killed: timed out after {t} s]" if res.timed_out else
                  f"[killed: more than {self.output_bytes} bytes of output]" if res.truncated else
                  f"[killed: {res.error}]" if res.error else f"[exit code {res.returncode}]")
        return status + "\n" + out.rstrip("\n")  # the status first: a long output is cut at its end


class SWEEnv(ToolEnv):
    """One episode: a fresh workspace, bash on it, the harness's grade at the end, then cleanup."""

    def __init__(self, spec: "SWEEnvironment", task: Task):
        self.spec, self.inst = spec, spec.instance_of(task)
        self.base: Path | None = None
        self.root: Path | None = None
        self.tool = BashTool(Path("."), None, None, spec.unsafe, spec.max_bash_timeout_s)
        super().__init__(task, [Tool.from_function(self.tool.bash, timeout_s=spec.max_bash_timeout_s + 15.0)],
                         spec.rubric, spec.limits)
        self.state.scratch.update(env=self)
        self._ready = False
        self._cleanup = None

    def _setup(self) -> None:
        from flywheel.envs.swe.prepared import prepare_env

        try:
            self.base = instance_base(self.inst)
            env = prepare_env(self.inst.environment, self.inst.env_key)
            self.root = new_workspace(self.base, isolated=self.tool.box.isolated)
            self.tool.root, self.tool.python_bin, self.tool.env_root = self.root, env.bin, env.root
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        except (SourceError, OSError) as e:
            self.tool.setup_error = str(e)
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
            await self.graded()  # grade before the workspace goes
            if self._cleanup:
                await asyncio.to_thread(self._cleanup)
        return result

    async def graded(self) -> Evaluation:
        """The harness's evaluation of this episode's diff (computed once, in a worker thread)."""
        st = self.state
        if "grade" not in st.scratch:
            st.scratch["grade"] = asyncio.ensure_future(asyncio.to_thread(self._grade))
        return await st.scratch["grade"]

    def _grade(self) -> Evaluation:
        if self.tool.setup_error or self.root is None or self.base is None:
            return Evaluation(self.inst.instance_id, False, error=f"setup failed: {self.tool.setup_error}")
        try:
            diff = diff_against_base(self.root, self.base)
            self.state.scratch["diff"] = diff
            ev = evaluate(self.inst, diff, self.spec.unsafe)
        except Exception as e:  # noqa: BLE001 - the grader's own failure is reward 0 and a metric, never a crash
            ev = Evaluation(self.inst.instance_id, False, error=f"{type(e).__name__}: {e}")
        self.state.metrics.update(bash_commands=float(self.tool.commands), diff_lines=float(diff.count("\n")
                                  if "diff" in self.state.scratch else 0), grading_error=float(ev.error is not None))
        return ev


def problem_key(inst: SWEInstance) -> str:
    """One text per problem: repository, bug (or base commit) and statement, not the id."""
    return canonical([inst.repo, inst.bug_patch or inst.base_commit, inst.problem_statement])


class SWEEnvironment(Environment):
    name = "swe"
    description = "SWE-bench-style repair on real repositories with bash as the only tool, graded by pytest"
    answer_doc = "the gold patch (a unified diff): what the scripted policy applies; the grade is the tests"
    metadata_doc = "`instance`: the SWE-bench row the grader rebuilds the workspace and runs the tests from"

    def __init__(self, instances: list[SWEInstance], source: str = "", limits: ToolLimits | None = None,
                 max_bash_timeout_s: int = 60, unsafe: bool | None = None, test_fraction: float = 0.2):
        if not instances:
            raise SWEFormatError("no instances")
        self.instances, self.source, self.unsafe = instances, source, unsafe
        self.limits = limits or ToolLimits(max_turns=30, max_tool_calls_per_turn=1, max_observation_tokens=2048,
                                           episode_timeout_s=900.0)
        self.max_bash_timeout_s = int(max_bash_timeout_s)
        self.rubric = Rubric([RewardFn(self._resolved, 1.0, "resolved"), RewardFn(self._f2p, 0.0, "fail_to_pass"),
                              RewardFn(self._p2p, 0.0, "pass_to_pass")])
        self.tool_schemas = [Tool.from_function(BashTool(Path("."), None, None, unsafe).bash).schema]
        self._by_id = {i.instance_id: i for i in instances}
        self._sides = {i.instance_id: i.split or side_of("swe\0" + problem_key(i), test_fraction) for i in instances}

    def instance_of(self, task: Task) -> SWEInstance:
        inst = self._by_id.get(task.id)
        if inst is None or inst.row() != task.metadata.get("instance"):
            inst = parse_instance(task.metadata.get("instance"), f"task {task.id}")
        return inst

    def split_of(self, inst: SWEInstance) -> str:
        return self._sides[inst.instance_id]

    @staticmethod
    async def _resolved(st: EpisodeState) -> float:
        return float((await st.scratch["env"].graded()).resolved)

    @staticmethod
    async def _f2p(st: EpisodeState) -> float:
        ev = await st.scratch["env"].graded()
        return sum(v in ("passed", "xfailed") for v in ev.fail_to_pass.values()) / max(1, len(ev.fail_to_pass))

    @staticmethod
    async def _p2p(st: EpisodeState) -> float:
        ev = await st.scratch["env"].graded()
        return sum(v in ("passed", "xfailed") for v in ev.pass_to_pass.values()) / max(1, len(ev.pass_to_pass))

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        chosen = [i for i in self.instances if self.split_of(i) == split]
        if not chosen:
            raise SWEFormatError(f"{self.source or 'instances'}: no {split} instance among {len(self.instances)}; "
                                 f'mark some with "split": "{split}" or add instances')
        chosen = sample_of(chosen, n, seed)
        return [Task(id=i.instance_id, split=split, answer=i.patch, tools=self.tool_schemas,
                     prompt=[{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{i.problem_statement.strip()}\n\n(repository: {i.repo}, "
                                                         f"version {i.version})"}],
                     metadata={"instance": i.row()}) for i in chosen]

    def make_env(self, task: Task) -> Env:
        return SWEEnv(self, task)

    def example_task(self) -> Task:
        split = "test" if "test" in self._sides.values() else "train"
        return self.tasks(split, n=1)[0]

    def problem_key(self, task: Task) -> str:
        return problem_key(self.instance_of(task))

    def scripted_policy(self) -> Policy:
        return GoldPatchByBash()

    def info(self) -> dict:
        return {**super().info(), "instances": len(self.instances), "source": self.source,
                "repos": sorted({i.repo for i in self.instances}),
                "splits": {s: sum(self.split_of(i) == s for i in self.instances) for s in ("train", "test")},
                "tools": self.tool_schemas, "limits": dataclasses.asdict(self.limits),
                "reward": "1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes (harness.py); metrics "
                          "fail_to_pass, pass_to_pass (fractions)"}


def bash_applying(patch: str) -> str:
    """A bash command that applies `patch` in the repository root with `patch -p1`."""
    marker = "FLYWHEEL_PATCH_END"
    while marker in patch:
        marker += "_"
    return f"patch -p1 --no-backup-if-mismatch <<'{marker}'\n{patch.rstrip(chr(10))}\n{marker}"


class GoldPatchByBash(Policy):
    """Proves the plumbing: applies the gold patch through bash, checks the diff, submits."""

    async def act(self, task, history, tools, episode: int = 0) -> str:
        f2p = task.metadata["instance"]["FAIL_TO_PASS"]
        check = "python -m pytest -q -p no:cacheprovider " + " ".join(shlex.quote(n) for n in f2p[:5])
        steps = [bash_applying(task.answer), check, SUBMIT]
        done = sum(1 for m in history if isinstance(m, dict) and m.get("role") == "assistant")
        command = steps[min(done, len(steps) - 1)]
        call = {"name": "bash", "arguments": {"command": command}}
        return f"Step {done + 1}.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def load(instances: str | None = None, projects: str = "", max_turns: int = 30, max_bash_timeout_s: int = 60,
         max_observation_tokens: int = 2048, episode_timeout_s: float = 900.0, unsafe: bool | None = None,
         test_fraction: float = 0.2) -> SWEEnvironment:
    """instances: a SWE-bench JSONL file; default: the shipped instances of the built-in
    projects (`projects`: a comma-separated subset of their names)."""
    if instances:
        rows, source = read_instances(instances), str(instances)
    else:
        files = shipped_files()
        wanted = {p.strip() for p in projects.split(",") if p.strip()}
        names = {f.stem for f in files}
        if wanted - names:
            raise SWEFormatError(f"projects: unknown {sorted(wanted - names)}; shipped: {', '.join(sorted(names))}")
        files = [f for f in files if not wanted or f.stem in wanted]
        if not files:
            raise SWEFormatError("no shipped SWE instances: run `flywheel swe build`")
        rows = [inst for f in files for inst in read_instances(f)]
        source = f"shipped instances ({', '.join(f.stem for f in files)})"
    limits = ToolLimits(max_turns=int(max_turns), max_tool_calls_per_turn=1,
                        max_observation_tokens=int(max_observation_tokens), episode_timeout_s=float(episode_timeout_s))
    return SWEEnvironment(rows, source, limits, int(max_bash_timeout_s), unsafe, float(test_fraction))


__all__ = ["SWEEnvironment", "SWEEnv", "BashTool", "GoldPatchByBash", "bash_applying", "load", "problem_key"]
