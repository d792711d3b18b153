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
        "import sys, tui_merger.cli, tui_merger.core.engine;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in %r))" % (HEAVY | {"textual"},)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
