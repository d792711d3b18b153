"""``tui-merger demo``: a tiny random Qwen2-style model, a LoRA adapter and a tokenizer, built offline
in seconds with the real libraries, then merged. Nothing is downloaded."""

from __future__ import annotations

import json
import os
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.hf_refs import OFFLINE_BY_DEMO

MARKER = ".tui-merger-demo"
DEMO_TEXT = """\
After training, people hold a checkpoint, not a model. A merge adds the low-rank update of each
adapted layer to its base weight: W plus alpha over r times B times A. The tokenizer, the chat template
and the generation settings travel with the weights, so that the merged model answers like the
adapter did. Users merge over SSH on shared machines, so progress must be live and an interruption
must never leave half a model behind.
"""
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_demo(workspace: Path, seed: int = 0) -> tuple[Path, Path]:
    """Create ``base/`` and ``adapter/`` under workspace (reused when already there)."""
    workspace = Path(workspace)
    base, adapter = workspace / "base", workspace / "adapter"
    if "HF_HUB_OFFLINE" not in os.environ:  # the demo never needs the Hub; said so if an upload is tried
        os.environ["HF_HUB_OFFLINE"] = "1"
        os.environ[OFFLINE_BY_DEMO] = "1"
    if workspace.exists() and any(workspace.iterdir()) and not (workspace / MARKER).exists():
        raise MergeError(
            f"{workspace} exists and is not a tui-merger demo folder; choose another --workspace."
        )
    if (base / "config.json").is_file() and (adapter / "adapter_config.json").is_file():
        return base, adapter
    workspace.mkdir(parents=True, exist_ok=True)
    (workspace / MARKER).write_text("made by tui-merger demo\n")

    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DEMO_TEXT.split("\n"), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    vocab = 512  # padded beyond the tokenizer, as real models pad their embeddings

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.max_new_tokens = 32
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # random A and B, so the merge visibly changes the model
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(Qwen2ForCausalLM(config), lora)
    peft_model.save_pretrained(adapter)
    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["base_model_name_or_path"] = str(base.resolve())
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return base, adapter


@contextmanager
def _quiet():
    """The libraries' own output while the demo is built (the tokenizer trainer's bars, written by
    Rust straight to the terminal; transformers' "Writing model shards"; warnings) goes to a file; it
    is shown only if building fails."""
    import tempfile
    import warnings

    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        failed = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            if failed:
                log.seek(0)
                sys.stderr.write(log.read().decode("utf-8", "replace"))


def cmd_demo(args, launch) -> int:
    """``launch``: how the command line opens the assistant on a folder (cli.launch)."""
    from tui_merger.cli.common import print_result, report_verification, run_with_progress, terminal
    from tui_merger.core.options import MergeOptions

    workspace = Path(args.workspace)
    print(f"Building a tiny demo model and LoRA adapter in {workspace} ...", file=sys.stderr)
    with _quiet():
        base, adapter = build_demo(workspace)
    interactive, dumb = terminal()
    if interactive and not args.no_ui:  # a person at a terminal: the assistant takes it from here
        return launch(workspace, plain=dumb)
    out = workspace / "merged"
    result, report = run_with_progress(MergeOptions(base=base, adapter=adapter, out=out, overwrite=True))
    print_result(result)
    code = report_verification(report)
    from tui_merger.core.options import python_command

    load = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({json.dumps(str(out))})"
    print(f"\nTry it:  {python_command()} -c {shlex.quote(load)}")
    return code
