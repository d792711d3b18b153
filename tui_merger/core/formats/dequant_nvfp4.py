"""NVFP4 bases (NVIDIA ModelOpt releases, ``quant_method: modelopt``, ``quant_algo: NVFP4``; compressed-tensors'
``nvfp4-pack-quantized``): 4-bit floats (e2m1) two a byte, the even-indexed value in the low nibble, one
float8_e4m3fn scale per 16 values along the input dimension, and one fp32 global scale per weight.

transformers 5.25 cannot load either pre-quantized (its NVFP4Config quantizes 16-bit weights on a GPU), so
the dequantized values a transformers + peft user can train on are compressed-tensors': its
``NVFP4PackedCompressor.decompress`` (what ``CompressedTensorsConfig(run_compressed=False)`` runs), a
ModelOpt checkpoint first through compressed-tensors' own ``ModelOptNvfp4Converter``. Those values are
followed bit for bit:

- compressed-tensors: ``W.weight_packed`` uint8 [rows, cols/2], ``W.weight_scale`` e4m3 [rows, cols/16],
  ``W.weight_global_scale`` fp32 [1], ``W.input_global_scale`` (activations: dropped). Each value is
  ``fp32(code) * (fp32(weight_scale) / weight_global_scale)``, rounded to bfloat16 (the decompressor's
  dtype), then cast to the model's dtype. torch's type promotion decides that fp32: with a 0-dim global
  scale the block scale and the product are computed in bfloat16 instead.
- ModelOpt: ``W.weight`` uint8, ``W.weight_scale`` e4m3, ``W.weight_scale_2`` fp32 (a scalar),
  ``W.input_scale`` (dropped). The converter's global scale is ``1 / weight_scale_2``, a 0-dim fp32 tensor,
  so the block scale ``bf16(weight_scale) / global`` and the product are bfloat16.
  ModelOpt's own ``NVFP4QTensor.dequantize`` multiplies by ``weight_scale_2`` instead, which differs in the
  last bfloat16 bits of some values.

No torch at import time.
"""

from __future__ import annotations

from tui_merger.core.errors import MergeError

GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MODELOPT, CT = "modelopt", "compressed-tensors"
# (values, block scale, global scale, dropped activation scales) per flavour
NAMES = {MODELOPT: ("weight", "weight_scale", "weight_scale_2", ("input_scale",)),
         CT: ("weight_packed", "weight_scale", "weight_global_scale", ("input_global_scale", "input_scale"))}


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def modelopt_fields(q: dict) -> dict | None:
    """Scheme fields of a ModelOpt ``quantization_config`` with quant_algo NVFP4 (None: another algorithm)."""
    inner = q.get("quantization") if isinstance(q.get("quantization"), dict) else q
    algo = str(inner.get("quant_algo") or "").upper()
    if algo != "NVFP4":
        return None
    group = inner.get("group_size")
    groups = q.get("config_groups")
    if group is None and isinstance(groups, dict):
        for g in groups.values():
            if isinstance(g, dict) and isinstance(g.get("weights"), dict):
                group = g["weights"].get("group_size", group)
    if group not in (None, GROUP):
        raise MergeError(
            f"The base's quantization_config says NVFP4 with group_size {group!r}; NVFP4 has one scale per 16 values. "
            "Nothing was written.")
    skip = inner.get("exclude_modules") or q.get("ignore") or ()
    return dict(method="nvfp4", scale_suffix="weight_scale", fp8_dtype="uint8", block=(1, GROUP), strategy=MODELOPT,
                ignored=tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else ())


def compressed_fields(q: dict, weights: dict) -> dict:
    """Scheme fields of compressed-tensors' nvfp4-pack-quantized (``weights``: one group's weights args)."""
    if weights.get("type") != "float" or weights.get("num_bits") != 4 or weights.get("group_size") != GROUP \
            or weights.get("symmetric") is False:
        raise MergeError(
            f"The base's compressed-tensors config says nvfp4-pack-quantized with weights {weights!r}; NVFP4 is "
            "symmetric 4-bit floats with group_size 16. Nothing was written.")
    skip = q.get("ignore") or ()
    return dict(method="nvfp4", scale_suffix="weight_scale", fp8_dtype="uint8", block=(1, GROUP), strategy=CT,
                ignored=tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else ())


def label(scheme) -> str:
    who = "ModelOpt" if scheme.strategy == MODELOPT else "compressed-tensors"
    return f"NVFP4 (e2m1, e4m3 scale per 16 values, fp32 global scale; {who})"


def loader(scheme) -> str:
    if scheme.strategy == CT:
        return "CompressedTensorsConfig(run_compressed=False)"
    return "compressed-tensors' ModelOptNvfp4Converter, then CompressedTensorsConfig(run_compressed=False)"


def parts(tensors: dict, scheme) -> tuple[dict, list[str]]:
    """{dequantized weight name: (values name, scale name, global scale name)} and the activation scales to
    drop, checked from the headers: one sentence naming the tensor for the first thing that does not fit."""
    values, scale_key, global_key, acts = NAMES[scheme.strategy]
    found, drop = {}, []
    for name, ref in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf in acts:
            drop.append(name)
            continue
        if leaf == global_key and f"{module}.{values}" not in tensors:
            raise MergeError(f"The base has the NVFP4 global scale {name} but no {module}.{values} beside it; the "
                             "checkpoint is incomplete. Nothing was written.")
        if leaf != values or (scheme.strategy == MODELOPT and ref.dtype != "uint8"):
            continue  # ModelOpt keeps unquantized weights (embeddings, lm_head, norms) under .weight in 16 bits
        scale, glob = tensors.get(f"{module}.{scale_key}"), tensors.get(f"{module}.{global_key}")
        if ref.dtype != "uint8" or len(ref.shape) not in (2, 3):
            raise MergeError(f"{name} is {ref.dtype} {_shape(ref.shape)}; NVFP4 values are uint8 [rows, columns/2] "
                             "(two 4-bit floats a byte), or [experts, rows, columns/2] for experts stacked in one "
                             "tensor. Nothing was written.")
        if scale is None or glob is None:
            missing = f"{module}.{scale_key}" if scale is None else f"{module}.{global_key}"
            raise MergeError(f"{name} holds NVFP4 values but there is no {missing} beside it, so they cannot be "
                             "recovered. Nothing was written.")
        lead, (rows, half) = tuple(ref.shape[:-2]), ref.shape[-2:]
        want = lead + (rows, half * 2 // GROUP)
        if scale.dtype != "float8_e4m3fn":
            raise MergeError(f"{module}.{scale_key} is stored in {scale.dtype}; NVFP4 scales are float8_e4m3fn "
                             "(one per 16 values). Nothing was written.")
        if (half * 2) % GROUP or tuple(scale.shape) != want:
            raise MergeError(f"{module}.{scale_key} has shape {_shape(scale.shape)} but {name} {_shape(ref.shape)} "
                             f"({rows}x{half * 2} values{' per expert' if lead else ''}) needs {_shape(want)} (one per "
                             "16 values). Nothing was written.")
        globals_ok = ((), (1,)) + ((lead, lead + (1,)) if lead else ())
        if glob.dtype != "float32" or tuple(glob.shape) not in globals_ok:
            each = f" (or one per expert, {_shape(lead)})" if lead else ""
            raise MergeError(f"{module}.{global_key} is {glob.dtype} {_shape(glob.shape)}; the NVFP4 global scale is "
                             f"one float32 value{each}. Nothing was written.")
        found[f"{module}.weight"] = (name, f"{module}.{scale_key}", f"{module}.{global_key}")
    for name, ref in tensors.items():
        if ref.dtype.startswith("float8") and name.rpartition(".")[2] == scale_key \
                and name.rpartition(".")[0] + ".weight" not in found:
            raise MergeError(f"The base has the NVFP4 scale {name} but no {name.rpartition('.')[0]}.{values} in "
                             "uint8 beside it; the checkpoint is incomplete. Nothing was written.")
    return found, drop


def expert_global(global_scale, scheme, e: int):
    """Expert ``e``'s global scale of experts stacked in one tensor, shaped as one expert's would be stored:
    ModelOpt's ``weight_scale_2`` a scalar (its converter makes it 0-dim), compressed-tensors' [1]; a single
    stored value serves every expert."""
    g = global_scale.reshape(-1)
    g = g[e if g.numel() > 1 else 0]
    return g.reshape(()) if scheme.strategy == MODELOPT else g.reshape(1)


def dequantize(packed, scale, global_scale, scheme, dtype):
    """Rows of one weight (``packed`` uint8 [r, cols/2], ``scale`` e4m3 [r, cols/16]) as compressed-tensors
    dequantizes them, in ``dtype``; experts stacked in one tensor ([experts, r, cols/2]) expert by expert,
    each with its own global scale."""
    import torch

    if packed.dim() == 3:
        return torch.stack([dequantize(packed[e], scale[e], expert_global(global_scale, scheme, e), scheme, dtype)
                            for e in range(packed.shape[0])])
    rows, half = packed.shape
    lut = torch.tensor(E2M1, dtype=torch.bfloat16)  # the decompressor unpacks to bfloat16 (exact)
    b = packed.to(torch.int64)
    codes = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).reshape(rows, half * 2 // GROUP, GROUP)
    g = global_scale.to(torch.float32)
    if scheme.strategy == MODELOPT:  # weight_scale_2 -> weight_global_scale, as the converter does
        g = 1 / g
    # torch's promotion decides the dtype, as in the decompressor: a global scale of shape [1] makes the block
    # scale fp32; a 0-dim one (ModelOpt's scalar, through the converter) leaves it in bfloat16
    block = scale.to(torch.bfloat16)[..., None] / g
    return (codes.to(block.dtype) * block).reshape(rows, half * 2).to(torch.bfloat16).to(dtype)
