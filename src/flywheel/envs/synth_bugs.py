"""Synthesize code_repair instances from a repository with a test suite (SWE-smith style).

Procedure: check the repository out into a scratch folder and run its whole test suite in the
sandbox with the lean runner (tests failing already are left out). The stdlib `ast` finds
mutation sites inside function bodies: swapped binary / comparison / boolean operators,
changed integer and boolean constants, inverted `if` / conditional-expression tests, dropped
`not`, and statements (or whole `if` blocks without `else`) replaced by `pass`. Each edit is
made on the SOURCE TEXT at the node's exact position (lineno / col_offset / end_lineno /
end_col_offset; col offsets are UTF-8 bytes), so a diff touches one spot and formatting and
comments stay. Sites are visited in a seeded order that takes turns between functions. A
mutant is kept when it still parses, changes the AST, and makes at least one test fail
without any test timing out (endless loops make slow, flaky tasks). Its failing tests become
FAIL_TO_PASS, the tests passing on both PASS_TO_PASS; the gold `patch` is the inverse diff
(mutant -> original, a/ b/ prefixes, with enough context that every hunk's old text is unique,
so it also works as str_replace calls); `bug_patch` makes the mutant from the checkout.

"Works" for a local repository means: the tests are files `test_*.py` / `*_test.py` with
plain `def test_*` functions or `Test*` classes (no fixtures, no parametrize), importable from
the repository root with the standard library and what the sandbox's interpreter has.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import random
import re
import subprocess
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.envs.grading import run_tests, shared_pool
from flywheel.locations import cache_dir
from flywheel.envs.patches import make_diff, parse_patch, split_lines
from flywheel.envs.repo import (checkout, CodeRepairError, copy_tree, CORPORA, fingerprint, Instance,
                                is_git_repo, is_test_path, list_files, precompile, resolve_repo,
                                RUNNER_SOURCE, write_instances)

SYNTH_VERSION = 1  # bump when the mutations change: cached instance sets are keyed on it
_SKIP = r"(?:\s|\\\n|[()]|#[^\n]*)*"  # what may sit between an operand and its operator
_BIN = {ast.Add: (r"\+", "-"), ast.Sub: ("-", "+"), ast.Mult: (r"\*", "+"), ast.Div: ("/", "*"),
        ast.FloorDiv: ("//", "/"), ast.Mod: ("%", "//"), ast.Pow: (r"\*\*", "*"), ast.LShift: ("<<", ">>"),
        ast.RShift: (">>", "<<"), ast.BitOr: (r"\|", "&"), ast.BitAnd: ("&", "|"), ast.BitXor: (r"\^", "|")}
_CMP = {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"),
        ast.Gt: (">", ">="), ast.GtE: (">=", ">"), ast.In: (r"in", "not in"), ast.NotIn: (r"not\s+in", "in"),
        ast.Is: ("is", "is not"), ast.IsNot: (r"is\s+not", "is")}
_BOOL = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Raise, ast.Break, ast.Continue)


@dataclass(frozen=True)
class Mutation:
    path: str  # relative to the repository root
    function: str  # qualified name of the enclosing function
    kind: str  # binop | compare | boolop | constant | negate | remove
    line: int
    start: int  # character offsets into the file's text
    end: int
    replacement: str

    def apply(self, text: str) -> str:
        return text[:self.start] + self.replacement + text[self.end:]


class _Finder:
    """Mutation sites of one source file."""

    def __init__(self, path: str, text: str):
        self.path, self.text, self.out = path, text, []
        self.line_starts = [0]
        self.lines = split_lines(text, python=True)
        for line in self.lines:
            self.line_starts.append(self.line_starts[-1] + len(line))

    def offset(self, lineno: int, col: int) -> int:  # (1-based line, UTF-8 byte column) -> character offset
        return self.line_starts[lineno - 1] + len(self.lines[lineno - 1].encode()[:col].decode(errors="ignore"))

    def span(self, node) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def add(self, func, kind, node_line, start, end, replacement):
        if self.text[start:end] != replacement:
            self.out.append(Mutation(self.path, func, kind, node_line, start, end, replacement))

    def between(self, func, kind, a, b, pattern, replacement):
        """Swap the operator token that sits between nodes a and b."""
        lo, hi = self.span(a)[1], self.span(b)[0]
        m = re.fullmatch(f"{_SKIP}({pattern}){_SKIP}", self.text[lo:hi])
        if m:
            self.add(func, kind, a.end_lineno, lo + m.start(1), lo + m.end(1), replacement)

    def functions(self, node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qual = prefix + child.name
                self.function(qual, child)
                self.functions(child, qual + ".")
            elif isinstance(child, ast.ClassDef):
                self.functions(child, prefix + child.name + ".")

    def function(self, qual: str, fn) -> None:
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        for stmt in body:
            for node in _walk_local(stmt):
                self.visit(qual, node)

    def visit(self, func: str, node) -> None:
        if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
            self.between(func, "binop", node.left, node.right, *_BIN[type(node.op)])
        elif isinstance(node, ast.AugAssign) and type(node.op) in _BIN:
            pat, rep = _BIN[type(node.op)]
            self.between(func, "binop", node.target, node.value, pat + "=", rep + "=")
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                self.between(func, "compare", operands[i], operands[i + 1], *_CMP[type(op)])
        elif isinstance(node, ast.BoolOp):
            pat, rep = _BOOL[type(node.op)]
            self.between(func, "boolop", node.values[0], node.values[1], rf"\b{pat}\b", rep)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool):
            v = node.value
            new = repr(not v) if isinstance(v, bool) else str({0: 1, 1: 0}.get(v, v + 1))
            self.add(func, "constant", node.lineno, *self.span(node), new)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):  # drop the `not`
            start = self.span(node)[0]
            m = re.match(r"not\s*", self.text[start:])
            if m:
                self.add(func, "negate", node.lineno, start, start + m.end(), "")
        if isinstance(node, (ast.If, ast.IfExp)) and not isinstance(node.test, ast.UnaryOp):
            src = self.text[slice(*self.span(node.test))]
            wrap = isinstance(node.test, (ast.BoolOp, ast.IfExp, ast.NamedExpr, ast.Lambda)) or "\n" in src
            self.add(func, "negate", node.lineno, *self.span(node.test), f"not ({src})" if wrap else f"not {src}")
        if isinstance(node, _REMOVABLE) or (isinstance(node, ast.If) and not node.orelse):
            if isinstance(node, ast.Expr) and not isinstance(node.value, ast.Call):
                return
            start, end = self.span(node)
            before = self.text[self.line_starts[node.lineno - 1]:start]
            after = self.text[end:self.line_starts[node.end_lineno]] if node.end_lineno < len(self.line_starts) else ""
            if not before.strip() and (not after.strip() or after.strip().startswith("#")):
                self.add(func, "remove", node.lineno, start, end, "pass")


def _walk_local(node):
    """The node and its descendants, without nested functions, classes and lambdas."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            yield from _walk_local(child)


def find_mutations(root: Path) -> list[Mutation]:
    """Valid mutations (parse, change the AST, distinct results) of the non-test .py files under root."""
    out = []
    for rel, path in sorted(list_files(root).items()):
        if not rel.endswith(".py") or is_test_path(rel) or path.is_symlink():
            continue
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")  # line endings kept as they are
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        finder = _Finder(rel, text)
        finder.functions(tree)
        original, seen = ast.dump(tree), set()
        for m in finder.out:
            mutant = m.apply(text)
            try:
                changed = ast.dump(ast.parse(mutant)) != original
            except SyntaxError:
                continue
            if changed and mutant not in seen:
                seen.add(mutant)
                out.append(m)
    return out


def interleave(muts: list[Mutation], rng: random.Random) -> list[Mutation]:
    """Seeded order that takes one site per function in turn (varied bugs before many in one place)."""
    groups = defaultdict(list)
    for m in muts:
        groups[(m.path, m.function)].append(m)
    queues = []
    for _, g in sorted(groups.items()):  # within a function, kinds take turns too (`remove` sites abound)
        kinds = sorted({m.kind for m in g})
        rng.shuffle(kinds)
        key, seen = {}, Counter()
        for m in rng.sample(g, len(g)):  # the i-th site of each kind, kinds in a random order
            key[m], seen[m.kind] = (-seen[m.kind], -kinds.index(m.kind)), seen[m.kind] + 1
        queues.append(sorted(g, key=key.__getitem__))  # popped from the end
    rng.shuffle(queues)
    order = []
    while queues:
        order += [q.pop() for q in queues]
        queues = [q for q in queues if q]
    return order


def gold_diff(rel: str, mutant: str, original: str) -> str:
    """mutant -> original, with the least context (>= 3) that makes each hunk's old text unique."""
    for ctx in (3, 5, 8, 13, 21, 40):
        diff = make_diff(rel, mutant, original, ctx)
        olds = ["".join(t for tag, t in body if tag != "+") for fp in parse_patch(diff) for _, _, body in fp.hunks]
        if all(mutant.count(o) == 1 for o in olds):
            break
    return diff


def problem_statement(name: str, f2p: list[str], results: dict, shown: int = 5) -> str:
    lines = [f"Running the test suite of {name} shows {len(f2p)} failing test{'s' * (len(f2p) > 1)}:", ""]
    for tid in f2p[:shown]:
        msg = results[tid][1].strip() or results[tid][0]
        lines.append(f"- {tid}\n    {msg[:300]}")
    if len(f2p) > shown:
        lines.append(f"- ... and {len(f2p) - shown} more")
    lines += ["", "The tests are right; the bug is in the library code. Fix it so that these tests pass and the "
                  "other tests keep passing."]
    return "\n".join(lines)


@dataclass
class SynthReport:
    tests: int = 0  # tests passing on the original (the ones used)
    failing_before: int = 0  # tests failing on the original (left out)
    sites: int = 0
    tried: int = 0
    kept: int = 0
    no_failure: int = 0  # mutants every test still passes (equivalent or untested)
    timed_out: int = 0
    kinds: dict = field(default_factory=dict)
    seconds: float = 0.0


def synthesize(repo: str, max_n: int = 100, seed: int = 0, rev: str | None = None, unsafe: bool | None = None,
               per_test_s: float | None = None, workers: int | None = None,
               log=None) -> tuple[list[Instance], SynthReport]:
    """Up to max_n instances from `repo` (a corpus name, a folder or a git repository at `rev`)."""
    t0, report = time.perf_counter(), SynthReport()
    src = resolve_repo(repo)
    corpus = src.parent == CORPORA
    name = repo if corpus else src.name
    commit = ""
    if is_git_repo(src) and (rev or not corpus):
        proc = subprocess.run(["git", "-C", str(src), "rev-parse", "--verify", (rev or "HEAD") + "^{commit}"],
                              capture_output=True, text=True)
        if proc.returncode:
            raise CodeRepairError(f"{src}: no commit {rev or 'HEAD'}: {proc.stderr.strip()}")
        commit = proc.stdout.strip()
    elif rev:
        raise CodeRepairError(f"--rev {rev}: {src} is not a git repository")
    pool = shared_pool(unsafe)
    workers = workers or min(4, os.cpu_count() or 2)
    with tempfile.TemporaryDirectory(prefix="flywheel-synth-") as tmp:
        orig = Path(tmp, "orig")
        checkout(src, commit, orig)
        commit = commit or fingerprint(orig)
        base = run_tests(orig, None, pool, per_test_s=per_test_s or 10.0, timeout_s=600.0)
        if base.error:
            raise CodeRepairError(f"{src}: the test suite did not run: {base.error}")
        passing = [t for t, (o, _) in base.results.items() if o == "passed"]
        if per_test_s is None:  # generous for the slowest test, short enough that endless loops cost little
            per_test_s = min(5.0, max(0.25, 20 * max(base.test_seconds.values(), default=0.0)))
        report.tests, report.failing_before = len(passing), len(base.results) - len(passing)
        if not passing:
            raise CodeRepairError(f"{src}: no passing tests found (the lean runner collected {len(base.results)}: "
                                  f"{', '.join(list(base.results)[:5])}); see `flywheel env synth-bugs --help`")
        order = interleave(find_mutations(orig), random.Random(seed))
        precompile(orig)  # the mutated file's pyc no longer matches its source hash: it is compiled
        report.sites = len(order)
        dirs = []
        for w in range(workers):
            dirs.append(Path(tmp, f"w{w}"))
            copy_tree(orig, dirs[-1], keep_pycache=True)

        def attempt(job):
            m, wdir = job
            f = wdir / m.path
            text = f.read_bytes().decode("utf-8", errors="surrogateescape")
            f.write_bytes(m.apply(text).encode("utf-8", errors="surrogateescape"))
            try:
                return m, text, run_tests(wdir, passing, pool, per_test_s=per_test_s, stop_on_timeout=True,
                                          timeout_s=60.0)
            finally:
                f.write_bytes(text.encode("utf-8", errors="surrogateescape"))

        out, kinds = [], Counter()
        with ThreadPoolExecutor(workers) as ex:
            for i in range(0, len(order), workers):
                if len(out) >= max_n:
                    break
                for m, text, run in ex.map(attempt, zip(order[i:i + workers], dirs)):
                    report.tried += 1
                    outcomes = Counter(o for o, _ in run.results.values())
                    if run.error or outcomes["timeout"] or outcomes["not_run"]:
                        report.timed_out += 1
                        continue
                    f2p = [t for t in passing if not run.passed(t)]
                    if not f2p:
                        report.no_failure += 1
                        continue
                    if len(out) >= max_n:
                        continue
                    mutant = m.apply(text)
                    key = hashlib.sha1(f"{m.path}:{m.start}:{m.end}:{m.replacement}".encode()).hexdigest()[:8]
                    out.append(Instance(
                        instance_id=f"{name}__{m.function}__{m.kind}__{key}", repo=repo if corpus else str(src),
                        base_commit=commit, problem_statement=problem_statement(name, f2p, run.results),
                        patch=gold_diff(m.path, mutant, text), test_patch="", FAIL_TO_PASS=f2p,
                        PASS_TO_PASS=[t for t in passing if run.passed(t)], bug_patch=make_diff(m.path, text, mutant),
                        extra={"synth": {"file": m.path, "line": m.line, "function": m.function, "kind": m.kind,
                                         "seed": seed, "version": SYNTH_VERSION}},
                        repo_path=src))
                    kinds[m.kind] += 1
                if log:
                    log(f"tried {report.tried}/{len(order)} sites, kept {len(out)}")
    report.kept, report.kinds, report.seconds = len(out), dict(kinds), time.perf_counter() - t0
    return out, report


def cache_dir_default() -> Path:
    """flywheel's cache (locations.py: $FLYWHEEL_CACHE_DIR, else ~/.cache/flywheel)."""
    return cache_dir()


def cached_corpus_instances(corpus: str, max_n: int = 100, seed: int = 0, cache_dir: str | Path | None = None,
                            unsafe: bool | None = None) -> Path:
    """The JSONL of instances synthesized from a bundled corpus, made once per corpus content and settings."""
    src = resolve_repo(corpus)
    key = hashlib.sha256(json.dumps([fingerprint(src), SYNTH_VERSION, max_n, seed,
                                     hashlib.sha256(RUNNER_SOURCE.encode()).hexdigest()]).encode()).hexdigest()[:12]
    path = Path(cache_dir or cache_dir_default()) / "code_repair" / f"{corpus}-{key}.jsonl"
    if not path.exists():
        instances, _ = synthesize(corpus, max_n=max_n, seed=seed, unsafe=unsafe)
        if not instances:
            raise CodeRepairError(f"corpus {corpus!r}: no mutant broke a test")
        write_instances(path, instances)
    return path
