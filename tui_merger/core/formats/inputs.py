"""What a merge reads: a base tensor source, an adapter (possibly empty), the model config and the
files to carry. One place turns every kind of input (HF base + PEFT adapter, verl FSDP checkpoint)
into the same four things, so the plan, the writer and the front ends never branch on the format."""

from __future__ import annotations

import gc
import json
from contextlib import contextmanager

from pathlib import Path

from tui_merger.core.formats.peft_adapter import adapter_from_source, empty_adapter
from tui_merger.core.formats.combine import combine_adapters
from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import FilePlan, config_dtype, plan_files, read_config
from tui_merger.core.formats.input_types import Inputs, _value_model, paths_of
from tui_merger.core.formats.kohya import open_any_adapter
from tui_merger.core.options import MergeOptions
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES
from tui_merger.core.formats.hf_model import open_model

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


@contextmanager
def _cycle_collector_paused():
    """Opening a checkpoint makes thousands of small objects (records, tensor views) and no reference
    cycles. In a fresh process just after ``import torch`` that triggers a full collection over all of
    torch's objects: 60-100 ms of an FSDP open of ~150 ms (measured). Refcounting still frees
    everything; the collector is paused only while opening."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_inputs(options: MergeOptions) -> Inputs:
    with _cycle_collector_paused():
        return _open_inputs(options)


def _open_inputs(options: MergeOptions) -> Inputs:
    if options.checkpoint is not None:
        from tui_merger.core.formats.verl_megatron import is_megatron_checkpoint

        return _open_megatron(options) if is_megatron_checkpoint(options.checkpoint) else _open_fsdp(options)
    base = open_model(options.base)
    inputs = Inputs(base, empty_adapter(options.adapter), {}, FilePlan(), paths_of(options), closers=[base])
    try:
        parts = []
        for path, weight in options.adapter_weights():
            part = open_any_adapter(path, base.tensors)
            inputs.closers.append(part)
            parts.append((part, weight, path))
        inputs.parts = parts
        adapter = inputs.adapter = combine_adapters(parts)
        inputs.config = read_config(options.base)
        _quantized_base(inputs, options)
        inputs.files = plan_files(options.base, options.adapter, inputs.config, options.tokenizer_from)
        inputs.notices = adapter.notices + inputs.files.notices
        adapter_files = []
        for part, _, _ in parts:
            if part.folder.is_file():  # a kohya-style LoRA file: the file itself is the adapter
                adapter_files.append(part.folder)
            else:
                adapter_files += [part.folder / "adapter_config.json"] + [part.folder / f for f in part.source.files]
        inputs.read_files = (
            [options.base / f for f in base.files]
            + [options.base / "config.json"]
            + adapter_files
            + [src for src, _ in inputs.files.copies]
        )
    except BaseException:
        inputs.close()
        raise
    return inputs


def _quantized_base(inputs: Inputs, options: MergeOptions) -> None:
    """Weights saved already quantized (bitsandbytes, GPTQ, AWQ) are refused; with --qlora-base the
    base reads as dequant(quant(W)), the weights QLoRA training saw. The settings come from the flag
    alone (default: blocksize 64, double quantization, as QLoRA): the 16-bit base records nothing about
    how training quantized it, and peft saves nothing about it either."""
    from tui_merger.core.formats.quant import RoundTripSource, parse_roundtrip, refuse_packed

    refuse_packed(inputs.base, inputs.config, options.base)
    if options.base_roundtrip:
        conv1d = True if getattr(inputs.adapter, "fan_in_fan_out", False) else None  # else: by model_type
        source = RoundTripSource(inputs.base, parse_roundtrip(options.base_roundtrip), inputs.config, conv1d)
        inputs.base = source
        inputs.base_weights = source.describe()


def _lora_config(folder: Path, options: MergeOptions, ranks: set[int]) -> dict:
    """r and alpha of a verl LoRA run: lora_train_meta.json (verl >= 0.8) or lora_adapter/ (<= 0.7)."""
    cfg: dict = {}
    for path in (folder / "lora_train_meta.json", folder / "lora_adapter" / "adapter_config.json"):
        if path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except ValueError:
                raise MergeError(f"{path} is not valid JSON; fix it or pass --lora-alpha.") from None
            if not isinstance(cfg, dict):
                raise MergeError(f"{path} does not hold a JSON object; fix it or pass --lora-alpha.")
            from tui_merger.core.formats.peft_adapter import check_adapter_config

            check_adapter_config(cfg, path)
            break
    if options.lora_alpha is not None:
        cfg["lora_alpha"] = options.lora_alpha
    if not cfg.get("lora_alpha"):
        said = "is 0" if "lora_alpha" in cfg else "is not recorded"
        raise MergeError(
            f"This LoRA checkpoint's lora_alpha {said} (looked in lora_train_meta.json and "
            "lora_adapter/adapter_config.json); pass --lora-alpha with the value used in training."
        )
    if "r" not in cfg and len(ranks) == 1:
        cfg["r"] = next(iter(ranks))
    cfg.setdefault("peft_type", "LORA")
    return cfg


def _open_fsdp(options: MergeOptions) -> Inputs:
    from tui_merger.core.formats.verl_fsdp import FsdpSource, RenamedSource, find_fsdp_checkpoint, split_peft_keys

    layout = find_fsdp_checkpoint(options.checkpoint)
    source = FsdpSource(layout)
    inputs = Inputs(None, empty_adapter(layout.folder), {}, FilePlan(), paths_of(options), closers=[source])
    inputs.notices = list(layout.notices)
    try:
        hf_dir = layout.hf_dir
        base_map, adapter_map = split_peft_keys(source.tensors)
        config_dir = hf_dir if hf_dir is not None else options.base  # the trained model's own config first
        if config_dir is None:
            raise MergeError(
                f"{layout.folder} has no huggingface/ folder with config.json; copy the model's config.json "
                "and tokenizer into it, or pass --base with the original model."
            )
        inputs.config = read_config(config_dir)
        if adapter_map:
            ranks = {source.tensors[k].shape[0] for k in adapter_map if ".lora_A" in k}
            cfg = _lora_config(layout.folder, options, ranks)
            inputs.adapter = adapter_from_source(layout.folder, cfg, RenamedSource(source, adapter_map))
        base_only_lora = not any(k.endswith((".weight", ".bias")) for k in base_map)
        if base_only_lora:  # checkpoint.save_lora_only: the base weights are not in the files
            if options.base is None:
                raise MergeError(
                    f"{layout.folder} holds only LoRA weights (save_lora_only); pass --base with the model "
                    "the run started from."
                )
            base = open_model(options.base)
            inputs.closers.append(base)
            inputs.base = base
        else:
            inputs.base = RenamedSource(source, base_map)
        _value_model(inputs, options, layout)
        _tied(inputs, options, source, base_map)
        dtype = config_dtype(inputs.config)
        inputs.dtype = dtype if dtype in FLOAT_DTYPES else None
        if inputs.dtype == "float32" and options.dtype is None:
            inputs.notices.append(
                "The checkpoint's config says float32, so the model is written in float32 (twice the size "
                "of bf16); pass --dtype bf16 for the half-size model verl's merger writes."
            )
        files_dir = hf_dir if hf_dir is not None else config_dir
        inputs.files = plan_files(files_dir, files_dir, inputs.config, options.tokenizer_from)
        inputs.notices += inputs.files.notices
        meta = [layout.folder / n for n in ("lora_train_meta.json", "lora_adapter/adapter_config.json")]
        inputs.read_files = (
            list(layout.rank_files)
            + [config_dir / "config.json"]
            + [p for p in meta if p.is_file()]
            + ([options.base / f for f in inputs.base.files] if base_only_lora else [])
            + [src for src, _ in inputs.files.copies]
        )
    except BaseException:
        inputs.close()
        raise
    return inputs


def _open_megatron(options: MergeOptions) -> Inputs:
    """A verl Megatron checkpoint (dist_ckpt v1/v2, legacy mp_rank files, or HF weights saved by
    mbridge): converted to Hugging Face names by core/formats/verl_megatron.py, no adapter."""
    from tui_merger.core.formats.verl_megatron import open_megatron_inputs

    return open_megatron_inputs(options)


def _tied(inputs: Inputs, options: MergeOptions, source, base_map) -> None:
    """Tied embeddings appear twice in an FSDP state dict: write one tensor and keep the tie, unless
    the two differ, which is then said, and both are kept."""
    import torch

    names = inputs.base.tensors
    tie = bool(inputs.config.get("tie_word_embeddings")) or options.tie_word_embedding
    if not (tie and EMBED in names and HEAD in names):
        if options.tie_word_embedding and HEAD not in names:
            inputs.config_changes["tie_word_embeddings"] = True
        return
    emb = source.entries[base_map[EMBED]]
    head = source.entries[base_map[HEAD]]
    same = emb.shape == head.shape and len(emb.parts) == len(head.parts)
    for a, b in zip(emb.parts, head.parts):
        if not same:
            break
        # FSDP2 pickles the tied pair as one storage; FSDP1 as two equal ones, compared shard by shard
        shared = a.local.data_ptr() == b.local.data_ptr() and a.local.shape == b.local.shape
        same = shared or (a.local.shape == b.local.shape and torch.equal(a.local, b.local))
        source.release_part(a)  # the comparison touched these pages: hand them back
        source.release_part(b)
    if same:
        del names[HEAD]
        if not inputs.config.get("tie_word_embeddings"):
            inputs.config_changes["tie_word_embeddings"] = True
    else:
        inputs.notices.append(
            "lm_head.weight differs from the input embedding, so both are kept and "
            "tie_word_embeddings is set to false."
        )
        inputs.config_changes["tie_word_embeddings"] = False
