"""A model tui-merger merged is never proposed as the base of an adapter, and merging an adapter into a
model that already holds it is refused in one sentence (issue 32, item 1): in the plan every face shows,
in the engine itself, on the command line (``--force`` included) and in the plain flow. The TUI's pilot
test is in ``test_tui_merged_twice.py``. Real tiny models and adapters; the first merge is a real one."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
from factory import edit_adapter_config, save_adapter
from test_cli import run_cli

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.scan import scan
from tui_merger.core.options import MergeOptions
from tui_merger.core.plan.choices import base_candidates, models_found
from tui_merger.core.plan.lineage import merged_into, records_adapter
from tui_merger.core.plan.preflight import make_plan
from tui_merger.core.record.manifest import MANIFEST_NAME
from tui_merger.plain import run_plain

NAMED = "Qwen/Qwen2.5-0.5B-Instruct"  # what the adapter says it was trained on: not on this machine


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing proposed from the machine's cache
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    from tui_merger.demo import build_demo

    base, _ = build_demo(tmp_path_factory.mktemp("twice") / "ws")
    return base.parent


@pytest.fixture(scope="module")
def merged_once(demo, tmp_path_factory) -> Path:
    """The issue's folder after the first merge: base/, my-adapter/ (naming a base that is not here) and
    the merged model the assistant wrote beside them."""
    ws = tmp_path_factory.mktemp("folder") / "runs"
    shutil.copytree(demo / "base", ws / "base")
    shutil.copytree(demo / "adapter", ws / "my-adapter")
    edit_adapter_config(ws / "my-adapter", base_model_name_or_path=NAMED)
    out = ws / "Qwen2.5-0.5B-Instruct-my-adapter-r8"
    proc = run_cli("merge", "--base", ws / "base", "--adapter", ws / "my-adapter", "--out", out, "--no-verify")
    assert proc.returncode == 0, proc.stderr
    return ws


@pytest.fixture
def ws(merged_once, tmp_path) -> Path:
    ws = tmp_path / "runs"
    shutil.copytree(merged_once, ws, symlinks=True)
    manifest = ws / "Qwen2.5-0.5B-Instruct-my-adapter-r8" / MANIFEST_NAME
    data = json.loads(manifest.read_text())  # the copy's manifest names the copy's inputs
    for item in data["inputs"]:
        item["path"] = item["path"].replace(str(merged_once), str(ws))
    manifest.write_text(json.dumps(data))
    return ws


def merged(ws: Path) -> Path:
    return ws / "Qwen2.5-0.5B-Instruct-my-adapter-r8"


def test_a_merged_model_is_never_proposed_as_the_base(ws):
    found = models_found(scan(ws).candidates)
    assert merged(ws) in found  # a complete model, which the adapter's shapes fit...
    assert records_adapter(merged(ws)) and not records_adapter(ws / "base")
    proposals = base_candidates(ws / "my-adapter", found)
    assert [p for p, _ in proposals] == [ws / "base"]  # ...but it holds an adapter already


def test_a_merged_model_that_holds_another_adapter_is_not_proposed_either(ws, tmp_path):
    other = save_adapter(tmp_path / "other", ws / "base", seed=5, target_modules=["q_proj"])
    assert [p for p, _ in base_candidates(other, models_found(scan(ws).candidates))] == [ws / "base"]


def test_the_cli_refuses_the_same_adapter_again_in_one_sentence_force_included(ws):
    out = ws / "twice"
    proc = run_cli("merge", "--base", merged(ws), "--adapter", ws / "my-adapter", "--out", out, "--force")
    assert proc.returncode == 1, proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {merged(ws)} already has the adapter {ws / 'my-adapter'} merged into it, as its merge_manifest.json "
        "records, so merging it again would apply the adapter twice. Merge the adapter into the model it was made "
        f"from, {ws / 'base'}; to apply its change twice on purpose, give it weight 2 there "
        f"(--adapter {ws / 'my-adapter'}:2)."
    ]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_copy_of_the_adapter_elsewhere_is_recognised_by_its_weights(ws, tmp_path):
    copy = tmp_path / "elsewhere" / "final"
    shutil.copytree(ws / "my-adapter", copy)
    plan = make_plan(MergeOptions(base=merged(ws), adapters=[(copy, 0.5)], out=tmp_path / "x"))
    assert plan.blocked and [f.id for f in plan.of("error")] == ["merged-twice"]


def test_the_delta_twice_on_purpose_is_weight_2_on_the_original_base(ws):
    """What the sentence suggests works: the adapter with weight 2 into the base it was made from."""
    proc = run_cli("merge", "--base", ws / "base", "--adapter", f"{ws / 'my-adapter'}:2", "--out", ws / "double", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" not in proc.stdout


def test_another_adapter_may_go_into_a_merged_model(ws, tmp_path):
    """Stacking a different adapter onto a merged model is the user's call, not refused."""
    other = save_adapter(tmp_path / "other", merged(ws), seed=5, target_modules=["q_proj"])
    plan = make_plan(MergeOptions(base=merged(ws), adapter=other, out=tmp_path / "x"))
    assert "merged-twice" not in [f.id for f in plan.findings], plan.findings


def test_through_a_model_made_from_the_merged_one(ws, tmp_path):
    """m2 = m1 + another adapter: m2 still holds my-adapter (through m1), and says so."""
    other = save_adapter(tmp_path / "other", merged(ws), seed=5, target_modules=["q_proj"])
    m2 = ws / "stacked"
    proc = run_cli("merge", "--base", merged(ws), "--adapter", other, "--out", m2, "--no-verify")
    assert proc.returncode == 0, proc.stderr
    assert [m.path.name for m in merged_into(m2)] == ["other", "my-adapter"]
    plan = make_plan(MergeOptions(base=m2, adapter=ws / "my-adapter", out=tmp_path / "x"))
    [error] = plan.of("error")
    assert error.id == "merged-twice" and f"(through {merged(ws)}, which it was made from)" in error.message


def test_the_engine_refuses_it_whoever_calls_it(ws):
    """A caller that skips the plan (a detached job, a script) gets the same sentence; nothing is written."""
    from tui_merger.core.merge.engine import run_merge

    out = ws / "twice"
    with pytest.raises(MergeError, match="already has the adapter .* merged into it"):
        run_merge(MergeOptions(base=merged(ws), adapter=ws / "my-adapter", out=out, force_fp16_overflow=True))
    assert not out.exists()


def plain_lines(path: Path, *answers: str) -> tuple[int, str]:
    out = io.StringIO()
    code = run_plain(path, input=io.StringIO("".join(a + "\n" for a in answers)), output=out, dumb=True)
    return code, out.getvalue()


def menu_number(transcript: str, title: str) -> str:
    """The number of the last menu line that contains ``title``."""
    lines = [line.strip() for line in transcript.splitlines() if title in line and line.strip()[:1].isdigit()]
    return lines[-1].split(")")[0]


def test_the_plain_flow_proposes_the_base_again_and_refuses_the_merged_one(ws):
    """Run again in the same folder: the proposal is base/, not the model just written; typing the merged
    model as the base shows the error and offers no Start."""
    code, out = plain_lines(ws, "")  # the end of input at the first question: read the menu
    number = menu_number(out, "peft-adapter  my-adapter")
    code, out = plain_lines(ws, number, "", "", "")  # the adapter, Enter takes the proposal, the output folder
    assert f"Proposed base model: {ws / 'base'}: fits all 28 LoRA modules" in out, out
    assert str(merged(ws)) not in out.split("Proposed base model:")[1].splitlines()[0]
    assert "Start the merge?" in out

    code, out = plain_lines(ws, number, str(merged(ws)), "", "")
    assert code == 1, out  # the input ended at the question after the error
    assert f"ERROR   {merged(ws)} already has the adapter {ws / 'my-adapter'} merged into it" in out
    assert "Start the merge" not in out and "1 problem(s) stop this merge" in out
    assert not any(p.name.startswith("Qwen2.5") and p != merged(ws) for p in ws.iterdir())
