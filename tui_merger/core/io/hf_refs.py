"""References to models: a path or an ORG/NAME Hub id, resolved to a local folder (the path itself, or its
snapshot in the Hugging Face cache, found by the cache's path convention without importing huggingface_hub)."""

from __future__ import annotations

import os
import re
from pathlib import Path


# set (with HF_HUB_OFFLINE) by `tui-merger demo` when it made the process offline itself, so that a refused
# upload says who set HF_HUB_OFFLINE (huggingface_hub reads it once, at import: it cannot be unset after)
OFFLINE_BY_DEMO = "TUI_MERGER_DEMO_OFFLINE"


def hf_command() -> str:
    """How the person running tui-merger starts huggingface_hub's `hf` command: `hf` when their PATH finds
    one, else the full path of the one installed beside this Python (pipx keeps it inside tui-merger's own
    environment and puts only `tui-merger` on the PATH)."""
    import shlex
    import shutil
    import sys

    if shutil.which("hf"):
        return "hf"
    beside = Path(sys.executable).parent / "hf"  # not resolved: a venv's python is a link out of the venv
    return shlex.quote(str(beside)) if beside.is_file() else "hf"


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")


def is_repo_id(ref: str) -> bool:
    """Whether a model reference can be a Hub id (ORG/NAME or NAME), which `hf download` fetches."""
    return bool(_REPO_ID.fullmatch(ref)) and "--" not in ref and ".." not in ref


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, found as huggingface_hub finds it (without importing it)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot of a Hub model (refs/main first) holding config.json, by the cache's path
    convention; None when the model is not in the cache."""
    repo = hub_cache() / ("models--" + repo_id.replace("/", "--"))
    try:
        main = (repo / "refs" / "main").read_text().strip()
    except (OSError, UnicodeDecodeError):
        main = ""
    try:
        others = sorted((repo / "snapshots").iterdir(), reverse=True)
    except OSError:
        others = []
    for snap in ([repo / "snapshots" / main] if main else []) + others:
        if (snap / "config.json").is_file():
            return snap
    return None


def resolve_model_reference(name) -> Path | None:
    """A model reference (a path or an ORG/NAME Hub id) to a local folder with config.json: the path
    itself, or its snapshot in the Hugging Face cache. None when it would need a download."""
    if not name or not isinstance(name, str):
        return None
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        return path
    if re.fullmatch(r"[\w.\-]+/[\w.\-]+", name) and ".." not in name:
        return cached_snapshot(name)
    return None


def names_of_base(base: Path, config: dict) -> set[str]:
    names = {str(base), str(base.resolve()), base.name, base.resolve().name}
    if config.get("_name_or_path"):
        names.add(str(config["_name_or_path"]))
    for part in base.resolve().parts:  # .../models--Org--Name/snapshots/<sha>
        if part.startswith("models--"):
            names.add(part[len("models--"):].replace("--", "/"))
    return names
