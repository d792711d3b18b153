"""The user's settings, kept in ``config.toml`` in the config folder ($XDG_CONFIG_HOME/tui-merger).

Every setting is a string or unset. Keys this version does not know are ignored on reading (a newer
version may have written them). Nothing here raises: a problem comes back as one sentence to show.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tui_merger.core.record.manifest import config_dir


@dataclass
class Settings:
    theme: str | None = None  # the colour theme chosen in the app; None: the default theme


def config_path() -> Path:
    return config_dir() / "config.toml"


def load() -> tuple[Settings, str | None]:
    """The saved settings (defaults when there is no file), and a problem sentence or None."""
    path = config_path()
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return Settings(), None
    except OSError as err:
        return Settings(), _ignored(path, f"it cannot be read ({err.strerror or err})")
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        return Settings(), _ignored(path, f"it is not valid TOML ({err})")
    given = {f.name: data[f.name] for f in fields(Settings) if f.name in data}
    wrong = [key for key, value in given.items() if not isinstance(value, str)]
    if wrong:
        return Settings(), _ignored(path, f"{', '.join(wrong)} must be a quoted string")
    return Settings(**given), None


def save(settings: Settings) -> str | None:
    """Write the settings atomically (a temporary file renamed over the old one). Returns a problem
    sentence, or None when saved."""
    path = config_path()
    lines = [f"{key} = {_toml_string(value)}" for key, value in asdict(settings).items() if value is not None]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("# tui-merger settings\n" + "".join(f"{line}\n" for line in lines),
                       encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, UnicodeEncodeError) as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        reason = getattr(err, "strerror", None) or err
        return f"The settings could not be saved to {path} ({reason})."
    return None


def _ignored(path: Path, why: str) -> str:
    return f"The settings file {path} was ignored and the defaults are used: {why}."


def _toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and TOML also wants DEL escaped."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")
