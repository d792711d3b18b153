"""GGUF export of a vision-language folder's language model (core/ship/gguf_vl.py): Gemma 3 and Gemma 4
``...ForConditionalGeneration`` folders, as every released Gemma 3 (4B+) and Gemma 4 checkpoint is.

The reference does not use our code: transformers loads the VL folder, its language model and output head
are put into the text causal LM (``Gemma3ForCausalLM``, ``Gemma4ForCausalLM``) by transformers'
``load_state_dict`` (strict) and saved with ``save_pretrained``: a text folder, exported as any text
family is (tests/test_gguf_families.py checks those against llama.cpp's layout). The VL folder's GGUF must
equal that text folder's GGUF tensor by tensor (name, type, shape, bytes) and key by key.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from test_gguf import SMALL, byte_level_tokenizer
from test_gguf_families import CASES
from tui_merger.core.errors import MergeError
from tui_merger.core.events import Notice
from tui_merger.core.ship.gguf import export_gguf, plan_gguf

VISION = {
    "gemma3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
    "gemma4": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                   head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2),
}
AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4], output_proj_dims=32)
SPECIAL_IDS = {  # the image tokens inside the tiny vocabulary
    "gemma3": dict(image_token_index=440, boi_token_index=441, eoi_token_index=442, mm_tokens_per_image=4),
    "gemma4": dict(image_token_id=440, boi_token_id=441, eoi_token_id=442, video_token_id=443, audio_token_id=444,
                   boa_token_id=445, eoa_token_index=446),
}


def make_vl(path: Path, vl_type: str, seed: int = 0, dtype=torch.float32, **text_overrides) -> Path:
    """A tiny random ``Gemma{3,4}ForConditionalGeneration`` (random norms, as test_gguf_families makes them), saved by
    transformers; ``text_overrides`` widen the language model (benchmarks/llama_cpp_check.py)."""
    import transformers
    from transformers import AutoConfig

    torch.manual_seed(seed)
    text_type = f"{vl_type}_text"
    text = dict(SMALL, vocab_size=448, **CASES[text_type][0])
    text.update(text_overrides)
    text["pad_token_id"] = 0  # the VL model's forward replaces image/audio tokens by it (Gemma 4 needs one)
    text.pop("rope_theta", None) if "rope_parameters" in text else None
    extra = {"audio_config": AUDIO} if vl_type == "gemma4" else {}  # Gemma 4 E2B / E4B also hear
    config = AutoConfig.for_model(vl_type, text_config=text, vision_config=VISION[vl_type], **extra, **SPECIAL_IDS[vl_type])
    cls = getattr(transformers, f"{vl_type.capitalize()}ForConditionalGeneration")
    model = cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
            if vl_type == "gemma4" and "language_model" in name and name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(p.numel() ** -0.25)  # as test_gguf_families does for Gemma 4 (attention scale 1)
    model.to(dtype).save_pretrained(path)
    byte_level_tokenizer("qwen").save_pretrained(path)
    return path


def text_folder(vl_folder: Path, path: Path) -> Path:
    """The reference: transformers' own VL model loaded from the folder, its language model and head loaded into
    the text causal LM (strict) and saved by transformers."""
    import transformers

    vl = transformers.AutoModelForImageTextToText.from_pretrained(vl_folder, dtype=torch.float32)
    text_cfg = vl.config.get_text_config(decoder=True)
    text_cfg.tie_word_embeddings = vl.config.tie_word_embeddings
    cls = getattr(transformers, type(vl).__name__.replace("ForConditionalGeneration", "ForCausalLM"))
    model = cls(text_cfg)
    state = {f"model.{k}": v for k, v in vl.model.language_model.state_dict().items()}
    state["lm_head.weight"] = vl.lm_head.weight
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.save_pretrained(path)
    byte_level_tokenizer("qwen").save_pretrained(path)
    return path


def read(path: Path):
    from gguf import GGUFReader

    return GGUFReader(path)


def fields(reader) -> dict:
    out = {}
    for name, f in reader.fields.items():
        if name.startswith("general.") or name.startswith("GGUF."):  # the folder's name and size label, the header
            continue
        out[name] = [bytes(f.parts[i]) for i in f.data]
    return out


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    vl = make_vl(root / "vl", request.param)
    return request.param, vl, text_folder(vl, root / "text")


@pytest.mark.parametrize("type_", ["f16", "q4_k_m"])
def test_language_model_of_vl_folder_equals_text_export(pair, type_, tmp_path):
    vl_type, vl, text = pair
    events = []
    ours = export_gguf(vl, type_, tmp_path / "vl.gguf", on_event=events.append)
    ref = export_gguf(text, type_, tmp_path / "text.gguf")
    assert ours.arch == ref.arch == {"gemma3": "gemma3", "gemma4": "gemma4"}[vl_type]
    a, b = read(ours.path), read(ref.path)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert (x.tensor_type, list(x.shape)) == (y.tensor_type, list(y.shape)), x.name
        assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), x.name
    assert fields(a) == fields(b)
    said = [e.message for e in events if isinstance(e, Notice)]
    vision = [t for t in said if "vision tower" in t]
    assert len(vision) == 1 and "mmproj" in vision[0] and "not in this GGUF" in vision[0]
    assert ("audio tower" in vision[0]) == (vl_type == "gemma4")
    assert not any(w in t.name for t in a.tensors for w in ("vision", "audio", "mm_"))


def test_vl_family_we_do_not_write_is_refused(tmp_path):
    """Qwen2.5-VL: llama.cpp writes its language model under its own M-RoPE architecture (qwen2vl), not ours."""
    from transformers import AutoConfig

    folder = tmp_path / "qwen25vl"
    folder.mkdir()
    config = AutoConfig.for_model("qwen2_5_vl", text_config=dict(SMALL, vocab_size=448), vision_config=dict(depth=1, hidden_size=32))
    config.save_pretrained(folder)
    with pytest.raises(MergeError) as err:
        plan_gguf(folder, "f16", tmp_path / "x.gguf")
    text = str(err.value)
    assert "vision-language model (qwen2_5_vl)" in text and "Gemma 3 and Gemma 4" in text
    assert text.count(". ") == 0 and text.endswith(".")
    assert not (tmp_path / "x.gguf").exists()


def test_vl_folder_names_where_transformers_keeps_them(tmp_path):
    """A folder saved with the newer names (``model.language_model.*``, as transformers 4.5x wrote Gemma 3) gives the
    same GGUF as the older on-disk names transformers 5 writes: the names are transformers' loading rules."""
    import json

    from safetensors.torch import load_file, save_file

    vl = make_vl(tmp_path / "vl", "gemma3")
    other = tmp_path / "renamed"
    other.mkdir()
    for f in vl.iterdir():
        if f.suffix != ".safetensors":
            (other / f.name).write_bytes(f.read_bytes())
    state = load_file(vl / "model.safetensors")
    renamed = {}
    for k, v in state.items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith(("vision_tower.", "multi_modal_projector.")):
            k = "model." + k
        renamed[k] = v
    assert renamed.keys() != state.keys()
    save_file(renamed, other / "model.safetensors", metadata={"format": "pt"})
    json.loads((other / "config.json").read_text())
    a = read(export_gguf(vl, "f16", tmp_path / "a.gguf").path)
    b = read(export_gguf(other, "f16", tmp_path / "b.gguf").path)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert np.array_equal(np.asarray(x.data), np.asarray(y.data)), x.name


def test_check_of_vl_gguf_runs_the_vl_model_on_text(pair, tmp_path):
    """The in-app check's reference for a VL folder is transformers' own VL model on the text-only prompt (streamed
    from the folder): equal to from_pretrained's logits. Without llama.cpp, transformers' GGUF reader cannot read
    gemma3/gemma4 files: the file is "not checked", never PASSED."""
    import transformers

    from tui_merger.core.ship import gguf_check

    _vl_type, vl, _text = pair
    ref = gguf_check._reference(vl, None)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vl, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([ref.prompt])).logits[0]
    torch.testing.assert_close(ref.logits, want, rtol=1e-4, atol=1e-4)
    path = export_gguf(vl, "f16", tmp_path / "vl.gguf").path
    verdict = gguf_check.check_gguf(vl, path, "f16", reader="transformers")
    assert verdict.status == gguf_check.NOT_CHECKED and not verdict.passed


@pytest.mark.parametrize("rope, checked", [
    ({"full_attention": {"rope_type": "default", "rope_theta": 50000.0}}, True),
    ({"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}, False),  # as Gemma 3 4B+
])
def test_transformers_reader_checks_gemma3_only_where_it_builds_the_same_model(tmp_path, rope, checked):
    """transformers' GGUF reader builds Gemma 3 with query_pre_attn_scalar 256 and no rope scaling: with head size 256
    and no scaling it is the file's model (PASSED); with Gemma 3 4B's linear rope scaling it is another (measured:
    FAILED at 0.37 on a file llama.cpp PASSES at 0.0078), so "not checked"; head size 16 (above): "not checked"."""
    from test_gguf_families import make_family
    from tui_merger.core.ship import gguf_check

    rope = {**rope, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    folder = make_family(tmp_path / "g", "gemma3_text", head_dim=256, query_pre_attn_scalar=256, rope_parameters=rope)
    path = export_gguf(folder, "f16", tmp_path / "g.gguf").path
    verdict = gguf_check.check_gguf(folder, path, "f16", reader="transformers")
    assert verdict.status == (gguf_check.PASSED if checked else gguf_check.NOT_CHECKED), verdict.line()
