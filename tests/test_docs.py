"""The README and the pages under docs/ keep every command true (issue 32): the README fits on a screen
and holds the two commands exactly; every `tui-merger ...` command they show names a subcommand and
options the command line has, and that subcommand answers --help; every `python benchmarks/...`
script exists and has the options shown; every relative link leads to a file."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tui_merger.cli import build_parser, build_ui_parser, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def snippets(text: str) -> list[str]:
    """The lines of code blocks and the inline code spans of a Markdown page (``text`` blocks are what
    a program printed, not commands)."""
    found, block, output = [], False, False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            block, output = not block, line.strip() == "```text"
            continue
        if block:
            if not output:
                found.append(line)
        else:
            found += re.findall(r"`([^`]+)`", line)
    return found


def commands(program: str) -> list[tuple[Path, str]]:
    """Every command line that runs ``program`` ("tui-merger", "python benchmarks/..."), cut at a
    comment or the next command of a chain."""
    out = []
    for page in PAGES:
        for snippet in snippets(page.read_text()):
            for part in re.split(r"&&|\|\||;|\|", snippet.split(" #")[0]):
                part = part.strip()
                at = re.search(rf"(?:^|\s){re.escape(program)}(?:\s|$)", part)
                if at:
                    out.append((page, part[at.start():].strip()))
    return out


def subcommands() -> dict:
    return build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 (argparse keeps them here)


def test_the_readme_fits_on_a_screen_and_keeps_its_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 50
    blocks = [s for s in snippets(text) if "pip install" in s]
    # the app in an environment of its own, then the demo; the tests as .ci/run runs them
    # (issue 38 item 7: pipx ensurepath leaves `tui-merger` on the PATH of the shells opened after it)
    assert ("python -m pip install pipx && python -m pipx install --preinstall torch==2.13.0 . && "
            "python -m pipx ensurepath && ~/.local/bin/tui-merger demo") in blocks
    assert "pip install torch==2.13.0 -e '.[dev]' && python -m pytest -q" in blocks
    for page in ("assistant", "command-line", "formats", "verification", "troubleshooting", "performance", "install",
                 "megatron-lora"):
        assert f"(docs/{page}.md)" in text


def test_every_documented_tui_merger_command_exists_with_its_options():
    subs = subcommands()
    top = set(build_parser()._option_string_actions)  # noqa: SLF001
    found = commands("tui-merger")
    assert len(found) > 40  # the pages do show commands: the reader below found them
    checked = set()
    for page, command in found:
        words = [w for w in command.split()[1:] if not w.startswith("-")]
        sub = words[0] if words and words[0] in subs else None
        parser = subs[sub] if sub else build_ui_parser()
        known = set(parser._option_string_actions) | top  # noqa: SLF001
        unknown = [f for f in FLAG.findall(command) if f not in known]
        assert not unknown, f"{page.name}: `{command}` has options tui-merger {sub or '[PATH]'} does not: {unknown}"
        if words and sub is None:  # a path for the assistant, not a misspelt command
            assert not re.fullmatch(r"[a-z]+(-[a-z]+)*", words[0]), f"{page.name}: `{command}`: no command {words[0]}"
        checked.add(sub)
    assert {"merge", "inspect", "verify", "cleanup", "upload", "gguf", "try", "jobs", "attach", "demo", "test",
            "convert-kohya"} <= checked


@pytest.mark.parametrize("sub", sorted(subcommands()))
def test_every_subcommand_answers_help(sub, capsys):
    with pytest.raises(SystemExit) as done:
        main([sub, "--help"])
    assert done.value.code == 0
    assert f"usage: tui-merger {sub}" in capsys.readouterr().out


def test_every_documented_benchmark_script_exists_with_its_options():
    found = commands("python")
    scripts = [(page, c) for page, c in found if re.match(r"python benchmarks/\w+\.py", c)]
    assert len(scripts) > 8
    for page, command in scripts:
        script = ROOT / shlex.split(command)[1]
        assert script.is_file(), f"{page.name}: `{command}`: no {script.name}"
        source = script.read_text()
        for flag in FLAG.findall(command):
            assert f'"{flag}"' in source or f"'{flag}'" in source, f"{page.name}: `{command}`: {script.name} has no {flag}"


def test_every_relative_link_leads_to_a_file():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_both_exit_code_tables_list_every_code_the_command_line_returns():
    """Issue 38 item 16: with no terminal the assistant exits 2, which neither table listed. The codes:
    0 done, 1 bad input, 2 nothing done (no terminal, or argparse's usage error), 3 a bug, 4 verification
    failed (cli.common.VERIFY_FAILED), 130 cancelled."""
    import re

    from tui_merger.cli.common import VERIFY_FAILED

    codes = {0, 1, 2, 3, VERIFY_FAILED, 130}
    table = (ROOT / "docs" / "troubleshooting.md").read_text().split("## Exit codes", 1)[1]
    assert {int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)} == codes
    line = (ROOT / "docs" / "command-line.md").read_text().split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    assert {int(m) for m in re.findall(r"(?:^ ?|; )(\d+) ", line.replace("\n", " "))} == codes, line


def test_the_command_line_page_lists_every_command_and_option():
    """Issue 38 item 21: docs/command-line.md says it lists "every command and option"; it lacked demo,
    --no-behaviour, --rewrite-card, inspect --depth, cleanup --include/--exclude/--merged and upload
    --revision/--message. Every listed subcommand is named there and each option of it is shown (one of
    its spellings) somewhere on the page."""
    import argparse

    page = (ROOT / "docs" / "command-line.md").read_text()
    documented = set(FLAG.findall(page))
    group = build_parser()._subparsers._group_actions[0]  # noqa: SLF001
    listed = {a.dest for a in group._choices_actions}  # noqa: SLF001 (those with help: not _job-run)
    missing = []
    for name, parser in group.choices.items():
        if name not in listed:
            continue
        if f"tui-merger {name}" not in page:
            missing.append(name)
        for action in parser._actions:  # noqa: SLF001
            if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
                continue
            if not documented & set(action.option_strings):
                missing.append(f"{name} {'/'.join(action.option_strings)}")
    assert missing == []


def test_no_page_says_megatron_bridge_adapter_shards_are_refused():
    """Issue 38 item 21: formats.md said a run holding its adapter only as Megatron-Bridge shards is
    refused, while they are merged (megatron-lora.md). The code's answer is asked (a real Megatron-Bridge
    run of the fixtures is a mergeable candidate), and no page may say otherwise."""
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.plan.choices import why_not_mergeable

    found = scan(ROOT / "tests" / "fixtures" / "megatron_lora" / "lora_tp1")
    [run] = [c for c in found.candidates if c.kind == "verl-megatron"]
    assert why_not_mergeable(run) is None
    for page in PAGES:
        text = " ".join(page.read_text().split())
        for sentence in re.split(r"(?<=[.:;])\s", text):
            if "Megatron-Bridge" in sentence and "shards" in sentence:
                claim = r"shards[^.]*\b(?:is|are) (?:refused|not (?:yet )?merged)|refuses?\b[^.]*shards|Not yet: those shards"
                assert not re.search(claim, sentence), (page.name, sentence)
