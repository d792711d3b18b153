"""Output tensors made two at a time: a quantized weight's values and its scales come from one merge
and one quantization (``requant.RequantSource``, ``requant_mxfp4.Mxfp4RequantSource``)."""

from __future__ import annotations

from tui_merger.core.io.sources import DerivedSource


class PairSource(DerivedSource):
    """Two output tensors made by one computation (a quantized weight's values and its scales): the
    first asked computes both and keeps the other until it is asked for, within ``KEPT_BYTES`` (a shard
    puts a weight's values, then its scales, one after the other: plan.shard_tensors; what does not
    fit is computed again when asked: the merge is deterministic, so both come from the same values).
    The recompute's threads share it: the kept tensors are behind a lock."""

    KEPT_BYTES = 256 << 20

    def __init__(self) -> None:
        import threading

        self.weights = {}  # output name (either of the pair) -> the 16-bit OutputTensor it quantizes
        self._kept: dict[str, object] = {}
        self._kept_bytes = 0
        self._lock = threading.Lock()

    def _pair(self, ref) -> dict:
        """{output name: tensor} of both tensors the 16-bit weight behind ``ref`` is written as."""
        raise NotImplementedError

    def load(self, ref):
        with self._lock:
            kept = self._kept.pop(ref.name, None)
            if kept is not None:
                self._kept_bytes -= kept.nbytes
                return kept
        pair = self._pair(ref)
        with self._lock:
            for name, tensor in pair.items():
                if name != ref.name and self._kept_bytes + tensor.nbytes <= self.KEPT_BYTES:
                    self._kept[name] = tensor
                    self._kept_bytes += tensor.nbytes
        return pair[ref.name]

    def release(self, ref) -> None:
        for x in self.weights[ref.name].inputs():
            x.release()

    def close(self) -> None:
        with self._lock:
            self._kept.clear()
            self._kept_bytes = 0
