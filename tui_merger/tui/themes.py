"""Colour themes: the ones shipped with tui-merger and the user's own TOML files.

A theme file holds ``name``, ``dark`` and colours (``#rrggbb`` or a colour name), like the shipped
files in ``themes/``. Only ``name``, ``dark`` and ``primary`` are required; Textual derives the colours
left out. A file that cannot be used is skipped with a one-sentence problem for the user, never an
exception.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from textual.color import Color, ColorParseError
from textual.theme import BUILTIN_THEMES, Theme

from tui_merger.core.record.manifest import config_dir

DEFAULT_THEME = "harbor-night"
SHIPPED_DIR = Path(__file__).with_name("themes")
COLOURS = ("primary", "secondary", "accent", "warning", "error", "success", "foreground", "background",
           "surface", "panel")
REQUIRED = ("name", "dark", "primary")
# The app gets the CSS class "-theme-NAME", so a name must be usable in a class name.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class _Unusable(Exception):
    """Why a theme file is skipped: the end of a sentence that names the file."""


def user_themes_dir() -> Path:
    return config_dir() / "themes"


def load_themes(extra_dirs: list[Path] | None = None) -> tuple[list[Theme], list[str]]:
    """The shipped themes, then the ``*.toml`` files of the user's themes folder and of each extra folder.

    Returns the themes and one problem sentence per skipped file. Each name is used once: a later file
    with a name already taken is skipped as a clash, silently if it defines exactly the same theme (a
    copy of a shipped file).
    """
    themes: list[Theme] = []
    problems: list[str] = []
    seen: dict[str, tuple[Path, dict]] = {}  # name -> the file that defined it, and its table
    for folder in [SHIPPED_DIR, user_themes_dir(), *(extra_dirs or [])]:
        for path in sorted(Path(folder).glob("*.toml")):
            try:
                data = _read(path)
                name = data["name"]
                if name in seen:
                    other, other_data = seen[name]
                    if data == other_data:
                        continue
                    raise _Unusable(f"the name {name!r} is already used by {other}; give this theme another name")
            except _Unusable as why:
                problems.append(f"Theme file {path} was skipped: {why}.")
                continue
            seen[name] = (path, data)
            themes.append(Theme(**data))
    return themes, problems


def _read(path: Path) -> dict:
    """The file's table, every key checked."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as err:
        raise _Unusable(f"it cannot be read ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise _Unusable("it is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise _Unusable(f"it is not valid TOML ({err})") from None

    unknown = sorted(set(data) - {"name", "dark", *COLOURS})
    if unknown:
        raise _Unusable(f"{_keys('unknown key', unknown)} (the keys are name, dark, {', '.join(COLOURS)})")
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise _Unusable(f"{_keys('the required key', missing)} {'is' if len(missing) == 1 else 'are'} missing")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _Unusable("name must be letters, digits, '-' and '_', starting with a letter or digit")
    if name in BUILTIN_THEMES:
        raise _Unusable(f"the name {name!r} is taken by a built-in Textual theme; choose another")
    if not isinstance(data["dark"], bool):
        raise _Unusable("dark must be true or false")
    for key in COLOURS:
        if key in data:
            _check_colour(key, data[key])
    return data


def _check_colour(key: str, value) -> None:
    hint = "write #rrggbb or a colour name"
    if isinstance(value, str):
        try:
            Color.parse(value)
            return
        except ColorParseError as err:
            if err.suggested_color:
                hint = f"did you mean {err.suggested_color!r}?"
    raise _Unusable(f"{key} = {value!r} is not a colour ({hint})")


def _keys(what: str, keys: list[str]) -> str:
    """For example: the required keys 'name', 'dark'."""
    return f"{what}{'s' if len(keys) > 1 else ''} " + ", ".join(f"'{key}'" for key in keys)
