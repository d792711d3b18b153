"""The Textual merge assistant, driven with Textual's pilot on real checkpoints: every step, back and next,
validation, a failing merge (the app stays alive), cancel mid-merge gated by the engine's own events,
and a full run to a verified model."""

from __future__ import annotations

import io
import json
import re
import shutil
import threading
from shlex import quote as shlex_quote
from pathlib import Path

import pytest
import torch
from textual.widgets import Button, Checkbox, DataTable, Input, OptionList, ProgressBar, Select, Static

from tui_merger.core.events import TensorProgress, TrialToken
from tui_merger.core.record.manifest import read_manifest
from tui_merger.tui.app import MergeApp


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from tui_merger.demo import build_demo

    ws = tmp_path_factory.mktemp("tui") / "ws"
    build_demo(ws)
    return ws


def text(app, selector) -> str:
    """A Static's text: its markup, or a Rich renderable (the plan's grid) rendered as plain text."""
    content = app.screen.query_one(selector, Static).content
    if isinstance(content, str) or not hasattr(content, "__rich_console__"):
        return str(content)
    from rich.console import Console

    console = Console(width=200, record=True, file=io.StringIO())
    console.print(content)
    return console.export_text()


def header(app) -> tuple[str, str]:
    """(the header as plain text, the step it highlights)."""
    from textual.content import Content

    title = app.screen.query_one("#title", Static)
    content = Content.from_markup(str(title.content))
    current = [content.plain[span.start:span.end].strip() for span in content.spans if "reverse" in str(span.style)]
    return content.plain, current[0] if current else ""


async def until(pilot, condition, what: str, tries: int = 600):
    for _ in range(tries):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def recheck(pilot, app, what="the new plan"):
    """Enter in the output field checks again, as a user does after editing it."""
    app.screen.query_one("#out", Input).focus()
    await pilot.press("enter")
    await until(pilot, lambda: app.wizard.running is None and not app.wizard.plan_stale, what)


async def to_review(pilot, app):
    wizard = app.wizard
    await until(pilot, lambda: wizard.candidate is not None, "a candidate")
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.plan is not None and wizard.running is None, "the plan")
    return wizard


async def merge_and_verify(pilot, wizard):
    """Merge from Review, as Ctrl+N does, and wait for the merge and its verification to end."""
    await pilot.press("ctrl+n")
    await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=1200)


async def test_find_lists_checkpoints_and_picks_the_adapter(workspace):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidate is not None, "a candidate")
        plain, current = header(app)
        assert "Find > Review > Merge > Verify >" in plain.replace("  ", " ") and current == "Find"
        kinds = [c.kind for c in wizard.candidates]
        assert "peft-adapter" in kinds and "hf-model" in kinds
        assert wizard.candidate.kind == "peft-adapter"  # the first mergeable one is chosen
        assert "LoRA rank 8, alpha 16" in text(app, "#path-status")
        assert not app.screen.query_one("#next", Button).disabled
        assert app.screen.query_one("#back", Button).disabled
        bindings = app.screen.active_bindings  # the footer: no "^b Back" where Back does nothing (issue 32)
        assert "ctrl+b" not in bindings and "ctrl+n" in bindings


async def test_typed_path_is_validated(workspace, tmp_path):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        path = app.screen.query_one("#path", Input)
        path.value = str(tmp_path / "nowhere")
        path.focus()
        await pilot.press("enter")
        assert "does not exist" in text(app, "#path-status")
        empty = tmp_path / "empty"
        empty.mkdir()
        path.value = str(empty)
        path.focus()
        await pilot.press("enter")
        assert "No checkpoint found" in text(app, "#path-status")
        assert app.screen.query_one("#next", Button).disabled
        path.value = str(workspace / "adapter")
        path.focus()
        await pilot.press("enter")
        await until(pilot, lambda: app.wizard.candidate is not None, "the typed adapter")
        assert app.wizard.candidate.path == str(workspace / "adapter")


async def test_review_shows_the_plan_and_back_returns_to_find(workspace):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert header(app)[1] == "Review"
        assert "r=8 alpha=16" in text(app, "#plan-text")
        assert "every check passed" in text(app, "#findings")
        out = app.screen.query_one("#out", Input).value
        assert out.endswith(wizard.plan.suggested_out) and Path(out).parent == workspace
        assert not app.screen.query_one("#next", Button).disabled
        await pilot.press("ctrl+b")
        assert wizard.step == "find"


async def test_errors_block_and_warnings_need_a_tick(workspace, tmp_path):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        taken = tmp_path / "taken"
        taken.mkdir()
        (taken / "x").write_text("x")
        app.screen.query_one("#out", Input).value = str(taken)
        await pilot.pause()
        assert app.screen.query_one("#next", Button).disabled  # edited: stale until checked again
        await recheck(pilot, app)
        assert "ERROR" in text(app, "#findings") and "not empty" in text(app, "#findings")
        assert app.screen.query_one("#next", Button).disabled
        assert "1 error to fix first" in text(app, "#nav-status")
        assert not app.screen.query_one("#ack", Checkbox).display  # issue 38 item 15: an error only: no box
        # a warning: the adapter config lost its lora_alpha (peft would use 8)
        app.screen.query_one("#out", Input).value = str(tmp_path / "fresh")
        cfg = workspace / "adapter" / "adapter_config.json"
        saved = cfg.read_text()
        try:
            data = json.loads(saved)
            del data["lora_alpha"]
            cfg.write_text(json.dumps(data))
            await recheck(pilot, app, "the plan with a warning")
            assert "WARNING" in text(app, "#findings") and app.screen.query_one("#ack", Checkbox).display
            # while the checks run again the box asks nothing (issue 38 item 15)
            wizard.panes["review"].replan()
            assert wizard.running == "plan" and not app.screen.query_one("#ack", Checkbox).display
            await until(pilot, lambda: wizard.running is None, "the plan again")
            assert app.screen.query_one("#ack", Checkbox).display
        finally:
            cfg.write_text(saved)
        assert app.screen.query_one("#next", Button).disabled
        app.screen.query_one("#ack", Checkbox).value = True
        await pilot.pause()
        assert not app.screen.query_one("#next", Button).disabled


def _workspace_with_alpha(workspace, tmp_path, alpha):
    """The demo's base and adapter, the adapter recording ``alpha`` as lora_alpha (None: no lora_alpha)
    and its base by path."""
    ws = tmp_path / "ws"
    for name in ("base", "adapter"):
        shutil.copytree(workspace / name, ws / name)
    cfg_path = ws / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("lora_alpha")
    if alpha is not None:
        cfg["lora_alpha"] = alpha
    cfg["base_model_name_or_path"] = str(ws / "base")
    cfg_path.write_text(json.dumps(cfg))
    return ws


async def _merged_with_the_typed_alpha(pilot, app, wizard, out):
    """Merge from Review; the verification passes and the manifest records the alpha typed (32) as given."""
    await merge_and_verify(pilot, wizard)
    assert "PASSED" in text(app, "#verify-status")
    manifest = read_manifest(out)
    assert manifest["adapter"]["alpha"] == 32 and manifest["adapter"]["alpha_from"] == "--lora-alpha"


async def test_an_adapter_without_lora_alpha_gets_the_field_and_the_value_is_merged(workspace, tmp_path):
    """Issue 38: Review had no way to give lora_alpha to a PEFT adapter that records none. The field is
    shown (empty: peft's 8, said in it), a typed value is planned, merged and recorded."""
    ws = _workspace_with_alpha(workspace, tmp_path, None)
    app = MergeApp(ws)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        alpha = app.screen.query_one("#alpha", Input)
        assert alpha.display and "8, peft's default" in alpha.placeholder
        assert "has no lora_alpha" in text(app, "#findings") and 'type it in "LoRA alpha"' in text(app, "#findings")
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        alpha.value = "32"
        await recheck(pilot, app)
        assert 'alpha=32 (from "LoRA alpha")' in text(app, "#plan-text")
        assert "has no lora_alpha" not in text(app, "#findings") and "alpha 32, from" in text(app, "#findings")
        await _merged_with_the_typed_alpha(pilot, app, wizard, out)


async def test_a_recorded_zero_alpha_gets_the_field_and_the_value_is_merged(workspace, tmp_path):
    """Issue 38: an adapter recording lora_alpha 0 showed the error with no field (a dead end), and the
    engine refused the value even when given. The field says why it is asked, the error tells the user
    to type in it, and the typed value is merged."""
    ws = _workspace_with_alpha(workspace, tmp_path, 0)
    app = MergeApp(ws)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        alpha = app.screen.query_one("#alpha", Input)
        assert alpha.display and alpha.placeholder == ""  # no default: 0 would change nothing
        assert "records 0, which would change nothing" in str(app.screen.query_one("#alpha-label", Static).content)
        findings = text(app, "#findings")
        assert "lora_alpha is 0" in findings and '"LoRA alpha"' in findings and "--lora-alpha" not in findings
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        alpha.value = "32"
        await recheck(pilot, app)
        assert 'alpha=32 (from "LoRA alpha")' in text(app, "#plan-text")
        assert "lora_alpha is 0" not in text(app, "#findings")
        await _merged_with_the_typed_alpha(pilot, app, wizard, out)


async def test_a_named_base_that_does_not_fit_gets_the_base_field_and_a_fitting_proposal(workspace, tmp_path):
    """Issue 38 item 3: the adapter names a base that is here but is another model (shapes do not fit):
    Review showed the error with no base field and no proposal (a dead end), though a model that fits
    was beside it. The base field appears, holding the named base, with the model that fits proposed."""
    from factory import qwen_config, save_base

    ws = tmp_path / "ws"
    for name in ("base", "adapter"):
        shutil.copytree(workspace / name, ws / name)
    wrong = save_base(ws / "other-model", qwen_config(hidden_size=96, num_attention_heads=4, num_key_value_heads=2))
    cfg_path = ws / "adapter" / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(wrong)
    cfg_path.write_text(json.dumps(cfg))
    app = MergeApp(ws)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidate is not None, "a candidate")
        await pilot.press("ctrl+n")
        base = app.screen.query_one("#base", Input)
        await until(pilot, lambda: base.display and base.value == str(ws / "base") and wizard.running is None
                    and wizard.plan is not None and not wizard.plan_stale, "the fitting base proposed and planned")
        note = text(app, "#base-note")
        assert f"the base the adapter names, {wrong}, does not fit it" in note and "Proposed" in note
        assert not wizard.plan.of("error") and wizard.options.base == ws / "base"
        assert base.has_focus
        # the walk at 80x24: the suggested output was named after the model that does not fit; the warning
        # told the user to use it; ctrl+n ("accepts it", says the note) scrolled the checks away from the box
        assert Path(app.screen.query_one("#out", Input).value).name.startswith("base-ws-")
        findings = text(app, "#findings")
        assert f"names {wrong} as its base" in findings and "Use the base the adapter names" not in findings
        warnings = [f.id for f in wizard.plan.of("warning")]
        assert "base-name" in warnings and len(warnings) > 1  # the named model's config differs too
        await pilot.press("ctrl+n")
        ack = app.screen.query_one("#ack", Checkbox)
        assert wizard.step == "review" and ack.display and ack.has_focus and not ack.value
        assert ack.region.height and app.screen.query_one("#problems").region.contains_region(ack.region)  # in sight
        await pilot.press("space")
        assert ack.value and not app.screen.query_one("#next", Button).disabled


async def test_full_run_to_a_verified_model(workspace, tmp_path):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        assert "PASSED" in text(app, "#verify-status")
        table = app.screen.query_one("#checks", DataTable)
        assert [table.get_row_at(i)[1] for i in range(table.row_count)] == ["structure", "recompute", "behaviour"]
        await pilot.press("ctrl+n")
        assert wizard.step == "try"  # Try it, skipped
        await pilot.press("ctrl+n")
        assert wizard.step == "finish" and "verified" in text(app, "#summary")
        assert not app.screen.query_one("#cleanup", Button).disabled
        assert app.screen.query_one("#quit", Button).has_focus
        # the last step: no "Next >" (it was drawn as an empty block) and no ^n in the footer; Back works
        assert not app.screen.query_one("#next", Button).display
        assert "ctrl+n" not in app.screen.active_bindings and "ctrl+b" in app.screen.active_bindings
        await pilot.press("enter")  # Quit
    assert app.return_code == 0
    manifest = read_manifest(out)
    assert manifest["verification"]["passed"] is True
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # issue 32 item 6: what the terminal keeps once the app has closed, and its transformers line works
    lines = app.farewell().splitlines()
    assert lines[0] == f"The merged model is in {out} (verified)."
    import os
    import subprocess
    import sys

    # issue 38 item 7: the Python tui-merger runs in, by its full path (after pipx, `python` has no transformers)
    assert lines[1].startswith(f"  transformers: {shlex_quote(sys.executable)} -c ")
    assert lines[2] == f"  vLLM:         vllm serve {out}"
    assert len(lines) == 3  # no GGUF made: no llama.cpp line
    command = lines[1].split(": ", 1)[1]
    env = {**os.environ, "PATH": str(tmp_path), "HF_HUB_OFFLINE": "1"}  # no python on the PATH
    run = subprocess.run(["/bin/bash", "-c", command], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.startswith("Hello"), run.stderr[-2000:]


async def test_a_failing_merge_is_shown_and_the_app_stays_alive(workspace, tmp_path):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(tmp_path / "out")
        await recheck(pilot, app)
        # the base loses its weights after the checks passed (a disk unmounted, a file removed)
        weights = workspace / "base" / "model.safetensors"
        moved = tmp_path / "moved.safetensors"
        shutil.move(weights, moved)
        try:
            await pilot.press("ctrl+n")
            await until(pilot, lambda: wizard.running is None and wizard.step == "merge", "the failure")
        finally:
            shutil.move(moved, weights)
        assert "The merge failed" in text(app, "#merge-status")
        assert not app.screen.query_one("#back", Button).disabled
        await pilot.press("ctrl+b")
        assert wizard.step == "review" and app.is_running
        assert not (tmp_path / "out").exists()


async def test_cancel_mid_merge_stops_the_thread_and_leaves_no_model(workspace, tmp_path):
    """The engine thread is held at its first progress event until the test has pressed Cancel: no sleeps."""
    reached, release = threading.Event(), threading.Event()

    def hook(event):
        if isinstance(event, TensorProgress) and not reached.is_set():
            reached.set()
            release.wait(30)

    app = MergeApp(workspace, engine_hook=hook)
    out = tmp_path / "out"
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await pilot.press("ctrl+n")
        await until(pilot, reached.is_set, "the merge to start")
        await pilot.click("#cancel")
        await pilot.click("#yes")  # the confirmation
        assert wizard.cancel_token.cancelled
        assert "Stopping..." in text(app, "#merge-status")  # said at once, before the thread has stopped
        release.set()
        await until(pilot, lambda: wizard.running is None, "the merge thread to stop")
        assert "Cancelled:[/] nothing of the merge is left on disk" in text(app, "#merge-status")
        assert wizard.result is None and wizard.step == "merge"
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


async def test_stop_and_quit_says_stopping_waits_for_the_stop_and_says_what_is_on_disk(workspace, tmp_path):
    """Issue 38: "Stop and quit" closed the app at once with "The partial output is removed" whatever the
    merge then did (once it went on to a verified model), the screen frozen while Textual waited for the
    thread. Now "Stopping..." at once, the app closes when the merge has stopped, and the terminal says
    what the disk holds."""
    reached, release = threading.Event(), threading.Event()

    def hook(event):
        if isinstance(event, TensorProgress) and not reached.is_set():
            reached.set()
            release.wait(30)

    app = MergeApp(workspace, engine_hook=hook)
    out = tmp_path / "out"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await pilot.press("ctrl+n")
        await until(pilot, reached.is_set, "the merge to start")
        await pilot.press("ctrl+q")
        await pilot.click("#yes")  # Stop and quit
        assert wizard.cancel_token.cancelled and app.is_running  # not closed before the merge stopped
        assert "Stopping..." in text(app, "#merge-status")
        release.set()
        await until(pilot, lambda: not app.is_running, "the app to close once the merge stopped")
    assert app.return_value == 130  # what run_tui returns, the exit code
    assert app.farewell() == f"The merge was stopped: nothing of the merge is left on disk (no {out.name}, no partial folder); the inputs are untouched."
    assert not out.exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


async def test_stop_and_quit_after_the_merge_finished_keeps_the_model_and_says_so(workspace, tmp_path):
    """The merge ended while "Stop and quit?" was open: the model it wrote is kept, and the terminal says
    so (verified or not, as the folder records it), instead of "the partial output is removed"."""
    reached, release = threading.Event(), threading.Event()

    def hook(event):
        if isinstance(event, TensorProgress) and not reached.is_set():
            reached.set()
            release.wait(30)

    app = MergeApp(workspace, engine_hook=hook)
    out = tmp_path / "out"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await pilot.press("ctrl+n")
        await until(pilot, reached.is_set, "the merge to start")
        await pilot.press("ctrl+q")
        await pilot.pause()
        release.set()  # the merge finishes while the question is open
        await until(pilot, lambda: wizard.running != "merge", "the merge to end", tries=1200)
        await pilot.click("#yes")
        await until(pilot, lambda: not app.is_running, "the app to close")
    assert app.return_value == 0
    assert (out / "config.json").is_file()
    said = app.farewell()
    assert said.startswith(f"The merged model is in {out}") and "removed" not in said


async def test_help_and_command_palette(workspace):
    app = MergeApp(workspace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f1")
        assert type(app.screen).__name__ == "HelpScreen"
        await pilot.press("escape")
        assert app.screen is app.wizard
        commands = [c.title for c in app.get_system_commands(app.screen)]
        assert {"Next step", "Previous step", "Help"} <= set(commands)


async def test_theme_choice_persists_and_a_bad_theme_file_is_a_notification(workspace, tmp_path):
    themes = tmp_path / "config" / "tui-merger" / "themes"
    themes.mkdir(parents=True)
    (themes / "broken.toml").write_text("name = 'broken'\ndark = true\nprimary = 'not-a-colour'\n")
    app = MergeApp(workspace)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert app.theme == "harbor-night"  # the default, despite the bad file
        assert any("broken.toml" in str(n.message) for n in app._notifications)
        app.theme = "paper"
        await pilot.pause()
    assert "paper" in (tmp_path / "config" / "tui-merger" / "config.toml").read_text()
    again = MergeApp(workspace)
    async with again.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert again.theme == "paper"


async def test_finish_offers_cleanup_of_a_training_run(tmp_path):
    """A trainer run: after the verified merge of checkpoint-20, Clean up lists the older checkpoint
    and the optimizer state, deletes what is picked after a last confirmation that names the total, and
    says how much was freed. Issue 32 item 8, at 80x24 in a deep folder: every path is shown whole
    (wrapped, not cut), with its size; "Delete selected..." deletes nothing until confirmed."""
    from textual.geometry import Region

    from tui_merger.core.options import human_bytes
    from tui_merger.demo import build_demo

    ws = tmp_path / "ws"
    base, adapter = build_demo(ws)
    run = tmp_path / "a-training-run-with-a-rather-long-name-as-people-give-them" / "outputs"
    for step in (10, 20):
        shutil.copytree(adapter, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"\0" * 300_000)
    app = MergeApp(run)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        assert wizard.candidate.path.endswith("checkpoint-20")  # newest first
        await merge_and_verify(pilot, wizard)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        await pilot.click("#cleanup")
        await pilot.pause()
        dialog = app.screen
        assert type(dialog).__name__ == "CleanupDialog"
        rows = list(dialog.query(".item-text").results(Static))
        assert len(rows) == len(dialog.plan.items) >= 2
        for item, row in zip(dialog.plan.items, rows):
            shown = "".join(s.text.strip() for s in row.render_lines(Region(0, 0, row.size.width, row.size.height)))
            for path in item.paths[:3]:
                assert str(path) in shown, [s.text for s in row.render_lines(Region(0, 0, row.size.width, row.size.height))]
            assert row.region.right <= dialog.query_one(".dialog").region.right
        checkboxes = [dialog.query_one(f"#item-{n}") for n in range(len(rows))]
        assert [human_bytes(i.size) for i in dialog.plan.items] == [str(c.label).strip() for c in checkboxes]
        chosen = [i for i, c in zip(dialog.plan.items, checkboxes) if c.value]
        total = human_bytes(sum(i.size for i in chosen))
        assert chosen and f"Selected: {len(chosen)} of {len(rows)}, {total}." == plain(app, "#cleanup-total")
        await pilot.click("#delete")
        await pilot.pause()
        assert type(app.screen).__name__ == "Confirm"  # the last word before anything goes
        question = str(app.screen.query_one(Static).content)
        assert f"[b]{total}[/b], for good?" in question and str(app.screen.query_one("#yes", Button).label) == f"Delete {total}"
        assert (run / "checkpoint-10").exists()  # nothing deleted yet
        await pilot.click("#yes")
        await until(pilot, lambda: wizard.running is None and "Freed" in text(app, "#finish-notes"), "the cleanup")
        assert f"Freed {total}." in text(app, "#finish-notes")
    assert not (run / "checkpoint-10").exists()
    assert not (run / "checkpoint-20" / "optimizer.pt").exists()
    assert (run / "checkpoint-20" / "adapter_model.safetensors").is_file()  # what was merged stays unless picked


async def test_keep_running_if_i_disconnect_runs_a_background_job(workspace, tmp_path):
    """Ticked in Review, the merge runs as a detached job (its own process session); the wizard
    follows it to the verified result, read from the job's manifest."""
    from tui_merger.core.merge.jobs import FINISHED, list_jobs

    app = MergeApp(workspace)
    out = tmp_path / "bg"
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        app.screen.query_one("#detach", Checkbox).value = True
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "the job", tries=2400)
        # issue 38 item 9: said once ("verification PASSED. the merged model ... passed verification." was twice)
        from rich.text import Text

        assert Text.from_markup(text(app, "#verify-status")).plain == f"Job {wizard.job.id}: verification PASSED."
        # the Merge step shows the merge complete, not the last count the follower happened to see
        assert app.screen.query_one("#merge-progress", ProgressBar).percentage == 1.0
        detail = text(app, "#merge-detail")
        assert detail == "" or re.search(r" (\d+)/\1 tensors", detail), detail
        table = app.screen.query_one("#checks", DataTable)
        assert [table.get_row_at(i)[1] for i in range(table.row_count)] == ["structure", "recompute", "behaviour"]
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        assert "verified" in text(app, "#summary") and "written by job" in text(app, "#summary")
        # every file in the folder is listed, the model card and the manifest too
        listed = Text.from_markup(text(app, "#summary")).plain.split("Files: ", 1)[1].split(", ")
        assert listed == sorted(p.name for p in out.iterdir() if not p.name.startswith(".")), listed
        assert "README.md" in listed and "merge_manifest.json" in listed
    [job] = list_jobs()
    assert job.state == FINISHED and job.out == str(out)
    assert read_manifest(out)["verification"]["passed"] is True


async def test_reopening_the_app_follows_a_running_job(workspace, tmp_path):
    from tui_merger.core.merge.jobs import start_detached
    from tui_merger.core.options import MergeOptions

    out = tmp_path / "bg2"
    job = start_detached(MergeOptions(base=workspace / "base", adapter=workspace / "adapter", out=out))
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await pilot.pause()
        assert wizard._running_job() is not None  # the job takes seconds (it verifies): still running
        assert any(job.id in str(n.message) for n in app._notifications)  # the app says so
        await pilot.press("ctrl+j")
        # the step follows that very job (its status line names it until the job's progress replaces it,
        # which on a busy machine can come before this line runs)
        assert wizard.step == "merge" and wizard.job is not None and wizard.job.id == job.id
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "the job", tries=2400)
        assert "PASSED" in text(app, "#verify-status")
    assert read_manifest(out)["verification"]["passed"] is True


async def test_review_blends_weighted_adapters(workspace, tmp_path):
    """The Review step takes a weight for the picked adapter and more adapters as PATH:WEIGHT; the plan
    shows both, and the merge writes the blend (checked against peft by the verification step)."""
    from factory import save_adapter

    other = save_adapter(tmp_path / "other-lora", workspace / "base", seed=9, target_modules=["q_proj", "v_proj"], r=2, lora_alpha=4)
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert app.screen.query_one("#weight", Input).display
        app.screen.query_one("#weight", Input).value = "0.7"
        app.screen.query_one("#more", Input).value = f"{other}:abc"
        app.screen.query_one("#more", Input).focus()
        await pilot.press("enter")
        await until(pilot, lambda: "not a number" in text(app, "#findings"), "the bad weight said")
        assert app.screen.query_one("#next", Button).disabled
        app.screen.query_one("#more", Input).value = f"{other}:0.3"
        out = tmp_path / "blend"
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        plan = text(app, "#plan-text")
        assert "0.7 x adapter 1 (adapter:" in plan and "0.3 x adapter 2 (other-lora:" in plan
        assert "q_proj: adapter + other-lora" in plan
        await merge_and_verify(pilot, wizard)
        assert "PASSED" in text(app, "#verify-status")
    manifest = read_manifest(out)
    assert [p["weight"] for p in manifest["adapter"]["adapters"]] == [0.7, 0.3]


async def test_a_quantized_base_asks_for_the_16_bit_one_found_beside_it(workspace, tmp_path):
    """The adapter names a bitsandbytes model; its 16-bit original lies beside it: Review says why the
    quantized base is refused, shows the base field filled with the original, and a recheck passes."""
    ws = tmp_path / "ws"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "base", ws / "base-bnb-4bit")
    shutil.copytree(workspace / "adapter", ws / "adapter")
    cfg = json.loads((ws / "base-bnb-4bit" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (ws / "base-bnb-4bit" / "config.json").write_text(json.dumps(cfg))
    acfg = json.loads((ws / "adapter" / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = str(ws / "base-bnb-4bit")
    (ws / "adapter" / "adapter_config.json").write_text(json.dumps(acfg))
    app = MergeApp(ws / "adapter")
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert "The base model is quantized (bitsandbytes)" in text(app, "#findings")
        base = app.screen.query_one("#base", Input)
        assert base.display and base.value == str(ws / "base")
        assert app.screen.query_one("#next", Button).disabled
        await recheck(pilot, app, "the plan with the 16-bit base")
        assert "ERROR" not in text(app, "#findings")
        assert wizard.options.base == ws / "base"
        assert not app.screen.query_one("#next", Button).disabled, text(app, "#findings")
        # QLoRA: the merge may go into the rounded weights training saw instead
        roundtrip = app.screen.query_one("#roundtrip", Select)
        assert roundtrip.display and roundtrip.value == ""
        roundtrip.value = "nf4:double_quant=no"
        await recheck(pilot, app, "the plan with the round trip")
        assert wizard.options.base_roundtrip == "nf4:double_quant=no"
        assert "round-tripped through" in text(app, "#findings")


async def test_weights_start_afresh_for_another_checkpoint(workspace):
    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#weight", Input).value = "0.4"
        await pilot.press("ctrl+b")
        await pilot.press("ctrl+n")  # the same adapter again: the weight stays
        await until(pilot, lambda: wizard.plan is not None and wizard.running is None, "the plan")
        assert app.screen.query_one("#weight", Input).value == "0.4"
        wizard.panes["review"]._reviewed = "somewhere else"  # as if another checkpoint had been reviewed in between
        await pilot.press("ctrl+b")
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.plan is not None and wizard.running is None, "the plan")
        assert app.screen.query_one("#weight", Input).value == "1"


async def test_review_says_what_a_resume_keeps(workspace, tmp_path):
    """A merge of these very options was interrupted (a real CLI process, SIGINT after two shards):
    Review says how many shards are kept and what is left to write; other options: the partial folder
    will be replaced."""
    import signal

    from test_resume import interrupt

    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        out = tmp_path / "merged"
        app.screen.query_one("#out", Input).value = str(out)
        app.screen.query_one("#shard", Input).value = "100KB"  # ~16 shards: room to stop it after 2
        await recheck(pilot, app)
        assert "Resuming" not in text(app, "#findings")
        chosen = wizard.plan.options
        args = ["merge", "--base", chosen["base"], "--adapter", chosen["adapter"], "--out", str(out),
                "--shard-size", "100KB", "--plain", "--no-verify"]
        code, err = interrupt(None, None, out, tmp_path, 2, signal.SIGINT, args=args)
        assert code == 130 and "finished shard(s) are kept" in err, err
        await recheck(pilot, app)
        findings = text(app, "#findings")
        assert "Resuming:" in findings and f"of {wizard.plan.shards} shards kept" in findings, findings
        assert "to write" in findings
        app.screen.query_one("#shard", Input).value = "200KB"
        await recheck(pilot, app)
        assert "does not match these inputs/options" in text(app, "#findings")


async def test_the_output_suggestion_never_collides_and_replace_is_a_switch(workspace, tmp_path):
    """The suggested folder skips names an earlier run used (-2, -3 ...); typing a taken folder shows
    the "Replace the existing folder" switch (not a command-line flag), and ticking it makes the merge
    replace the folder once the new model is complete."""
    from tui_merger.core.plan.choices import default_out_folder

    app = MergeApp(workspace)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        first = Path(app.screen.query_one("#out", Input).value)
        assert not first.exists()
        folder = default_out_folder(wizard.candidate)[0]
        assert first.parent == folder
    first.mkdir()
    (first / "model.safetensors").write_text("an earlier merge")
    try:
        app = MergeApp(workspace)
        async with app.run_test(size=(100, 30)) as pilot:
            wizard = await to_review(pilot, app)
            second = Path(app.screen.query_one("#out", Input).value)
            assert second.name == first.name + "-2" and not second.exists()
            assert not app.screen.query_one("#replace", Checkbox).display
            app.screen.query_one("#out", Input).value = str(first)
            await recheck(pilot, app)
            findings = text(app, "#findings")
            assert "ERROR" in findings and "--overwrite" not in findings
            assert 'tick "Replace the existing folder"' in findings
            assert app.screen.query_one("#replace", Checkbox).display
            app.screen.query_one("#replace", Checkbox).value = True
            await until(pilot, lambda: wizard.running is None and not wizard.plan_stale and wizard.options.overwrite, "the plan again")
            findings = text(app, "#findings")
            assert "ERROR" not in findings and "will be replaced" in findings and "--overwrite" not in findings
            app.screen.query_one("#ack", Checkbox).value = True
            await pilot.pause()
            await merge_and_verify(pilot, wizard)
            assert "PASSED" in text(app, "#verify-status")
        assert (first / "config.json").is_file() and (first / "model.safetensors").stat().st_size > 1000
    finally:
        import shutil

        shutil.rmtree(first, ignore_errors=True)


@pytest.fixture
def unresolved(workspace, tmp_path, monkeypatch):
    """A folder holding base/ (the demo's), narrow/ (a model whose shapes do not fit) and lora/, whose
    adapter_config.json names a base path that does not exist on this machine."""
    from factory import edit_adapter_config, qwen_config, save_base

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing proposed from the machine's cache
    ws = tmp_path / "ws"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "adapter", ws / "lora")
    save_base(ws / "narrow", qwen_config())
    edit_adapter_config(ws / "lora", base_model_name_or_path="/home/someone/models/Qwen2-tiny")
    return ws


async def test_a_base_not_on_this_machine_is_proposed_and_ctrl_n_accepts_it(unresolved):
    """Review proposes the model of the folder that fits the adapter (not the one whose shapes differ),
    fills the base field with it and says why; the adapter names another base (a warning), so ctrl+n
    first accepts the proposal, then merges. At 80x24, the Verify table wraps its summaries."""
    app = MergeApp(unresolved)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        await until(pilot, lambda: wizard.plan is not None and wizard.running is None and not wizard.plan_stale, "the plan")
        base = app.screen.query_one("#base", Input)
        assert base.display and base.value == str(unresolved / "base")
        assert [p.name for p, _ in wizard.panes["review"]._proposals] == ["base"]
        note = text(app, "#base-note")
        assert "Proposed" in note and "/home/someone/models/Qwen2-tiny is not on this machine" in note
        assert "fits all 28 LoRA modules" in note and "ctrl+n accepts it" in note
        assert wizard.options.base == unresolved / "base"
        assert [f.id for f in wizard.plan.of("warning")] == ["base-name"] and not wizard.plan.blocked
        nxt = app.screen.query_one("#next", Button)
        assert not nxt.disabled and str(nxt.label) == "Use this base >"
        await pilot.press("ctrl+n")  # accepts the proposal
        # issue 38 item 15: accepting answers the "names another base" warning; the box is not ticked for the user
        ack = app.screen.query_one("#ack", Checkbox)
        assert not ack.value and not ack.display and wizard.step == "review"
        assert str(nxt.label) == "Merge >" and not nxt.disabled
        await merge_and_verify(pilot, wizard)
        assert "PASSED" in text(app, "#verify-status") and header(app)[1] == "Verify"
        table = app.screen.query_one("#checks", DataTable)
        summaries = [str(table.get_row_at(i)[2]) for i in range(table.row_count)]
        assert summaries == [c.summary for c in wizard.report.checks]  # whole, not cut at the width
        assert table.virtual_size.width <= table.size.width  # nothing to scroll sideways to
        assert max(row.height for row in table.rows.values()) > 1  # the long ones wrap
    assert read_manifest(wizard.options.out)["verification"]["passed"] is True


async def test_a_kohya_file_gets_the_model_that_fits_as_its_base(unresolved):
    from test_base_candidates import kohya_file

    ws = unresolved
    kohya_file(ws / "lora", ws / "style.safetensors")
    shutil.rmtree(ws / "lora")
    app = MergeApp(ws)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert wizard.candidate.path == str(ws / "style.safetensors")
        await until(pilot, lambda: wizard.plan is not None and wizard.running is None and not wizard.plan_stale, "the plan")
        assert app.screen.query_one("#base", Input).value == str(ws / "base")
        assert "does not say which base" in text(app, "#base-note") and "fits all 28 LoRA modules" in text(app, "#base-note")
        assert not wizard.plan.blocked, text(app, "#findings")
        assert not app.screen.query_one("#next", Button).disabled


async def test_nothing_fits_says_so_and_asks_for_the_base(unresolved):
    shutil.rmtree(unresolved / "base")
    app = MergeApp(unresolved)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidate is not None, "a candidate")
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.panes["review"]._searched and wizard.running is None, "the search")
        assert "no model in this folder or in the Hugging Face cache fits it" in text(app, "#base-note")
        assert "Say which base model" in text(app, "#findings")
        assert app.screen.query_one("#base", Input).value == "" and app.screen.query_one("#base", Input).has_focus
        assert "1 error to fix first" in text(app, "#nav-status")


async def test_problems_stay_in_sight_when_the_form_scrolls_and_ctrl_n_says_why(workspace, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    app = MergeApp(workspace)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(taken)
        await recheck(pilot, app)
        assert wizard.plan.blocked
        form = app.screen.query_one("#review-form")
        form.scroll_end(animate=False)
        await pilot.pause()
        assert form.scroll_y > 0 and form.max_scroll_y > 0  # the form is taller than the screen: it scrolled
        findings = app.screen.query_one("#findings", Static)
        screen = app.screen.region
        assert findings.region.height > 0 and screen.contains_region(findings.region)
        assert findings.region.y >= form.region.bottom  # below the form, not inside it
        assert "ERROR" in text(app, "#findings") and "not empty" in text(app, "#findings")
        assert "1 error" in str(app.screen.query_one("#problems").border_title)
        nxt = app.screen.query_one("#next", Button)
        assert nxt.disabled and nxt.tooltip == "1 error to fix first (under Checks)"
        await pilot.press("ctrl+n")
        assert wizard.step == "review"
        assert any("Not yet: 1 error to fix first" in str(n.message) for n in app._notifications)
        assert "1 error to fix first" in text(app, "#nav-status")


async def test_review_shows_the_base_config_and_marks_what_the_adapter_side_disagrees_with(workspace, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "adapter", ws / "adapter")
    config = json.loads((ws / "base" / "config.json").read_text())
    config["max_position_embeddings"] = 4096  # what the adapter was trained against, saved beside it
    (ws / "adapter" / "config.json").write_text(json.dumps(config))
    app = MergeApp(ws / "adapter")
    async with app.run_test(size=(80, 24)) as pilot:
        await to_review(pilot, app)
        plan = text(app, "#plan-text")
        [line] = [line for line in plan.splitlines() if line.startswith("base cfg")]
        assert "Qwen2ForCausalLM, 4 layers, hidden 128, heads 4 / KV 2, vocab 512, bfloat16, rope_theta 10000" in line
        assert "max positions 512 (≠ 4096 in the adapter's base config)" in line
        from tui_merger.core.plan.choices import base_config_fields
        from tui_merger.tui.steps.review import config_text as _config_text

        marked = _config_text(base_config_fields(ws / "base", [ws / "adapter"]))
        assert "[b yellow]max positions 512 (≠ 4096 in the adapter's base config)[/]" in marked  # in yellow


def plain(app, selector) -> str:
    """A Static's markup as the text it shows."""
    from textual.content import Content

    return Content.from_markup(text(app, selector)).plain


async def test_try_it_answers_as_generate_does_and_stop_ends_it(workspace, tmp_path):
    """After Verify, Try it: the memory is said first; the merged model's answer (streamed into its
    column) equals transformers' own greedy generate for the prompt, and so does the base's beside it
    (stacked at 80 columns). Asked again, the engine thread is held at the merged model's 3rd token until
    Stop is pressed: the answer ends there and the base is not asked; Finish is one key away."""
    from test_try import reference
    from transformers import AutoTokenizer

    from tui_merger.tui.steps.common import visible

    prompt_text = "the adapter"  # the tiny random model's answer starts with whole characters
    reached, release, armed = threading.Event(), threading.Event(), threading.Event()

    def hook(event):
        if armed.is_set() and isinstance(event, TrialToken) and event.tokens == 3 and not reached.is_set():
            reached.set()
            release.wait(30)

    app = MergeApp(workspace, engine_hook=hook)
    out = tmp_path / "merged"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        await pilot.press("ctrl+n")
        assert wizard.step == "try" and header(app)[1] == "Try"
        await until(pilot, lambda: wizard.panes["try"].trial_plan is not None, "the trial plan")
        status = text(app, "#try-status")
        assert status.startswith("Needs about ") and "(one model at a time), in bfloat16; " in status
        # issue 38 item 19: on the demo (random models) the unmerged adapter is compared by default, where the
        # answers agree; the base is one choice away
        assert [s.label for s in wizard.panes["try"].trial_plan.sides] == ["merged model", "unmerged adapter"]
        from tui_merger.tui.steps.try_it import DEMO_PROMPT

        assert app.screen.query_one("#prompt", Input).value == DEMO_PROMPT  # a line of the demo's own text
        app.screen.query_one("#against", Select).value = "base"
        await until(pilot, lambda: (plan := wizard.panes["try"].trial_plan) is not None
                    and [s.label for s in plan.sides] == ["merged model", "base model"], "the plan against the base")
        assert app.screen.query_one("#answers").has_class("stacked")  # 80 columns: one above the other
        wizard.panes["try"].try_tokens = 12
        prompt = app.screen.query_one("#prompt", Input)
        prompt.value = prompt_text
        prompt.focus()
        await pilot.press("enter")
        await until(pilot, lambda: wizard.running is None, "both answers")
        tok = AutoTokenizer.from_pretrained(out)
        merged_ids = reference(out, prompt_text, 12)
        base_ids = reference(workspace / "base", prompt_text, 12, tokenizer_dir=out)
        assert merged_ids != base_ids
        assert plain(app, "#answer-merged-text") == visible(tok.decode(merged_ids, skip_special_tokens=True))
        assert plain(app, "#answer-other-text") == visible(tok.decode(base_ids, skip_special_tokens=True))
        for side in ("merged", "other"):
            subtitle = str(app.screen.query_one(f"#answer-{side}").border_subtitle)
            assert subtitle.startswith("12 tokens, ") and subtitle.endswith(" tokens/s")
        same = next(i for i, (a, b) in enumerate(zip(merged_ids, base_ids)) if a != b)
        where = "differ from the first token" if same == 0 else f"are the same for {same} token"
        assert f"The two answers {where}" in plain(app, "#try-status")  # where they part, said

        armed.set()
        ask = app.screen.query_one("#ask", Button)
        await until(pilot, lambda: not ask.disabled, "Ask to be enabled again")
        await pilot.pause()  # the status above it grew by a line: click where Ask is now
        await pilot.click("#ask")
        await until(pilot, lambda: wizard.running == "trial", "the click on Ask to start a trial")
        await until(pilot, reached.is_set, "the 3rd token", tries=6000)  # a loaded machine: the model loads slowly
        assert wizard.running == "trial" and app.screen.query_one("#next", Button).disabled
        assert "answering" in text(app, "#nav-status")
        await pilot.click("#try-cancel")
        assert wizard.trial_cancel.cancelled
        release.set()
        await until(pilot, lambda: wizard.running is None, "the trial thread to stop")
        assert "Stopped." in text(app, "#try-status")
        shown = visible(tok.decode(merged_ids[:3], skip_special_tokens=True))
        assert shown.strip() and "\ufffd" not in shown  # this prompt's first 3 tokens are whole characters
        assert plain(app, "#answer-merged-text") == shown
        assert app.screen.query_one("#answer-merged").border_subtitle == "stopped after 3 tokens"
        assert "not asked" in text(app, "#answer-other-text")
        assert not app.screen.query_one("#next", Button).disabled
        await pilot.press("ctrl+n")
        assert wizard.step == "finish" and "verified" in text(app, "#summary")
        await pilot.press("ctrl+b")
        assert wizard.step == "try"


async def test_an_adapter_whose_config_is_not_json_is_marked_in_find_and_cannot_go_to_review(workspace, tmp_path):
    """Issue 32 item 3: a broken adapter_config.json is said in Find (what and how to fix it), the
    checkpoint cannot be picked, and ctrl+n says why instead of Review asking for a base."""
    ws = tmp_path / "ws"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "adapter", ws / "adapter")
    (ws / "adapter" / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16,')
    app = MergeApp(ws)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = app.wizard
        await pilot.pause()
        [n] = [n for n, c in enumerate(wizard.candidates) if c.path == str(ws / "adapter")]
        options = app.screen.query_one("#candidates", OptionList)
        assert "cannot be read" in str(options.get_option_at_index(n).prompt)
        options.focus()
        options.highlighted = n
        await pilot.pause()
        status = plain(app, "#path-status")
        assert "adapter_config.json is not valid JSON" in status and "fix or re-save it" in status, status
        assert wizard.candidate is None and app.screen.query_one("#next", Button).disabled
        await pilot.press("ctrl+n")
        await pilot.press("enter")  # selecting it does not open Review either
        assert wizard.step == "find"
        assert any("not valid JSON" in str(n.message) for n in app._notifications)


async def test_try_it_says_the_demo_is_random_and_a_prompt_of_no_tokens_in_a_sentence(workspace, tmp_path):
    """Issue 32 item 4: the demo's answers are random characters: Try it says so. A tokenizer that turns the
    prompt into no tokens: one red sentence (not torch's "cannot reshape tensor of 0 elements"), and no
    panel left on "loading..."."""
    from test_try import wordless_tokenizer

    app = MergeApp(workspace)
    out = tmp_path / "merged"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        wordless_tokenizer(out)
        await pilot.press("ctrl+n")
        trial = wizard.panes["try"]
        await until(pilot, lambda: trial.trial_plan is not None, "the trial plan")
        status = plain(app, "#try-status")
        assert "Demo models are random, never trained: they answer in random characters." in status
        prompt = app.screen.query_one("#prompt", Input)
        prompt.value = "xyz"
        prompt.focus()
        await pilot.press("enter")
        await until(pilot, lambda: wizard.running is None, "the trial to end")
        status = plain(app, "#try-status")
        assert "Try it failed: The tokenizer of" in status and "turns this prompt into no tokens" in status, status
        assert "reshape" not in status
        for side in ("merged", "other"):
            assert app.screen.query_one(f"#answer-{side}").border_subtitle == "no answer"
            assert "no answer" in plain(app, f"#answer-{side}-text")
        assert not app.screen.query_one("#ask", Button).disabled and not app.screen.query_one("#next", Button).disabled


async def test_review_at_80x24_focuses_the_output_folder_in_sight_and_typing_goes_there(workspace, tmp_path):
    """Issue 32 item 7: the first focused field (the output folder) was below the visible part of the form,
    so Tab, ctrl+u and a typed path went into the dtype dropdown and the path was lost. Now it is in sight
    and what is typed after ctrl+u becomes the output; Tab goes on to the next field, scrolled into sight."""
    app = MergeApp(workspace)
    out = tmp_path / "o"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        form = app.screen.query_one("#review-form")
        field = app.screen.query_one("#out", Input)
        assert app.focused is field
        assert form.region.contains_region(field.region), (form.region, field.region)  # in sight
        await pilot.press("end", "ctrl+u", *str(out), "enter")
        await until(pilot, lambda: wizard.running is None and not wizard.plan_stale, "the plan for the typed folder")
        assert field.value == str(out) and wizard.options.out == out
        assert app.screen.query_one("#dtype", Select).value == ""  # untouched
        await pilot.press("tab")
        await pilot.pause(0.2)
        assert app.focused is app.screen.query_one("#weight", Input)
        assert form.region.contains_region(app.focused.region)


async def test_a_verl_conversion_is_described_as_one_and_says_what_to_do_in_the_app(tmp_path_factory):
    """Issue 32 item 10: a verl FSDP checkpoint (no adapter) was labelled "dtype: as the base", "tokenizer
    from the adapter folder" and "27 tensors (0 merged)", and its float32 note said "pass --dtype bf16"."""
    import re

    from fsdp_factory import cached_fsdp_checkpoint

    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=1)
    app = MergeApp(info["run_dir"])
    async with app.run_test(size=(80, 24)) as pilot:
        await to_review(pilot, app)
        plan_text = text(app, "#plan-text")
        assert re.search(r"tensors \(converted, no adapter to merge\)", plan_text) and "merged)" not in plan_text, plan_text
        assert "dtype float32" in plan_text and "as the base" not in plan_text, plan_text  # verl writes fp32 masters
        assert re.search(r"tokenizer +from the checkpoint", plan_text) and "adapter folder" not in plan_text, plan_text
        dtype = app.screen.query_one("#dtype", Select)
        assert dict((v, str(p)) for p, v in dtype._options)[""] == "dtype: as the checkpoint"
        findings = plain(app, "#findings")
        assert 'choose "dtype: bf16" in Review' in findings, findings
        assert not re.search(r"--[a-z]", findings), findings  # no command-line flags in the app


async def test_browse_goes_up_from_the_launch_folder(workspace, tmp_path):
    """Issue 32 item 10: Browse started at the launch folder and could not go above it."""
    ws = tmp_path / "ws"
    shutil.copytree(workspace / "base", ws / "base")
    shutil.copytree(workspace / "adapter", ws / "adapter")
    app = MergeApp(ws / "base")  # launched in the model folder: nothing to merge here
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = app.wizard
        await pilot.pause()
        assert wizard.candidate is None
        await pilot.click("#browse")
        await pilot.pause()
        picker = app.screen
        assert type(picker).__name__ == "FolderPicker" and picker.query_one("#tree").has_focus
        await pilot.press("backspace")  # up one folder
        await pilot.pause()
        assert Path(picker.query_one("#tree").path) == ws and picker.chosen == ws
        await pilot.click("#up")
        await pilot.pause()
        assert Path(picker.query_one("#tree").path) == tmp_path
        await pilot.press("escape")
        await pilot.click("#browse")
        await pilot.pause()
        app.screen.query_one("#up", Button).press()
        await pilot.pause()
        await pilot.click("#use")
        await pilot.pause()
        assert wizard.root == ws and wizard.candidate is not None and wizard.candidate.path == str(ws / "adapter")


async def test_the_farewell_says_when_the_model_was_not_verified(tmp_path):
    """Closed while Verify ran (no report, no verification recorded): the lines say so and how to check."""
    from types import SimpleNamespace

    from tui_merger.tui.steps.finish import farewell

    out = tmp_path / "model"
    out.mkdir()
    wizard = SimpleNamespace(result=SimpleNamespace(out=out), report=None, job=None, out_path=out)
    lines = farewell(wizard).splitlines()
    assert lines[0] == f"The merged model is in {out} (not verified yet: run tui-merger verify {out})."
    wizard.report = SimpleNamespace(passed=False)
    assert "(verification FAILED: do not ship it)." in farewell(wizard)
    assert farewell(SimpleNamespace(result=None, report=None, job=None)) is None  # nothing merged: nothing said


# -- the output format (issue 30): offered as the plan says, re-planned at once, refusals said ------------


async def pick_format(pilot, app, position: int, what: str):
    """Choose the output format with the keyboard: focus the select, open it, move, take."""
    select = app.screen.query_one("#output-format", Select)
    assert select.display
    select.focus()
    await pilot.press("enter", *["down"] * position, "enter")
    await until(pilot, lambda: app.wizard.running is None and not app.wizard.plan_stale, what)


def offered(app) -> list[str]:
    return [str(prompt) for prompt, _ in app.screen.query_one("#output-format", Select)._options]


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory):
    from fp8_factory import make_fp8_release_workspace

    return make_fp8_release_workspace(tmp_path_factory.mktemp("fp8-release") / "ws")


async def test_review_keeps_an_fp8_release_in_its_format_when_asked_and_the_merge_writes_it(fp8_release, tmp_path):
    """Review offers bf16 (default) or the base's own FP8 blocks; picking "as the base" with the keyboard
    re-plans at once (the plan's output line and size change) and the merge writes FP8, verified."""
    from safetensors import safe_open

    app = MergeApp(fp8_release / "qv-lora")
    out = tmp_path / "kept"
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        assert wizard.candidate.kind == "peft-adapter"
        assert offered(app) == ["bf16, a plain model (default)",
                                "FP8 (e4m3), 128x128 blocks as the base (--keep-quantization)"]
        assert "bfloat16, a plain model (quantization_config removed)" in text(app, "#plan-text")
        plain_bytes = wizard.plan.output_bytes
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await pick_format(pilot, app, 1, "the plan with the base's format")
        assert wizard.options.output_quantization == "keep"
        plan = text(app, "#plan-text")
        assert "FP8 (e4m3), 128x128 blocks as the base:" in plan and "quantization_config kept" in plan, plan
        assert wizard.plan.output_bytes < plain_bytes  # the size estimate follows
        assert not app.screen.query_one("#format-note", Static).display
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.step == "verify" and wizard.running is None, "merge and verification", tries=2400)
        assert "PASSED" in text(app, "#verify-status"), text(app, "#verify-status")
    config = json.loads((out / "config.json").read_text())
    base_config = json.loads((fp8_release / "Qwen3-tiny-FP8" / "config.json").read_text())
    assert config["quantization_config"] == base_config["quantization_config"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert str(f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype()) == "F8_E4M3"
    manifest = read_manifest(out)
    assert manifest["options"]["output_quantization"] == "keep" and manifest["verification"]["passed"] is True


async def test_review_writes_a_16_bit_merge_as_fp8_blocks_for_serving(workspace, tmp_path):
    """A 16-bit merge offers "as merged" (default) or FP8 blocks; the merge runs with --quantize fp8."""
    app = MergeApp(workspace)
    out = tmp_path / "fp8"
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        assert offered(app) == ["as merged (default)", "FP8 128x128 blocks for serving (--quantize fp8)"]
        assert "output is" not in text(app, "#plan-text")
        await pick_format(pilot, app, 1, "the plan with FP8 blocks")
        assert "FP8 (e4m3), 128x128 blocks, weight-only" in text(app, "#plan-text")
        await pilot.press("ctrl+b")  # back to Find and again to Review: the same checkpoint keeps its format
        await to_review(pilot, app)
        assert app.screen.query_one("#output-format", Select).value == "fp8"
        assert wizard.options.output_quantization == "fp8"
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        assert "FP8 (e4m3), 128x128 blocks, weight-only" in text(app, "#plan-text")
        await merge_and_verify(pilot, wizard)
        assert "PASSED" in text(app, "#verify-status"), text(app, "#verify-status")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    assert read_manifest(out)["options"]["output_quantization"] == "fp8"


async def test_a_format_the_engine_refuses_is_said_and_the_previous_one_kept(tmp_path):
    """A model with no Linear weight of whole 128x128 blocks: FP8 blocks are offered (the engine, not the
    screen, decides), picking them shows the engine's sentence, and the format goes back to "as merged"."""
    from factory import qwen_config, save_adapter, save_base

    ws = tmp_path / "ws"
    base = save_base(ws / "base", qwen_config())
    save_adapter(ws / "adapter", base)
    app = MergeApp(ws / "adapter")
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        before = wizard.plan
        await pick_format(pilot, app, 1, "the refused format")
        await until(pilot, lambda: app.screen.query_one("#format-note", Static).display, "the refusal shown")
        note = text(app, "#format-note")
        assert "found no Linear weight of whole 128x128 blocks" in note, note
        assert app.screen.query_one("#output-format", Select).value == ""
        assert wizard.options.output_quantization is None and wizard.plan is not before
        assert not wizard.plan.blocked and "ERROR" not in text(app, "#findings"), text(app, "#findings")


async def test_a_long_path_on_finish_is_shown_whole_and_copied_whole(workspace, tmp_path):
    """Issue 38 item 14 and its remains: at 80 columns Finish broke the model folder after a "/" with real
    newlines, so a copied path kept them. The summary's text holds the whole path, on a line of its own;
    Textual folds it on screen (every drawn line fits), and what the app copies (its selection's text,
    which Ctrl+C puts on the clipboard) is the path itself."""
    from textual.geometry import Region
    from textual.selection import Selection

    out = tmp_path / "projects" / "llama-finetune-experiments" / "run-2026-12-04" / "base-run-2026-12-04-r8-20261204"
    out.parent.mkdir(parents=True)
    app = MergeApp(workspace)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        await pilot.pause()
        summary = app.screen.query_one("#summary", Static)
        assert len(str(out)) > summary.size.width  # the case: the path is longer than a line
        assert f"\n{out} (verified)." in plain(app, "#summary")  # the text holds the path whole, from a line's start
        drawn = [s.text for s in summary.render_lines(Region(0, 0, summary.size.width, summary.size.height))]
        assert all(len(line.rstrip()) <= summary.size.width for line in drawn)
        assert str(out) not in "\n".join(drawn) and str(out) in "".join(line.rstrip() for line in drawn)  # folded on screen
        app.screen.selections = {summary: Selection(None, None)}  # select all of it, as a mouse drag does
        copied = app.screen.get_selected_text()
        assert f"\n{out} (verified)." in copied, copied


async def test_the_folder_itself_is_named_and_a_local_base_is_on_this_machine(workspace):
    """Issue 38 item 16: opened on an adapter folder, Find listed it as "." and said its base, in another
    folder, was "(found here)"."""
    from textual.widgets import OptionList

    app = MergeApp(workspace / "adapter")
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidates, "the scan")
        first = str(app.screen.query_one("#candidates", OptionList).get_option_at_index(0).prompt)
        assert first.startswith("peft-adapter  adapter (this folder)  LoRA r=8"), first
        await until(pilot, lambda: wizard.candidate is not None, "the pick")
        note = text(app, "#path-status")
        assert f"base {workspace / 'base'} (on this machine)." in note and "found here" not in note, note


async def test_a_missing_hub_base_says_hf_download_and_browse_picks_a_folder(unresolved, tmp_path):
    """Issue 38 item 17: the base field of an adapter whose Hub base is not here says the `hf download`
    command inspect says, and has a Browse... that fills it with a folder from anywhere."""
    from factory import edit_adapter_config

    far = tmp_path / "far" / "models" / "Qwen2-tiny"
    far.parent.mkdir(parents=True)
    shutil.move(unresolved / "base", far)  # outside the folder: not proposed
    edit_adapter_config(unresolved / "lora", base_model_name_or_path="Qwen/Qwen2-tiny-not-here")
    app = MergeApp(unresolved)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidate is not None, "a candidate")
        await pilot.press("ctrl+n")
        await until(pilot, lambda: wizard.panes["review"]._searched and wizard.running is None, "the search")
        note = plain(app, "#base-note")
        assert "find it with Browse..." in note
        assert "`hf download Qwen/Qwen2-tiny-not-here` puts it in the Hugging Face cache" in note, note
        await pilot.click("#browse-base")
        await pilot.pause()
        assert type(app.screen).__name__ == "FolderPicker"
        app.screen._pick(far)
        await pilot.click("#use")
        await until(pilot, lambda: wizard.running is None and wizard.plan is not None and not wizard.plan_stale, "the plan")
        assert app.screen.query_one("#base", Input).value == str(far)
        assert wizard.options.base == far and not wizard.plan.blocked


async def test_run_it_locally_also_writes_the_adapter_as_a_gguf_lora(workspace, tmp_path):
    """Issue 40: after a peft LoRA merge, "Run it locally" offers the adapter as a GGUF LoRA (Ollama ADAPTER,
    llama-cli --lora). Ticked, it says the files, sizes and time before anything is written; the worker
    writes the merged GGUF, the LoRA beside the adapter, the base's GGUF in the base folder and the
    Modelfile; Finish shows each check's verdict as the engine recorded it and the exact lines to run it.
    The LoRA's factors are the adapter's own (read with safetensors); asked again, the base's GGUF is
    said to be there and used as it is."""
    import gguf
    from safetensors.torch import load_file

    from tui_merger.core.ship.gguf_check import llama_cpp_version

    ws = _workspace_with_alpha(workspace, tmp_path, 16)
    out = tmp_path / "merged"
    app = MergeApp(ws)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(out)
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        await pilot.click("#gguf")
        await until(pilot, lambda: "About " in str(app.screen.query_one("#gguf-estimate", Static).content), "the estimate")
        box = app.screen.query_one("#gguf-lora", Checkbox)
        assert str(box.label) == "Also the adapter as a GGUF LoRA (Ollama ADAPTER / --lora)"
        assert not box.value and not app.screen.query_one("#lora-estimate", Static).display  # said when ticked
        await pilot.click("#gguf-lora")
        await pilot.pause()
        assert box.value and app.screen.query_one("#lora-estimate", Static).display
        said = plain(app, "#lora-estimate")
        lora_file, base_file = ws / "adapter" / "adapter-LoRA-F32.gguf", ws / "base" / "base-Q4_K_M.gguf"
        assert said.startswith(f"The LoRA: {lora_file} (about ") and " KB, F32), applied to the base's GGUF " in said
        assert f"{base_file} (about " in said and " KB, written first and checked against the base); about " in said
        if llama_cpp_version() is None:  # CI: only llama.cpp applies a GGUF LoRA, and it is not installed there
            assert "; the LoRA will not be checked: only llama.cpp applies a GGUF LoRA, and llama-cpp-python is not installed here;" in said
        assert not list(ws.rglob("*.gguf")) and not list(out.glob("*.gguf"))  # nothing written before "Make"
        await pilot.click("#make")
        await until(pilot, lambda: wizard.running is None and "GGUF written" in plain(app, "#finish-notes"),
                    "the GGUFs", tries=1200)
        assert plain(app, "#finish-notes").startswith("GGUF written (Q4_K_M, ")
        notes = plain(app, "#lora-notes")  # below the merged model's GGUF, brought into view
        lora_notes = app.screen.query_one("#lora-notes", Static)
        await until(pilot, lambda: lora_notes.region.height > 0, "the LoRA's outcome in view")  # (at 100x30, below the fold)
        assert f"GGUF LoRA written (F32, " in notes and ", 28 LoRA pairs, rank 8, alpha 16):\n" in notes
        assert f"\n{lora_file}\non the base's GGUF, written now (Q4_K_M, " in notes and f" s): {base_file}\n" in notes
        assert "\nBase GGUF check PASSED: token ids equal on " in notes
        if llama_cpp_version() is None:
            assert ("\nLoRA check not checked: llama.cpp's Python binding (llama_cpp) is not installed here, and only "
                    "llama.cpp applies a GGUF LoRA; install llama-cpp-python to check it.\n") in notes
        else:
            assert "\nLoRA check PASSED: " in notes
        record = lora_file.with_suffix(".json")  # the base has no manifest: the record beside the LoRA
        assert f"\nRecorded in {record} (base has no merge_manifest.json: tui-merger did not make it).\n" in notes
        assert json.loads(record.read_text())["sha256"] and not (ws / "base" / "merge_manifest.json").exists()
        modelfile = lora_file.with_suffix(".Modelfile")
        assert notes.endswith(
            f"Ollama Modelfile beside the LoRA: {modelfile.name}. Run it with:\n"
            f"ollama create adapter:q4_k_m -f {modelfile}\n"
            f"llama-cli -m {base_file} --lora {lora_file}"
        ), notes
        text_ = modelfile.read_text()
        assert f"\nFROM {base_file}\nADAPTER ./adapter-LoRA-F32.gguf\n" in text_
        # the file holds the adapter's own factors where llama.cpp keeps the base's order (v_proj: no permute)
        reader = gguf.GGUFReader(lora_file)
        assert bytes(reader.fields["general.type"].parts[-1]).decode() == "adapter"
        tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
        saved = load_file(ws / "adapter" / "adapter_model.safetensors")
        [a_name] = [k for k in saved if "layers.0." in k and "v_proj.lora_A" in k]
        assert torch.equal(tensors["blk.0.attn_v.weight.lora_a"], saved[a_name].float())
        assert torch.equal(tensors["blk.0.attn_v.weight.lora_b"], saved[a_name.replace("lora_A", "lora_B")].float())
        # asked again: the base's GGUF is there and used as it is; the LoRA is made of the adapter alone, replaced
        await pilot.pause()
        app.screen.query_one("#finish").scroll_home(animate=False, immediate=True)  # the notes were brought into view
        await pilot.pause()
        await pilot.click("#gguf")
        await until(pilot, lambda: "About " in str(app.screen.query_one("#gguf-estimate", Static).content), "the estimate")
        await pilot.click("#gguf-lora")
        await pilot.pause()
        said = plain(app, "#lora-estimate")
        assert f"(about " in said and ", F32, replacing the one there), applied to the base's GGUF " in said
        assert f"{base_file} (already there: used as it is); about " in said and " to write it; " in said
        made_at = base_file.stat().st_mtime_ns
        await pilot.click("#make")  # the merged model's GGUF is there too: refused in the app's words, the LoRA made
        await until(pilot, lambda: wizard.running is None and "GGUF LoRA written" in plain(app, "#lora-notes"),
                    "the LoRA", tries=1200)
        refused = plain(app, "#finish-notes")
        assert refused.startswith("No GGUF: ") and refused.endswith(' exists; type another "File" in "Run it locally..." (the file there is kept).')
        assert "--" not in refused
        notes = plain(app, "#lora-notes")
        assert f"\non the base's GGUF (already there, used as it is): {base_file}\n" in notes
        assert base_file.stat().st_mtime_ns == made_at and "Base GGUF check" not in notes
        assert notes.endswith(f"llama-cli -m {base_file} --lora {lora_file}"), notes
        app.exit(0)
    lines = app.farewell().splitlines()
    assert lines[-2:] == [f"  llama.cpp:    llama-cli -m {base_file} --lora {lora_file}",
                          f"  Ollama:       ollama create adapter:q4_k_m -f {modelfile}"]
    assert len(lines) == len(set(lines))  # made twice: said once


async def test_run_it_locally_says_the_mmproj_and_its_check(workspace, tmp_path, monkeypatch):
    """A vision-language model's "Run it locally" at 80x24 (issue 40): the dialog counts the mmproj file before anything
    is written; Finish says the mmproj file beside the GGUF with its size, its own check's verdict in the engine's
    sentence, and llama.cpp's multimodal line (llama-mtmd-cli with --mmproj); a FAILED mmproj check shows as FAILED,
    "do not share it"; the farewell gives the multimodal line too. The Finish step is the demo merge's, pointed at a
    Gemma 3 VL folder made as test_gguf_mmproj makes one (test_vl merges a VL adapter in the app; its tiny folders
    have no tokenizer, which a GGUF needs)."""
    from test_gguf_vl_text import make_vl

    from tui_merger.core.options import human_bytes
    from tui_merger.core.ship import gguf_mmproj
    from tui_merger.core.ship.gguf_check import FAILED, GgufCheck, llama_cpp_version
    from tui_merger.core.ship.run_locally import estimate

    ws = _workspace_with_alpha(workspace, tmp_path, 16)
    vl = make_vl(tmp_path / "vl", "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (vl / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    e = estimate(vl, "q4_k_m")
    gguf_file, mmproj = vl / "vl-Q4_K_M.gguf", vl / "mmproj-vl-F16.gguf"
    app = MergeApp(ws)
    async with app.run_test(size=(80, 24)) as pilot:
        wizard = await to_review(pilot, app)
        app.screen.query_one("#out", Input).value = str(tmp_path / "merged")
        await recheck(pilot, app)
        await merge_and_verify(pilot, wizard)
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        wizard.result.out = vl  # the merged folder is a vision-language model's, with the merge's record
        shutil.copy(tmp_path / "merged" / "merge_manifest.json", vl / "merge_manifest.json")
        app.screen.query_one("#gguf", Button).press()  # (at 80x24 below the fold)
        await pilot.pause()
        await until(pilot, lambda: "About " in str(app.screen.query_one("#gguf-estimate", Static).content), "the estimate")
        said = plain(app, "#gguf-estimate")
        assert said.startswith(f"About {human_bytes(e.size)} (with the vision tower's mmproj file beside it, about "
                               f"{human_bytes(e.mmproj_size)}, checked on an image), about "), said
        assert not mmproj.exists()  # nothing written before "Make"
        app.screen.query_one("#make", Button).press()
        await pilot.pause()
        await until(pilot, lambda: wizard.running is None and "GGUF written" in plain(app, "#finish-notes"), "the GGUF", tries=1200)
        notes = plain(app, "#finish-notes")
        assert f"GGUF written (Q4_K_M, " in notes and "; recorded in merge_manifest.json; Upload... includes it):\n" in notes
        assert f"\nVision tower beside it (mmproj, {human_bytes(mmproj.stat().st_size)}):\n{mmproj}\n" in notes, notes
        if llama_cpp_version() is None:  # CI: only llama.cpp reads an mmproj file
            assert "\nmmproj check not checked: llama-cpp-python is not installed, and only llama.cpp reads an mmproj file.\n" in notes
        else:
            assert "\nmmproj check PASSED: " in notes
        assert notes.endswith(f"\nllama-mtmd-cli -m {gguf_file} --mmproj {mmproj} --image IMAGE.jpg -p 'Describe this image.'"), notes
        notes_widget = app.screen.query_one("#finish-notes", Static)
        await until(pilot, lambda: notes_widget.region.height > 0, "the outcome in view")
        app.save_screenshot(filename="finish-mmproj.svg", path=str(tmp_path))
        # again as f16 (the mmproj there is used), its check FAILED as check_mmproj says a FAILED one
        monkeypatch.setattr(gguf_mmproj, "check_mmproj", lambda *a, **k: GgufCheck(
            FAILED, "llama.cpp's libmtmd (test)", "image embeddings differ by 3.2 (limit 0.05) on 4 tokens."))
        app.screen.query_one("#finish").scroll_home(animate=False, immediate=True)
        await pilot.pause()
        app.screen.query_one("#gguf", Button).press()  # (at 80x24 below the fold)
        await pilot.pause()
        await until(pilot, lambda: "About " in str(app.screen.query_one("#gguf-estimate", Static).content), "the estimate")
        app.screen.query_one("#gguf-type").value = "f16"
        await until(pilot, lambda: app.screen.query_one("#gguf-out", Input).value.endswith("vl-F16.gguf"), "the f16 file")
        app.screen.query_one("#make", Button).press()
        await pilot.pause()
        await until(pilot, lambda: wizard.running is None and "(F16, " in plain(app, "#finish-notes"), "the f16 GGUF", tries=1200)
        notes = plain(app, "#finish-notes")
        assert "\nmmproj check FAILED: do not share it: image embeddings differ by 3.2 (limit 0.05) on 4 tokens.\n" in notes, notes
        app.save_screenshot(filename="finish-mmproj-failed.svg", path=str(tmp_path))
        app.exit(0)
    lines = app.farewell().splitlines()  # each GGUF recorded, with the mmproj beside it
    assert f"  llama.cpp:    llama-cli -m {gguf_file}" in lines
    assert not [line for line in lines if f"-m {mmproj}" in line], lines  # the vision tower is not a model to run alone
    assert f"  images:       llama-mtmd-cli -m {gguf_file} --mmproj {mmproj}" in lines, lines
    assert f"  images:       llama-mtmd-cli -m {vl / 'vl-F16.gguf'} --mmproj {mmproj}" in lines, lines
