"""A base released quantized as the checks read it: dequantized by the formats' own code, never by the
merge's (``formats/dequant.py``), so that a wrong dequantization in the merge shows as a difference
instead of being repeated on both sides of the comparison.

- FP8 (``quant_method: fp8``): transformers' own FP8 dequantization (``integrations.finegrained_fp8``:
  the declared blocks, a short last block where rows or columns are not whole blocks), in fp32, rounded
  once to the dtype asked for;
- compressed-tensors FP8: the ``compressed_tensors`` package's ``dequantize`` where it is installed (an
  optional dependency); else the format's definition written here on its own (``q`` cast to the
  scale's dtype, times the scale of its tensor, row or block);
- MXFP4 (GPT-OSS): transformers' ``convert_moe_packed_tensors``, in fp32, rounded once;
- DeepSeek-V4's MXFP4 experts (int8 beside FP8 dense layers): transformers' ``Fp8Dequantize``.

The recompute check reads the base through ``independent_base`` and the behaviour check's unmerged
reference is built on it too.
"""

from __future__ import annotations

from tui_merger.core.io.sources import DerivedSource


def dequantize_fp8(q, scale, block, dtype):
    """transformers' FP8 dequantization of one weight (blocks ``block`` or one scale), rounded once."""
    import torch
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    s = scale.to(torch.float32)
    if block is None:
        s = s.reshape([1] * q.dim()) if s.numel() == 1 else s
        return _dequantize_fp8_weight(q, s, None, torch.float32).to(dtype)
    return _dequantize_fp8_weight(q, s, list(block), torch.float32).to(dtype)


def dequantize_compressed(q, scale, scheme, dtype):
    """compressed-tensors FP8 (strategy tensor, channel or block), as its ``dequantize`` gives it."""
    import torch

    try:
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize
    except ImportError:
        dequantize = None
    if dequantize is not None and q.dim() == 2:
        args = dict(num_bits=8, type="float", symmetric=True, strategy=scheme.strategy)
        if scheme.block is not None:
            args["block_structure"] = list(scheme.block)
        return dequantize(q, scale, args=QuantizationArgs(**args), dtype=scale.dtype).to(dtype)
    # the definition, written apart from the merge's: values in the scale's dtype times their scale
    x = q.to(scale.dtype)
    rows, cols = q.shape[-2], q.shape[-1]
    if scheme.block is not None:
        br, bc = scheme.block
        grid = scale.reshape(*scale.shape[:-2], rows // br, 1, cols // bc, 1)
        return (x.reshape(*x.shape[:-2], rows // br, br, cols // bc, bc) * grid).reshape(x.shape).to(dtype)
    if scheme.strategy == "channel":
        return (x * scale.reshape(*x.shape[:-1], 1)).to(dtype)
    return (x * scale.reshape([])).to(dtype) if scale.numel() == 1 else (x * scale).to(dtype)


def dequantize_mxfp4(blocks, scales, dtype):
    """GPT-OSS's MXFP4 experts as transformers' ``convert_moe_packed_tensors`` gives them ([experts, in, out])."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).to(dtype)


def dequantize_fp4_experts(q, scale, dtype):
    """DeepSeek-V4's MXFP4 experts (int8, two e2m1 codes a byte, a float8_e8m0fnu scale per 32 values) as
    transformers' own ``Fp8Dequantize`` gives them (the block read from the scale grid), in fp32, rounded once."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=torch.float32).to(dtype)


def dequantize_independently(q, scale, scheme, dtype):
    import torch

    if scheme.method == "fp8" and q.dtype == torch.int8:
        return dequantize_fp4_experts(q, scale, dtype)
    if scheme.method == "mxfp4":
        return dequantize_mxfp4(q, scale, dtype)
    if scheme.method == "compressed-tensors":
        return dequantize_compressed(q, scale, scheme, dtype)
    return dequantize_fp8(q, scale, scheme.block, dtype)


class IndependentDequant(DerivedSource):
    """The tensors of a ``DequantSource`` (same names, shapes and dtypes), the quantized ones dequantized
    here from the stored values and scales; the others are the stored tensors themselves."""

    def __init__(self, view) -> None:
        import torch

        self.view = view
        self.scheme = view.scheme
        self._dtype = getattr(torch, view.dtype)
        self._tensors = None

    @property
    def tensors(self) -> dict:
        if self._tensors is None:
            self._tensors = {name: self.ref_of(ref) for name, ref in self.view.tensors.items()}
        return self._tensors

    def ref_of(self, ref):
        """This source's TensorRef for the view's ``ref`` (``ref`` itself where it is not dequantized)."""
        from tui_merger.core.io.sources import TensorRef

        if ref.source is not self.view or (ref.file, ref.name) not in self.view._scales:
            return ref
        return TensorRef(self, ref.file, ref.name, ref.dtype, tuple(ref.shape))

    def _stored(self, ref):
        return self.view._scales[(ref.file, ref.name)]

    def load(self, ref):
        w, s = self._stored(ref)
        return dequantize_independently(w.load(), s.load(), self.scheme, self._dtype)

    def load_experts(self, ref, i: int, j: int):
        """Experts [i, j) of a packed experts weight (only those read)."""
        w, s = self._stored(ref)
        scale = s.load()
        if self.scheme.method == "mxfp4" or (scale.dim() == 3 and scale.shape[0] == ref.shape[0]):
            out = dequantize_independently(w.load()[i:j], scale[i:j], self.scheme, self._dtype)
            w.release_rows(i, j)  # the stored experts' pages go back as they are read
            return out
        return self.load(ref)[i:j]

    def release(self, ref) -> None:
        w, s = self._stored(ref)
        w.release()
        s.release()


_VIEWS: "weakref.WeakKeyDictionary" = None  # DequantSource -> its IndependentDequant


def independent_base(source):
    """``source`` as the checks read it: a base released quantized through ``IndependentDequant``, any
    other source as it is."""
    import weakref

    from tui_merger.core.formats.dequant import DequantSource

    global _VIEWS
    if not isinstance(source, DequantSource):
        return source
    if _VIEWS is None:
        _VIEWS = weakref.WeakKeyDictionary()
    view = _VIEWS.get(source)
    if view is None:
        view = _VIEWS[source] = IndependentDequant(source)
    return view


def independent_ref(ref):
    """The TensorRef a check reads for the plan's input ``ref``: the same tensor, dequantized by
    ``IndependentDequant`` where ``ref`` is a dequantized weight of a ``DequantSource``."""
    view = independent_base(ref.source)
    return ref if view is ref.source else view.ref_of(ref)
