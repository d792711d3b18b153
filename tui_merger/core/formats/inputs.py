"""What a merge reads: a base tensor source, an adapter (possibly empty), the model config and the
files to carry. Every kind of input becomes the same ``Inputs``: a checkpoint through its kind's
``open``, a base with adapters here (the base through the model kind, each adapter through its own
kind), so the plan, the writer and the front ends never branch on the format."""

from __future__ import annotations

import gc
from contextlib import contextmanager

from pathlib import Path

from tui_merger.core.formats.adapter import empty_adapter, use_alpha
from tui_merger.core.formats.base import Reference
from tui_merger.core.formats.combine import combine_adapters
from tui_merger.core.formats.input_types import Inputs, paths_of
from tui_merger.core.formats.registry import adapter_format, checkpoint_format, model_format, open_adapter
from tui_merger.core.io.files import FilePlan, plan_files, read_config
from tui_merger.core.options import MergeOptions


@contextmanager
def cycle_collector_paused():
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
    from tui_merger.core.io import libc

    libc.large_blocks_mapped()  # from the first read on, large blocks go back to the OS when freed
    with cycle_collector_paused():
        return _open_inputs(options)


def _open_inputs(options: MergeOptions) -> Inputs:
    if options.checkpoint is not None:
        fmt = checkpoint_format(options.checkpoint)
        inputs = fmt.open(options)
        inputs.format = fmt
        return inputs
    base = model_format().open_base(options.base)
    inputs = Inputs(base, empty_adapter(options.adapter), {}, FilePlan(), paths_of(options), closers=[base])
    try:
        inputs.config = read_config(options.base)
        parts = []
        for path, weight in options.adapter_weights():
            part = open_adapter(path, base.tensors, inputs.config, alpha_given=options.lora_alpha is not None)
            inputs.closers.append(part)
            if options.lora_alpha is not None:  # the user's value: used, and said (never dropped)
                said = use_alpha(part, options.lora_alpha)
                if said:
                    inputs.infos.append(said)
            parts.append((_on_disk_names(part, base, options.base, inputs.closers), weight, path))
        inputs.parts = parts
        adapter = inputs.adapter = combine_adapters(parts)
        _quantized_base(inputs, options)
        inputs.files = plan_files(options.base, options.adapter, inputs.config, options.tokenizer_from)
        inputs.notices = adapter.notices + inputs.files.notices
        adapter_files = []
        for part, _, _ in parts:
            if part.folder.is_file():  # an adapter kept in one file (kohya-style): the file is the adapter
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


def _on_disk_names(adapter, base, base_dir: Path, closers: list):
    """An adapter saved with the names transformers keeps in memory (a vision-language model's
    ``model.language_model.*``) given the names its base has on disk, by transformers' own rules; an
    adapter whose names the base already has comes back as it is."""
    from tui_merger.core.formats.adapter import module_params, renamed

    wanted = module_params(adapter)
    if all(name in base.tensors for name in wanted) and not adapter.param_lora:
        return adapter
    from tui_merger.core.formats.hf_names import memory_to_disk

    mapping = memory_to_disk(base_dir, base.tensors)
    if any(name in mapping for name in wanted):
        adapter = renamed(adapter, lambda name: mapping.get(name, name))
    if adapter.param_lora:
        from tui_merger.core.formats.hf_names import place_parameter_loras

        place_parameter_loras(adapter, base_dir, closers)
    return adapter  # names the base still lacks: the plan says which


def _quantized_base(inputs: Inputs, options: MergeOptions) -> None:
    """A base released quantized (FP8 blocks, compressed-tensors FP8) reads dequantized, as transformers'
    dequantizing load gives it (``dequant.DequantSource``), and the output drops its quantization_config.
    Weights saved already quantized (bitsandbytes, GPTQ, AWQ) are refused; with --qlora-base the
    base reads as dequant(quant(W)), the weights QLoRA training saw. The settings come from the flag
    alone (default: blocksize 64, double quantization, as QLoRA): the 16-bit base records nothing about
    how training quantized it, and peft saves nothing about it either."""
    from tui_merger.core.formats.dequant import DequantSource, scheme_for
    from tui_merger.core.formats.quant import RoundTripSource, parse_roundtrip, refuse_packed

    scheme = scheme_for(inputs.config, options.base)  # config.json's, or ModelOpt's hf_quant_config.json
    if scheme is not None:  # released quantized (FP8 blocks, compressed-tensors FP8): no other original
        source = DequantSource(inputs.base, scheme, inputs.config, options.dtype)
        inputs.base = source
        inputs.base_weights = source.describe()
        if "quantization_config" in inputs.config:  # the output is a plain model, unless:
            inputs.config_changes["quantization_config"] = None
        source.output_quantization = options.output_quantization  # merge.requant.output_plan writes it again
        if options.base_roundtrip:
            from tui_merger.core.errors import MergeError

            raise MergeError(
                f"--qlora-base rounds 16-bit weights the way bitsandbytes does; {options.base} is released as "
                f"{scheme.label} and is merged into its dequantized weights, what training saw. Drop --qlora-base."
            )
        return
    refuse_packed(inputs.base, inputs.config, options.base)
    if options.output_quantization is not None:  # --quantize fp8 (--keep-quantization on a 16-bit base: refused there)
        inputs.base.output_quantization = options.output_quantization
    if options.base_roundtrip:
        conv1d = True if getattr(inputs.adapter, "fan_in_fan_out", False) else None  # else: by model_type
        from tui_merger.core.formats.hf_names import quantizable_linears

        linears = quantizable_linears(inputs.config, inputs.base.tensors)  # the Linear layers transformers replaces
        source = RoundTripSource(inputs.base, parse_roundtrip(options.base_roundtrip), inputs.config, conv1d, linears)
        inputs.base = source
        inputs.base_weights = source.describe()


def reference(inputs: Inputs, options: MergeOptions, tmp: Path) -> Reference | None:
    """What verification runs as the unmerged reference (None: a conversion, nothing to compare with):
    a checkpoint's by its kind; for a base with adapters, the base as the merge read it with each adapter
    in a folder peft can load (its kind says which) and the base's own config."""
    if inputs.format is not None:
        return inputs.format.reference(inputs, options, tmp)
    if options.weighted:
        adapters = [
            (adapter_format(path).reference_folder(part, tmp, f"adapter{index}"), weight)
            for index, (part, weight, path) in enumerate(inputs.parts)
        ]
    else:
        adapters = [(adapter_format(options.adapter).reference_folder(inputs.adapter, tmp, "adapter"), None)]
    return Reference(adapters, config_dir=Path(options.base))
