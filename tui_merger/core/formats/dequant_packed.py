"""The view of a base whose weights are stored as packed 4-bit values with their scales (NVFP4:
``dequant_nvfp4``; INT4 pack-quantized: ``dequant_int4``): each quantized weight reads dequantized under
``<module>.weight`` (its values, scales, global scale or weight_shape hidden; activation scales dropped),
a block of rows at a time, so memory stays flat; the rest passes through as stored.

It answers what ``dequant.DequantSource`` answers (``dequant.DequantSource(...)`` returns one for these
schemes). No torch at import time.
"""

from __future__ import annotations

from tui_merger.core.errors import MergeError
from tui_merger.core.formats import dequant_int4, dequant_nvfp4

ROW_VALUES = 1 << 22  # values dequantized at a time
FORMATS = {"nvfp4": dequant_nvfp4, "int4": dequant_int4}


def label(scheme) -> str:
    return FORMATS[scheme.method].label(scheme)


def loader(scheme) -> str:
    if scheme.method == "nvfp4":
        return dequant_nvfp4.loader(scheme)
    return "CompressedTensorsConfig(run_compressed=False)"


class PackedSource:
    def __init__(self, inner, scheme, config: dict, dtype: str) -> None:
        from tui_merger.core.io.sources import TensorRef

        self.inner = inner
        self.scheme = scheme
        self.folder = getattr(inner, "folder", None)
        self.files = getattr(inner, "files", [])
        self.dtype = dtype
        self.quantization_config = config.get("quantization_config")
        self.output_quantization = None
        fmt = FORMATS[scheme.method]
        found, drop = fmt.parts(inner.tensors, scheme)
        values_names = {names[0] for names in found.values()}
        hidden = {n for names in found.values() for n in names[1:]} | set(drop)
        self._parts = {}  # (file, name in the file) of the values -> (values ref, scale ref, third ref, columns)
        self.tensors = {}
        for name, ref in inner.tensors.items():
            if name in hidden or name in values_names:
                continue
            self.tensors[name] = ref
        for weight, (values, scale, third) in found.items():
            ref, s, t = inner.tensors[values], inner.tensors[scale], inner.tensors[third]
            if scheme.method == "int4":
                shape = tuple(int(v) for v in t.load().tolist())
                t.release()
                dequant_int4.check_shape(values, ref, s, shape, scheme)
                cols = shape[1]
            else:
                cols = ref.shape[-1] * 2
            if weight != values and weight in inner.tensors:
                raise MergeError(f"The base has both {weight} and its packed {values}; keep one. Nothing was written.")
            self._parts[(ref.file, ref.name)] = (ref, s, t, cols)
            # experts stacked in one tensor (NVFP4 [experts, rows, cols/2]) read as [experts, rows, cols]
            self.tensors[weight] = TensorRef(self, ref.file, ref.name, dtype, tuple(ref.shape[:-1]) + (cols,))
        self._names = {(r.file, r.name): w for w, r in self.tensors.items() if r.source is self}
        self.dropped = sorted(drop)
        from tui_merger.core.formats.dequant_checks import check_against_config, unknown_tensors

        unknown_tensors(self.tensors, self, scheme.label)
        check_against_config(self, config, {w: inner.tensors[names[0]] for w, names in found.items()})

    @property
    def dequantized(self) -> list[str]:
        return list(self._names.values())

    def pair(self, ref):
        return None  # nothing is written in these formats again (no --keep-quantization)

    def describe(self) -> dict:
        return {"weights": "dequantized as released", "format": self.scheme.label, "method": self.scheme.method,
                "block": list(self.scheme.block) if self.scheme.block else None, "strategy": self.scheme.strategy,
                "dtype": self.dtype, "as": self.scheme.loader, "tensors": len(self._parts)}

    def _rows(self, ref, r0: int, r1: int):
        import torch

        v, s, t, cols = self._parts[(ref.file, ref.name)]
        dtype = getattr(torch, self.dtype)
        if self.scheme.method == "nvfp4":
            return dequant_nvfp4.dequantize(v.load()[r0:r1], s.load()[r0:r1], t.load(), self.scheme, dtype)
        return dequant_int4.dequantize(v.load()[r0:r1], s.load()[r0:r1], cols, self.scheme, dtype)

    def _step(self, ref) -> int:
        return max(1, ROW_VALUES // max(ref.shape[1], 1))

    def load(self, ref):
        import torch

        out = torch.empty(ref.shape, dtype=getattr(torch, self.dtype))
        self.load_into(ref, out)
        return out

    def load_into(self, ref, out) -> None:
        if len(ref.shape) == 3:  # experts stacked in one tensor: an expert at a time
            for e in range(ref.shape[0]):
                out[e] = self.load_experts(ref, e, e + 1)[0]
            return
        rows, step = ref.shape[0], self._step(ref)
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            out[r0:r1] = self._rows(ref, r0, r1)

    def load_experts(self, ref, i: int, j: int):
        """Experts [i, j) of experts stacked in one tensor (only those read); a matrix whole."""
        import torch

        if len(ref.shape) != 3:
            return self.load(ref)[i:j]
        v, s, t, cols = self._parts[(ref.file, ref.name)]
        g = t.load()
        parts = [dequant_nvfp4.dequantize(v.load()[e], s.load()[e], dequant_nvfp4.expert_global(g, self.scheme, e),
                                          self.scheme, getattr(torch, self.dtype)) for e in range(i, j)]
        return torch.stack(parts)

    def raw_ranges(self, ref):
        return None  # the stored bytes are packed values, not the weight

    def row_blocks(self, ref):
        """The weight's dequantized values a block of rows at a time (the engine merges and writes block by
        block: no weight is held whole)."""
        if len(ref.shape) != 2:
            return None  # experts stacked in one tensor: read a few experts at a time (load_experts)
        return self._blocks(ref)

    def _blocks(self, ref):
        v = self._parts[(ref.file, ref.name)][0]
        rows, step = ref.shape[0], self._step(ref)
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            yield self._rows(ref, r0, r1), (lambda a=r0, b=r1: v.release_rows(a, b))

    def release(self, ref) -> None:
        for part in self._parts[(ref.file, ref.name)][:3]:
            part.release()

    def close(self) -> None:
        pass  # the inner source is closed by its owner
