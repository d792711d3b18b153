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
- DeepSeek-V4's MXFP4 experts (int8 beside FP8 dense layers): transformers' ``Fp8Dequantize``;
- NVFP4 (ModelOpt, compressed-tensors) and INT4 pack-quantized: compressed-tensors' own decompressors
  (``NVFP4PackedCompressor``, a ModelOpt checkpoint first through its ``ModelOptNvfp4Converter``;
  ``PackedQuantizationCompressor``), expert by expert for experts stacked in one tensor; where the package
  is missing, the formats' definitions written here on their own (e2m1 decoded from its sign, exponent and
  mantissa bits; int4 words shifted apart), sharing nothing with ``formats/dequant_nvfp4.py`` or
  ``dequant_int4.py``.

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


class _Independent(DerivedSource):
    """The tensors of a merge's dequantizing view (same names, shapes and dtypes): those the view
    dequantizes (``_quantized``: the view's own table of them) are this source's, dequantized by the
    subclass; the others are the stored tensors themselves."""

    def __init__(self, view) -> None:
        import torch

        self.view = view
        self.scheme = view.scheme
        self._dtype = getattr(torch, view.dtype)
        self._tensors = None

    def _quantized(self) -> dict:
        raise NotImplementedError

    @property
    def tensors(self) -> dict:
        if self._tensors is None:
            self._tensors = {name: self.ref_of(ref) for name, ref in self.view.tensors.items()}
        return self._tensors

    def ref_of(self, ref):
        """This source's TensorRef for the view's ``ref`` (``ref`` itself where it is not dequantized)."""
        from tui_merger.core.io.sources import TensorRef

        if ref.source is not self.view or (ref.file, ref.name) not in self._quantized():
            return ref
        return TensorRef(self, ref.file, ref.name, ref.dtype, tuple(ref.shape))


class IndependentDequant(_Independent):
    """A ``DequantSource``'s tensors, the quantized ones dequantized here from the stored values and scales."""

    def _quantized(self) -> dict:
        return self.view._scales

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


def _compressed_tensors():
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        return False
    return True


def _ct_scheme(weights: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


NVFP4_ARGS = dict(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True, dynamic=False)


def _e2m1(codes):
    """e2m1 values of 4-bit codes from their bits: sign (bit 3), exponent (bits 2-1, bias 1), mantissa (bit 0);
    exponent 0 is subnormal (0 or 0.5)."""
    import torch

    sign = 1.0 - 2.0 * ((codes >> 3) & 1).to(torch.float32)
    exp = ((codes >> 1) & 3).to(torch.float32)
    man = (codes & 1).to(torch.float32)
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp - 1.0) * (1.0 + man * 0.5))
    return sign * mag


def nvfp4_by_definition(values, scale, glob, modelopt: bool):
    """One NVFP4 matrix written from the format and compressed-tensors' arithmetic (no package): the nibbles of
    each byte low first, times ``e4m3 scale / global`` per 16 values; ModelOpt's global is 1 / weight_scale_2.
    The dtypes follow torch's promotion as the decompressor meets them (a 0-dim global leaves the bf16 block
    scale bf16, a [1] one makes it fp32), rounded to bf16."""
    import torch

    b = values.to(torch.int32)
    codes = torch.empty(values.shape[0], values.shape[1] * 2, dtype=torch.int32)
    codes[:, 0::2], codes[:, 1::2] = b & 0xF, (b >> 4) & 0xF
    x = _e2m1(codes).to(torch.bfloat16)
    g = glob.to(torch.float32)
    g = (1.0 / g).reshape(()) if modelopt else g
    per_value = (scale.to(torch.bfloat16) / g).repeat_interleave(16, dim=1)
    return (x.to(per_value.dtype) * per_value).to(torch.bfloat16)


def dequantize_nvfp4(values, scale, glob, modelopt: bool, dtype):
    """An NVFP4 weight as compressed-tensors' decompressor gives it (ModelOpt's through its converter), in
    ``dtype``; experts stacked in one tensor expert by expert, each with its own global scale stored as one
    expert's would be (ModelOpt's ``weight_scale_2`` a scalar, compressed-tensors' global scale [1])."""
    import torch

    if values.dim() == 3:
        flat = glob.reshape(-1)
        return torch.stack([
            dequantize_nvfp4(values[e], scale[e], flat[e if flat.numel() > 1 else 0].reshape(() if modelopt else 1),
                             modelopt, dtype) for e in range(values.shape[0])])
    if not _compressed_tensors():
        return nvfp4_by_definition(values, scale, glob, modelopt).to(dtype)
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    if modelopt:
        from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

        state = ModelOptNvfp4Converter(targets=["re:.*"]).process(
            {"m.weight": values, "m.weight_scale": scale, "m.weight_scale_2": glob})
        state = {k[2:]: v for k, v in state.items()}
    else:
        state = {"weight_packed": values, "weight_scale": scale, "weight_global_scale": glob}
    return NVFP4PackedCompressor.decompress(state, _ct_scheme(NVFP4_ARGS))["weight"].to(dtype)


def int4_by_definition(packed, scale, shape, group):
    """INT4 pack-quantized written from the format (no package): value i of a row in bits 4i..4i+3 of its
    int32 word, stored as q + 8; ``q * scale`` in the scale's dtype, one scale per ``group`` values (or per
    row)."""
    import torch

    rows, cols = shape
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(rows, -1)[:, :cols] - 8
    per_value = scale.repeat_interleave(group, dim=1) if group else scale.reshape(rows, 1)
    return nibbles.to(scale.dtype) * per_value


def dequantize_int4(packed, scale, shape, group, dtype):
    """An INT4 pack-quantized weight as compressed-tensors' ``PackedQuantizationCompressor.decompress`` gives
    it, in ``dtype``."""
    import torch

    if not _compressed_tensors():
        return int4_by_definition(packed, scale, shape, group).to(dtype)
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    args = dict(num_bits=4, type="int", symmetric=True, dynamic=False,
                **(dict(strategy="group", group_size=group) if group else dict(strategy="channel")))
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(list(shape))}
    return PackedQuantizationCompressor.decompress(state, _ct_scheme(args))["weight"].to(dtype)


class IndependentPacked(_Independent):
    """A ``dequant_packed.PackedSource``'s tensors (NVFP4, INT4 pack-quantized), the quantized ones
    dequantized here by compressed-tensors' decompressors (or the definitions above)."""

    def _quantized(self) -> dict:
        return self.view._parts

    def _dequantize(self, v, s, t, cols):
        if self.scheme.method == "nvfp4":
            return dequantize_nvfp4(v, s, t, self.scheme.strategy == "modelopt", self._dtype)
        group = self.scheme.block[1] if self.scheme.block else None
        return dequantize_int4(v, s, (v.shape[0], cols), group, self._dtype)

    def load(self, ref):
        v, s, t, cols = self.view._parts[(ref.file, ref.name)]
        return self._dequantize(v.load(), s.load(), t.load(), cols)

    def load_experts(self, ref, i: int, j: int):
        """Experts [i, j) of experts stacked in one tensor (only those read)."""
        v, s, t, cols = self.view._parts[(ref.file, ref.name)]
        if len(ref.shape) != 3:
            return self.load(ref)[i:j]
        g = t.load().reshape(-1)
        glob = g[i:j] if g.numel() > 1 else g.expand(j - i)
        return self._dequantize(v.load()[i:j], s.load()[i:j], glob, cols)

    def release(self, ref) -> None:
        for part in self.view._parts[(ref.file, ref.name)][:3]:
            part.release()


_VIEWS: "weakref.WeakKeyDictionary" = None  # DequantSource -> its IndependentDequant


def independent_base(source):
    """``source`` as the checks read it: a base released quantized through ``IndependentDequant``, any
    other source as it is."""
    import weakref

    from tui_merger.core.formats.dequant import DequantSource
    from tui_merger.core.formats.dequant_packed import PackedSource

    global _VIEWS
    if not isinstance(source, (DequantSource, PackedSource)):
        return source
    if _VIEWS is None:
        _VIEWS = weakref.WeakKeyDictionary()
    view = _VIEWS.get(source)
    if view is None:
        make = IndependentPacked if isinstance(source, PackedSource) else IndependentDequant
        view = _VIEWS[source] = make(source)
    return view


def independent_ref(ref):
    """The TensorRef a check reads for the plan's input ``ref``: the same tensor, dequantized by
    ``IndependentDequant`` where ``ref`` is a dequantized weight of a ``DequantSource``."""
    view = independent_base(ref.source)
    return ref if view is ref.source else view.ref_of(ref)
