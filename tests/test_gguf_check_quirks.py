"""The GGUF check where the installed llama.cpp computes an architecture otherwise than the file says, by a
fault of its own (gguf_check._llama_cpp_quirk): llama.cpp 0.3.36's qwen2vl loader never reads the RMS-norm
epsilon the file holds (its src/models/qwen2vl.cpp reads the M-RoPE sections only), so it runs the norms with
epsilon 0. The check's reference then does the same, and says so; the file itself is written as the converter
writes it (the epsilon key included). No llama.cpp is needed here: the version is what the check reads."""

from __future__ import annotations

import torch

from test_gguf_vl_text import make_vl
from tui_merger.core.ship import gguf_check
from tui_merger.core.ship.gguf import export_gguf


def test_qwen2vl_under_llama_cpp_0_3_36_gets_a_reference_without_the_epsilon(tmp_path, monkeypatch):
    """The quirk applies to a qwen2vl file under llama-cpp-python 0.3.36 only; the reference it asks for equals
    transformers' own VL model built with rms_norm_eps 0 (from_pretrained, an independent forward), and differs
    from the plain reference (the epsilon matters on these tiny models, which is why the check needs it)."""
    import gguf
    import transformers

    vl = make_vl(tmp_path / "vl", "qwen2_vl")
    path = export_gguf(vl, "f16", tmp_path / "vl.gguf").path
    eps = gguf.GGUFReader(path).fields["qwen2vl.attention.layer_norm_rms_epsilon"]
    assert float(eps.parts[eps.data[0]][0]) > 0  # the file holds the epsilon, as the converter writes it

    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.3.36")
    edit, said = gguf_check._llama_cpp_quirk(path)
    assert edit == {"rms_norm_eps": 0.0} and "epsilon 0" in said
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.3.37")
    assert gguf_check._llama_cpp_quirk(path) is None  # another version: no assumption about it
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.3.36")
    llava = make_vl(tmp_path / "llava", "llava")
    assert gguf_check._llama_cpp_quirk(export_gguf(llava, "f16", tmp_path / "llava.gguf").path) is None  # llama arch

    ref = gguf_check._reference(vl, None, config_edit=edit)
    plain = gguf_check._reference(vl, None)
    config = transformers.AutoConfig.from_pretrained(vl)
    config.get_text_config().rms_norm_eps = 0.0
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl, config=config, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ref.prompt])).logits[0]
    torch.testing.assert_close(ref.logits, want, rtol=1e-4, atol=1e-4)
    assert (ref.logits - plain.logits).abs().max() > 1e-3


def test_the_quirk_is_said_in_the_verdict(tmp_path, monkeypatch):
    """A check under the quirk names it beside the reader, so nobody reads the comparison as the plain one."""
    vl = make_vl(tmp_path / "vl", "qwen2_5_vl")
    path = export_gguf(vl, "f16", tmp_path / "vl.gguf").path
    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: "0.3.36")

    def reader(gguf_path, ref, lora=None, cancel=None):  # llama.cpp is not in CI: a reader that gives the reference's own ids and logits
        return gguf_check._Read(ref.ids, ref.logits.clone()), "llama.cpp (llama-cpp-python 0.3.36)"

    monkeypatch.setattr(gguf_check, "_with_llama_cpp", reader)
    verdict = gguf_check.check_gguf(vl, path, "f16", reader="llama.cpp")
    assert verdict.passed, verdict.line()
    assert "epsilon 0" in verdict.line() and "qwen2vl" in verdict.line()
