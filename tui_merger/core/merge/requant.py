"""Outputs written quantized: the base's own FP8-block format (``--keep-quantization``: tensors the adapter
does not touch are copied byte for byte with their scales, changed ones quantized again the same way)
and FP8 blocks for serving from any merge (``--quantize fp8``: every Linear weight of the decoder layers
in 128x128 blocks, weight-only; embeddings, lm_head, norms and routers stay 16-bit).

``output_plan`` is ``build_plan`` plus that rewrite, so the engine, the recompute and the dry run see the
same output tensors. A re-quantized weight is two output tensors (the e4m3 values and the fp32
``weight_scale_inv``) read from ``RequantSource``, which computes the merged 16-bit weight once (as the
16-bit output would hold it) and quantizes it as transformers' Fp8Quantize does.
"""

from __future__ import annotations

import re

from tui_merger.core.errors import MergeError
from tui_merger.core.plan.plan import OutputTensor, TensorPlan, build_plan, shard_tensors

KEEP = "keep"
FP8 = "fp8"
CHOICES = (KEEP, FP8)
# Linear weights of the decoder layers; not routers (mlp.gate, mlp.router), norms or embeddings
_QUANTIZABLE = re.compile(r"\.layers\.\d+\..*\.weight$")
_NOT_LINEAR = re.compile(r"(?:norm[^.]*|\.gate|\.router|embed[^.]*|lm_head|\.score|\.shared_expert_gate)\.weight$")


def output_plan(base, adapter, config: dict, dtype, shard_size: int) -> TensorPlan:
    """The tensor plan, with the quantized output the base source was opened for (none: build_plan's)."""
    plan = build_plan(base, adapter, config, dtype, shard_size)
    mode = getattr(base, "output_quantization", None)
    if mode is None:
        return plan
    if mode == KEEP:
        tensors, changes = _keep(plan, base)
    else:
        tensors, changes = _fp8(plan, base)
    return TensorPlan(tensors, shard_tensors(tensors, shard_size), {**plan.config_changes, **changes},
                      plan.merged_modules)


def _keep(plan, base):
    """The base's own FP8 blocks: untouched weights and their scales as stored, changed ones again."""
    if getattr(base, "scheme", None) is not None and base.scheme.method == "mxfp4":  # GPT-OSS's experts
        from tui_merger.core.merge.requant_mxfp4 import keep_mxfp4

        return keep_mxfp4(plan, base)
    if getattr(base, "scheme", None) is None or base.scheme.method != "fp8" or base.scheme.block is None:
        label = base.scheme.label if getattr(base, "scheme", None) is not None else "not quantized"
        raise MergeError(
            f"--keep-quantization writes FP8 blocks (quant_method fp8 with weight_block_size) again; the base is "
            f"{label}. Leave it out for a 16-bit output. Nothing was written."
        )
    requant = RequantSource(base.scheme.block)
    out = []
    for t in plan.tensors:
        pair = base.pair(t.source) if t.source.source is base else None
        if pair is None:
            out.append(t)
        elif not t.ops:  # as stored: the e4m3 bytes and their scales
            w, s = pair
            out.append(OutputTensor(t.name, w, w.dtype, tuple(w.shape)))
            out.append(OutputTensor(_scale_name(t.name), s, s.dtype, tuple(s.shape)))
        else:
            out += requant.add(t)
    for name in base.dropped:  # activation scales (a static scheme): kept with the model
        ref = base.inner.tensors[name]
        out.append(OutputTensor(name, ref, ref.dtype, tuple(ref.shape)))
    return out, {"quantization_config": base.quantization_config}


def _fp8(plan, base):
    """Every Linear weight of the decoder layers whose rows and columns are whole 128x128 blocks."""
    from tui_merger.core.formats.dequant import FP8_BLOCK_CONFIG

    if getattr(base, "scheme", None) is not None:
        raise MergeError(
            f"--quantize fp8 quantizes a 16-bit merge; the base is already {base.scheme.label}: use "
            "--keep-quantization to write its own format again. Nothing was written."
        )
    requant = RequantSource((128, 128))
    out, skipped = [], []
    for t in plan.tensors:
        linear = (len(t.shape) == 2 and t.dtype in ("bfloat16", "float16", "float32") and _QUANTIZABLE.search(t.name)
                  and not _NOT_LINEAR.search(t.name))
        if linear and t.shape[0] % 128 == 0 and t.shape[1] % 128 == 0:
            out += requant.add(t)
            continue
        if linear:
            skipped.append(t.name[: -len(".weight")])
        out.append(t)
    if not requant.weights:
        raise MergeError("--quantize fp8 found no Linear weight of whole 128x128 blocks in the decoder layers to "
                         "quantize. Nothing was written.")
    config = {**FP8_BLOCK_CONFIG, "modules_to_not_convert": ["lm_head", *skipped]}
    return out, {"quantization_config": config}


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + "weight_scale_inv"


class RequantSource:
    """The e4m3 values and scales of re-quantized weights: the merged 16-bit weight is computed and
    quantized in 128x128 blocks for each of the two (within a shard the fp32 scales are written before
    the one-byte values, so caching one for the other would hold a shard's worth; the merge is
    deterministic, so both come from the same values). Stateless: the recompute's threads share it."""

    computes = True  # its tensors are not copies although their dtype is the output's (behaviour.rounded_by_depth)

    def __init__(self, block) -> None:
        self.block = tuple(block)
        self.weights = {}  # output name (values or scale) -> the 16-bit OutputTensor it quantizes

    def add(self, t) -> list:
        from tui_merger.core.io.sources import TensorRef

        rows, cols = t.shape
        grid = (-(-rows // self.block[0]), -(-cols // self.block[1]))
        w = TensorRef(self, "", t.name, "float8_e4m3fn", tuple(t.shape))
        s = TensorRef(self, "", _scale_name(t.name), "float32", grid)
        self.weights[w.name] = self.weights[s.name] = t
        return [OutputTensor(t.name, w, w.dtype, w.shape), OutputTensor(s.name, s, s.dtype, s.shape)]

    def load(self, ref):
        from tui_merger.core.formats.dequant import quantize_fp8_blocks
        from tui_merger.core.merge.merge_math import compute

        q, inv = quantize_fp8_blocks(compute(self.weights[ref.name]), self.block)
        return inv if ref.name.endswith("weight_scale_inv") else q

    def load_into(self, ref, out) -> None:
        out.copy_(self.load(ref))

    def raw_ranges(self, ref):
        return None

    def row_blocks(self, ref):
        return None

    def release(self, ref) -> None:
        for x in self.weights[ref.name].inputs():
            x.release()

    def close(self) -> None:
        pass
