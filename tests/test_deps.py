"""The declared dependency ranges: what `tui-merger --version` prints, the sentence an out-of-range
library gets instead of "a bug in tui-merger", and the minimum-versions pins CI installs.

The environment running this file must itself be inside the ranges (CI runs it at the latest versions
and again pinned to the minimums): ``test_this_environment_is_in_range`` says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tui_merger import deps

ROOT = Path(__file__).resolve().parents[1]
needs_metadata = pytest.mark.skipif(not deps.declared(), reason="tui-merger is not installed (pip install -e .)")


def _run(*args, pythonpath=(), timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(ROOT)])}
    return subprocess.run([sys.executable, "-m", "tui_merger", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT)


def _fake_old_peft(folder: Path, version: str = "0.17.1") -> Path:
    """A peft that says it is ``version`` (its metadata and ``__version__``) and fails to import with
    transformers 5 exactly as the real peft 0.17.1 does (it imports HybridCache, gone from transformers 5)."""
    pkg = folder / "peft"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f'__version__ = "{version}"\nfrom transformers import HybridCache\n')
    info = folder / f"peft-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: peft\nVersion: {version}\n")
    return folder


@needs_metadata
def test_this_environment_is_in_range():
    assert deps.mismatches() == []


@needs_metadata
def test_every_library_that_a_bug_report_needs_is_declared():
    assert set(deps.LIBRARIES) <= set(deps.declared())


@needs_metadata
def test_version_prints_ours_python_and_each_library_without_loading_torch():
    proc = _run("--version")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    from tui_merger import __version__

    assert lines[0] == f"tui-merger {__version__}"
    assert lines[1].startswith(f"Python {sys.version.split()[0]} ")
    ranges = deps.declared()
    for name in deps.LIBRARIES:
        line = next(line for line in lines if line.split()[0] == name)
        assert line.split()[1] == metadata.version(name), line
        assert f"(needs {ranges[name]})" in line and "outside" not in line
    code = "import sys; from tui_merger.cli import main\ntry: main(['--version'])\nexcept SystemExit: pass\n" \
           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft', 'textual')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


@needs_metadata
def test_an_out_of_range_library_is_named_with_its_range_and_fix_not_called_a_bug(tmp_path):
    """The issue's case: peft 0.17.1 (kept by pip in a training environment) under transformers 5:
    `tui-merger demo --no-ui` used to end with "unexpected ImportError ... This is a bug in tui-merger"."""
    fake = _fake_old_peft(tmp_path / "site")
    proc = _run("demo", "--no-ui", "--workspace", tmp_path / "ws", pythonpath=[fake])
    assert proc.returncode == 1, proc.stderr
    needed = deps.declared()["peft"]
    first = proc.stderr.strip().splitlines()[-2]
    assert first == (
        f"error: peft 0.17.1 is installed, but tui-merger needs peft{needed}; run `pip install 'peft{needed}'` "
        f"in this environment, or install tui-merger {deps.ISOLATED}."
    ), proc.stderr
    assert "HybridCache" in proc.stderr.splitlines()[-1]  # what failed, after the sentence
    assert "bug" not in proc.stderr and "Traceback" not in proc.stderr
    version = _run("--version", pythonpath=[fake])
    assert version.returncode == 0
    line = next(line for line in version.stdout.splitlines() if line.split()[0] == "peft")
    assert line.split()[1] == "0.17.1" and "outside the range" in line


@needs_metadata
def test_an_unexpected_failure_with_every_library_in_range_is_still_ours():
    assert deps.explain_failure(RuntimeError("boom")) is None


def test_a_missing_library_and_an_old_one_are_said_in_one_sentence_each():
    old = deps.Mismatch("transformers", "4.57.1", ">=5.23.0")
    assert old.sentence().startswith("transformers 4.57.1 is installed, but tui-merger needs transformers>=5.23.0; ")
    gone = deps.Mismatch("gguf", None, ">=0.18.0")
    assert gone.sentence().startswith("gguf is not installed, but tui-merger needs gguf>=0.18.0; ")
    for sentence in (old.sentence(), gone.sentence()):
        assert sentence.count(". ") == 0 and sentence.endswith(".") and "\n" not in sentence


def test_local_and_nightly_builds_count_by_their_release():
    assert not deps._outside("2.13.0+cpu", ">=2.13")
    assert not deps._outside("2.15.0.dev20261201+cu130", ">=2.13")
    assert deps._outside("2.12.1+cpu", ">=2.13")


MIN_FILE = ROOT / ".ci" / "min-versions.txt"


@needs_metadata
def test_ci_pins_exactly_the_declared_minimums():
    """.ci/min-versions.txt (the minimum-versions run) pins each declared floor, and nothing else; torch
    alone is pinned to the CPU build CI has on disk (older torch for Linux is a multi-GB CUDA download
    from the registry), a version inside its declared range."""
    from packaging.version import Version

    pins = {}
    for line in MIN_FILE.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    floors = {}
    for name, spec in deps.declared().items():
        found = re.search(r">=([\w.]+)", spec)
        assert found, f"{name}{spec} declares no floor"
        floors[name] = found.group(1)
    assert set(pins) == set(floors)
    assert {n: v for n, v in pins.items() if n != "torch"} == {n: v for n, v in floors.items() if n != "torch"}
    assert pins["torch"] == "2.13.0" and Version(pins["torch"]) >= Version(floors["torch"])
