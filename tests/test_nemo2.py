"""A NeMo 2 checkpoint written by NeMo itself (tests/fixtures/megatron_layouts/nemo2_saved, made by
generate_nemo2.py: NeMo 2.7.3's own HF importer ``llm.import_ckpt`` -> ``nemo_save`` on CPU).

The reference is the tiny Hugging Face Llama NeMo imported, as ``save_pretrained`` wrote it (nemo2_saved/hf):
converting NeMo's ``weights/`` back must give exactly those tensors, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from factory import read_output

from tui_merger.core.errors import MergeError
from tui_merger.core.formats.scan import scan
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions

SAVED = Path(__file__).resolve().parent / "fixtures" / "megatron_layouts" / "nemo2_saved"
CKPT, HF = SAVED / "nemo2", SAVED / "hf"


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))


def test_fixture_is_nemos_own_save():
    """What NeMo's save wrote: the dist checkpoint under weights/, the io context under context/."""
    assert (CKPT / "weights" / ".metadata").is_file() and (CKPT / "weights" / "metadata.json").is_file()
    assert (CKPT / "context" / "io.json").is_file()
    assert "nemo.collections.llm.gpt.model.llama.LlamaModel" in (CKPT / "context" / "model.yaml").read_text()


def test_inspect_detects_nemo2():
    (c,) = scan(CKPT).candidates
    assert c.backend == "nemo2" and c.needs_base
    assert any("LlamaModel" in n for n in c.notes)


def test_refused_without_base(tmp_path):
    out = tmp_path / "o"
    with pytest.raises(MergeError) as err:
        run_merge(MergeOptions(checkpoint=CKPT, out=out), fsync=False)
    message = str(err.value)
    assert "NeMo 2" in message and "--base" in message and message.endswith("."), message
    assert not out.exists()


def test_merge_equals_the_imported_hf_weights_and_verifies(tmp_path):
    from tui_merger.core.verify.checks import verify_merge

    out = tmp_path / "out"
    options = MergeOptions(checkpoint=CKPT, out=out, base=HF)  # what `merge CKPT --base HF --out O` runs
    run_merge(options, fsync=False)
    report = verify_merge(out, options)
    assert report.passed, [(c.name, c.status, c.summary, c.details) for c in report.checks]
    assert [c.name for c in report.checks] == ["structure", "recompute", "behaviour"]
    ours, want = read_output(out), read_output(HF)
    assert sorted(ours) == sorted(want) and len(want) == 21
    assert not torch.equal(want["model.norm.weight"], torch.ones(64))  # a lost norm would show
    for name, tensor in want.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name
