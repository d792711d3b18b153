"""Layering rules: the engine never imports a UI library; start-up paths never import torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UI_LIBS = {"textual", "questionary", "rich", "prompt_toolkit"}
HEAVY = {"torch", "transformers", "peft", "safetensors"}


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (not inside functions)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_no_ui_library():
    for path in (ROOT / "tui_merger" / "core").rglob("*.py"):
        assert not _all_imports(path) & UI_LIBS, path


def test_no_module_imports_torch_at_top_level():
    for path in (ROOT / "tui_merger").rglob("*.py"):
        assert not _top_level_imports(path) & HEAVY, path


def test_cli_start_up_does_not_load_torch():
    code = (
        "import sys, tui_merger.cli, tui_merger.core.merge.engine;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY | {"textual"},)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def _import_graph() -> dict[str, set[str]]:
    """tui_merger's modules and the tui_merger modules each imports, at any level (function-level
    imports included; imports only for type checkers, under ``if TYPE_CHECKING:``, left out)."""
    package = ROOT / "tui_merger"
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skipped = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                skipped |= {id(n) for child in node.body for n in ast.walk(child)}
        edges = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    graph = _import_graph()
    assert len(graph) > 40 and graph["tui_merger.cli"]  # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_command_modules_import_only_the_shared_module():
    """tui_merger/cli/: the dispatcher (__init__) imports the commands; a command imports common, never
    another command (what two commands share lives in common)."""
    graph = _import_graph()
    commands = [m for m in graph if m.startswith("tui_merger.cli.") and m != "tui_merger.cli.common"]
    assert len(commands) >= 6
    for name in commands:
        siblings = {m for m in graph[name] if m.startswith("tui_merger.cli")} - {"tui_merger.cli.common"}
        assert not siblings, (name, siblings)
    assert not {m for m in graph["tui_merger.cli.common"] if m.startswith("tui_merger.cli")}
