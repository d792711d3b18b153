"""The libraries tui-merger runs on: the ranges it declares and the versions installed here.

The ranges are read from the installed package's own metadata (pyproject.toml's ``dependencies``,
the one place they are written), the installed versions from each library's metadata: nothing here
imports torch or any other library it names, so ``tui-merger --version`` stays fast. A user's
environment can hold anything (a training environment pins its own transformers and peft): when an
unexpected failure happens with a library outside its range, :func:`explain_failure` says so in one
sentence with the fix, instead of calling it a bug of ours.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import metadata

DIST = "tui-merger"
# what a bug report needs, in this order; each is a dependency declared in pyproject.toml
LIBRARIES = (
    "torch", "transformers", "peft", "accelerate", "safetensors", "huggingface_hub",
    "textual", "rich", "questionary", "gguf",
)
ISOLATED = "in an environment of its own, which leaves this one as it is (pipx install or uv tool install, see docs/install.md)"


@dataclass(frozen=True)
class Mismatch:
    name: str  # as pyproject.toml writes it
    installed: str | None  # None: not installed
    needed: str  # the declared specifier, e.g. ">=0.18"

    def sentence(self) -> str:
        want = f"{self.name}{self.needed}"
        fix = f"`pip install '{want}'` in this environment, or install tui-merger {ISOLATED}"
        if self.installed is None:
            return f"{self.name} is not installed, but tui-merger needs {want}; run {fix}."
        return f"{self.name} {self.installed} is installed, but tui-merger needs {want}; run {fix}."


def declared() -> dict[str, str]:
    """The declared range of each run-time dependency, by name (``{}`` when tui-merger runs from a
    source tree without being installed: then nothing is checked)."""
    try:
        requires = metadata.requires(DIST) or []
    except metadata.PackageNotFoundError:
        return {}
    from packaging.requirements import Requirement

    ranges = {}
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's (dev) requirement, or one for another platform
        ranges[req.name] = str(req.specifier)
    return ranges


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _outside(version: str, needed: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:  # a nightly or a local build (2.13.0+cpu) counts by its release number
        return not SpecifierSet(needed).contains(version, prereleases=True)
    except InvalidVersion:
        return False  # a version we cannot read is not called wrong


def mismatches(names: tuple[str, ...] | None = None) -> list[Mismatch]:
    """The declared dependencies (or those of ``names``) missing or outside their range."""
    found = []
    for name, needed in declared().items():
        if names is not None and name not in names:
            continue
        version = installed(name)
        if version is None or (needed and _outside(version, needed)):
            found.append(Mismatch(name, version, needed))
    return found


def explain_failure(err: BaseException) -> str | None:
    """For an unexpected failure: the sentence(s) naming each library outside its range (one line
    each, the failure itself after them), or None when every library is in range (then it is ours)."""
    found = mismatches()
    if not found:
        return None
    lines = [m.sentence() for m in found]
    lines.append(f"(What failed: {type(err).__name__}: {err}.)")
    return "\n".join(lines)


def version_report() -> str:
    """``tui-merger --version``: ours, Python's, and each library's version with its declared range;
    one marked line for each one outside it."""
    import platform

    from tui_merger import __version__

    ranges = declared()
    lines = [f"tui-merger {__version__}", f"Python {platform.python_version()} ({sys.executable})"]
    names = list(LIBRARIES) + [n for n in ranges if n not in LIBRARIES]
    width = max(len(n) for n in names)
    for name in names:
        version = installed(name)
        needed = ranges.get(name, "")
        line = f"  {name:<{width}}  {version or 'not installed'}"
        if needed:
            line += f"  (needs {needed})"
        if ranges and (version is None or (needed and _outside(version, needed))):
            line += "  <- outside the range: " + Mismatch(name, version, needed).sentence()
        lines.append(line)
    if not ranges:
        lines.append("(tui-merger is not installed as a package here: the declared ranges are unknown)")
    return "\n".join(lines)
