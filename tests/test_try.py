"""Try it (``core/ship/trial.py``, ``tui-merger try``, the plain flow's offer): the demo's merged model and
its base answer a prompt; every answer is compared with an independent ``model.generate`` of transformers
on the same prompt (greedy: identical tokens), the unmerged adapter (peft) with the merged model."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from tui_merger.cli import main
from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import CancelToken, TrialFinished, TrialStarted, TrialToken
from tui_merger.core.io.files import TOKENIZER_FILES
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions
from tui_merger.core.record.manifest import MANIFEST_NAME
from tui_merger.core.record.provenance import finish_merge
from tui_merger.core.ship.trial import ADAPTER, BASE, MERGED, agreement, plan_trial, run_trial
from tui_merger.demo import build_demo
from tui_merger.plain import run_plain

PROMPT = "What does a merge do?"


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)


def _merge(base: Path, adapter: Path, out: Path, dtype: str | None = None) -> Path:
    options = MergeOptions(base=base, adapter=adapter, out=out, dtype=dtype)
    finish_merge(options, run_merge(options), verify=False, fsync=False)  # the manifest names the base
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> dict:
    """The demo's base and adapter, merged as the demo merges them (bfloat16, the base's dtype)."""
    ws = tmp_path_factory.mktemp("try") / "ws"
    base, adapter = build_demo(ws)
    return {"ws": ws, "base": base, "adapter": adapter, "merged": _merge(base, adapter, ws / "merged")}


def reference(model_dir: Path, prompt: str, n: int, dtype=torch.bfloat16, tokenizer_dir: Path | None = None) -> list[int]:
    """transformers on its own: the chat template's user message, greedy generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir)
    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    out = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id)
    return out[0, enc["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def answered(demo) -> tuple:
    """The demo's merged model and its base answering PROMPT: (plan, answers, events)."""
    plan = plan_trial(demo["merged"])
    events = []
    return plan, run_trial(plan, PROMPT, max_new_tokens=10, on_event=events.append), events


def test_the_merged_model_and_its_base_answer_as_generate_does(demo, answered):
    plan, (merged, base), events = answered
    assert [(s.label, s.path) for s in plan.sides] == [(MERGED, demo["merged"]), (BASE, demo["base"].resolve())]
    assert plan.chat_template and plan.fits and plan.dtype == "bfloat16"
    assert plan.notes[0].startswith("Needs about ") and "(one model at a time), in bfloat16; " in plan.notes[0]
    weights = (demo["base"] / "model.safetensors").stat().st_size
    assert weights < plan.memory_bytes < 2 * weights + (1 << 20)

    assert merged.token_ids == reference(demo["merged"], PROMPT, 10)
    assert base.token_ids == reference(demo["base"], PROMPT, 10, tokenizer_dir=demo["merged"])
    assert merged.token_ids != base.token_ids  # the adapter changed the model
    for answer in (merged, base):
        assert len(answer.token_ids) == 10 and answer.tokens_per_s > 0 and answer.seconds > 0
        tokens = [e for e in events if isinstance(e, TrialToken) and e.side == answer.label]
        assert [e.tokens for e in tokens] == list(range(1, 11))  # one event per token, streamed
        [finished] = [e for e in events if isinstance(e, TrialFinished) and e.side == answer.label]
        assert list(finished.token_ids) == answer.token_ids and finished.text == answer.text
        assert answer.text.startswith(tokens[-1].text)
    kinds = [(type(e).__name__, e.side) for e in events if not isinstance(e, TrialToken)]
    assert kinds == [("TrialStarted", MERGED), ("TrialFinished", MERGED), ("TrialStarted", BASE), ("TrialFinished", BASE)]


def test_the_unmerged_adapter_answers_like_the_merged_model(demo, tmp_path):
    """In float32 (the merge written in float32, every side loaded so) nothing is rounded: peft's
    unmerged base + adapter and the merged weights choose the same tokens."""
    merged = _merge(demo["base"], demo["adapter"], tmp_path / "merged32", dtype="fp32")
    plan = plan_trial(merged, against=demo["adapter"])
    assert [s.label for s in plan.sides] == [MERGED, ADAPTER] and plan.dtype == "float32"
    assert plan.sides[1].path == demo["adapter"] and plan.sides[1].base == demo["base"].resolve()
    first, unmerged = run_trial(plan, PROMPT, max_new_tokens=12)
    assert first.token_ids == unmerged.token_ids == reference(merged, PROMPT, 12, dtype=torch.float32)
    assert first.text == unmerged.text
    # issue 38 item 19: said in words, since random answers cannot be compared by eye
    assert agreement([first, unmerged]) == "The two answers are the same, token for token (12 tokens)."

    # in bfloat16 the plan says why a long answer may part from the unmerged one
    notes = plan_trial(demo["merged"], against=demo["adapter"]).notes
    assert any("rounding, not a bad merge" in n for n in notes)


def test_cancel_stops_mid_generation(demo):
    plan = plan_trial(demo["merged"])
    cancel, events = CancelToken(), []

    def on_event(event):
        events.append(event)
        if isinstance(event, TrialToken) and event.tokens == 3:
            cancel.cancel()

    with pytest.raises(MergeCancelled, match="stopped at your request"):
        run_trial(plan, PROMPT, max_new_tokens=40, on_event=on_event, cancel=cancel)
    assert [e.tokens for e in events if isinstance(e, TrialToken)] == [1, 2, 3]
    assert not any(isinstance(e, TrialFinished) for e in events)
    assert [e.side for e in events if isinstance(e, TrialStarted)] == [MERGED]  # the base never loaded


def test_bad_input_is_one_sentence(demo, tmp_path):
    def error(*args, **kwargs) -> str:
        with pytest.raises(MergeError) as info:
            plan_trial(*args, **kwargs)
        text = str(info.value)
        assert "\n" not in text and text.endswith(".")
        return text

    assert error(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'} does not exist; check the path of the merged model."
    assert "is a LoRA adapter, not a model" in error(demo["adapter"])
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    assert error(no_config) == f"{no_config} has no config.json, so it is not a Hugging Face model folder."

    bare = tmp_path / "bare"  # the merged model without its tokenizer
    shutil.copytree(demo["merged"], bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    assert error(bare).startswith(f"{bare} has no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model)")

    assert error(demo["merged"], against=tmp_path / "none") == (
        f"{tmp_path / 'none'} does not exist; give a base model folder or a LoRA adapter folder to compare with."
    )
    assert error(demo["merged"], against=no_config).endswith("has no config.json, so it is not a Hugging Face model folder.")

    moved = tmp_path / "moved"  # the base the manifest names is gone
    shutil.copytree(demo["merged"], moved)
    manifest = json.loads((moved / MANIFEST_NAME).read_text())
    for item in manifest["inputs"]:
        if item["role"] == "base":
            item["path"] = str(tmp_path / "gone")
    (moved / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert error(moved).startswith(f"The base this model was merged from, {tmp_path / 'gone'}, is no longer there")

    plan = plan_trial(demo["merged"])
    with pytest.raises(MergeError, match="^The prompt is empty"):
        run_trial(plan, "  \n")


def test_a_model_without_a_manifest_answers_alone(demo):
    plan = plan_trial(demo["base"])  # a plain model folder: nothing recorded to compare with
    assert [s.label for s in plan.sides] == [MERGED]
    assert any(n.startswith("Only the merged model answers: it has no merge_manifest.json") for n in plan.notes)


def test_a_model_that_does_not_fit_runs_layer_by_layer_and_says_so(demo, tmp_path):
    """Less memory than one model needs: each side runs from its files one module at a time, in
    float32, and answers what transformers' own float32 model answers (the base, and the unmerged
    adapter through peft)."""
    plan = plan_trial(demo["merged"], available=100_000)
    assert not plan.fits and plan.available_bytes == 100_000
    assert plan.notes[1].startswith("It does not fit: ") and "is more than the 100.00 KB available" in plan.notes[1]
    assert "layer by layer" in plan.notes[1]
    events = []
    merged, base = run_trial(plan, PROMPT, max_new_tokens=8, on_event=events.append)
    assert merged.token_ids == reference(demo["merged"], PROMPT, 8, dtype=torch.float32)
    assert base.token_ids == reference(demo["base"], PROMPT, 8, dtype=torch.float32, tokenizer_dir=demo["merged"])
    started = [e.message for e in events if isinstance(e, TrialStarted)]
    assert len(started) == 2 and all("layer by layer from its files, float32" in m for m in started)
    merged32 = _merge(demo["base"], demo["adapter"], tmp_path / "merged32", dtype="fp32")
    plan = plan_trial(merged32, against=demo["adapter"], available=100_000)
    first, unmerged = run_trial(plan, PROMPT, max_new_tokens=8)
    assert first.token_ids == unmerged.token_ids == reference(merged32, PROMPT, 8, dtype=torch.float32)


# -- the command line ------------------------------------------------------------------------------


def test_cli_try_streams_both_answers(demo, answered, capsys):
    code = main(["try", str(demo["merged"]), "--prompt", PROMPT, "--max-new-tokens", "10"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.splitlines()[0].startswith("Needs about ")  # the memory statement comes first
    assert f"Loading the merged model from {demo['merged']} (bfloat16) ..." in err
    assert out.index("\nmerged model:\n") < out.index("\nbase model:\n")
    merged, base = answered[1]
    same = next(i for i, (a, b) in enumerate(zip(merged.token_ids, base.token_ids)) if a != b)  # they differ
    where = "differ from the first token" if same == 0 else f"are the same for {same} token"
    assert f"\nThe two answers {where}" in out and "the adapter changed what the base model says" in out
    for answer in answered[1]:
        block = out.split(f"\n{answer.label}:\n", 1)[1]
        assert block.startswith(answer.text + "\n") if answer.text.strip() else block.startswith("(no readable text)")
        assert block.splitlines()[1].startswith("  10 tokens in ") and block.splitlines()[1].endswith(" tokens/s")


def test_cli_try_reads_the_prompt_from_stdin_and_says_errors_in_a_sentence(demo, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    assert main(["try", str(demo["merged"]), "--against", str(demo["adapter"]), "--max-new-tokens", "3"]) == 0
    out, _ = capsys.readouterr()
    assert "merged model:" in out and "unmerged adapter:" in out and out.count("  3 tokens in ") == 2

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["try", str(demo["merged"])]) == 1
    assert "error: No prompt was given; pass one with --prompt TEXT" in capsys.readouterr().err
    assert main(["try", str(tmp_path / "nowhere"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'nowhere'} does not exist; check the path of the merged model.\n"
    with pytest.raises(SystemExit):
        main(["try", str(demo["merged"]), "--max-new-tokens", "0"])
    assert "0 is not at least 1" in capsys.readouterr().err


def test_cli_ctrl_c_stops_cleanly(demo, monkeypatch, capsys):
    from tui_merger import console

    class CtrlC(console.TrialPrinter):  # the user presses Ctrl-C at the second token
        def __call__(self, event):
            super().__call__(event)
            if isinstance(event, TrialToken) and event.tokens == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(console, "TrialPrinter", CtrlC)
    assert main(["try", str(demo["merged"]), "--prompt", PROMPT]) == 130
    out, err = capsys.readouterr()
    assert err.rstrip().endswith("Try it stopped at your request; nothing was changed.")
    assert "Traceback" not in err and "base model:" not in out


# -- the plain flow ---------------------------------------------------------------------------------


def test_plain_flow_offers_try_it_after_verification(demo, tmp_path, monkeypatch):
    from tui_merger import plain

    monkeypatch.setattr(plain, "TRY_TOKENS", 8)  # short answers: the test's time goes to the merge
    ws = tmp_path / "ws"
    for name in ("base", "adapter"):
        shutil.copytree(demo["ws"] / name, ws / name)
    config = ws / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": str(ws / "base")}))
    answers = ["1", "", "1", "y", PROMPT, "4"]  # adapter, output folder, Start; Try it: yes, the prompt; Done
    out = io.StringIO()
    code = run_plain(ws, input=io.StringIO("".join(a + "\n" for a in answers)), output=out, dumb=True)
    text = out.getvalue()
    assert code == 0, text
    assert "Try the merged model with a prompt? (y/N) y" in text
    order = ["PASSED", "\nmerged model:\n", "  8 tokens in ", "\nbase model:\n", "  8 tokens in ", "Step 5 of 5"]
    at = 0
    for part in order:
        at = text.index(part, at)
    assert text.count(" tokens/s") == 2 and "Needs about " in text and "Traceback" not in text


def wordless_tokenizer(folder: Path) -> None:
    """Replace the tokenizer in ``folder`` by one that knows only "a" and "b" (no unknown token, no chat
    template): any other prompt becomes no tokens."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "<e>": 2}, merges=[]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<e>").save_pretrained(folder)


def test_a_prompt_that_becomes_no_tokens_is_one_sentence(demo, tmp_path):
    """Issue 32 item 4: generate() failed with torch's "cannot reshape tensor of 0 elements"."""
    model = tmp_path / "wordless"
    shutil.copytree(demo["merged"], model)
    wordless_tokenizer(model)
    plan = plan_trial(model)
    assert not plan.chat_template
    events = []
    with pytest.raises(MergeError) as info:
        run_trial(plan, "xyz", max_new_tokens=3, on_event=events.append)
    assert str(info.value) == (
        f"The tokenizer of {model} turns this prompt into no tokens (none of its characters are in its vocabulary, "
        "and it has no chat template to add any); type a prompt in the language and script the model was trained on."
    )
    assert "reshape" not in str(info.value) and not events  # said before any model is loaded
    [answer, _] = run_trial(plan, "ab", max_new_tokens=2)  # a prompt it can read still works
    assert len(answer.token_ids) == 2


def test_where_two_answers_part_is_said_with_the_reason_of_their_comparison():
    """Issue 38 item 19: the sentence under two answers, from their token ids (an independent count here)."""
    from tui_merger.core.ship.trial import TrialAnswer

    def answer(label, ids):
        return TrialAnswer(label, "", ids, 1.0, 1.0)

    assert agreement([answer(MERGED, [1, 2])]) is None
    assert agreement([answer(MERGED, [1, 2, 3]), answer(ADAPTER, [1, 2, 3])]) == (
        "The two answers are the same, token for token (3 tokens).")
    parted = agreement([answer(MERGED, [1, 2, 3, 4]), answer(ADAPTER, [1, 2, 9, 4])])
    assert parted == ("The two answers are the same for 2 tokens, then part: where the model hesitates between two "
                      "tokens, rounding decides (not a bad merge).")
    assert "not a bad merge" in parted
    shorter = agreement([answer(MERGED, [1, 2]), answer(ADAPTER, [1, 2, 3])])  # one stopped earlier
    assert shorter.startswith("The two answers are the same for 2 tokens, then part")
    assert agreement([answer(MERGED, [5]), answer(BASE, [6])]) == (
        "The two answers differ from the first token: the adapter changed what the base model says (that is the "
        "training).")
