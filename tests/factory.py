"""Tiny real models and adapters for tests: built from configs with transformers, adapters saved by
peft. Shared by the test modules (imported as a plain module; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

QWEN = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def qwen_config(**overrides):
    from transformers import Qwen2Config

    return Qwen2Config(**{**QWEN, **overrides})


def gpt2_config(**overrides):
    from transformers import GPT2Config

    kw = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2Config(**{**kw, **overrides})


def save_base(path: Path, config, dtype=torch.float32, seed=0, max_shard_size=None, bin_format=False) -> Path:
    """A random model from ``config`` saved the way transformers saves models."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    if bin_format:  # what older transformers wrote: one torch.save'd state dict
        path.mkdir(parents=True, exist_ok=True)
        config.dtype = dtype
        config.save_pretrained(path)
        state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight" or not config.tie_word_embeddings}
        torch.save(state, path / "pytorch_model.bin")
        return path
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def load_base(path: Path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def save_adapter(path: Path, base_dir: Path, seed=1, perturb=True, resize_to=None, **lora_kwargs) -> Path:
    """A LoRA adapter trained (here: randomly initialised) on the model in ``base_dir``, saved by peft.

    ``perturb`` adds noise to parts peft initialises as copies of the base (DoRA magnitudes,
    modules_to_save copies, trainable token rows) so that a merge that ignored them would be caught.
    """
    from peft import LoraConfig, get_peft_model

    model = load_base(base_dir)
    if resize_to:
        model.resize_token_embeddings(resize_to, mean_resizing=False)
    torch.manual_seed(seed)
    lora_kwargs.setdefault("r", 4)
    lora_kwargs.setdefault("lora_alpha", 8)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    if perturb:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_magnitude_vector" in name or "modules_to_save" in name or "trainable_tokens_delta" in name:
                    param.add_(torch.randn_like(param) * 0.05)
    peft_model.save_pretrained(path)
    return path


def edit_adapter_config(path: Path, **changes) -> None:
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))


def reference(base_dir: Path, adapter_dir: Path, dtype=torch.float32, resize_to=None, probe=None):
    """peft's own answer: (logits of the unmerged PeftModel, state dict after merge_and_unload)."""
    from peft import PeftModel

    model = load_base(base_dir, dtype)
    if resize_to:
        model.resize_token_embeddings(resize_to, mean_resizing=False)
    peft_model = PeftModel.from_pretrained(model, adapter_dir)
    peft_model.eval()
    logits = None
    if probe is not None:
        with torch.no_grad():
            logits = peft_model(probe).logits
    merged = peft_model.merge_and_unload()
    return logits, {k: v.detach().clone() for k, v in merged.state_dict().items()}, peft_model


def read_output(out_dir: Path) -> dict:
    """Every tensor of a merged folder, read with the safetensors library (not our reader)."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(out_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def verification_checks(out_dir: Path) -> dict:
    """{check name: status} as the merge recorded them in merge_manifest.json."""
    manifest = json.loads((Path(out_dir) / "merge_manifest.json").read_text())
    return {c["name"]: c["status"] for c in manifest["verification"]["checks"]}


def logits_of(model_dir: Path, probe, dtype=torch.float32):
    model = load_base(model_dir, dtype)
    model.eval()
    with torch.no_grad():
        return model(probe).logits


def probe_ids(vocab=256, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 16), generator=g)


class Evil:
    """Pickles into a call of os.system that creates ``marker``: a loader that runs code from a
    checkpoint leaves the file behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def refused_by_cli(capsys, tmp_path: Path, args: list[str], needles=(), extra_leftover: str | None = None) -> str:
    """Run ``tui-merger ARGS`` (which must write to tmp_path/merged): exit code 1, exactly one ``error:``
    line holding every needle, no traceback, and nothing left behind (no output, no partial folder).
    Returns the error line."""
    from tui_merger.cli import main as cli_main

    out = tmp_path / "merged"
    code = cli_main(args)
    err = capsys.readouterr().err
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name or (extra_leftover and p.name.startswith(extra_leftover))]
    return lines[0]


def small_blocks_exact() -> bool:
    """Whether this CPU's BLAS computes a product of a few rows bit for bit as those rows of the whole
    product. Where it does not (MKL on AMD EPYC takes another kernel for blocks of 2-3 rows: one fp32
    unit off), tests that force tiny blocks compare within one unit of the output dtype instead of bit
    for bit; at the real block sizes (thousands of values) the merges are exact either way."""
    g = torch.Generator().manual_seed(0)
    b, a = torch.randn(128, 4, generator=g), torch.randn(4, 128, generator=g)
    whole = b @ a
    return all(torch.equal(torch.mm(b[i:i + k], a), whole[i:i + k]) for k in (2, 3) for i in range(0, 120, k))


def assert_same_or_one_unit(got, want, name: str) -> None:
    """Bit for bit where the CPU's BLAS allows it for tiny blocks (``small_blocks_exact``), else within
    two units of the output dtype at the tensor's largest value (a rounding tie may flip)."""
    if small_blocks_exact():
        assert torch.equal(got, want), f"{name}: max diff {(got.float() - want.float()).abs().max()}"
        return
    # a product's rounding scales with its terms, not its result: one unit at the tensor's largest value
    limit = 2 * torch.finfo(want.dtype).eps * want.float().abs().max()
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert bool(((got.float() - want.float()).abs() <= limit).all()), \
        f"{name}: max diff {(got.float() - want.float()).abs().max()} (limit {limit})"
