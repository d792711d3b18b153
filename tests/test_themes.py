"""Colour themes (shipped and user files, applied in a real Textual app) and the settings file.

Every test gets its own XDG_CONFIG_HOME, so the user's real config is never read or written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import textual.constants
from textual.app import App, ComposeResult
from textual.color import Color
from textual.widgets import Static

from tui_merger import settings
from tui_merger.settings import Settings
from tui_merger.tui.themes import COLOURS, DEFAULT_THEME, SHIPPED_DIR, load_themes, user_themes_dir

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))
GOOD = 'name = "{name}"\ndark = true\nprimary = "#336699"\nbackground = "#101010"\npanel = "#202830"\n'


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path / "config"


class ThemeApp(App):
    CSS = "#box { background: $panel; color: $foreground; }"

    def __init__(self, themes) -> None:
        super().__init__()
        for theme in themes:
            self.register_theme(theme)

    def compose(self) -> ComposeResult:
        yield Static("Themed", id="box")


async def apply(themes, name: str) -> None:
    """Switch a running app to `name`; check the theme's colours reach the CSS variables and a widget."""
    theme = next(t for t in themes if t.name == name)
    app = ThemeApp(themes)
    async with app.run_test(size=(60, 10)) as pilot:
        app.theme = name
        await pilot.pause()
        assert app.theme == name
        variables = app.get_css_variables()
        for key in COLOURS:
            if getattr(theme, key) is not None:
                assert same_colour(variables[key], getattr(theme, key)), key
        if theme.panel is not None:
            assert same_colour(app.query_one("#box").styles.background, theme.panel)
        assert "Themed" in app.export_screenshot()


def same_colour(a: str | Color, b: str) -> bool:
    """Equal but for rounding: Textual's colour system passes some colours through HSL."""
    a = Color.parse(a) if isinstance(a, str) else a
    return all(abs(x - y) <= 1 for x, y in zip(a.rgb, Color.parse(b).rgb))


def write_theme(folder: Path, file: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / file
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# Shipped themes
# ---------------------------------------------------------------------------------------------


def test_shipped_themes_are_the_examples_in_the_top_level_folder():
    examples = sorted((ROOT / "themes").glob("*.toml"))
    assert [p.stem for p in examples] == SHIPPED
    for example in examples:
        assert (SHIPPED_DIR / example.name).read_bytes() == example.read_bytes(), example.name


def test_shipped_themes_load_without_problems():
    themes, problems = load_themes()
    assert problems == []
    assert [t.name for t in themes] == SHIPPED
    assert DEFAULT_THEME in SHIPPED
    assert {"harbor-night", "paper"} <= set(SHIPPED)


@pytest.mark.anyio
@pytest.mark.parametrize("name", SHIPPED)
async def test_shipped_theme_applies(name):
    themes, _ = load_themes()
    await apply(themes, name)


def test_examples_folder_as_extra_dir_adds_no_duplicates():
    themes, problems = load_themes([ROOT / "themes"])
    assert problems == []
    assert [t.name for t in themes] == SHIPPED


# ---------------------------------------------------------------------------------------------
# User theme files
# ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_user_theme_loads_and_applies():
    write_theme(user_themes_dir(), "mine.toml", GOOD.format(name="mine"))
    themes, problems = load_themes()
    assert problems == []
    assert [t.name for t in themes] == [*SHIPPED, "mine"]
    await apply(themes, "mine")


def test_extra_dirs_are_read_after_the_user_folder(tmp_path):
    write_theme(user_themes_dir(), "a.toml", GOOD.format(name="a"))
    write_theme(tmp_path / "extra", "b.toml", GOOD.format(name="b"))
    themes, problems = load_themes([tmp_path / "extra", tmp_path / "missing"])
    assert problems == []
    assert [t.name for t in themes] == [*SHIPPED, "a", "b"]


BAD = {
    "bad-colour.toml": (GOOD.format(name="x").replace("#101010", "#10101g"), "background = '#10101g' is not a colour"),
    "colour-typo.toml": (GOOD.format(name="x").replace('"#101010"', '"Red"'), "did you mean 'red'"),
    "colour-number.toml": (GOOD.format(name="x").replace('"#101010"', "16"), "background = 16 is not a colour"),
    "missing-key.toml": ('name = "x"\ndark = true\n', "the required key 'primary' is missing"),
    "missing-keys.toml": ('primary = "red"\n', "the required keys 'name', 'dark' are missing"),
    "unknown-key.toml": (GOOD.format(name="x") + 'primray = "red"\n', "unknown key 'primray'"),
    "broken.toml": ('name = "x\ndark = true\n', "is not valid TOML"),
    "not-utf8.toml": ("name = \"caf\xe9\"\n", "is not UTF-8 text"),
    "dark-string.toml": (GOOD.format(name="x").replace("dark = true", 'dark = "yes"'), "dark must be true or false"),
    "bad-name.toml": (GOOD.format(name="my theme"), "name must be letters, digits"),
    "builtin-name.toml": (GOOD.format(name="nord"), "'nord' is taken by a built-in Textual theme"),
    "shipped-name.toml": (GOOD.format(name="paper"), "'paper' is already used by"),
}


@pytest.mark.parametrize("file", BAD)
def test_bad_theme_file_is_skipped_with_one_sentence(file):
    text, expected = BAD[file]
    folder = user_themes_dir()
    write_theme(folder, "good.toml", GOOD.format(name="good"))
    path = folder / file
    path.write_bytes(text.encode("latin-1") if file == "not-utf8.toml" else text.encode())
    themes, problems = load_themes()
    assert [t.name for t in themes] == [*SHIPPED, "good"]
    assert len(problems) == 1
    assert problems[0].startswith(f"Theme file {path} was skipped: ")
    assert expected in problems[0]
    assert problems[0].endswith(".") and "\n" not in problems[0]


def test_unreadable_theme_files_are_skipped(tmp_path):
    folder = user_themes_dir()
    write_theme(folder, "good.toml", GOOD.format(name="good"))
    (folder / "dangling.toml").symlink_to(tmp_path / "gone.toml")
    (folder / "folder.toml").mkdir()
    problems = load_themes()[1]
    assert len(problems) == 2
    assert f"Theme file {folder / 'dangling.toml'} was skipped: it cannot be read (No such file" in problems[0]
    assert f"Theme file {folder / 'folder.toml'} was skipped: it cannot be read (Is a directory)." == problems[1]
    if os.geteuid() != 0:  # root reads any file
        (folder / "good.toml").chmod(0)
        problems = load_themes()[1]
        assert f"{folder / 'good.toml'} was skipped: it cannot be read (Permission denied)" in problems[0]


@pytest.mark.anyio
async def test_themes_load_and_apply_without_colour_or_at_256_colours(monkeypatch):
    """NO_COLOR=1 (greyscale) and TEXTUAL_COLOR_SYSTEM=256 (SSH without COLORTERM) change how Textual
    draws, not which themes load or apply."""
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("TEXTUAL_COLOR_SYSTEM", "256")
    monkeypatch.setattr(textual.constants, "COLOR_SYSTEM", "256")  # read when textual was imported
    write_theme(user_themes_dir(), "mine.toml", GOOD.format(name="mine"))
    themes, problems = load_themes()
    assert problems == []
    app = ThemeApp(themes)
    async with app.run_test(size=(60, 10)) as pilot:
        assert app.no_color and app.console.color_system == "256"
        for theme in themes:
            app.theme = theme.name
            await pilot.pause()
            assert app.theme == theme.name
            assert "Themed" in app.export_screenshot()


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


def test_settings_default_without_a_file(config_home):
    assert settings.load() == (Settings(), None)
    assert not config_home.exists()


@pytest.mark.parametrize("theme", ["paper", 'odd "quoted" \\ name\twith\nnewline, DEL \x7f, é and 😀', None])
def test_settings_round_trip(theme):
    assert settings.save(Settings(theme=theme)) is None
    assert settings.load() == (Settings(theme=theme), None)
    assert not [p for p in settings.config_path().parent.iterdir() if p.name != "config.toml"]  # no temp file


def test_settings_ignore_keys_this_version_does_not_know():
    settings.config_path().parent.mkdir(parents=True)
    settings.config_path().write_text('theme = "paper"\nlast_folder = "/data"\n')
    assert settings.load() == (Settings(theme="paper"), None)


@pytest.mark.parametrize(
    "text, expected",
    [
        (b'theme = "paper\n', "it is not valid TOML (Illegal character"),  # unterminated string
        (b"theme = \"caf\xe9\"\n", "it is not valid TOML ('utf-8' codec can't decode"),
        (b"theme = 3\n", "theme must be a quoted string"),
    ],
)
def test_broken_settings_file_gives_defaults_and_a_problem(text, expected):
    path = settings.config_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    loaded, problem = settings.load()
    assert loaded == Settings()
    assert problem.startswith(f"The settings file {path} was ignored and the defaults are used: {expected}")
    assert problem.endswith(".") and "\n" not in problem


def test_unreadable_settings_file_gives_defaults_and_a_problem():
    path = settings.config_path()
    path.mkdir(parents=True)  # a folder where the file should be
    assert settings.load() == (
        Settings(),
        f"The settings file {path} was ignored and the defaults are used: it cannot be read (Is a directory).",
    )


def test_save_to_an_unwritable_config_folder_gives_a_problem(config_home):
    config_home.mkdir()
    (config_home / "tui-merger").write_text("a file where the folder should be")
    problem = settings.save(Settings(theme="paper"))
    assert problem == f"The settings could not be saved to {settings.config_path()} (File exists)."
    if os.geteuid() != 0:  # root writes anywhere
        (config_home / "tui-merger").unlink()
        (config_home / "tui-merger").mkdir(mode=0o500)
        problem = settings.save(Settings(theme="paper"))
        assert problem == f"The settings could not be saved to {settings.config_path()} (Permission denied)."


def test_save_keeps_the_old_file_when_writing_fails():
    assert settings.save(Settings(theme="paper")) is None
    assert settings.save(Settings(theme="bad \udcff surrogate")) is not None  # cannot be UTF-8 encoded
    assert settings.load() == (Settings(theme="paper"), None)
    assert [p.name for p in settings.config_path().parent.iterdir()] == ["config.toml"]
