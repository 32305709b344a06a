"""The package layer order of docs/architecture.md, read from the source: every import of
one flywheel package by another (module level and inside functions alike) points down the
order, and pure modules import nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "flywheel"

# top to bottom; a package may import its own modules, its layer's and those below
LAYERS = [
    {"cli"},
    {"client"},  # the SDK: the CLI's job commands drive it; it imports no server layer
    {"demo"},  # the command line drives the demo, the demo drives the processes below
    {"daemon", "worker"},  # `flywheel loop run` (serves through serve/), `flywheel worker`
    {"serve"},  # `flywheel serve`: the HTTP app and its routes
    {"finetuning"},  # the fine-tuning service's core, under the routes and the worker
    {"loop"},
    {"train"},
    {"orchestrate"},
    {"rollout", "buffer"},
    {"envs", "inference", "weights"},
    {"sandbox", "models", "traces", "registry", "economics", "jobs"},
    {"migrations"},  # every store's schema runner (Alembic) over database.py
]
BASE = len(LAYERS)  # types.py, config.py, errors.py, files.py, process.py
# `python -m flywheel.demo` is the CLI's demo command: the one edge allowed up the order
ALLOWED = {("demo/__main__.py", "cli")}


def layer(package: str) -> int:
    return next((i for i, names in enumerate(LAYERS) if package in names), BASE)


def imports(path: Path):
    """(line, imported flywheel package, module) of every absolute flywheel import in the file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("flywheel."):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("flywheel.")]
        else:
            continue
        for name in names:
            yield node.lineno, name.split(".")[1], name


def upward_imports() -> list[str]:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        package = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for line, target, module in imports(path):
            if target != package and layer(target) < layer(package) and (str(rel), target) not in ALLOWED:
                found.append(f"src/flywheel/{rel}:{line}: {package} imports {module}, a layer above it")
    return found


def test_every_package_is_in_the_order():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set().union(*LAYERS), sorted(packages - set().union(*LAYERS))


def test_imports_point_down_the_layer_order():
    assert upward_imports() == []


def test_the_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The test above can fail: a module of `traces` importing `loop` is reported by file and line."""
    fake = tmp_path / "flywheel"
    (fake / "traces").mkdir(parents=True)
    (fake / "traces" / "bad.py").write_text("import json\n\ndef f():\n    from flywheel.loop.cycle import run_cycle\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", fake)
    assert upward_imports() == ["src/flywheel/traces/bad.py:4: traces imports flywheel.loop.cycle, a layer above it"]


@pytest.mark.parametrize("module", ["flywheel.loop.gate", "flywheel.loop.paired", "flywheel.loop.retention",
                                    "flywheel.economics.catalog"])
def test_pure_modules_import_nothing_heavy(module):
    code = (f"import sys, {module}; "
            "print(sorted(h for h in ('torch', 'sqlalchemy', 'fastapi', 'transformers') if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} loads {out.strip()}"


def test_the_sdk_imports_only_itself():
    """flywheel.client runs on a user's laptop without the server's dependencies."""
    found = [f"{path.name}:{line}: {module}" for path in sorted((SRC / "client").rglob("*.py"))
             for line, target, module in imports(path) if target != "client"]
    assert found == []


def module_graph(src: Path) -> dict[str, set[str]]:
    """flywheel module -> the flywheel modules it imports (module level, in functions, under
    TYPE_CHECKING alike; `from flywheel.x import name` counts as importing flywheel.x.name when
    that is a module, else flywheel.x)."""
    modules = {}
    for path in src.rglob("*.py"):
        parts = ("flywheel",) + path.relative_to(src).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("flywheel"):
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("flywheel")]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_through_others():
    assert import_circles(module_graph(SRC)) == []


def test_the_circle_check_finds_a_lazy_circle(tmp_path):
    fake = tmp_path / "flywheel"
    (fake / "train").mkdir(parents=True)
    for name in ("__init__", "train/__init__"):
        (fake / f"{name}.py").write_text("")
    (fake / "train" / "a.py").write_text("from flywheel.train import b\n")
    (fake / "train" / "b.py").write_text("def f():\n    from flywheel.train.a import x\n")
    (fake / "train" / "c.py").write_text("import flywheel.train.a\n")
    assert import_circles(module_graph(fake)) == [["flywheel.train.a", "flywheel.train.b"]]


ROOMS_DOC = SRC.parents[1] / "docs" / "architecture.md"


def rooms() -> dict[str, tuple[set[str], set[str]]]:
    """docs/architecture.md's Rooms table: package -> (may use, used by)."""
    text = ROOMS_DOC.read_text(encoding="utf-8")
    table = text[text.index("## Rooms"):].split("\n## ")[0]
    found = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("package", "---"):
            continue
        names = [{n.strip() for n in cell.split(",")} - {"-", ""} for cell in cells[2:]]
        found[cells[0]] = (names[0], names[1])
    return found


def package_uses(src: Path) -> dict[str, set[str]]:
    """package -> the other packages its modules import (base modules left out)."""
    def package(module: str) -> str | None:
        parts = module.split(".")  # flywheel, then a package or a base module, ...
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and (src / parts[1]).is_dir()) else None

    uses: dict[str, set[str]] = {}
    for module, targets in module_graph(src).items():
        here = package(module)
        for target in targets:
            there = package(target)
            if here and there and there != here:
                uses.setdefault(here, set()).add(there)
    return uses


def test_every_package_has_a_room():
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(rooms()), (sorted(packages - set(rooms())), sorted(set(rooms()) - packages))


def test_packages_import_only_what_their_room_may_use():
    table = rooms()
    extra = {package: sorted(used - table[package][0]) for package, used in package_uses(SRC).items()
             if used - table[package][0]}
    assert extra == {}


def test_used_by_is_the_inverse_of_may_use():
    table = rooms()
    for package, (_, used_by) in table.items():
        assert used_by == {other for other, (may, _) in table.items() if package in may}, package


def test_no_flat_package_holds_more_than_20_modules():
    crowded = {str(d.relative_to(SRC)): n for d in [SRC, *SRC.rglob("*")] if d.is_dir()
               if (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > 20}
    assert crowded == {}


def test_the_room_check_sees_a_package_using_another(tmp_path):
    fake = tmp_path / "flywheel"
    for folder in ("client", "loop"):
        (fake / folder).mkdir(parents=True)
        (fake / folder / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "types.py").write_text("")
    (fake / "loop" / "gate.py").write_text("")
    (fake / "client" / "sdk.py").write_text("import flywheel.types\n\ndef f():\n    from flywheel.loop.gate import x\n")
    assert package_uses(fake) == {"client": {"loop"}}  # the base module is not a package


def long_functions(src: Path, most: int = 100) -> list[str]:
    """Functions (methods, nested ones) under `src` longer than `most` lines, as path:line name (n)."""
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > most:
                    found.append(f"{path.relative_to(src.parent)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_runs_over_100_lines():
    assert long_functions(SRC) == []


def test_the_length_check_counts_a_long_function(tmp_path):
    (tmp_path / "flywheel").mkdir()
    (tmp_path / "flywheel" / "m.py").write_text("def f():\n" + "    x = 1\n" * 100 + "\n\ndef g():\n    pass\n")
    assert long_functions(tmp_path / "flywheel") == ["flywheel/m.py:1 f (101 lines)"]


def test_the_learner_package_sits_below_the_recipes():
    """train/learner/ (ranks, FSDP2, Ray actors, groups) imports no recipe (sft, dpo, rl)."""
    recipes = {"flywheel.train.sft", "flywheel.train.dpo", "flywheel.train.rl"}
    graph = module_graph(SRC)
    assert {m: sorted(graph[m] & recipes) for m in graph if m.startswith("flywheel.train.learner")
            if graph[m] & recipes} == {}
