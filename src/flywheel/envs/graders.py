"""OpenAI's fine-tuning graders, run by flywheel: what scores a reinforcement job's samples.

`build_grader(spec)` checks a grader object and returns a `Grader` whose `grade(sample, item)`
is a float: `sample` is `{"output_text": str, "output_json": obj | None}` (the model's answer),
`item` the training row. Templates `{{ item.x }}`, `{{ sample.output_text }}` (dotted paths
into the two) are filled before grading; a path that is missing is a GraderError naming it.

- string_check: `input` vs `reference` by `operation` eq | ne | like (contains) | ilike
  (contains, ignoring case): 1.0 or 0.0.
- text_similarity: `input` vs `reference` by `evaluation_metric`: fuzzy_match (difflib's
  ratio), bleu (sentence BLEU-4 with add-one smoothing of the 2- to 4-gram precisions and the
  brevity penalty), rouge_1 | rouge_2 | rouge_l (F1 of unigrams, bigrams, the longest common
  subsequence) over lower-cased word tokens. The score is in [0, 1].
- python: `source` defines `grade(sample, item) -> float`; it runs in flywheel's sandbox
  (no network, read-only system, limits: 10 s, 512 MB) with the two as JSON on stdin.
- score_model: a model flywheel serves is asked (`input`, chat messages with templates) for a
  number; the first number in its answer, clipped to `range` (default [0, 1]).
- multi: `graders` {name: grader} combined by `calculate_output`, an arithmetic formula over
  their names (+ - * /, parentheses, numbers, min, max, abs).
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import operator
import re
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

TEMPLATE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*)\s*\}\}")
METRICS = ("fuzzy_match", "bleu", "rouge_1", "rouge_2", "rouge_l")
OPERATIONS = ("eq", "ne", "like", "ilike")
TYPES = ("string_check", "text_similarity", "python", "score_model", "multi")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
PYTHON_TIMEOUT_S = 10.0


class GraderError(ValueError):
    """A grader object is invalid, or cannot grade this sample: `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ---------------------------------------------------------------- templates


def render(template: Any, sample: dict[str, Any], item: dict[str, Any], where: str = "input") -> str:
    """`template` with every {{ path }} replaced by the text of that value."""
    if not isinstance(template, str):
        raise GraderError(f"{where} must be a string template", where)
    scope = {"sample": sample, "item": item}

    def value(m: re.Match) -> str:
        node: Any = scope
        for part in m.group(1).split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise GraderError(f"{where}: {{{{ {m.group(1)} }}}} names nothing in the sample or the item", where)
        return node if isinstance(node, str) else json.dumps(node)

    return TEMPLATE.sub(value, template)


# ---------------------------------------------------------------- text similarity (pure)


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def f1(overlap: int, candidate: int, reference: int) -> float:
    if overlap == 0 or candidate == 0 or reference == 0:
        return 0.0
    p, r = overlap / candidate, overlap / reference
    return 2 * p * r / (p + r)


def rouge_n(candidate: str, reference: str, n: int) -> float:
    c, r = ngrams(words(candidate), n), ngrams(words(reference), n)
    return f1(sum((c & r).values()), sum(c.values()), sum(r.values()))


def lcs(a: list[str], b: list[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev = 0
        for j, y in enumerate(b, start=1):
            prev, row[j] = row[j], prev + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_l(candidate: str, reference: str) -> float:
    c, r = words(candidate), words(reference)
    return f1(lcs(c, r), len(c), len(r))


def bleu(candidate: str, reference: str, max_n: int = 4) -> float:
    c, r = words(candidate), words(reference)
    if not c or not r:
        return 0.0
    logs = []
    for n in range(1, max_n + 1):
        cn, rn = ngrams(c, n), ngrams(r, n)
        total, hits = sum(cn.values()), sum((cn & rn).values())
        if n == 1 and hits == 0:
            return 0.0
        logs.append(math.log(hits / total) if n == 1 else math.log((hits + 1) / (total + 1)))
    brevity = 1.0 if len(c) > len(r) else math.exp(1 - len(r) / len(c))
    return brevity * math.exp(sum(logs) / max_n)


def similarity(metric: str, candidate: str, reference: str) -> float:
    if metric == "fuzzy_match":
        return difflib.SequenceMatcher(None, candidate, reference).ratio()
    if metric == "bleu":
        return bleu(candidate, reference)
    if metric == "rouge_l":
        return rouge_l(candidate, reference)
    return rouge_n(candidate, reference, int(metric[-1]))


# ---------------------------------------------------------------- formulas (pure)

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_FUNCTIONS = {"min": min, "max": max, "abs": abs}


def formula(text: str, names: set[str]) -> Callable[[dict[str, float]], float]:
    """A function of {name: value} computing `text`; GraderError for anything else in it."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise GraderError(f"calculate_output is not a formula: {e.msg}", "calculate_output") from None

    def check(node) -> None:
        if isinstance(node, ast.Expression):
            check(node.body)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            check(node.left), check(node.right)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            check(node.operand)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            pass
        elif isinstance(node, ast.Name) and node.id in names:
            pass
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords:
            for a in node.args:
                check(a)
        else:
            what = node.id if isinstance(node, ast.Name) else type(node).__name__
            raise GraderError(f"calculate_output: {what!r} is not allowed (sub-grader names: "
                              f"{', '.join(sorted(names))}; + - * /, numbers, min, max, abs)", "calculate_output")

    check(tree)

    def run(node, values):
        if isinstance(node, ast.Expression):
            return run(node.body, values)
        if isinstance(node, ast.BinOp):
            right = run(node.right, values)
            if isinstance(node.op, ast.Div) and right == 0:
                return 0.0
            return _BINARY[type(node.op)](run(node.left, values), right)
        if isinstance(node, ast.UnaryOp):
            return -run(node.operand, values)
        if isinstance(node, ast.Constant):
            return float(node.value)
        if isinstance(node, ast.Name):
            return values[node.id]
        return _FUNCTIONS[node.func.id](*(run(a, values) for a in node.args))

    return lambda values: float(run(tree, values))


# ---------------------------------------------------------------- graders


@dataclass
class Grader:
    """A checked grader: `grade(sample, item)` -> float; `subgraders` names a multi's parts."""

    spec: dict[str, Any]
    fn: Callable[[dict[str, Any], dict[str, Any]], float]
    subgraders: dict[str, "Grader"] | None = None
    pass_threshold: float | None = None

    def grade(self, sample: dict[str, Any], item: dict[str, Any]) -> float:
        return float(self.fn(sample, item))

    def run(self, sample: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
        """What POST /v1/fine_tuning/alpha/graders/run answers."""
        subs = {name: g.grade(sample, item) for name, g in (self.subgraders or {}).items()}
        reward = self.grade(sample, item)
        meta = {"name": self.spec.get("name"), "type": self.spec["type"], "errors": {}, "sampled_model_name": None}
        if self.pass_threshold is not None:
            meta["passed"] = reward >= self.pass_threshold
        return {"reward": reward, "metadata": meta, "sub_rewards": subs, "model_grader_token_usage_per_model": {}}


def sample_of(text: str) -> dict[str, Any]:
    """The grader's view of a sampled answer: its text, and its JSON when it is JSON."""
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    return {"output_text": text, "output_json": parsed}


def build_grader(spec: Any, *, score_model: Callable[[str, list[dict]], str] | None = None,
                 where: str = "grader") -> Grader:
    """A Grader for OpenAI's grader object `spec`. score_model(model, messages) -> reply text
    runs a score_model grader's model (None: such graders are refused)."""
    if not isinstance(spec, dict):
        raise GraderError(f"{where} must be an object with a type", where)
    kind = spec.get("type")
    if kind not in TYPES:
        raise GraderError(f"{where}.type must be one of {', '.join(TYPES)}, got {kind!r}", f"{where}.type")

    def need(name: str, kinds=(str,)):
        value = spec.get(name)
        if not isinstance(value, kinds):
            raise GraderError(f"{where}.{name} is required for a {kind} grader", f"{where}.{name}")
        return value

    if kind == "string_check":
        op, inp, ref = need("operation"), need("input"), need("reference")
        if op not in OPERATIONS:
            raise GraderError(f"{where}.operation must be one of {', '.join(OPERATIONS)}, got {op!r}",
                              f"{where}.operation")

        def check(sample, item):
            a, b = render(inp, sample, item, f"{where}.input"), render(ref, sample, item, f"{where}.reference")
            return float({"eq": a == b, "ne": a != b, "like": b in a, "ilike": b.lower() in a.lower()}[op])
        return Grader(spec, check, pass_threshold=1.0)
    if kind == "text_similarity":
        metric, inp, ref = need("evaluation_metric"), need("input"), need("reference")
        if metric not in METRICS:
            raise GraderError(f"{where}.evaluation_metric must be one of {', '.join(METRICS)} here, got {metric!r}",
                              f"{where}.evaluation_metric")
        threshold = spec.get("pass_threshold")
        return Grader(spec, lambda s, i: similarity(metric, render(inp, s, i, f"{where}.input"),
                                                    render(ref, s, i, f"{where}.reference")),
                      pass_threshold=float(threshold) if isinstance(threshold, (int, float)) else None)
    if kind == "python":
        source = need("source")
        try:
            compile(source, "<grader>", "exec")
        except SyntaxError as e:
            raise GraderError(f"{where}.source does not compile: line {e.lineno}: {e.msg}", f"{where}.source") from None
        if "def grade" not in source:
            raise GraderError(f"{where}.source must define grade(sample, item)", f"{where}.source")
        return Grader(spec, lambda s, i: python_grade(source, s, i), pass_threshold=spec.get("pass_threshold"))
    if kind == "score_model":
        model, messages = need("model"), need("input", (list,))
        if score_model is None:
            raise GraderError(f"{where}: score_model graders need a model this server runs", f"{where}.model")
        low, high = spec.get("range") or [0.0, 1.0]

        def ask(sample, item):
            filled = [{**m, "content": render(m.get("content", ""), sample, item, f"{where}.input")} for m in messages]
            found = _NUMBER.search(score_model(model, filled))
            return min(high, max(low, float(found.group()))) if found else low
        return Grader(spec, ask, pass_threshold=spec.get("pass_threshold"))
    graders = need("graders", (dict,))
    if not graders:
        raise GraderError(f"{where}.graders must name at least one grader", f"{where}.graders")
    subs = {name: build_grader(g, score_model=score_model, where=f"{where}.graders.{name}")
            for name, g in graders.items()}
    combine = formula(need("calculate_output"), set(subs))
    return Grader(spec, lambda s, i: combine({n: g.grade(s, i) for n, g in subs.items()}), subgraders=subs)


_RUNNER = """
import json, sys
exec(compile({source!r}, "<grader>", "exec"))
data = json.loads(sys.stdin.read())
print(json.dumps(float(grade(data["sample"], data["item"]))))
"""


def python_grade(source: str, sample: dict[str, Any], item: dict[str, Any]) -> float:
    """The python grader's `grade(sample, item)`, run in a sandbox; GraderError if it fails."""
    from flywheel.sandbox import Limits, Sandbox

    result = Sandbox(Limits(wall_s=PYTHON_TIMEOUT_S, memory_mb=512)).run_python(
        _RUNNER.format(source=source), stdin=json.dumps({"sample": sample, "item": item}))
    if not result.ok:
        why = "timed out" if result.timed_out else (result.stderr.strip().splitlines() or ["failed"])[-1]
        raise GraderError(f"the python grader failed: {why}", "grader.source")
    try:
        return float(json.loads(result.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise GraderError(f"the python grader printed no number: {result.stdout[-200:]!r}", "grader.source") from None


class LocalScorer:
    """score_model's model runner over local model folders: `models` maps a grader's `model`
    name to its folder; each is loaded once (LocalEngine) and asked greedily, at most
    `max_tokens` new tokens, through its chat template. Thread-safe (one lock per engine)."""

    def __init__(self, models: dict[str, str], max_tokens: int = 16):
        self.models, self.max_tokens = models, max_tokens
        self._engines: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, model: str, messages: list[dict]) -> str:
        from flywheel.inference import LocalEngine, SamplingParams
        from flywheel.models import ChatRenderer

        with self._lock:
            if model not in self._engines:
                if model not in self.models:
                    raise GraderError(f"score_model: no model {model!r} to grade with", "grader.model")
                engine = LocalEngine.from_path(self.models[model])
                self._engines[model] = (engine, ChatRenderer(engine.tokenizer))
            engine, renderer = self._engines[model]
            prompt = renderer.render(messages, add_generation_prompt=True)
            return engine.generate_text([prompt], SamplingParams(temperature=0, max_tokens=self.max_tokens))[0][0].text
