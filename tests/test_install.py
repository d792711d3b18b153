"""An isolated install (what `pipx install .` or `uv tool install .` makes: tui-merger in a venv of its
own) answers `tui-merger --help` from its console script, with none of the heavy libraries loaded.

The venv here is clean (no system site-packages) and gets tui-merger built from this tree as a wheel
(not editable) plus packaging, without the ML libraries: a full install would spend minutes unpacking
torch, and `--help` must not need them. `--version` there names each missing library in a sentence.
Building the wheel takes setuptools from the package registry (or pip's cache): without it, skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def isolated(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("isolated") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", str(ROOT), "packaging"],
        capture_output=True, text=True, env=env, timeout=600, cwd=venv.parent,
    )
    if proc.returncode != 0:
        unreachable = ("Could not find a version", "NewConnectionError", "Max retries", "Temporary failure")
        if any(s in proc.stderr for s in unreachable):
            pytest.skip(f"the package registry is unreachable: {proc.stderr.strip().splitlines()[-1]}")
        raise AssertionError(proc.stderr)
    return venv


def _run(venv: Path, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run([str(venv / "bin" / "tui-merger"), *args], capture_output=True, text=True, env=env,
                          timeout=60, cwd=venv.parent, stdin=subprocess.DEVNULL)


def test_the_isolated_install_answers_help_fast(isolated):
    start = time.perf_counter()
    proc = _run(isolated, "--help")
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: tui-merger") and "merge" in proc.stdout and "demo" in proc.stdout
    assert elapsed < 5, elapsed  # no torch, no transformers: it does not even have them
    # the code that answered is the installed copy, not this tree
    where = subprocess.run([str(isolated / "bin" / "python"), "-c", "import tui_merger; print(tui_merger.__file__)"],
                           capture_output=True, text=True, cwd=isolated.parent, check=True).stdout
    assert str(isolated) in where and str(ROOT) not in where


def test_the_isolated_install_names_each_missing_library(isolated):
    proc = _run(isolated, "--version")
    assert proc.returncode == 0, proc.stderr
    torch = next(line for line in proc.stdout.splitlines() if line.split()[0] == "torch")
    assert "not installed" in torch and "torch is not installed, but tui-merger needs torch>=" in torch
