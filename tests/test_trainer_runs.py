"""An HF Trainer output_dir (checkpoint-N folders, maybe a final save at the top, trainer_state.json with
best_model_checkpoint): one rule for which checkpoint is proposed, said the same way by inspect's Next
line, the plain flow and the assistant's Find list; the step in the suggested output name; cleanup
labels that say which checkpoint a state file belongs to (issue 38, items 5 and 6)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from factory import qwen_config, save_adapter, save_base

from tui_merger.core.formats.scan import scan
from tui_merger.core.plan.choices import proposed

FIXTURES = Path(__file__).parent / "fixtures" / "trainer"


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def _age(folder: Path, seconds_ago: float) -> None:
    t = os.path.getmtime(folder) - seconds_ago if seconds_ago else None
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (t, t) if t else None)


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory) -> Path:
    """What HF Trainer + PEFT leaves: ws/base/, ws/run/checkpoint-{100,200}/ (adapter written by peft,
    optimizer.pt, scheduler.pt, trainer_state.json naming checkpoint-100 best) and the final adapter at the
    top of ws/run/ (trainer.save_model()), written last."""
    ws = tmp_path_factory.mktemp("trainer") / "ws"
    base = save_base(ws / "base", qwen_config())
    run = ws / "run"
    for n, seed in ((100, 1), (200, 2)):
        ckpt = save_adapter(run / f"checkpoint-{n}", base, seed=seed, target_modules=["q_proj", "v_proj"])
        torch.save({"state": {0: {"exp_avg": torch.randn(4, 8)}}}, ckpt / "optimizer.pt")
        torch.save({"last_epoch": n}, ckpt / "scheduler.pt")
        state = {"global_step": n, "best_model_checkpoint": f"/elsewhere/run/checkpoint-100", "best_metric": 0.5}
        (ckpt / "trainer_state.json").write_text(json.dumps(state))
    save_adapter(run, base, seed=3, target_modules=["q_proj", "v_proj"])
    for p in (run / "adapter_config.json", run / "adapter_model.safetensors"):
        data = json.loads(p.read_text()) if p.suffix == ".json" else None
        if data is not None:  # a base the adapter names on this machine, as a Trainer run on it records
            data["base_model_name_or_path"] = str(base)
            p.write_text(json.dumps(data))
    for n in (100, 200):
        data = json.loads((run / f"checkpoint-{n}" / "adapter_config.json").read_text())
        data["base_model_name_or_path"] = str(base)
        (run / f"checkpoint-{n}" / "adapter_config.json").write_text(json.dumps(data))
    _age(run / "checkpoint-100", 300)
    _age(run / "checkpoint-200", 200)
    return ws


def _by_name(result) -> dict:
    return {os.path.relpath(c.path, result.root): c for c in result.candidates}


def test_best_is_marked_and_the_final_save_is_proposed(peft_run):
    result = scan(peft_run)
    found = _by_name(result)
    assert found["run/checkpoint-100"].best and not found["run/checkpoint-200"].best
    assert found["run/checkpoint-200"].latest
    c, reason = proposed(result.candidates)
    assert c is found["run"]
    assert reason == ("the final save at the top of the run: written after its newest checkpoint, step 200, it is "
                      "what the training ended with; best_model_checkpoint is step 100")


def test_inspect_next_line_says_the_rule(peft_run, capsys):
    from tui_merger.cli import main

    assert main(["inspect", str(peft_run)]) == 0
    out = capsys.readouterr().out
    assert "step 100  (best)" in out and "step 200  (latest)" in out
    next_line = next(line for line in out.splitlines() if line.startswith("Next: "))
    assert f"--adapter {peft_run / 'run'} --out {peft_run / 'run'}-merged-final  # " in next_line
    assert next_line.endswith("# the final save at the top of the run: written after its newest checkpoint, step 200, "
                              "it is what the training ended with; best_model_checkpoint is step 100")


def test_an_older_final_save_gives_way_to_the_newest_step(peft_run, tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(peft_run, ws)
    run = ws / "run"
    for n, ago in ((100, 300), (200, 200)):
        _age(run / f"checkpoint-{n}", ago)
    for name in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
        t = os.path.getmtime(run / "checkpoint-100") - 100
        os.utime(run / name, (t, t))
    c, reason = proposed(scan(ws).candidates)
    assert c.path == str(run / "checkpoint-200")
    assert reason == ("the newest step, 200: the save at the top of the run is older than it; "
                      "best_model_checkpoint is step 100")


def test_plain_flow_proposes_the_same_first(peft_run):
    from tui_merger.plain import run_plain

    out = io.StringIO()
    # pick the first choice (the proposal), then quit at the base / output question (end of input)
    run_plain(peft_run, input=io.StringIO("1\n"), output=out, dumb=True)
    text = out.getvalue()
    assert ("Proposed first: peft-adapter  run  r=4 alpha=8, the final save at the top of the run: written after "
            "its newest checkpoint, step 200") in text.replace("\n", " ")
    choices = text[text.index("Which checkpoint"):]
    assert choices.index("  run  ") < choices.index("checkpoint-200")


@pytest.mark.anyio
async def test_assistant_highlights_the_proposal_and_says_why(peft_run):
    from test_tui import text, until

    from tui_merger.tui.app import MergeApp

    app = MergeApp(peft_run)
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(pilot, lambda: wizard.candidate is not None, "a candidate")
        assert wizard.candidate.path == str(peft_run / "run")
        status = text(app, "#path-status")
        assert "Proposed: the final save at the top of the run" in status.replace("\n", " ")


@pytest.fixture
def anyio_backend():
    return "asyncio"


def test_fsdp_run_proposes_its_newest_step_with_the_step_in_the_name(tmp_path):
    from tui_merger.cli.common import next_step
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.plan.preflight import make_plan

    run = tmp_path / "fsdp2_fp32"
    shutil.copytree(FIXTURES / "fsdp2_fp32", run)
    result = scan(run)
    found = _by_name(result)
    assert found["checkpoint-4"].best and found["checkpoint-4"].latest and not found["checkpoint-2"].best
    hint = next_step(result, str)
    assert hint == (f"tui-merger merge {run / 'checkpoint-4'} --base BASE_MODEL --out {run / 'merged-step-4'}"
                    "  # the newest step of the run, 4")
    plan = make_plan(MergeOptions(checkpoint=run / "checkpoint-4", base=run / "base_model"))
    assert "-step4-" in plan.suggested_out


# -- cleanup (issue 38 item 6) ---------------------------------------------------------------------


def _labels(plan) -> dict:
    return {i.label: (i.reason, i.selected_by_default) for i in plan.items}


def test_cleanup_after_merging_the_final_save(peft_run, tmp_path):
    """The final save at the top was merged: neither checkpoint's optimizer is "of the merged checkpoint";
    both checkpoints are offered whole, with what is true of them."""
    from test_cleanup import make_merge

    from tui_merger.core.ship.cleanup import find_cleanup

    run = peft_run / "run"
    out = make_merge(tmp_path / "merged", [("adapter", run, ["adapter_config.json", "adapter_model.safetensors"])])
    labels = _labels(find_cleanup(run, [out]))
    why = ("checkpoint that was not merged; the final save of its run (at the top of this folder) was merged and "
           "verified, so it is only needed to resume training or to merge this step")
    assert labels["checkpoint-100/"] == (why, False)
    assert labels["checkpoint-200/"] == (why, False)
    assert not any("merged checkpoint" in reason for reason, _ in labels.values())


def test_cleanup_after_merging_a_step(peft_run, tmp_path):
    from test_cleanup import make_merge

    from tui_merger.core.ship.cleanup import find_cleanup

    run = peft_run / "run"
    out = make_merge(tmp_path / "merged", [("adapter", run / "checkpoint-200", ["adapter_config.json", "adapter_model.safetensors"])])
    labels = _labels(find_cleanup(run, [out]))
    assert labels["checkpoint-100/"] == ("checkpoint older than checkpoint-200, which was merged and verified", True)
    assert labels["checkpoint-200/optimizer.pt"] == (
        "optimizer state of checkpoint-200, the merged checkpoint, only needed to resume training", True)


def test_cleanup_of_an_fsdp_run_offers_its_sharded_optimizer(tmp_path):
    from test_cleanup import make_merge

    from tui_merger.core.ship.cleanup import find_cleanup

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "fsdp2_fp32", run)
    model = run / "checkpoint-4" / "pytorch_model_fsdp_0"
    out = make_merge(tmp_path / "merged", [("checkpoint", run / "checkpoint-4",
                                            [f"pytorch_model_fsdp_0/{p.name}" for p in model.iterdir()])])
    labels = _labels(find_cleanup(run, [out]))
    assert labels["checkpoint-4/optimizer_0/"] == (
        "optimizer state of checkpoint-4, the merged checkpoint, only needed to resume training", True)
    assert labels["checkpoint-2/"] == ("checkpoint older than checkpoint-4, which was merged and verified", True)


def test_output_names_say_which_save(peft_run):
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.plan.preflight import make_plan

    run = peft_run / "run"
    final = make_plan(MergeOptions(base=peft_run / "base", adapter=run)).suggested_out
    step = make_plan(MergeOptions(base=peft_run / "base", adapter=run / "checkpoint-100")).suggested_out
    assert "-run-r4-final-" in final and "-run-r4-step100-" in step
