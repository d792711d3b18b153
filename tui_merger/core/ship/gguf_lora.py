"""A peft LoRA adapter as a GGUF adapter file, for llama.cpp (``--lora``) and Ollama (``ADAPTER``).

The layout is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and its adapter loader reads:
``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, and for each base tensor a
LoRA changes, ``<GGUF name>.lora_a`` (peft's lora_A, [r, in]) and ``<GGUF name>.lora_b`` (lora_B,
[out, r]), F32 (the converter's default). llama.cpp adds ``scale * alpha / r * B @ A`` (r: that tensor's
rank) to the base tensor's product.

The base folder says where each LoRA lands: its tensors are planned as the GGUF export plans them
(ship/gguf.py, the family data in gguf_families.py), and a LoRA follows its base tensor's transform
where that is a reordering of rows: Llama-style q/k rows for llama.cpp's rope (lora_b's rows, as the
converter permutes them). Where a base tensor is computed from the HF one otherwise (DeepSeek's MLA
k_b/v_b), cut from it, or stacked (experts), a LoRA on it is refused in one sentence, as are DoRA,
LoRA on embeddings, modules_to_save (whole trained copies: a GGUF adapter has no place for them;
merge instead), and a LoRA on a tensor llama.cpp's graph multiplies without its adapters (NOT_APPLIED).

Where peft's scale is not llama.cpp's alpha / r (rsLoRA's alpha / sqrt(r), alpha_pattern), lora_b is
multiplied by their ratio, so llama.cpp computes peft's delta; the file's alpha stays lora_alpha.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError


# GGUF tensors (after "blk.N.") whose LoRA llama.cpp's graph for the architecture does not apply (it multiplies
# them without their adapters), measured with benchmarks/llama_cpp_lora_check.py --targets (llama-cpp-python
# 0.3.36: a LoRA there changed no logit): a file with them would run as if that part were not trained
NOT_APPLIED = {
    "deepseek2": ("attn_q", "attn_q_a", "attn_q_b", "attn_kv_a_mqa"),
}


@dataclass(frozen=True)
class LoraGgufResult:
    path: Path
    arch: str
    alpha: float
    ranks: tuple[int, ...]  # the distinct ranks written
    pairs: int  # base tensors changed (each a lora_a and a lora_b)
    rescaled: int  # of them, with lora_b scaled to peft's scale
    size: int
    sha256: str
    seconds: float


def default_lora_out(adapter_folder: Path) -> Path:
    """ADAPTER/<adapter folder name>-LoRA-F32.gguf, beside the adapter it is made of."""
    folder = Path(adapter_folder).expanduser().absolute()
    return folder / f"{folder.name}-LoRA-F32.gguf"


def export_lora_gguf(base_folder: Path, adapter_folder: Path, out: Path | None = None,
                     overwrite: bool = False) -> LoraGgufResult:
    """Write the adapter as a GGUF LoRA for the base's GGUF (temporary name, renamed when complete)."""
    import gguf

    from tui_merger.core.formats.adapter import open_adapter
    from tui_merger.core.ship import gguf as ship_gguf
    from tui_merger.core.ship import gguf_families

    started = time.perf_counter()
    base_folder = Path(base_folder).expanduser().absolute()
    adapter_folder = Path(adapter_folder).expanduser().absolute()
    if not (adapter_folder / "adapter_config.json").is_file():
        raise MergeError(f"{adapter_folder} has no adapter_config.json; --adapter takes a peft LoRA adapter folder.")
    target = _target(adapter_folder, out, overwrite)
    config = ship_gguf._read_config(base_folder)
    family = gguf_families.FAMILIES[config["model_type"]]
    notices: list[str] = []
    with ship_gguf._quiet_library_logs():
        hp = ship_gguf._hyperparameters(base_folder, config, family, notices)
        source = ship_gguf._open_source(base_folder)
        try:
            planned = ship_gguf._plan_tensors(base_folder, source, config, hp, family, "f16", notices)
        finally:
            source.close()
    by_hf = {}
    for t in planned:
        for ref in t.sources:
            by_hf.setdefault(ref.name, []).append(t)
    adapter = open_adapter(adapter_folder)
    try:
        pairs = _pairs(adapter, by_hf, hp, base_folder)
        for name, entry, _ in pairs:
            part = name.split(".")[2] if name.startswith("blk.") else name
            if part in NOT_APPLIED.get(family.arch, ()):
                raise MergeError(
                    f"llama.cpp's {family.arch} graph does not apply a LoRA to {part} (the adapter's {entry.module}), "
                    "so a GGUF LoRA would run as if it were not trained; merge the adapter instead."
                )
        alpha = float(adapter.config["lora_alpha"])
        writer = gguf.GGUFWriter(None, family.arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_name(adapter_folder.name)
        writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        rescaled, ranks = 0, set()
        for name, entry, t in pairs:
            a, b = _factors(entry, t)
            r = a.shape[0]
            ranks.add(r)
            ratio = entry.scale / (alpha / r)
            if abs(ratio - 1.0) > 1e-12:
                b = b * ratio
                rescaled += 1
            writer.add_tensor(name + ".lora_a", a.contiguous().numpy())
            writer.add_tensor(name + ".lora_b", b.contiguous().numpy())
    finally:
        adapter.close()
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    digest = hashlib.sha256()
    with open(target, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return LoraGgufResult(target, family.arch, alpha, tuple(sorted(ranks)), len(pairs), rescaled,
                          target.stat().st_size, digest.hexdigest(), time.perf_counter() - started)


def _target(adapter_folder: Path, out: Path | None, overwrite: bool) -> Path:
    target = default_lora_out(adapter_folder) if out is None else Path(out).expanduser().absolute()
    if target.is_dir():
        target = target / default_lora_out(adapter_folder).name
    if target.suffix.lower() != ".gguf":
        raise MergeError(f"{target} does not end in .gguf; name the file to write, e.g. {target.with_suffix('.gguf').name}.")
    if not target.parent.is_dir():
        raise MergeError(f"The folder {target.parent} for the GGUF does not exist; create it or choose another --out.")
    if target.exists() and not overwrite:
        raise MergeError(f"{target} exists; choose another --out, or pass --overwrite to replace it.")
    return target


def _pairs(adapter, by_hf: dict, hp: dict, base_folder: Path) -> list:
    """[(GGUF base tensor name, LoraModule, GgufTensor)], or one sentence why not."""
    folder = adapter.folder
    if adapter.use_dora:
        raise MergeError(f"{folder} is a DoRA adapter; a GGUF LoRA has no magnitude vector, so llama.cpp cannot run it: merge it instead.")
    kept = sorted(adapter.replacements) + sorted(adapter.token_rows)
    if kept:
        raise MergeError(
            f"{folder} also saves whole trained modules ({kept[0]}...: modules_to_save or new token rows), which a "
            "GGUF LoRA cannot carry; merge the adapter and export the merged folder instead."
        )
    if adapter.param_lora or adapter.expert_lora:
        name = next(iter({**adapter.param_lora, **adapter.expert_lora}))
        raise MergeError(f"{folder} has a LoRA on packed parameters ({name}); a GGUF LoRA of experts is not written: merge it instead.")
    if adapter.fan_in_fan_out:
        raise MergeError(f"{folder} stores its LoRA as fan_in_fan_out (Conv1D layers), which no family tui-merger writes as GGUF has.")
    out = []
    for module, entry in sorted(adapter.lora.items()):
        if entry.is_embedding:
            raise MergeError(f"{folder} has a LoRA on the embedding {module}; tui-merger writes GGUF LoRAs of linear layers only: merge it instead.")
        if entry.B_bias is not None:
            raise MergeError(f"{folder} trains a bias with its LoRA ({module}); a GGUF LoRA has no place for it: merge it instead.")
        found = by_hf.get(module + ".weight")
        if not found:
            if module.endswith("lm_head") and hp["tie_word_embeddings"]:
                raise MergeError(
                    f"{folder} has a LoRA on lm_head, which {base_folder.name} ties to its embedding; llama.cpp "
                    "ignores such a LoRA, so merge the adapter instead."
                )
            raise MergeError(f"{folder} has a LoRA on {module}, which {base_folder} has no weight of; is this adapter for another model?")
        for t in found:
            if len(t.sources) != 1 or t.derive is not None or t.computed is not None or t.rows is not None or len(t.shape) != 2:
                raise MergeError(
                    f"{folder} has a LoRA on {module}, which llama.cpp's layout stores as {t.name} computed from it "
                    "(stacked experts, a part or a derived tensor); a GGUF LoRA of it is not written: merge it instead."
                )
            if tuple(t.sources[0].shape) != (entry.B.shape[0], entry.A.shape[1]):
                raise MergeError(
                    f"{module}: the LoRA is {entry.B.shape[0]}x{entry.A.shape[1]} but {base_folder.name}'s weight is "
                    f"{list(t.sources[0].shape)}; is this adapter for another model?"
                )
            out.append((t.name.removesuffix(".weight") + ".weight", entry, t))
    if not out:
        raise MergeError(f"{folder} holds no LoRA pair; there is nothing to write.")
    return out


def _factors(entry, t):
    """lora_a [r, in] and lora_b [out, r] as float32, lora_b's rows as the base tensor's in the GGUF."""
    import torch

    a = entry.A.load().to(torch.float32)
    b = entry.B.load().to(torch.float32)
    if t.permute_heads:  # the converter permutes lora_b's rows as it permutes the base tensor's
        n = t.permute_heads
        b = b.reshape(n, 2, b.shape[0] // n // 2, b.shape[1]).transpose(1, 2).reshape(b.shape)
    return a.clone(), b.clone()
