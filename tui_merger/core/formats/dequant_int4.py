"""INT4 pack-quantized bases (compressed-tensors ``format: pack-quantized``, Kimi-K2-Thinking / K2.6's routed
experts): symmetric 4-bit integers, eight to an int32 (``W.weight_packed`` int32 [rows, ceil(cols/8)]; value i
of a row in bits 4i..4i+3 of its word, little-endian, stored as q + 8), ``W.weight_scale`` [rows, cols/group]
in the model's 16-bit dtype, ``W.weight_shape`` [rows, cols]. compressed-tensors'
``PackedQuantizationCompressor.decompress`` gives each value as ``q * scale`` computed in the scale's dtype;
that is followed exactly, then cast to the model's dtype.

No torch at import time.
"""

from __future__ import annotations

from tui_merger.core.errors import MergeError

SCALE_DTYPES = ("bfloat16", "float16", "float32")


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def fields(q: dict, weights: dict) -> dict:
    """Scheme fields of pack-quantized (``weights``: one group's weights args): 4-bit symmetric integers, one
    scale per group (or per output row)."""
    strategy = str(weights.get("strategy") or "group")
    group = weights.get("group_size")
    ok = (weights.get("type") == "int" and weights.get("num_bits") == 4 and weights.get("symmetric") is not False
          and (strategy == "channel" or (strategy == "group" and isinstance(group, int) and group > 0)))
    if not ok:
        raise MergeError(
            f"The base's compressed-tensors config says pack-quantized with weights {weights!r}; tui-merger reads "
            "symmetric 4-bit integers with a scale per group or per output channel. Nothing was written.")
    skip = q.get("ignore") or ()
    return dict(method="int4", scale_suffix="weight_scale", fp8_dtype="int32",
                block=(1, int(group)) if strategy == "group" else None, strategy=strategy,
                ignored=tuple(str(s) for s in skip) if isinstance(skip, (list, tuple)) else ())


def label(scheme) -> str:
    per = f"a scale per {scheme.block[1]} values" if scheme.block else "a scale per output channel"
    return f"INT4 pack-quantized (symmetric 4-bit integers, 8 per int32, {per})"


def parts(tensors: dict, scheme) -> tuple[dict, list[str]]:
    """{dequantized weight name: (packed name, scale name, shape name)} and the activation scales to drop,
    checked from the headers (the sizes against weight_shape's values are checked by ``check_shape``)."""
    found = {}
    drop = [n for n in tensors if n.endswith((".input_scale", ".input_global_scale"))]
    for name, ref in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("weight_scale", "weight_shape") and f"{module}.weight_packed" not in tensors:
            raise MergeError(f"The base has {name} but no {module}.weight_packed beside it; the checkpoint is "
                             "incomplete. Nothing was written.")
        if leaf != "weight_packed":
            continue
        scale, shape = tensors.get(f"{module}.weight_scale"), tensors.get(f"{module}.weight_shape")
        if ref.dtype != "int32" or len(ref.shape) != 2:
            raise MergeError(f"{name} is {ref.dtype} {_shape(ref.shape)}; pack-quantized values are int32 "
                             "[rows, columns/8] (eight 4-bit integers a word). Nothing was written.")
        if scale is None or shape is None:
            missing = f"{module}.weight_scale" if scale is None else f"{module}.weight_shape"
            raise MergeError(f"{name} holds packed 4-bit values but there is no {missing} beside it, so they cannot "
                             "be recovered. Nothing was written.")
        if scale.dtype not in SCALE_DTYPES:
            raise MergeError(f"{module}.weight_scale is stored in {scale.dtype}; pack-quantized scales are "
                             "bfloat16, float16 or float32. Nothing was written.")
        if not shape.dtype.startswith(("int", "uint")) or tuple(shape.shape) != (2,):
            raise MergeError(f"{module}.weight_shape is {shape.dtype} {_shape(shape.shape)}; expected two integers "
                             "(the weight's rows and columns). Nothing was written.")
        found[f"{module}.weight"] = (name, f"{module}.weight_scale", f"{module}.weight_shape")
    return found, drop


def check_shape(name: str, packed, scale, shape: tuple[int, int], scheme) -> None:
    """``weight_shape``'s [rows, columns] against the packed words and the scales (headers)."""
    rows, cols = shape
    words = -(-cols // 8)
    if rows <= 0 or cols <= 0 or tuple(packed.shape) != (rows, words):
        raise MergeError(f"{name} has shape {_shape(packed.shape)} but its weight_shape says {rows}x{cols} values, "
                         f"which pack into {_shape((rows, words))} int32 words. Nothing was written.")
    module = name.rpartition(".")[0]
    if scheme.block is not None:
        if cols % scheme.block[1]:
            raise MergeError(f"{module} has {cols} columns, not a whole number of groups of {scheme.block[1]} (the "
                             "config's group_size). Nothing was written.")
        want = (rows, cols // scheme.block[1])
        how = f"one per {scheme.block[1]} values"
    else:
        want, how = (rows, 1), "one per output row"
    if tuple(scale.shape) != want:
        raise MergeError(f"{module}.weight_scale has shape {_shape(scale.shape)} but {name} ({rows}x{cols} values) "
                         f"needs {_shape(want)} ({how}). Nothing was written.")


def dequantize(packed, scale, cols: int, scheme, dtype):
    """Rows of one weight (``packed`` int32 [r, words], ``scale`` [r, groups]) as compressed-tensors'
    decompressor gives them, in ``dtype``."""
    import torch

    rows = packed.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((packed.to(torch.int32)[..., None] >> shifts) & 0xF).reshape(rows, -1)[:, :cols] - 8
    work = scale.dtype
    if scheme.block is not None:
        g = scheme.block[1]
        values = q.to(work).reshape(rows, cols // g, g) * scale[..., None]
    else:
        values = q.to(work) * scale.reshape(rows, 1)
    return values.reshape(rows, cols).to(dtype)
