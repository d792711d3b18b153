"""What the Megatron layout tests (Megatron-LM, Megatron-Bridge, ms-swift, NeMo 2, VL) share: a merge of a
checkpoint, a refusal checked as one sentence with nothing written, bit-for-bit tensor equality, and a dist
checkpoint's tensors read by torch.distributed.checkpoint itself (the independent reference)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tui_merger.core.errors import MergeError
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions


def merge_checkpoint(checkpoint: Path, out: Path, **options):
    """``options``: MergeOptions' fields (base=..., lora_alpha=...)."""
    return run_merge(MergeOptions(checkpoint=checkpoint, out=out, **options), fsync=False)


def refused(checkpoint: Path, out: Path, *words, **options) -> str:
    """The merge of ``checkpoint`` is refused in one sentence holding ``words``, and ``out`` is not written."""
    with pytest.raises(MergeError) as err:
        merge_checkpoint(checkpoint, out, **options)
    message = str(err.value)
    assert message.count(". ") == 0 and message.endswith("."), message  # one sentence
    for w in words:
        assert w in message, message
    assert not out.exists()
    return message


def same_tensors(got: dict, want: dict) -> None:
    """The same names, and each tensor equal in dtype and every value."""
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def dcp_tensors(folder: Path) -> dict:
    """Every tensor of the dist checkpoint in ``folder``, read by torch.distributed.checkpoint itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
             if isinstance(v, TensorStorageMetadata)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return state
