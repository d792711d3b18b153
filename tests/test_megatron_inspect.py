"""What inspect, the plain flow and the Find step call a Megatron checkpoint saved outside verl (issue 39):
the framework that saved it (Megatron-LM, Megatron-Bridge, NeMo 2, ms-swift), not the kind that reads it
("verl-megatron"), and the "Next:" command that fits its layout, run as printed on each layout fixture we
have, its output compared bit for bit with the weights save_pretrained wrote before the framework saved them.
verl's own Megatron checkpoints keep their heading and verl's command line."""

from __future__ import annotations

import io
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from factory import read_output
from megatron_helpers import same_tensors

from tui_merger.cli import main as cli_main
from tui_merger.cli.inspect import render
from tui_merger.core.formats.scan import scan
from tui_merger.core.plan.choices import describe_candidate

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# (fixture folder copied, what is scanned in it, heading, backend, the reference save_pretrained wrote,
#  the --base the Next line asks for (None: the run names its Hugging Face model and it is here))
CASES = {
    "megatron-lm torch_dist": ("megatron_lm", "lm_dense_tp2", "megatron-lm", "megatron-lm", "hf_dense", None),
    "megatron-lm legacy": ("megatron_lm", "lm_legacy_moe_ep2", "megatron-lm", "megatron-lm", "hf_moe", None),
    "megatron-lm torch_dcp": ("megatron_lm", "lm_dcp_dp2_optim", "megatron-lm", "megatron-lm", "hf_dense", None),
    "megatron-bridge": ("megatron_layouts/fw", "bridge_dense_tp2", "megatron-bridge", "megatron-bridge", "hf_dense", None),
    "megatron-bridge vl": ("megatron_vl", "bridge_qwen3_vl_tp2", "megatron-bridge", "megatron-bridge", "hf_qwen3", None),
    "nemo2": ("megatron_layouts/nemo2_saved", "nemo2", "nemo2", "nemo2", "hf", None),  # config from context/
    "ms-swift": ("ms_swift", "swift_full_tp2", "ms-swift-megatron", "ms-swift", "../megatron_layouts/fw/hf_dense",
                 "../megatron_layouts/fw/hf_dense"),
}


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def _copy(tmp: Path, folder: str, case: str) -> Path:
    """The case and the models beside it (runs name their Hugging Face model relative to the fixtures folder)."""
    src = FIXTURES / folder
    assert (src / case).is_dir(), f"fixture {folder}/{case} is missing"  # a renamed fixture must not skip the case
    dst = tmp / "fx"
    dst.mkdir()
    for p in src.iterdir():
        if p.name == case or p.name.startswith("hf"):
            shutil.copytree(p, dst / p.name, symlinks=True)
    return dst


@pytest.mark.parametrize("name", list(CASES))
def test_inspect_heads_the_checkpoint_with_its_framework_and_its_next_line_runs(tmp_path, capsys, name):
    folder, case, heading, backend, reference, base = CASES[name]
    fx = _copy(tmp_path, folder, case)
    result = scan(fx / case)
    proposed = [c for c in result.candidates if c.backend == backend]
    assert proposed and all(c.kind == heading and c.format == "verl-megatron" for c in proposed), result.candidates
    lines = [text for text, _ in render(result, str(fx / case))]
    heads = [line for line in lines if line.startswith(heading + " ")]
    assert len(heads) == len(proposed) and not any("verl" in line for line in lines), lines
    assert any(line.strip() == f"backend    {backend}, world size {proposed[0].world_size}" for line in lines), lines
    # the plain flow's menu and the Find step's list and status say the same
    c = proposed[0]
    assert describe_candidate(c, fx).startswith(heading + "  "), describe_candidate(c, fx)
    from tui_merger.tui.steps.find import FindStep

    status = FindStep._candidate_text(SimpleNamespace(proposal=None, wizard=SimpleNamespace(candidates=[c])), c)
    assert status.startswith(f"{heading}, "), status

    (nxt,) = [line for line in lines if line.startswith("Next: ")]
    command = shlex.split(nxt.removeprefix("Next: ").split("  # ")[0])
    assert command[:3] == ["tui-merger", "merge", str(fx / case / Path(c.path).relative_to(fx / case))], nxt
    assert "--backend" not in command and "--local_dir" not in command, nxt
    assert ("BASE_MODEL" in command) == (base is not None), nxt
    out = tmp_path / "out"
    argv = [str((FIXTURES / folder / base).resolve()) if a == "BASE_MODEL" else a for a in command[1:]]
    argv[argv.index("--out") + 1] = str(out)
    code = cli_main(argv + ["--plain"])
    assert code == 0, capsys.readouterr()
    from safetensors.torch import load_file

    same_tensors(read_output(out), load_file((FIXTURES / folder / reference / "model.safetensors").resolve()))


def test_the_plain_flow_lists_it_under_its_framework(tmp_path):
    from tui_merger.plain import run_plain

    fx = _copy(tmp_path, "megatron_lm", "lm_dense_tp2")
    out = io.StringIO()
    run_plain(fx / "lm_dense_tp2", input=io.StringIO(""), output=out, dumb=True)  # the input ends at the menu
    menu = [line for line in out.getvalue().splitlines() if "iter_000000" in line]
    assert menu and all("megatron-lm" in line and "verl" not in line for line in menu), out.getvalue()


def test_a_verl_megatron_checkpoint_keeps_its_heading_and_verls_command(tmp_path):
    src = FIXTURES / "megatron" / "qwen2_tp2"
    if not src.is_dir():
        pytest.skip("verl Megatron fixtures are not generated")
    result = scan(src)
    (c,) = [c for c in result.candidates if c.format == "verl-megatron"]
    assert c.kind == "verl-megatron" and c.backend.startswith("megatron-"), c
    lines = [text for text, _ in render(result, str(src))]
    (nxt,) = [line for line in lines if line.startswith("Next: ")]
    assert nxt.startswith("Next: tui-merger merge --backend megatron --local_dir "), nxt
