"""Tools are plain Python functions (sync or async). The JSON schema the model sees comes
from the signature (types, defaults) and the docstring (first paragraph = description,
Google-style `Args:` lines = parameter descriptions).

Calling a tool never raises into the episode: bad arguments, an exception inside the tool
and a timeout all become `ToolError`s, which the env reports to the model as a tool message.
"""

from __future__ import annotations

import asyncio
import collections.abc
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class EpisodeFinished(Exception):
    """Raised by a tool to end the episode (e.g. `submit`); `value` is kept as state.submitted."""

    def __init__(self, value=None, message: str = "submitted"):
        super().__init__(message)
        self.value = value


class ToolError(Exception):
    """Why a tool call failed, phrased for the model. kind: bad_arguments | exception | timeout | unknown_tool."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    fn: Callable[..., Any]
    timeout_s: float | None = 30.0
    blocking: bool = True  # sync tools run in a worker thread unless declared non-blocking (cheap, pure)

    @classmethod
    def from_function(cls, fn: Callable, name: str | None = None, description: str | None = None,
                      timeout_s: float | None = 30.0, blocking: bool | None = None) -> "Tool":
        doc_desc, arg_docs = _parse_docstring(inspect.getdoc(fn) or "")
        params = schema_from_signature(fn, arg_docs)
        return cls(name=name or fn.__name__, description=description or doc_desc, parameters=params, fn=fn,
                   timeout_s=timeout_s, blocking=not inspect.iscoroutinefunction(fn) if blocking is None else blocking)

    @property
    def schema(self) -> dict:
        """The OpenAI `tools` entry."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def call(self, arguments: dict[str, Any]) -> str:
        """Validate, run with the timeout, return the result as text (raises ToolError)."""
        problems = validate_arguments(self.parameters, arguments)
        if problems:
            raise ToolError("bad_arguments", f"{self.name}: " + "; ".join(problems))
        try:
            if inspect.iscoroutinefunction(self.fn):
                result = await _with_timeout(self.fn(**arguments), self.timeout_s)
            elif self.blocking:
                result = await _with_timeout(asyncio.to_thread(self.fn, **arguments), self.timeout_s)
            else:
                result = self.fn(**arguments)
            return result if isinstance(result, str) else _to_text(result)
        except _CallTimedOut:
            raise ToolError("timeout", f"{self.name}: timed out after {self.timeout_s:g} s") from None
        except (ToolError, EpisodeFinished):
            raise
        except Exception as e:  # the tool's own failure is information for the model
            raise ToolError("exception", f"{self.name}: {type(e).__name__}: {e}") from None


class _CallTimedOut(Exception):
    """The call ran past its timeout (distinct from a TimeoutError raised by the tool itself)."""


async def _with_timeout(awaitable, timeout_s: float | None):
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise _CallTimedOut()
    return task.result()


def tool(fn: Callable | None = None, *, name: str | None = None, timeout_s: float | None = 30.0,
         blocking: bool | None = None):
    """Decorator: `@tool` or `@tool(timeout_s=5)` turns a function into a Tool."""
    def wrap(f):
        return Tool.from_function(f, name=name, timeout_s=timeout_s, blocking=blocking)
    return wrap(fn) if fn is not None else wrap


# ---------------------------------------------------------------- schema


def schema_from_signature(fn: Callable, arg_docs: dict[str, str] | None = None) -> dict:
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for pname, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__}: *args / **kwargs cannot be described to a model")
        prop = type_schema(hints.get(pname, str))
        if arg_docs and pname in arg_docs:
            prop["description"] = arg_docs[pname]
        if p.default is inspect.Parameter.empty:
            required.append(pname)
        else:
            prop["default"] = p.default
        props[pname] = prop
    schema = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def type_schema(tp: Any) -> dict:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in _JSON_TYPES:
        return {"type": _JSON_TYPES[tp]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        non_null = [a for a in args if a is not type(None)]
        inner = type_schema(non_null[0]) if len(non_null) == 1 else {"anyOf": [type_schema(a) for a in non_null]}
        return {**inner, "nullable": True} if len(non_null) < len(args) else inner
    if origin in (list, tuple, set, collections.abc.Sequence):
        return {"type": "array", "items": type_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    return {"type": "string"}


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(first paragraph, {arg: description}) from a Google-style docstring."""
    parts = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)
    description = " ".join(parts[0].split()) if parts and parts[0] else ""
    args: dict[str, str] = {}
    section = re.search(r"^\s*(Args|Arguments|Parameters):\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if section:
        current = None
        for line in section.group(2).splitlines():
            m = re.match(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(3).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


# ---------------------------------------------------------------- validation


def validate_arguments(schema: dict, arguments: dict[str, Any]) -> list[str]:
    """Problems with `arguments` against an object schema made by schema_from_signature."""
    props = schema.get("properties", {})
    problems = [f"missing required argument {r!r}" for r in schema.get("required", []) if r not in arguments]
    for key, value in arguments.items():
        if key not in props:
            problems.append(f"unknown argument {key!r} (expected: {', '.join(props) or 'none'})")
            continue
        problem = _check(props[key], value)
        if problem:
            problems.append(f"argument {key!r}: {problem}")
    return problems


def _check(prop: dict, value: Any) -> str | None:
    if value is None:
        return None if prop.get("nullable") else "must not be null"
    if "enum" in prop:  # type-exact membership: True is not 1, 1.0 is not 1
        ok = any(type(value) is type(e) and value == e for e in prop["enum"])
        return None if ok else f"must be one of {prop['enum']}, got {value!r}"
    if "anyOf" in prop:
        return None if any(_check(p, value) is None for p in prop["anyOf"]) else f"has the wrong type ({value!r})"
    kind = prop.get("type")
    ok = {"string": lambda v: isinstance(v, str),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool),
          "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list)}.get(kind, lambda v: True)
    if not ok(value):
        return f"must be {kind}, got {type(value).__name__} {_short(value)}"
    if kind == "array" and "items" in prop:
        for i, item in enumerate(value):
            problem = _check(prop["items"], item)
            if problem:
                return f"item {i} {problem}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _to_text(result: Any) -> str:
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)
