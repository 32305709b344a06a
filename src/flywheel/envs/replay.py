"""replay: RL on curated tasks. Each task is one a real environment already knows how to grade.

A replay record (one line of curation's rl_train.jsonl / rl_heldout.jsonl) is
`{"env": name, "task": {Task fields}, "settings": {...}?, ...}`: `env` is a registry name or
import path, `settings` (optional, default {}) the keyword arguments of its loader, `task`
the Task as a dict (id, prompt, answer, tools, metadata, split). Other keys (trace_id,
source, prompt_hash) are provenance and ignored here.

`ReplayEnvironment` loads every distinct (env, settings) once. Split "train" is the train
records, "test" the held-out ones. Each replayed Task carries
`metadata["replay_env"] = {"env": name, "settings": settings}`, so `make_env` can route a task
to its environment even in another process (rollout workers rebuild the environment from the
config and receive tasks pickled). In an RL config:
`env: {name: replay, settings: {train: rl_train.jsonl, test: rl_heldout.jsonl}}`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Sequence

from flywheel.envs.base import Env, Environment, Policy, check_split, sample_of
from flywheel.envs.registry import load_env
from flywheel.types import Task

ROUTE_KEY = "replay_env"  # Task.metadata key naming the task's environment
TASK_FIELDS = tuple(f.name for f in dataclasses.fields(Task))


class ReplayError(ValueError):
    """A replay record cannot be used; the message names the file and line (or record index)."""


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean",
             int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def task_from_dict(payload: Any, default_id: str | None = None, default_prompt: Any = None) -> Task:
    """The Task a dict describes; ValueError naming the field when it describes none.

    Keys are Task's fields. Required: `prompt` (a non-empty string, or a non-empty list of
    message objects each with a string `role`; `default_prompt` when absent and given) and
    `id` (a non-empty string; `default_id` when absent and given). Optional: answer (any
    JSON), tools (list of objects or null), metadata (object), split (string).
    """
    if not isinstance(payload, dict):
        raise ValueError(f"must be a JSON object, got {_json_type(payload)}")
    unknown = sorted(set(payload) - set(TASK_FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (Task fields: {', '.join(TASK_FIELDS)})")
    task_id = payload.get("id", default_id)
    if task_id is None:
        raise ValueError("missing field 'id'")
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"'id' must be a non-empty string, got {task_id!r}")
    prompt = payload.get("prompt", default_prompt)
    if prompt is None:
        raise ValueError("missing field 'prompt'")
    if isinstance(prompt, list) and prompt:
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ValueError(f"prompt[{i}] must be a message object with a string 'role'")
    elif not (isinstance(prompt, str) and prompt):
        raise ValueError(f"'prompt' must be a non-empty string or list of messages, got {_json_type(prompt)} "
                         f"{prompt!r:.40}")
    tools = payload.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"'tools' must be a list of objects or null, got {_json_type(tools)}")
    metadata = payload.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"'metadata' must be an object, got {_json_type(metadata)}")
    split = payload.get("split", "train")
    if not isinstance(split, str):
        raise ValueError(f"'split' must be a string, got {_json_type(split)}")
    return Task(id=task_id, prompt=prompt, answer=payload.get("answer"), tools=tools,
                metadata=dict(metadata), split=split)


@dataclasses.dataclass(frozen=True)
class _Record:
    env: str
    settings: dict[str, Any]
    task: Task
    where: str  # "file:line" or "records[i]"


def _key(env: str, settings: dict[str, Any]) -> str:
    return json.dumps([env, settings], sort_keys=True, default=str)


def _record(raw: Any, where: str) -> _Record:
    if not isinstance(raw, dict):
        raise ReplayError(f"{where}: expected a JSON object, got {_json_type(raw)}")
    for name in ("env", "task"):
        if name not in raw:
            raise ReplayError(f"{where}: missing field {name!r}")
    env, settings = raw["env"], raw.get("settings") or {}
    if not isinstance(env, str) or not env:
        raise ReplayError(f"{where}: 'env' must be a non-empty string, got {env!r}")
    if env == "replay":
        raise ReplayError(f"{where}: env 'replay' cannot replay itself")
    if not isinstance(settings, dict):
        raise ReplayError(f"{where}: 'settings' must be an object, got {_json_type(settings)}")
    try:
        task = task_from_dict(raw["task"])
    except ValueError as e:
        raise ReplayError(f"{where}: task: {e}") from None
    return _Record(env, settings, task, where)


def read_records(path: str | Path) -> list[tuple[dict, str]]:
    """(record, "path:line") for each non-blank line of a JSONL file."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                out.append((json.loads(raw), where))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                detail = f"{e.msg} (column {e.colno})" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
                raise ReplayError(f"{where}: invalid JSON: {detail}") from None
    return out


def _records(source: Iterable[dict] | str | Path, label: str) -> list[_Record]:
    """Records from a JSONL path (errors name `path:line`) or from dicts (`label[i]`)."""
    if isinstance(source, (str, Path)):
        records = [_record(r, where) for r, where in read_records(source)]
        if not records:
            raise ReplayError(f"{source}: no replay records")
        return records
    return [_record(r, f"{label}[{i}]") for i, r in enumerate(source)]


class ReplayEnvironment(Environment):
    name = "replay"
    description = "tasks curated from failed traces, each graded by the environment that produced it"

    def __init__(self, train: Iterable[dict] | str | Path, test: Iterable[dict] | str | Path | None = None):
        """train / test: replay records, as dicts or a JSONL path; test=None: no "test" split."""
        self._train = _records(train, "records")
        if not self._train:
            raise ReplayError("records: no replay records")
        self._test = None if test is None else _records(test, "test_records")
        self._envs: dict[str, Environment] = {}
        self._policies: dict[str, Policy] = {}
        for rec in self._train + (self._test or []):
            key = _key(rec.env, rec.settings)
            if key not in self._envs:
                try:
                    self._envs[key] = load_env(rec.env, **rec.settings)
                except (ValueError, TypeError) as e:  # EnvLoadError, or a loader refusing its settings
                    raise ReplayError(f"{rec.where}: {e}") from None

    @classmethod
    def from_files(cls, train: str | Path, test: str | Path | None = None) -> ReplayEnvironment:
        """Train on `train` (rl_train.jsonl), evaluate on `test` (rl_heldout.jsonl)."""
        return cls(Path(train), None if test is None else Path(test))

    def _env_of(self, task: Task) -> tuple[str, Environment]:
        route = task.metadata.get(ROUTE_KEY)
        if not isinstance(route, dict) or "env" not in route:
            raise ValueError(f"task {task.id!r} has no metadata {ROUTE_KEY!r}: not made by a ReplayEnvironment")
        key = _key(route["env"], route.get("settings") or {})
        if key not in self._envs:  # a task from another replay set: load its env once
            self._envs[key] = load_env(route["env"], **(route.get("settings") or {}))
        return key, self._envs[key]

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        check_split(split)
        records = self._train if split == "train" else self._test
        if records is None:
            raise ValueError("replay has no held-out records: give test=<rl_heldout.jsonl>")
        records = sample_of(records, n, seed)
        # fresh Tasks each call: a caller may mutate what it gets
        return [dataclasses.replace(r.task, split=split, metadata={
            **r.task.metadata, ROUTE_KEY: {"env": r.env, "settings": dict(r.settings)}}) for r in records]

    def make_env(self, task: Task) -> Env:
        return self._env_of(task)[1].make_env(task)

    def scripted_policy(self) -> Policy:
        return _RoutingPolicy(self)

    def info(self) -> dict:
        return {**super().info(), "train_tasks": len(self._train),
                "test_tasks": None if self._test is None else len(self._test),
                "envs": sorted(json.loads(k)[0] for k in self._envs)}


class _RoutingPolicy(Policy):
    """Each task's own environment's scripted policy."""

    def __init__(self, replay: ReplayEnvironment):
        self.replay = replay

    def _policy(self, task: Task) -> Policy:
        key, env = self.replay._env_of(task)
        if key not in self.replay._policies:
            self.replay._policies[key] = env.scripted_policy()
        return self.replay._policies[key]

    async def act(self, task, history, tools, episode: int = 0) -> str:
        return await self._policy(task).act(task, history, tools, episode)

    async def end_episode(self, episode: int) -> None:
        for policy in list(self.replay._policies.values()):
            await policy.end_episode(episode)


def load(train: str, test: str | None = None) -> ReplayEnvironment:
    """`env: {name: replay, settings: {train: rl_train.jsonl, test: rl_heldout.jsonl}}`."""
    return ReplayEnvironment.from_files(train, test)


def records_of(tasks: Sequence[Task], env: str, settings: dict[str, Any] | None = None) -> list[dict]:
    """Replay records for `tasks` of environment `env` (tests, hand-made replay sets)."""
    out = []
    for t in tasks:
        rec: dict[str, Any] = {"env": env, "task": dataclasses.asdict(t)}
        if settings:
            rec["settings"] = dict(settings)
        out.append(rec)
    return out
