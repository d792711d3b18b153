"""A peft LoRA adapter as a GGUF adapter file, for llama.cpp (``--lora``) and Ollama (``ADAPTER``).

The layout is the one llama.cpp's ``convert_lora_to_gguf.py`` writes and its adapter loader reads:
``general.type`` "adapter", ``adapter.type`` "lora", ``adapter.lora.alpha``, and for each base tensor a
LoRA changes, ``<GGUF name>.lora_a`` (peft's lora_A, [r, in]) and ``<GGUF name>.lora_b`` (lora_B,
[out, r]), F32 (the converter's default). llama.cpp adds ``scale * alpha / r * B @ A`` (r: that tensor's
rank) to the base tensor's product.

The base folder says where each LoRA lands: its tensors are planned as the GGUF export plans them
(ship/gguf.py, the family data in gguf_families.py), and a LoRA follows its base tensor's transform
where that is a reordering or a cut of rows: Llama-style q/k rows for llama.cpp's rope (lora_b's rows,
as the converter permutes them), a packed tensor split into parts (lora_b's rows of each part).

Experts: llama.cpp stacks a layer's experts of one kind into one tensor (``ffn_gate_exps`` [experts, out,
in]) and runs their LoRA with the same expert ids (``build_lora_mm_id``): ``lora_a`` [experts, r, in] and
``lora_b`` [experts, out, r], expert e's pair at index e, as the converter stacks per-expert lora_A /
lora_B. Both ways peft trains experts land there: a LoRA per expert Linear (``experts.3.gate_proj``) and
``target_parameters`` on packed experts (``mlp.experts.gate_up_proj``), whose pairs the merge's own
placement (formats/hf_names.py) cuts into per-expert pairs on the tensors ``save_pretrained`` writes, or
keeps on a packed on-disk tensor (GraniteMoE's input_linear), cut here per expert. An expert without a
LoRA gets zeros; experts of other ranks are padded with zero rows to the largest (exact: the padding adds
nothing, and each lora_b carries its own scale). A router's LoRA (``gate.weight``) is an ordinary pair on
``ffn_gate_inp``. Where the base scales each expert's output (Gemma 4's per_expert_scale, ``ffn_down_exps.scale``),
llama.cpp scales only the base's product: lora_b of expert e carries scale[e] (_expert_scales).

A base released quantized (GPT-OSS's MXFP4 experts, FP8 releases) is planned from the names and shapes
transformers' dequantizing load gives it (formats/dequant.py), the model the adapter was trained on; the LoRA
reads no base weight (but Gemma 4's expert scales).

A base tensor the converter derives by moving the HF tensor's entries (Qwen3.5's value heads tiled,
Qwen3-Next's in_proj_qkvz regrouped into attn_qkv and attn_gate, GPT-OSS's packed experts transposed with
gate_up split into gate and up) gets its LoRA moved alike: lora_b's rows and lora_a's columns, swapped and
transposed for a transposed tensor (_gather: what convert_lora_to_gguf.py does by running the base's
modify_tensors on lora_A / lora_B). GPT-OSS's experts may be MXFP4 in the base GGUF (llama.cpp's own files)
or 16-bit (ours): llama.cpp adds the LoRA's product to theirs either way.

Refused in one sentence: a LoRA on a tensor llama.cpp computes from the HF one (DeepSeek's MLA k_b/v_b),
DoRA, LoRA on embeddings, modules_to_save (whole trained copies: a GGUF adapter has no place for them;
merge instead), and a LoRA on a tensor llama.cpp's graph multiplies without its adapters (NOT_APPLIED).

Where peft's scale is not llama.cpp's alpha / r (rsLoRA's alpha / sqrt(r), alpha_pattern), lora_b is
multiplied by their ratio, so llama.cpp computes peft's delta; the file's alpha stays lora_alpha.

``record_lora_gguf`` puts the file and its check (gguf_check.check_lora_gguf: llama.cpp with the base's
GGUF and this file against peft on the base) into the base folder's merge_manifest.json (``gguf_lora``)
and its model card, where the folder has one; else (a Hub download) into ``<lora>.json`` beside the file.
"""

from __future__ import annotations

import hashlib
import math
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
    "gemma4": ("per_layer_model_proj",),  # measured: llama.cpp's logits with the LoRA equal the base's alone
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
    experts: int = 0  # of the pairs, stacked expert tensors (lora_a [experts, r, in])
    adapter: Path | None = None  # the adapter folder it was made of


@dataclass
class _Pair:
    """One base tensor's LoRA: ``parts`` [(LoraModule, kind)] per expert (one part for a plain tensor;
    None where an expert has no LoRA); kind: None (the module's own pair), or (packed entry's expert
    index, experts) for a packed on-disk tensor's LoRA cut per expert."""

    name: str  # the base tensor's GGUF name, ending in .weight
    tensor: object  # gguf.GgufTensor
    parts: list
    gather: tuple | None = None  # a derived tensor that is the source's entries moved: _gather's (rows, cols, transposed)
    expert_scale: object = None  # the base's per-expert output scale of a stacked tensor (torch [experts]), see _expert_scales


def default_lora_out(adapter_folder: Path) -> Path:
    """ADAPTER/<adapter folder name>-LoRA-F32.gguf, beside the adapter it is made of."""
    folder = Path(adapter_folder).expanduser().absolute()
    return folder / f"{folder.name}-LoRA-F32.gguf"


def export_lora_gguf(base_folder: Path, adapter_folder: Path, out: Path | None = None,
                     overwrite: bool = False) -> LoraGgufResult:
    """Write the adapter as a GGUF LoRA for the base's GGUF (temporary name, renamed when complete)."""
    import gguf
    import numpy as np

    from tui_merger.core.formats.adapter import open_adapter
    from tui_merger.core.ship import gguf as ship_gguf
    from tui_merger.core.ship import gguf_families

    started = time.perf_counter()
    base_folder = Path(base_folder).expanduser().absolute()
    adapter_folder = Path(adapter_folder).expanduser().absolute()
    if not (adapter_folder / "adapter_config.json").is_file():
        raise MergeError(f"{adapter_folder} has no adapter_config.json; --adapter takes a peft LoRA adapter folder.")
    target = _target(adapter_folder, out, overwrite)
    # a LoRA needs the base's names and shapes only: a base released quantized (GPT-OSS's MXFP4 experts) is
    # read as transformers' dequantizing load names and shapes it, the one the adapter was trained on
    config = ship_gguf._read_config(base_folder, quantized_ok=True)
    scheme = _scheme(config)
    family = gguf_families.FAMILIES[config["model_type"]]
    notices: list[str] = []
    closers: list = []
    with ship_gguf._quiet_library_logs():
        hp = ship_gguf._hyperparameters(base_folder, config, family, notices)
        source = ship_gguf._open_source(base_folder)
        if scheme is not None:
            source = _DequantNames(source, scheme, config)
        try:
            planned = ship_gguf._plan_tensors(base_folder, source, config, hp, family, "f16", notices)
            scales = _expert_scales(planned)
            adapter = open_adapter(adapter_folder)
            closers.append(adapter)
            adapter = _on_disk(adapter, source, base_folder, closers)
        except BaseException:
            for c in closers:
                c.close()
            raise
        finally:
            source.close()
    try:
        pairs = _pairs(adapter, planned, hp, base_folder)
        for pair in pairs:
            pair.expert_scale = scales.get(pair.name)
        for pair in pairs:
            part = pair.name.split(".")[2] if pair.name.startswith("blk.") else pair.name.removesuffix(".weight")
            if part in NOT_APPLIED.get(family.arch, ()):
                module = next(p[0].module for p in pair.parts if p is not None)
                raise MergeError(
                    f"llama.cpp's {family.arch} graph does not apply a LoRA to {part} (the adapter's {module}), "
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
        ranks = set()
        for pair in pairs:  # the infos first, from shapes alone; the data then one pair at a time (memory: one pair)
            for suffix, shape in zip((".lora_a", ".lora_b"), _shapes(pair)):
                writer.add_tensor_info(pair.name + suffix, shape, np.dtype(np.float32), 4 * math.prod(shape))
            ranks.add(_shapes(pair)[0][-2])
        rescaled = experts = 0
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for pair in pairs:
                a, b, scaled = _factors(pair, alpha)
                rescaled += scaled
                experts += a.dim() == 3
                writer.write_tensor_data(a.contiguous().numpy())
                writer.write_tensor_data(b.contiguous().numpy())
                del a, b
            writer.close()
            os.replace(tmp, target)
        except BaseException:
            writer.close()
            tmp.unlink(missing_ok=True)
            raise
    finally:
        for c in closers:
            c.close()
    digest = hashlib.sha256()
    with open(target, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return LoraGgufResult(target, family.arch, alpha, tuple(sorted(ranks)), len(pairs), rescaled,
                          target.stat().st_size, digest.hexdigest(), time.perf_counter() - started, experts, adapter_folder)


class _DequantNames:
    """A quantized base's tensors as its dequantized parameters (formats/dequant.DequantSource: GPT-OSS's
    ``gate_up_proj`` for ``gate_up_proj_blocks`` + ``_scales``), each named as that parameter: what the LoRA's
    plan reads (names, shapes); no weight of the base is read."""

    def __init__(self, source, scheme, config: dict):
        import dataclasses

        from tui_merger.core.formats.dequant import DequantSource

        view = DequantSource(source, scheme, config)
        self.tensors = {name: dataclasses.replace(ref, name=name) for name, ref in view.tensors.items()}
        self.files = source.files
        self.close = source.close


def quantization_of(base_folder: Path) -> str | None:
    """The quant_method of a base released quantized ("mxfp4", "fp8"...), None for a 16-bit one: its LoRA is
    written, its GGUF is llama.cpp's to make."""
    import json

    try:
        q = json.loads((Path(base_folder) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None  # the export says what is wrong with the folder
    return (q.get("quant_method") or "quantized") if isinstance(q, dict) and q else ("quantized" if q else None)


def _scheme(config: dict):
    """The released-quantized format of the base (formats/dequant.py), None for a 16-bit one; one sentence for
    weights saved quantized in a way that cannot be read as the adapter's base (bitsandbytes, GPTQ, AWQ)."""
    from tui_merger.core.formats.dequant import scheme_of

    if not config.get("quantization_config"):
        return None
    scheme = scheme_of(config)
    if scheme is None:
        q = config["quantization_config"]
        method = q.get("quant_method", "quantized") if isinstance(q, dict) else "quantized"
        raise MergeError(f"The base holds {method} weights, which tui-merger does not read as a model's weights; "
                         "give the 16-bit base the adapter was trained on.")
    return scheme


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


def _on_disk(adapter, source, base_folder: Path, closers: list):
    """The adapter under the base's on-disk names, its target_parameters pairs placed as the merge places
    them (per-expert pairs on the tensors save_pretrained writes; packed on-disk experts in expert_lora)."""
    from tui_merger.core.formats.inputs import _on_disk_names

    return _on_disk_names(adapter, source, base_folder, closers)


def _pairs(adapter, planned: list, hp: dict, base_folder: Path) -> list[_Pair]:
    """The base tensors the adapter changes, in the base GGUF's order, or one sentence why not."""
    folder = adapter.folder
    if adapter.use_dora:
        raise MergeError(f"{folder} is a DoRA adapter; a GGUF LoRA has no magnitude vector, so llama.cpp cannot run it: merge it instead.")
    kept = sorted(adapter.replacements) + sorted(adapter.token_rows)
    if kept:
        raise MergeError(
            f"{folder} also saves whole trained modules ({kept[0]}...: modules_to_save or new token rows), which a "
            "GGUF LoRA cannot carry; merge the adapter and export the merged folder instead."
        )
    if adapter.param_lora:  # placement left some (the base could not say where they lie)
        name = next(iter(adapter.param_lora))
        raise MergeError(f"{folder} has a LoRA on parameters ({name}) whose place in {base_folder.name} is unknown; merge it instead.")
    if adapter.fan_in_fan_out:
        raise MergeError(f"{folder} stores its LoRA as fan_in_fan_out (Conv1D layers), which no family tui-merger writes as GGUF has.")
    for module, entry in sorted(adapter.lora.items()):
        if entry.is_embedding:
            raise MergeError(f"{folder} has a LoRA on the embedding {module}; tui-merger writes GGUF LoRAs of linear layers only: merge it instead.")
        if entry.B_bias is not None:
            raise MergeError(f"{folder} trains a bias with its LoRA ({module}); a GGUF LoRA has no place for it: merge it instead.")
    used: set[str] = set()
    out = []
    gathers: dict = {}  # one per kind of tensor and shape: every layer's transform is the same (1-2 s at 80B sizes)
    for t in planned:
        parts = []
        for ref in t.sources:
            module = ref.name.removesuffix(".weight")
            entry = adapter.lora.get(module) if ref.name.endswith(".weight") else None
            packed = adapter.expert_lora.get(ref.name)
            if entry is not None:
                used.add(module)
                parts.append((entry, None))
            elif packed is not None:
                used.add(ref.name)
                parts.extend((packed, (e, packed.experts)) for e in range(packed.experts))
            else:
                parts.append(None)
        if all(p is None for p in parts):
            continue
        what = next(p[0].module for p in parts if p is not None)
        gather = None
        if t.derive is not None and t.computed is None:
            kind = (t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name, tuple(t.sources[0].shape), tuple(t.shape))
            gather = gathers[kind] if kind in gathers else gathers.setdefault(kind, _gather(t))
        if gather is None and (t.derive is not None or t.computed is not None):
            raise MergeError(
                f"{folder} has a LoRA on {what}, which llama.cpp's layout stores as {t.name} computed from it "
                "(a derived tensor, not a cut or a stack of it); a GGUF LoRA of it is not written: merge it instead."
            )
        stacked = len(parts) > 1
        if len(t.shape) != (3 if stacked else 2) or (stacked and len(parts) != t.shape[0]):
            raise MergeError(
                f"{folder} has a LoRA on {what}, which llama.cpp's layout stores as {t.name} of shape {list(t.shape)}; "
                "a GGUF LoRA of it is not written: merge it instead."
            )
        want = tuple(t.sources[0].shape[-2:])  # one matrix of the base: an expert's, or the whole packed one's rows
        for p in parts:
            if p is not None and _delta_shape(*p) != want:
                have = _delta_shape(*p)
                raise MergeError(
                    f"{p[0].module}: the LoRA is {have[0]}x{have[1]} but {base_folder.name}'s weight is "
                    f"{list(want)}; is this adapter for another model?"
                )
        out.append(_Pair(t.name.removesuffix(".weight") + ".weight", t, parts, gather))
    left = sorted(set(adapter.lora) - used) + sorted(set(adapter.expert_lora) - used)
    if left:
        module = left[0]
        if module.endswith("lm_head") and hp["tie_word_embeddings"]:
            raise MergeError(
                f"{folder} has a LoRA on lm_head, which {base_folder.name} ties to its embedding; llama.cpp "
                "ignores such a LoRA, so merge the adapter instead."
            )
        raise MergeError(f"{folder} has a LoRA on {module}, which {base_folder} has no weight of; is this adapter for another model?")
    if not out:
        raise MergeError(f"{folder} holds no LoRA pair; there is nothing to write.")
    return out


def _expert_scales(planned: list) -> dict:
    """{stacked expert tensor's GGUF name: the base's per-expert scale of its output} (Gemma 4's
    router.per_expert_scale as ffn_down_exps.scale), read from the base. llama.cpp multiplies the base
    product by it and then adds the LoRA's (build_lora_mm_id), where the model scales the expert's whole
    output: so lora_b of expert e carries scale[e]."""
    import torch

    out = {}
    for t in planned:
        if t.name.endswith("_exps.scale") and len(t.sources) == 1:
            w = t.sources[0].load()
            out[t.name.removesuffix(".scale") + ".weight"] = (t.derive(w) if t.derive is not None else w).to(torch.float32).reshape(-1)
    return out


def _gather(t):
    """Where a derived base tensor (GgufTensor.derive) takes each entry from, when it only moves the source's
    entries: ``(rows, cols, transposed)`` such that one matrix of it is ``W[rows][:, cols]`` (``.T`` when
    transposed) of the source's matrix W, per expert alike; None when it computes anything else (DeepSeek's
    k_b / v_b, ``-exp(A_log)``). Then its LoRA is B's rows and A's columns moved (swapped and transposed for
    a transposed tensor), what convert_lora_to_gguf.py does by running the base's transform on lora_A / lora_B:
    Qwen3.5's value heads tiled (rows of in_proj_qkv / z / a / b, columns of out_proj), Qwen3-Next's
    in_proj_qkvz regrouped into attn_qkv and attn_gate, GPT-OSS's packed experts transposed and gate_up split.

    Found by running the transform itself on two index tensors of the source's shape (one expert's matrix for
    stacked experts; int32, views where the transform allows): one holding each entry's row, one its column.
    An entry taken from one place reads there in both, and a transform that only moves entries gives rows
    that depend on one axis of the result and columns on the other. Then confirmed: on a random matrix the
    transform gives exactly that gather of it (a transform that scales or combines entries does not)."""
    import torch

    shape = tuple(t.sources[0].shape)
    if len(shape) not in (2, 3) or len(t.shape) != len(shape) or len(t.sources) != 1:
        return None
    lead = (1,) if len(shape) == 3 else ()
    n_rows, n_cols = shape[-2:]
    probes = [torch.arange(n_rows, dtype=torch.int32).reshape(*lead, n_rows, 1).expand(*lead, n_rows, n_cols),
              torch.arange(n_cols, dtype=torch.int32).reshape(*lead, 1, n_cols).expand(*lead, n_rows, n_cols)]
    try:
        got = [t.derive(p) for p in probes]
    except Exception:  # noqa: BLE001 - a transform that is not a gather of a matrix (its shapes, its dtype)
        return None
    want = (*lead, *t.shape[-2:])
    if any(not isinstance(g, torch.Tensor) or g.dtype != torch.int32 or tuple(g.shape) != want for g in got):
        return None
    r, c = (g.reshape(t.shape[-2:]) for g in got)
    if bool((r == r[:, :1]).all()) and bool((c == c[:1]).all()):
        found = r[:, 0].long(), c[0].long(), False
    elif bool((r == r[:1]).all()) and bool((c == c[:, :1]).all()):  # rows of the result from the source's columns
        found = r[0].long(), c[:, 0].long(), True
    else:
        return None
    rows, cols, transposed = found
    if not (0 <= int(rows.min()) and int(rows.max()) < n_rows and 0 <= int(cols.min()) and int(cols.max()) < n_cols):
        return None  # e.g. a scaled tensor (w * 2): not where entries come from
    x = torch.randn(*lead, n_rows, n_cols, generator=torch.Generator().manual_seed(0))  # and it is that gather
    moved = x.reshape(n_rows, n_cols)[rows][:, cols]
    try:
        ok = torch.equal(t.derive(x).reshape(t.shape[-2:]), moved.T if transposed else moved)
    except Exception:  # noqa: BLE001 - as above
        return None
    return found if ok else None


def _delta_shape(entry, cut) -> tuple[int, int]:
    """(rows, columns) of the weight a part's delta is added to (one expert's matrix for a packed cut)."""
    if cut is None:
        return entry.B.shape[0], entry.A.shape[1]
    if entry.transposed:  # delta_e = (B_e @ A_e).T: A reads the rows
        return entry.A.shape[1], entry.B.shape[0]
    return entry.B.shape[0], entry.A.shape[1]


def _shapes(pair: _Pair) -> tuple[tuple, tuple]:
    """The numpy shapes of lora_a and lora_b, from the pair's ranks and its base tensor's shape."""
    t = pair.tensor
    r = max((entry.r if cut is not None else entry.A.shape[0]) for entry, cut in (p for p in pair.parts if p is not None))
    lead = (len(pair.parts),) if len(pair.parts) > 1 else ()
    return (*lead, r, t.shape[-1]), (*lead, t.shape[-2], r)


def _expert_pair(entry, cut, loaded: dict):
    """lora_A [r, in] and lora_B [out, r] (float32) of one part: the module's own pair, or expert e's of
    a packed pair (A_e: rows e*r.. of lora_A; B_e: every experts-th column of lora_B from e; transposed
    layout: the delta is (B_e @ A_e).T, so A_e.T writes and B_e.T reads), as formats/hf_names.py cuts them."""
    import torch

    key = id(entry)
    if key not in loaded:
        loaded[key] = (entry.A.load().to(torch.float32), entry.B.load().to(torch.float32))
    a, b = loaded[key]
    if cut is None:
        return a, b
    e, experts = cut
    r = entry.r
    a_e, b_e = a[e * r:(e + 1) * r], b[:, e::experts]
    if entry.transposed:
        return b_e.T, a_e.T
    return a_e, b_e


def _factors(pair: _Pair, alpha: float):
    """lora_a and lora_b as float32 (stacked per expert: [experts, r, in], [experts, out, r]), lora_b's rows
    as the base tensor's in the GGUF and scaled so that llama.cpp's alpha / r gives peft's scale; and
    whether any was rescaled."""
    import torch

    t = pair.tensor
    loaded: dict = {}
    pieces = []
    for p in pair.parts:
        if p is None:
            pieces.append(None)
            continue
        entry, cut = p
        a, b = _expert_pair(entry, cut, loaded)
        if pair.gather is not None:  # the base's rows and columns moved (and perhaps transposed): A's columns, B's rows
            rows, cols, transposed = pair.gather
            a, b = (b[rows].T, a[:, cols].T) if transposed else (a[:, cols], b[rows])
        if t.rows is not None:  # a part of a packed tensor: its rows
            b = b[t.rows[0]:t.rows[1]]
        if t.permute_heads:  # the converter permutes lora_b's rows as it permutes the base tensor's
            n = t.permute_heads
            b = b.reshape(n, 2, b.shape[0] // n // 2, b.shape[1]).transpose(1, 2).reshape(b.shape)
        pieces.append((a, b, entry.scale))
    r = max(p[0].shape[0] for p in pieces if p is not None)
    rows = t.shape[-2]
    cols = t.shape[-1]
    a_out = torch.zeros((len(pieces), r, cols), dtype=torch.float32)
    b_out = torch.zeros((len(pieces), rows, r), dtype=torch.float32)
    scaled = False
    for i, p in enumerate(pieces):
        if p is None:
            continue  # an expert without a LoRA: zeros add nothing
        a, b, scale = p
        ratio = scale / (alpha / r)
        if abs(ratio - 1.0) > 1e-12:
            b = b * ratio
            scaled = True
        a_out[i, : a.shape[0]] = a
        b_out[i, :, : b.shape[1]] = b
    if pair.expert_scale is not None:  # llama.cpp scales the base's product only: the LoRA's carries it too
        b_out *= pair.expert_scale.reshape(-1, 1, 1)
    if len(pieces) == 1 and t.sources and len(t.shape) == 2:
        return a_out[0], b_out[0], scaled
    return a_out, b_out, scaled


LORA_RECORD_FORMAT = "tui-merger-gguf-lora/1"


def lora_record_path(lora_path: Path) -> Path:
    """The JSON record beside a GGUF LoRA whose base folder has no manifest: x-LoRA-F32.gguf -> x-LoRA-F32.json."""
    return Path(lora_path).with_suffix(".json")


def _lora_entry(result: LoraGgufResult, base_gguf: Path, check, modelfile: Path | None, shown) -> dict:
    from tui_merger import __version__
    from tui_merger.core.record.manifest import now_iso

    entry = {
        "path": shown(result.path),
        "size": result.size,
        "sha256": result.sha256,
        "type": "f32",
        "architecture": result.arch,
        "adapter": str(result.adapter) if result.adapter is not None else None,
        "base_gguf": shown(base_gguf),
        "pairs": result.pairs,
        "experts": result.experts,
        "ranks": list(result.ranks),
        "alpha": result.alpha,
        "made_at": now_iso(),
        "tool": {"name": "tui-merger", "version": __version__},
        "check": check.record(),
    }
    if modelfile is not None:
        entry["modelfile"] = shown(modelfile)
    return entry


def write_lora_record(base_folder: Path, result: LoraGgufResult, base_gguf: Path, check, modelfile: Path | None = None,
                      why: str = "no merge_manifest.json") -> Path:
    """The LoRA's record as a small JSON beside it (lora_record_path): the manifest entry's fields (paths beside
    it by name, others absolute), the base folder, and why it is not in the base's manifest; written atomically,
    replacing the record of an earlier file at that path."""
    import json

    target = lora_record_path(result.path)
    here = target.parent

    def shown(path) -> str:
        path = Path(path).absolute()
        return path.name if path.parent == here else str(path)

    record = {"format": LORA_RECORD_FORMAT, **_lora_entry(result, base_gguf, check, modelfile, shown),
              "base": str(Path(base_folder).absolute()), "not_in_manifest": why}
    tmp = here / f".{target.name}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def record_lora_gguf(base_folder: Path, result: LoraGgufResult, base_gguf: Path, check, modelfile: Path | None = None) -> bool:
    """Add (or replace) the LoRA's entry, with its check (gguf_check.GgufCheck), in ``gguf_lora`` of the base
    folder's merge_manifest.json, and the model card when tui-merger wrote it: True. A base folder without a
    manifest (a Hub download, a folder tui-merger did not make) is not written to: the record goes to a JSON
    beside the LoRA (write_lora_record, at lora_record_path(result.path)) and the answer is False."""
    from tui_merger.core.record.card import is_ours, write_model_card
    from tui_merger.core.record.manifest import read_manifest, write_manifest

    folder = Path(base_folder).absolute()
    manifest = read_manifest(folder)
    if manifest is None:
        write_lora_record(folder, result, base_gguf, check, modelfile)
        return False

    def shown(path) -> str:
        path = Path(path).absolute()
        return path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)

    entry = _lora_entry(result, base_gguf, check, modelfile, shown)
    entries = manifest.get("gguf_lora") if isinstance(manifest.get("gguf_lora"), list) else []
    entries = [e for e in entries if isinstance(e, dict) and e.get("path") != entry["path"]]
    manifest["gguf_lora"] = entries + [entry]
    write_manifest(folder, manifest)
    card = folder / "README.md"
    if not card.exists() or is_ours(card):
        write_model_card(folder, manifest, overwrite=False)
    return True
