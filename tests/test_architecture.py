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
    # the registry imports its kinds by name (importlib), so that --help need not import them: those
    # edges count too
    from tui_merger.core.formats.registry import ENTRIES

    graph["tui_merger.core.formats.registry"] |= {f"tui_merger.core.formats.{e.module}" for e in ENTRIES}
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


# -- the formats seam -----------------------------------------------------------------------------

STAGES = {"io", "formats", "plan", "merge", "record", "verify", "ship"}


def test_core_is_stage_folders_and_the_shared_vocabulary():
    core = ROOT / "tui_merger" / "core"
    folders = {p.name for p in core.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == STAGES
    assert {p.name for p in core.glob("*.py")} == {"__init__.py", "errors.py", "events.py", "options.py"}


def test_io_imports_no_checkpoint_kind_and_no_later_stage():
    """The readers below the kinds know nothing of them, nor of planning, merging or verifying."""
    graph = _import_graph()
    for name, edges in graph.items():
        if name.startswith("tui_merger.core.io."):
            later = {e for e in edges if e.startswith("tui_merger.core.") and e.split(".")[2] in STAGES - {"io"}}
            assert not later, (name, later)


def test_registry_entries_describe_their_classes_and_each_kind_implements_its_role():
    from tui_merger.core.formats import base
    from tui_merger.core.formats.registry import BACKENDS, ENTRIES, formats

    loaded = formats()
    assert [f.kind for f in loaded] == [e.kind for e in ENTRIES]
    assert len({e.kind for e in ENTRIES}) == len(ENTRIES)
    needs = {
        "checkpoint": ("detect", "recognizes", "locate", "open", "reference", "next_step"),
        "adapter": ("recognizes", "open_adapter", "reference_folder", "next_step"),
        "model": ("detect", "recognizes", "open_base", "next_step"),
    }
    for entry, fmt in zip(ENTRIES, loaded):
        assert type(fmt).__name__ == entry.name and type(fmt).__module__.endswith("." + entry.module)
        assert (fmt.kind, fmt.role, fmt.backend) == (entry.kind, entry.role, entry.backend)
        assert fmt.label, fmt
        for method in needs[fmt.role]:
            assert getattr(type(fmt), method) is not getattr(base.Format, method), (fmt.kind, method)
        if fmt.role == "adapter":
            assert type(fmt).detect is not base.Format.detect or type(fmt).detect_file is not base.Format.detect_file
    assert BACKENDS == tuple(f.backend for f in loaded if f.role == "checkpoint")


def test_no_module_outside_formats_names_a_kind():
    """What a kind is and does lives in its module: everything else asks the registry."""
    from tui_merger.core.formats.registry import ENTRIES

    kinds = {e.kind for e in ENTRIES} | {"trainer-checkpoint"}
    for path in (ROOT / "tui_merger").rglob("*.py"):
        if path.parent.name == "formats" and path.parent.parent.name == "core":
            continue
        strings = {
            node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        assert not strings & kinds, (path, strings & kinds)


def test_kind_modules_import_no_other_kind_except_shared_helpers():
    """A kind module imports base, the adapter model, the inputs record and io, not the registry (the
    registry imports the kinds) and not the stages after formats."""
    from tui_merger.core.formats.registry import ENTRIES

    graph = _import_graph()
    for entry in ENTRIES:
        name = f"tui_merger.core.formats.{entry.module}"
        assert "tui_merger.core.formats.registry" not in graph[name], name
        assert "tui_merger.core.formats.scan" not in graph[name], name
        later = {e for e in graph[name] if e.startswith("tui_merger.core.") and e.split(".")[2] in {"plan", "merge", "record", "verify"}}
        assert not later, (name, later)


def test_the_cli_backend_choices_come_from_the_registry():
    from tui_merger.cli import build_parser
    from tui_merger.core.formats.registry import BACKENDS

    merge = next(a for a in build_parser()._subparsers._group_actions[0].choices["merge"]._actions if a.dest == "backend")
    assert tuple(merge.choices) == ("auto", *BACKENDS)
