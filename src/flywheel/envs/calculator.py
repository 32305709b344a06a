"""calculator: multi-turn tool use on arithmetic a small model cannot do in its head
(3-4-digit multiplication, chains of operations) with a `calc` tool.

Reward 1 when the last number in the final answer (the assistant turn without tool calls)
equals the exact value. Weight-0 metrics: `used_tool` (the episode called calc) and
`answer_format` (the final answer holds a number). `tool_latency_s` makes each calc call
take that long (asyncio sleep), to model tools that take real time. Operands have
`max_digits - 1` to `max_digits` digits (default 4), joined by `operator` (* + -), and the
question is `template` filled with {expression} or {a} and {b} ("Multiply {a} by {b}."), so
one tool serves several task families. `bare_prompt` asks the
question alone, with no system message and no tool schemas (the calc tool still answers): a
model fine-tuned on the tool does not need them, and prompts shrink from about a thousand byte
tokens to a few dozen, which is what makes multi-turn RL on it fit a CPU test.
`system_prompt=False` (without `bare_prompt`) asks the question alone but offers the calc
schema: the request of an OpenAI client that passes `tools=` and no system message.

Splits: a problem's side is a hash of its canonical expression (`canonical_expression`: the
operands of every + and * in a fixed order, so "57 * 12" and "12 * 57" are one problem), a
fifth of them test (envs/splits.py), whatever the settings, seed or count; so no train task is
ever a test problem, in this environment or in another with other settings (a family whose
operands overlap, e.g. max_digits 2 and 3). `tasks(split, n, seed)` draws `n` distinct
expressions of that side (default 5,000 train, 200 test), seeded; asking for more than the
side holds (only small spaces: max_digits 2 without chains has 9,801 ordered pairs, about
7,800 of them train and 2,000 test) is a ValueError.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import json
import math
import operator
import random
import re
import string
import warnings

from flywheel.envs.base import Env, Environment, Policy, check_split
from flywheel.envs.rubric import EpisodeState, RewardFn, Rubric
from flywheel.envs.splits import side_of
from flywheel.envs.tool_env import ToolEnv, ToolLimits
from flywheel.envs.tools import Tool
from flywheel.types import Task

SYSTEM = ("You are a careful assistant. Use the calc tool for arithmetic, then give the final "
          "answer as a number.")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")  # 1,234,567 or 1234567
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}


def evaluate(expression: str) -> int | float:
    """Exact value of an arithmetic expression: numbers, + - * / // % ** and parentheses.
    Anything else (names, calls, huge powers) is rejected with a ValueError."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    try:
        value = _eval(_parse(expression))
    except (ZeroDivisionError, OverflowError) as e:
        raise ValueError(str(e)) from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    return value


def _parse(expression: str) -> ast.expr:
    """The expression's syntax tree, never mutated; ValueError if it is not Python syntax.
    Short ones (a task's, read by `canonical_expression` and `evaluate` moments apart) are
    kept: 16,384 trees of <= 64 characters, a few MB."""
    return _parse_short(expression) if len(expression) <= 64 else _parse_text(expression)


@functools.lru_cache(maxsize=16_384)
def _parse_short(expression: str) -> ast.expr:
    return _parse_text(expression)


def _parse_text(expression: str) -> ast.expr:
    try:
        with warnings.catch_warnings():  # "1a" warns (invalid decimal literal) before it fails
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.parse(expression, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10 ** 6):
            raise ValueError("power too large")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"unsupported element: {ast.dump(node)[:60]}")


def _format(value) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


OPERATORS = ("*", "+", "-")
_TEMPLATE_FIELDS = {"expression", "a", "b"}


def _check_template(template: str, chain_prob: float) -> None:
    """A question template names its numbers as {expression} or {a} and {b}, nothing else."""
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as e:
        raise ValueError(f"template {template!r}: {e}") from None
    if fields - _TEMPLATE_FIELDS:
        raise ValueError(f"template {template!r}: unknown field(s) {sorted(fields - _TEMPLATE_FIELDS)}; "
                         "use {expression}, {a}, {b}")
    if "expression" not in fields and not {"a", "b"} <= fields:
        raise ValueError(f"template {template!r} must hold {{expression}}, or both {{a}} and {{b}}")
    if "expression" not in fields and chain_prob > 0:
        raise ValueError(f"template {template!r} cannot state chained problems (no {{expression}}); set chain_prob 0")


_OP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Mod: "%", ast.Div: "/",
            ast.Pow: "**"}


def canonical_expression(expression: str) -> str:
    """One text per problem: fully parenthesised, the two operands of every + and * in text
    order ("57 * 12" and "12 * 57" both give "(12 * 57)"). ValueError for what `evaluate`
    would not read."""
    return _canon(_parse(expression))


def _canon(node) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return repr(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return f"({'-' if isinstance(node.op, ast.USub) else '+'}{_canon(node.operand)})"
    if isinstance(node, ast.BinOp) and type(node.op) in _OP_TEXT:
        left, right = _canon(node.left), _canon(node.right)
        if isinstance(node.op, (ast.Add, ast.Mult)) and right < left:
            left, right = right, left
        return f"({left} {_OP_TEXT[type(node.op)]} {right})"
    raise ValueError(f"unsupported element: {ast.dump(node)[:60]}")


def side_of_expression(expression: str) -> str:
    """The split ("train" / "test") an expression's problem belongs to, under every setting."""
    return side_of("calculator\0" + canonical_expression(expression))


_ENUMERATE_MAX = 100_000  # plain a-op-b spaces up to this many pairs are listed whole (max_digits 2)


def final_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


class CalculatorEnvironment(Environment):
    name = "calculator"
    description = "multi-turn tool use: multiply and chain 3-4-digit numbers with a calc tool"
    answer_doc = ('the exact value as a JSON string, no separators, e.g. "6912" or "-15" (a number never '
                  "matches); the final answer scores 1 when its last number is it")

    def __init__(self, tool_latency_s: float = 0.0, chain_prob: float = 0.5, limits: ToolLimits = ToolLimits(max_turns=6),
                 bare_prompt: bool = False, max_digits: int = 4, operator: str = "*",
                 template: str = "What is {expression}?", system_prompt: bool = True):
        if tool_latency_s < 0 or not 0 <= chain_prob <= 1:
            raise ValueError("tool_latency_s must be >= 0 and chain_prob in [0, 1]")
        if operator not in OPERATORS:
            raise ValueError(f"operator must be one of {' '.join(OPERATORS)}, got {operator!r}")
        _check_template(template, chain_prob)
        self.operator, self.template = operator, template
        if not 2 <= max_digits <= 12:
            raise ValueError(f"max_digits must be in [2, 12], got {max_digits}")
        self.max_digits = max_digits
        self.tool_latency_s, self.chain_prob, self.limits = tool_latency_s, chain_prob, limits
        self.bare_prompt, self.system_prompt = bare_prompt, system_prompt
        self._plain_sides: dict[str, list[tuple[int, int]]] = {}
        self.calc = Tool.from_function(self._calc_async if tool_latency_s > 0 else self._calc,
                                       name="calc", blocking=False, timeout_s=10.0)
        self.rubric = Rubric([
            RewardFn(self._correct, weight=1.0, name="correct", inline=True),
            RewardFn(lambda st: float(any(c.name == "calc" for c in st.tool_calls)), weight=0.0,
                     name="used_tool", inline=True),
            RewardFn(lambda st: float(final_number(st.final_text) is not None), weight=0.0,
                     name="answer_format", inline=True)])

    @staticmethod
    def _calc(expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(1234 * 567) + 89".
        """
        return _format(evaluate(expression))

    async def _calc_async(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(1234 * 567) + 89".
        """
        await asyncio.sleep(self.tool_latency_s)
        return _format(evaluate(expression))

    @staticmethod
    def _correct(st: EpisodeState) -> float:
        return float(final_number(st.final_text) == st.task.answer)

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        """(expression, question)."""
        low, high = 10 ** (self.max_digits - 2), 10 ** self.max_digits  # 4: 3-4 digits; 2: 1-2 digits
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        expr = f"{a} {self.operator} {b}"
        if rng.random() < self.chain_prob:
            c, d = rng.randrange(10, 1000), rng.randrange(2, 100)
            expr = f"({expr} + {c}) * {d}" if rng.random() < 0.5 else f"{expr} - {c} * {d}"
        return expr, self.template.format(expression=expr, a=a, b=b)

    def _settings(self) -> str:
        return (f"max_digits={self.max_digits}, operator={self.operator!r}, chain_prob={self.chain_prob}")

    def _plain_side(self, split: str) -> list[tuple[int, int]]:
        """Every (a, b) of a small plain space on `split`'s side, in order (listed once)."""
        if not self._plain_sides:
            low, high = 10 ** (self.max_digits - 2), 10 ** self.max_digits
            sides: dict[str, list[tuple[int, int]]] = {"train": [], "test": []}
            for a in range(low, high):
                for b in range(low, high):
                    sides[side_of_expression(f"{a} {self.operator} {b}")].append((a, b))
            self._plain_sides = sides
        return self._plain_sides[split]

    def _draws(self, split: str, count: int, rng: random.Random) -> list[tuple[str, str]]:
        """`count` distinct (expression, question) pairs of `split`'s side."""
        low, high = 10 ** (self.max_digits - 2), 10 ** self.max_digits
        pairs = (high - low) ** 2
        if self.chain_prob == 0 and pairs <= _ENUMERATE_MAX:
            side = self._plain_side(split)
            if count > len(side):
                raise ValueError(f"calculator ({self._settings()}): the {split} split holds {len(side)} problems, "
                                 f"{count} asked; ask for fewer (or more digits, or chains)")
            chosen = rng.sample(side, count)
            return [(f"{a} {self.operator} {b}", self.template.format(expression=f"{a} {self.operator} {b}", a=a, b=b))
                    for a, b in chosen]
        # rejection: draw problems, keep the new ones of this side; a space this large holds plenty
        capacity = pairs * (1 if self.chain_prob < 1 else 0) + pairs * 990 * 98 * 2 * (self.chain_prob > 0)
        if count > capacity // 10:
            raise ValueError(f"calculator ({self._settings()}): {count} distinct {split} problems asked, "
                             f"of about {capacity} in all; ask for fewer")
        out, seen, attempts = [], set(), 0
        while len(out) < count:
            attempts += 1
            if attempts > 100 * count + 10_000:
                raise ValueError(f"calculator ({self._settings()}): found only {len(out)} distinct {split} problems "
                                 f"in {attempts - 1} draws, {count} asked; ask for fewer")
            expr, text = self._problem(rng)
            if expr not in seen and side_of_expression(expr) == split:
                seen.add(expr)
                out.append((expr, text))
        return out

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        """`n` distinct problems of `split` (default 5,000 train, 200 test), seeded (module docstring)."""
        check_split(split)
        rng = random.Random(f"calculator/{split}/{seed}")  # independent streams per split and seed
        count = n if n is not None else (5000 if split == "train" else 200)
        system = [] if self.bare_prompt or not self.system_prompt else [{"role": "system", "content": SYSTEM}]
        out = []
        for i, (expr, text) in enumerate(self._draws(split, count, rng)):
            out.append(Task(id=f"calc-{split}-{seed}-{i}", split=split, answer=_format(evaluate(expr)),
                            prompt=[*system, {"role": "user", "content": text}],
                            tools=[] if self.bare_prompt else [self.calc.schema], metadata={"expression": expr}))
        return out

    def problem_key(self, task: Task) -> str:
        """The canonical expression (`canonical_expression`), else (a task from elsewhere) the prompt."""
        expression = task.metadata.get("expression")
        if isinstance(expression, str):
            try:
                return canonical_expression(expression)
            except ValueError:
                pass
        return super().problem_key(task)

    def make_env(self, task: Task) -> Env:
        return ToolEnv(task, [self.calc], self.rubric, self.limits)

    def scripted_policy(self) -> Policy:
        return ScriptedCalculatorPolicy()

    def info(self) -> dict:
        return {**super().info(), "tools": [self.calc.schema], "tool_latency_s": self.tool_latency_s,
                "bare_prompt": self.bare_prompt, "system_prompt": self.system_prompt, "max_digits": self.max_digits, "operator": self.operator,
                "template": self.template,
                "reward": "1 if the last number of the final answer is exact; metrics used_tool, answer_format"}


class ScriptedCalculatorPolicy(Policy):
    """Calls calc on the task's expression, then states the tool's result."""

    async def act(self, task, history, tools, episode: int = 0) -> str:
        last = history[-1] if history else {}
        if last.get("role") == "tool":
            return f"The answer is {last['content']}."
        call = {"name": "calc", "arguments": {"expression": task.metadata["expression"]}}
        return f"Let me compute that.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"


def load(tool_latency_s: float = 0.0, chain_prob: float = 0.5, max_turns: int = 6,
         bare_prompt: bool = False, max_digits: int = 4, operator: str = "*",
         template: str = "What is {expression}?", system_prompt: bool = True) -> CalculatorEnvironment:
    for name, flag in (("bare_prompt", bare_prompt), ("system_prompt", system_prompt)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be true or false, got {flag!r}")
    return CalculatorEnvironment(tool_latency_s=float(tool_latency_s), chain_prob=float(chain_prob),
                                 limits=ToolLimits(max_turns=int(max_turns)), bare_prompt=bare_prompt,
                                 max_digits=int(max_digits), operator=str(operator), template=str(template),
                                 system_prompt=system_prompt)
