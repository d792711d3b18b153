"""The plain flow (``tui_merger.plain``), driven with piped keys (questionary) and typed lines (dumb mode)
on the real demo model and adapter: full merges, blocked plans, warnings, failures, cleanup, end of input."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from tui_merger import plain
from tui_merger.core.events import TensorProgress
from tui_merger.core.record.manifest import MANIFEST_NAME
from tui_merger.demo import build_demo
from tui_merger.plain import explain_no_terminal, run_plain

UP, DOWN, ENTER = "\x1b[A", "\x1b[B", "\r"  # questionary: UP from the first item wraps to the last


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    """Keep the user's merge history and Hub login out of the tests."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    base, _ = build_demo(tmp_path_factory.mktemp("demo") / "ws")
    return base.parent


@pytest.fixture
def ws(demo, tmp_path) -> Path:
    """A copy of the demo (base/ and adapter/, whose adapter_config.json names this base); adapter newest."""
    ws = tmp_path / "ws"
    for name in ("base", "adapter"):
        shutil.copytree(demo / name, ws / name)
    set_json(ws / "adapter" / "adapter_config.json", base_model_name_or_path=str(ws / "base"))
    os.utime(ws / "base", (1e9, 1e9))
    return ws


def set_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None}, indent=2))


def keys(path: Path, text: str, capsys) -> tuple[int, str]:
    """Run the questionary flow on piped keys; the pipe closes after them, so nothing can hang."""
    with create_pipe_input() as inp:
        inp.send_text(text)
        inp.close()
        code = run_plain(path, input=inp, output=DummyOutput())
    return code, capsys.readouterr().out


def lines(path: Path, *answers: str) -> tuple[int, str]:
    """Run the dumb flow on typed lines ("" is a bare Enter)."""
    out = io.StringIO()
    code = run_plain(path, input=io.StringIO("".join(a + "\n" for a in answers)), output=out, dumb=True)
    return code, out.getvalue()


def merged_folders(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if (p / MANIFEST_NAME).is_file()]


def verification(out: Path) -> dict:
    return json.loads((out / MANIFEST_NAME).read_text())["verification"]


def test_questionary_flow_merges_verifies_and_survives_a_failed_upload(ws, capsys):
    code, out = keys(
        ws,
        ENTER  # Find: the adapter, newest first
        + ENTER  # Review: the suggested output folder beside the adapter
        + ENTER  # Start the merge
        + ENTER  # Try the merged model with a prompt? No (the default)
        + UP + UP + ENTER  # Finish: Upload (second to last)
        + "me/tiny-merged" + ENTER + ENTER  # repo id, private
        + "hf_not_shown_5ecret" + ENTER  # not logged in: the token (issue 38 item 12)
        + UP + ENTER,  # Done
        capsys,
    )
    assert code == 0, out
    for n, name in enumerate(plain.STEPS, 1):
        assert f"Step {n} of 5: {name}" in out
    assert "Every check passed." in out
    [merged] = merged_folders(ws)
    assert merged.name.endswith("-r8-" + merged.name.rsplit("-", 1)[1])
    assert verification(merged)["passed"] is True
    assert (merged / "model.safetensors").is_file() and f"Merged model written to {merged}" in out
    assert "Verification of" in out and "PASSED" in out
    [upload_error] = [line for line in out.splitlines() if line.startswith("error: ")]
    assert "HF_HUB_OFFLINE" in upload_error or "token" in upload_error
    assert "Not logged in to the Hub on this machine: paste a write token" in out and "5ecret" not in out
    assert "Traceback" not in out


def test_dumb_flow_on_a_trainer_run_merges_then_cleans_up(ws, monkeypatch, capsys):
    run = ws / "run"
    for n in (10, 20):  # checkpoint-N: the adapter plus the trainer's state
        ckpt = run / f"checkpoint-{n}"
        shutil.copytree(ws / "adapter", ckpt)
        torch.save({"state": {0: {"exp_avg": torch.randn(64, 64)}}}, ckpt / "optimizer.pt")
        torch.save({"last_epoch": n}, ckpt / "scheduler.pt")
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": n}))
        os.utime(ckpt, (2e9 + n, 2e9 + n))
    shutil.rmtree(ws / "adapter")
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join([
        "",  # Find: checkpoint-20, the newest
        "",  # the suggested output folder, beside the run
        "",  # Start the merge
        "",  # Try the merged model with a prompt? No (the default)
        "1",  # Finish: free space
        "",  # the default selection
        "y",  # delete it
        "3",  # Done (GGUF and upload declined)
    ]) + "\n"))
    assert run_plain(ws, dumb=True) == 0
    out = capsys.readouterr().out
    assert "1) trainer-checkpoint  run/checkpoint-20  step 20  r=8 alpha=16  (latest)" in out
    [merged] = merged_folders(ws)
    assert verification(merged)["passed"] is True
    assert not (run / "checkpoint-20" / "optimizer.pt").exists()
    assert (run / "checkpoint-20" / "adapter_model.safetensors").is_file()  # an input: not selected
    assert "Freed " in out and "Done" in out


def test_blocked_plan_shows_the_error_and_lets_the_user_change_the_base(ws, demo):
    set_json(ws / "base" / "config.json", quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
    code, out = lines(
        ws,
        "1",  # the adapter
        "",  # output folder
        "2",  # Change the base model (there is no Start while blocked)
        str(ws / "adapter"),  # not a model folder: said, asked again
        str(demo / "base"),
        "10",  # Quit (the output format is offered now that the base can be read)
    )
    assert code == 0
    assert "ERROR   The base model is quantized (bitsandbytes)" in out
    assert "1 problem(s) stop this merge; what do you want to change?" in out
    assert "1) Start the merge" not in out.split("Change the base model")[0]
    assert f"{ws / 'adapter'} has no config.json, so it is not a Hugging Face model folder." in out
    assert out.rstrip().endswith("10) Quit\nNumber [1]: 10")
    assert "Start the merge?" in out  # the new base unblocked it
    assert not merged_folders(ws) and sorted(os.listdir(ws)) == ["adapter", "base"]


def test_warning_needs_acknowledgement_and_ctrl_c_cancels_cleanly(ws, monkeypatch, capsys):
    set_json(ws / "adapter" / "adapter_config.json", lora_alpha=None)

    class CtrlC(plain.PlainProgress):  # the user presses Ctrl-C once the first tensor is written
        def __call__(self, event):
            if isinstance(event, TensorProgress):
                raise KeyboardInterrupt
            super().__call__(event)

    monkeypatch.setattr(plain, "PlainProgress", CtrlC)
    code, out = keys(
        ws,
        ENTER + ENTER + ENTER  # the adapter, lora_alpha left empty (peft's 8), the suggested output folder
        + ENTER + ENTER  # Start; the warning confirm defaults to No: back to the menu
        + ENTER + "y"  # Start; acknowledged
        + UP + ENTER,  # after the cancel: Quit
        capsys,
    )
    assert code == 1
    assert "WARNING " in out and "has no lora_alpha" in out
    assert out.count("Step 3 of 5: Merge") == 1
    assert "Merge cancelled: nothing of the merge is left on disk (no " in out and "the inputs are untouched." in out
    assert sorted(os.listdir(ws)) == ["adapter", "base"]


def test_an_adapter_without_lora_alpha_is_asked_for_it_and_the_answer_merged(ws, tmp_path):
    """Issue 38: the plain flow had no way to give lora_alpha to a PEFT adapter that records none (the
    plan only said "edit the JSON"). It asks; the answer is used, said and recorded, and equals peft's
    merge of the adapter with that alpha written into its config."""
    from factory import read_output, reference

    set_json(ws / "adapter" / "adapter_config.json", lora_alpha=None)
    code, out = lines(
        ws,
        "1",  # the adapter
        "zero",  # not a number: said, asked again
        "32",  # lora_alpha used in training
        "",  # output folder
        "1",  # Start the merge
        "",  # Try the merged model with a prompt? No (the default)
        "4",  # Finish: Done (after free space, GGUF, upload)
    )
    assert code == 0, out
    assert "lora_alpha used in training (empty: 8, peft's default):" in out
    plan = out.split("The plan:")[1]
    assert "alpha=32 (from your answer)" in plan and "alpha 32, from your answer" in plan and "has no lora_alpha" not in plan
    [merged] = merged_folders(ws)
    assert json.loads((merged / MANIFEST_NAME).read_text())["adapter"]["alpha"] == 32
    told = shutil.copytree(ws / "adapter", tmp_path / "told")
    set_json(told / "adapter_config.json", lora_alpha=32)
    _, want, _ = reference(ws / "base", told)
    got = read_output(merged)
    for key, value in want.items():
        if key in got:
            torch.testing.assert_close(got[key].float(), value.float(), atol=1e-2, rtol=1e-2)
    changed = "model.layers.0.self_attn.q_proj.weight"
    _, at_eight, _ = reference(ws / "base", ws / "adapter")
    assert (got[changed].float() - want[changed].float()).abs().max() < (got[changed].float() - at_eight[changed].float()).abs().max()


def test_a_recorded_zero_alpha_is_asked_for_and_no_line_names_a_flag(ws):
    """Issue 38: an adapter recording lora_alpha 0 could not be merged with the user's value, and the
    merge's progress said "from --lora-alpha" to a user who never typed a flag. The flow says why it
    asks, needs an answer (0 would change nothing), uses it, and says it in the flow's words."""
    set_json(ws / "adapter" / "adapter_config.json", lora_alpha=0)
    code, out = lines(
        ws,
        "1",  # the adapter
        "",  # no answer: one is needed here (no default)
        "32",  # lora_alpha used in training
        "",  # output folder
        "1",  # Start the merge
        "",  # Try it? No
        "4",  # Done
    )
    assert code == 0, out
    assert "the checkpoint records 0, which would change nothing" in out
    assert "empty: 8" not in out  # peft's default is not what an empty answer would mean here
    assert "--lora-alpha" not in out and "--base" not in out, out
    merge = out.split("Step 3 of 5")[1]
    assert "alpha 32, from your answer, instead of the 0 recorded in" in merge
    [merged] = merged_folders(ws)
    assert json.loads((merged / MANIFEST_NAME).read_text())["adapter"]["alpha"] == 32
    assert all(c["status"] == "pass" for c in verification(merged)["checks"])


def test_failed_merge_is_one_sentence_and_the_flow_goes_back_to_review(ws, monkeypatch):
    weights = ws / "base" / "model.safetensors"
    real_plan = plain.make_plan

    def plan_then_truncate(options):  # the base is damaged after the Review step checked it
        plan = real_plan(options)
        if options.out is not None:
            os.truncate(weights, weights.stat().st_size // 2)
        return plan

    monkeypatch.setattr(plain, "make_plan", plan_then_truncate)
    code, out = lines(ws, "1", "", "1", "1", "8")  # adapter, output, Start; Back to Review; Quit
    assert code == 0
    [error] = [line for line in out.splitlines() if line.startswith("error: ")]
    assert "model.safetensors is not a valid safetensors file" in error and error.endswith("copy or download it again.")
    assert out.count("Step 2 of 5: Review") == 2 and "ERROR   " in out.split("Step 3 of 5")[1]
    assert "Traceback" not in out and sorted(os.listdir(ws)) == ["adapter", "base"]


def test_no_checkpoints_then_typed_paths(ws, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = lines(
        empty,
        "1",  # Type a path...
        str(tmp_path / "nowhere"),  # refused with a sentence, asked again
        str(ws),
        "2",  # the base: a full model, nothing to merge; back to Find (in ws now)
        "3",  # Type a path...
        str(ws / "adapter"),  # one checkpoint there: taken at once
        "",  # output folder
        "10",  # Quit
    )
    assert code == 0
    assert f"No checkpoints found in {empty}; type the path of one, or quit." in out
    assert f"{tmp_path / 'nowhere'} does not exist; check the path." in out
    assert "This is already a complete Hugging Face model: there is nothing to merge. Pick another one." in out
    assert out.count("Step 1 of 5: Find") == 2
    assert f"Found peft-adapter  {ws / 'adapter'}  r=8 alpha=16." in out


def test_end_of_input_stops_with_a_sentence(ws, capsys):
    code, out = lines(ws, "1")
    assert code == 1
    assert out.rstrip().endswith("The input ended before every question was answered, so tui-merger stopped.")
    code, out = keys(ws, "", capsys)
    assert code == 1 and "The input ended" in out


def test_explain_no_terminal_names_the_commands(ws, tmp_path):
    text = explain_no_terminal(ws)
    assert f"`tui-merger inspect {ws}`" in text
    assert f"Next: `tui-merger merge --base {ws / 'base'} --adapter {ws / 'adapter'} --out " in text
    assert explain_no_terminal(tmp_path / "nowhere").endswith("then `tui-merger merge` merges one.")


def test_dumb_flow_weights_the_adapter_and_blends_in_another(ws, tmp_path):
    from factory import save_adapter

    other = save_adapter(tmp_path / "other", ws / "base", seed=3, target_modules=["q_proj"], r=2, lora_alpha=2)
    code, out = lines(
        ws,
        "1",  # the adapter
        "",  # output folder
        "4",  # Weight this adapter or blend in others
        "abc",  # not a number: said, asked again
        "0.5",
        f"{tmp_path / 'nowhere'}:0.5",  # does not exist: said, asked again
        f"{other}:0.25",
        "1",  # Start the merge
        "",  # Try the merged model with a prompt? No (the default)
        "4",  # Finish: Done (after free space, GGUF, upload)
    )
    assert code == 0, out
    assert "not a number" in out and "nowhere does not exist" in out
    assert "0.5 x adapter 1 (adapter:" in out and "0.25 x adapter 2 (other:" in out
    [merged] = merged_folders(ws)
    assert verification(merged)["passed"] is True
    manifest = json.loads((merged / MANIFEST_NAME).read_text())
    assert [p["weight"] for p in manifest["adapter"]["adapters"]] == [0.5, 0.25]


def test_a_base_not_on_this_machine_is_proposed_and_enter_takes_it(ws, tmp_path, monkeypatch):
    """The adapter names a base path that does not exist here; the model in the folder fits it, so the
    base question proposes it (with why) and a bare Enter takes it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing from the machine's cache
    set_json(ws / "adapter" / "adapter_config.json", base_model_name_or_path="/home/someone/models/base")
    code, out = lines(ws, "1", "", "", "10")  # the adapter, the proposed base, the output folder, Quit
    assert code == 0, out
    assert f"Proposed base model: {ws / 'base'}: named like the adapter's base; fits all 28 LoRA modules" in out
    assert f"Base model folder (the model the adapter was trained on): [{ws / 'base'}]" in out
    assert "Start the merge?" in out and "ERROR" not in out


def test_dumb_flow_asks_the_output_format_and_merges_in_it(ws, tmp_path):
    """Review's menu offers the output format (default first); FP8 blocks for serving are written and
    verified. A base released quantized offers its own format again instead, and the merge keeps it."""
    from fp8_factory import make_fp8_release_workspace

    code, out = lines(
        ws,
        "1",  # the adapter
        "",  # output folder
        "6",  # Change the output format (now as merged)
        "2",  # FP8 128x128 blocks for serving (--quantize fp8)
        "1",  # Start the merge
        "",  # Try the merged model with a prompt? No
        "4",  # Finish: Done (after free space, GGUF, upload)
    )
    assert code == 0, out
    assert "6) Change the output format (now as merged)" in out
    assert "  1) as merged (default)\n  2) FP8 128x128 blocks for serving (--quantize fp8)" in out
    assert "output is  FP8 (e4m3), 128x128 blocks, weight-only" in out
    [merged] = merged_folders(ws)
    assert verification(merged)["passed"] is True
    assert json.loads((merged / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]

    release = make_fp8_release_workspace(tmp_path / "fp8")
    code, out = lines(release / "qv-lora", "1", "", "6", "2", "1", "", "4")  # the same, for "as the base"
    assert code == 0, out
    assert "6) Change the output format (now bf16, a plain model)" in out
    assert "2) FP8 (e4m3), 128x128 blocks as the base (--keep-quantization)" in out
    [kept] = merged_folders(release)
    assert verification(kept)["passed"] is True
    base_config = json.loads((release / "Qwen3-tiny-FP8" / "config.json").read_text())
    assert json.loads((kept / "config.json").read_text())["quantization_config"] == base_config["quantization_config"]
    from safetensors import safe_open

    with safe_open(kept / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn


def test_a_format_the_engine_refuses_is_said_and_the_previous_one_kept(tmp_path):
    from factory import qwen_config, save_adapter, save_base

    base = save_base(tmp_path / "ws" / "base", qwen_config())
    save_adapter(tmp_path / "ws" / "adapter", base)
    code, out = lines(tmp_path / "ws" / "adapter", "1", "", "6", "2", "10")  # the adapter, output, FP8 blocks, Quit
    assert code == 0, out
    assert "--quantize fp8 found no Linear weight of whole 128x128 blocks" in out
    assert "The output stays as merged." in out
    assert out.count("The plan:") == 1 and "Traceback" not in out


def test_run_it_locally_also_writes_the_adapter_as_a_gguf_lora(ws):
    """Issue 40: after a peft LoRA merge, "Run it locally" says what the adapter as a GGUF LoRA writes (the
    LoRA beside the adapter, the base's GGUF in the base folder, sizes, time, whether llama.cpp can check
    it) before asking; yes writes both after the merged model's GGUF and prints each check as the engine
    recorded it and the exact lines to run the base's GGUF with the LoRA."""
    import gguf

    from tui_merger.core.ship.gguf_check import llama_cpp_version

    code, out = lines(ws, "", "", "", "",  # Find, output, start, no trial
                      "2", "", "", "y",  # Finish: Run it locally, q4_k_m, its file, the LoRA too
                      "4")  # Done
    assert code == 0, out
    assert "2) Run it locally: a GGUF for llama.cpp, Ollama, LM Studio" in out
    lora, base = ws / "adapter" / "adapter-LoRA-F32.gguf", ws / "base" / "base-Q4_K_M.gguf"
    modelfile = lora.with_suffix(".Modelfile")
    said = out.index(f"The adapter can also be written as a GGUF LoRA (for Ollama ADAPTER / llama-cli --lora): {lora} (about ")
    assert out.index(f"  applied to the base's GGUF {base} (about ", said) < out.index("Also write the adapter as a GGUF LoRA? (y/N)")
    assert said < out.index("GGUF written: ") < out.index(f"GGUF LoRA written: {lora} (F32, ")  # said before anything is written
    assert ", 28 LoRA pairs, rank 8, alpha 16).\n" in out
    assert f"  On the base's GGUF {base}, written now (Q4_K_M, " in out
    assert "  Base GGUF check PASSED: token ids equal on " in out
    if llama_cpp_version() is None:  # CI: only llama.cpp applies a GGUF LoRA
        assert "; the LoRA will not be checked: only llama.cpp applies a GGUF LoRA, and llama-cpp-python is not installed here;" in out
        assert "  LoRA check not checked: llama.cpp's Python binding (llama_cpp) is not installed here" in out
    else:
        assert "  LoRA check PASSED: " in out
    assert f"  Recorded in {lora.with_suffix('.json')} (base has no merge_manifest.json: tui-merger did not make it).\n" in out
    assert (f"Ollama Modelfile: {modelfile}\nRun it with the LoRA:\n  ollama create adapter:q4_k_m -f {modelfile}\n"
            f"  llama-cli -m {base} --lora {lora}\n") in out
    assert f"\nFROM {base}\nADAPTER ./adapter-LoRA-F32.gguf\n" in modelfile.read_text()
    reader = gguf.GGUFReader(lora)  # llama.cpp's own library reads it as an adapter of the base's architecture
    assert bytes(reader.fields["general.type"].parts[-1]).decode() == "adapter"
    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "qwen2"
    assert "Traceback" not in out


def test_the_gguf_lora_is_offered_for_one_peft_adapter_only(ws, tmp_path):
    """lora_source: one peft adapter folder at weight 1 on a base folder; not a weighted blend, nor an
    adapter that is not a peft folder (nothing to make a GGUF LoRA of)."""
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.ship.run_locally import lora_source

    base, adapter = ws / "base", ws / "adapter"
    assert lora_source(MergeOptions(base=base, adapter=adapter)) == (base.absolute(), adapter.absolute())
    assert lora_source(MergeOptions(base=base, adapters=[(adapter, 0.5)])) is None
    lone = tmp_path / "lone.safetensors"
    shutil.copy(adapter / "adapter_model.safetensors", lone)
    assert lora_source(MergeOptions(base=base, adapter=lone)) is None
    assert lora_source(None) is None


def test_a_stop_after_a_file_is_written_says_that_it_is_there(ws, tmp_path):
    """Stopped during the GGUF's check, make_local said the merge's "nothing was written" though the file was
    complete; stopped after the GGUF LoRA, make_local_lora says which files are there and that the rest was not made."""
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken, PhaseStarted
    from tui_merger.core.ship.run_locally import make_local, make_local_lora, plan_lora

    cancel = CancelToken()

    def stop_at(phase):
        return lambda ev: cancel.cancel() if isinstance(ev, PhaseStarted) and ev.phase == phase else None

    target = tmp_path / "base-F16.gguf"
    with pytest.raises(MergeCancelled) as stopped:
        make_local(ws / "base", "f16", target, on_event=stop_at("check"), cancel=cancel)
    assert str(stopped.value) == f"Stopped during the check: {target} was written but is not checked."
    assert target.is_file()

    cancel = CancelToken()
    plan = plan_lora(ws / "base", ws / "adapter", "f16")
    with pytest.raises(MergeCancelled) as stopped:
        make_local_lora(plan, on_event=stop_at("plan"), cancel=cancel)  # the base's GGUF, after the LoRA
    assert str(stopped.value) == f"Stopped while making the base's GGUF: {plan.lora_path} written; the rest was not made."
    assert plan.lora_path.is_file() and not plan.base_gguf.exists()


def test_the_base_gguf_of_a_hub_cache_snapshot_goes_beside_the_adapter(ws, tmp_path, monkeypatch):
    """A base in the Hugging Face cache (a folder huggingface_hub manages, named by a commit hash) gets its GGUF
    beside the adapter, named after the Hub model; a base folder of one's own keeps it inside, as `tui-merger gguf`."""
    from tui_merger.core.ship.run_locally import default_base_gguf

    cache = tmp_path / "hub"
    snapshot = cache / "models--Org--Tiny-Qwen" / "snapshots" / "0123abcd"
    shutil.copytree(ws / "base", snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert default_base_gguf(snapshot, ws / "adapter", "q4_k_m") == (ws / "adapter" / "Tiny-Qwen-Q4_K_M.gguf").absolute()
    assert default_base_gguf(ws / "base", ws / "adapter", "q8_0") == (ws / "base" / "base-Q8_0.gguf").absolute()


def _gemma3_vl(folder: Path) -> Path:
    """A tiny Gemma 3 vision-language folder as test_gguf_mmproj makes one: transformers' model, its tokenizer and
    the image normalization a released checkpoint's preprocessor_config.json carries."""
    from test_gguf_vl_text import make_vl

    vl = make_vl(folder, "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (vl / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    return vl


@pytest.mark.parametrize("failed", [False, True], ids=["as-checked", "mmproj-failed"])
def test_run_it_locally_says_the_mmproj_and_its_check(tmp_path, monkeypatch, failed):
    """A vision-language model's "Run it locally" (issue 40): the plan counts the mmproj file's size before anything is
    written; then the mmproj file beside the GGUF with its size, its check's verdict in the engine's own sentence (a
    FAILED one with "do not share it", as the command says it), and llama.cpp's multimodal line to run both."""
    from tui_merger.core.options import human_bytes
    from tui_merger.core.ship import gguf_mmproj
    from tui_merger.core.ship.gguf_check import FAILED, GgufCheck
    from tui_merger.core.ship.run_locally import estimate

    vl = _gemma3_vl(tmp_path / "vl")
    if failed:  # the verdict as check_mmproj gives a FAILED one (llama.cpp is not here to give it)
        monkeypatch.setattr(gguf_mmproj, "check_mmproj", lambda *a, **k: GgufCheck(
            FAILED, "llama.cpp's libmtmd (test)", "image embeddings differ by 3.2 (limit 0.05) on 4 tokens."))
    e = estimate(vl, "q4_k_m")
    assert 0 < e.mmproj_size < e.size
    out = io.StringIO()
    flow = plain._Flow(plain.DumbAsk(stdin=io.StringIO("\n\n"), out=out), out, tmp_path)  # q4_k_m, its file
    assert flow.gguf(vl)
    said = out.getvalue()
    gguf_file, mmproj = vl / "vl-Q4_K_M.gguf", vl / "mmproj-vl-F16.gguf"
    assert (f"About {human_bytes(e.size)} (with the vision tower's mmproj file beside it, about {human_bytes(e.mmproj_size)}, "
            "checked on an image), about ") in said
    assert said.index("About ") < said.index("GGUF written: ")
    assert f"\nVision tower (mmproj): {mmproj} ({human_bytes(mmproj.stat().st_size)}).\n" in said
    if failed:
        assert ("\nmmproj check FAILED: image embeddings differ by 3.2 (limit 0.05) on 4 tokens.\n"
                "llama.cpp does not see images through the mmproj file as the model does: do not share it.\n") in said
    else:
        from tui_merger.core.ship.gguf_check import llama_cpp_version

        if llama_cpp_version() is None:  # CI: only llama.cpp reads an mmproj file
            assert ("\nmmproj check not checked: llama-cpp-python is not installed, and only llama.cpp reads an mmproj "
                    "file.\n") in said
        else:
            assert "\nmmproj check PASSED: " in said
    assert f"\n  llama-mtmd-cli -m {gguf_file} --mmproj {mmproj} --image IMAGE.jpg -p 'Describe this image.'\n" in said
    assert "Traceback" not in said
