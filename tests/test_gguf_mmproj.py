"""The mmproj file (core/ship/gguf_mmproj.py): a vision-language folder's vision tower and projector as llama.cpp's
``convert_hf_to_gguf.py --mmproj --outtype f16`` writes them.

The reference does not use our code: transformers loads the folder (``AutoModelForImageTextToText``), and every
tower parameter it loaded is put through the converter's rules written out here from the converter
(conversion/base.py ``MmprojModel``, gemma.py ``Gemma3VisionModel``, qwenvl.py ``Qwen2VLVisionModel``, qwen3vl.py
``Qwen3VLVisionModel``, llava.py ``LlavaVisionModel``): the ``gguf`` package's TensorNameMap for the names, Qwen2-VL's
qkv split, the Conv3D patch split, Gemma 3's 1 + w norm, Pixtral's q/k rows permuted as ``LlamaModel.permute``, and the f16/f32 type of each tensor; the keys from transformers' config dict as the
converter computes them. The file read back with gguf's GGUFReader must equal that, tensor by tensor and key by key.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from test_gguf import SMALL

TEXT = dict(SMALL, vocab_size=448)
VISION = {  # one-layer towers, but Qwen2.5-VL: two (its window pattern needs a full-attention block after a windowed one)
    "gemma3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
    "qwen2_vl": dict(depth=1, embed_dim=32, hidden_size=TEXT["hidden_size"], num_heads=2, mlp_ratio=2, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                       patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1]),
    "qwen3_vl": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT["hidden_size"],
                     patch_size=16, spatial_merge_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0]),
}
VISION["qwen3_vl_moe"] = VISION["qwen3_vl"]
# Pixtral towers (Mistral 3: with its patch merger; Llava: Pixtral 12B's layout, llama inside): 128 x 128 images of 16 x 16
# patches, the size llama.cpp's pixtral tower takes without resizing (8 to 1024 tokens)
PIXTRAL = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               head_dim=16, image_size=128, patch_size=16)
VISION["mistral3"] = VISION["llava"] = PIXTRAL
TEXT_TYPE = {"mistral3": "mistral", "llava": "llama"}
OTHER = {"gemma3": dict(image_token_index=440, boi_token_index=441, eoi_token_index=442, mm_tokens_per_image=1),
         "mistral3": dict(image_token_index=440, spatial_merge_size=2),
         "llava": dict(image_token_index=440, vision_feature_select_strategy="full", vision_feature_layer=-1)}
# the image normalization of the released checkpoints' preprocessor_config.json (Gemma 3: 0.5; Qwen: OpenAI CLIP's)
MEAN_STD = {"gemma3": ([0.5] * 3, [0.5] * 3)}
CLIP = ([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])


def make_tower(path: Path, model_type: str, seed: int = 0, dtype=torch.float32) -> Path:
    """A tiny random VL model saved by transformers, with the preprocessor files a released checkpoint carries."""
    import transformers
    from transformers import AutoConfig

    if model_type.startswith("gemma4"):  # test_gguf_vl_text's Gemma 4 (with its audio tower, as E2B / E4B), pooling 3x3 as
        import test_gguf_vl_text  # released; gemma4:clipped with the clipped linears' scalar bounds (use_clipped_linears)

        saved = test_gguf_vl_text.VISION["gemma4"]
        test_gguf_vl_text.VISION["gemma4"] = dict(saved, pooling_kernel_size=3, use_clipped_linears=model_type.endswith(":clipped"))
        try:
            test_gguf_vl_text.make_vl(path, "gemma4", seed=seed, dtype=dtype)
        finally:
            test_gguf_vl_text.VISION["gemma4"] = saved
        randomize_zero_tensors(path, seed)
        (path / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.0] * 3, "image_std": [1.0] * 3}))
        return path
    torch.manual_seed(seed)
    text = dict(TEXT)
    if model_type.startswith("qwen3"):
        text["head_dim"] = text["hidden_size"] // text["num_attention_heads"]
    if model_type == "qwen3_vl_moe":
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if model_type in TEXT_TYPE:
        text["model_type"] = TEXT_TYPE[model_type]
    config = AutoConfig.for_model(model_type, text_config=text, vision_config=VISION[model_type], **OTHER.get(model_type, {}))
    model = transformers.AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.ndim == 1:  # random norms and biases: a transform that forgets one shows
                p.copy_(0.1 * torch.randn_like(p) + (0.5 if _name.endswith("norm.weight") else 0))
            elif not p.any():  # Gemma 3's input projection starts at zero: a transposed one would not show
                p.copy_(0.1 * torch.randn_like(p))
            if model_type in TEXT_TYPE and ".attention." in _name and "vision" in _name:  # sharp, weighty attention:
                p.copy_((1.0 if _name.endswith(("q_proj.weight", "k_proj.weight")) else 0.5) * torch.randn_like(p))  # its 2-D rope shows
    model.to(dtype).save_pretrained(path)
    mean, std = MEAN_STD.get(model_type, CLIP)
    (path / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std}))
    if model_type in TEXT_TYPE:  # a tokenizer: the language model's GGUF beside it (benchmarks/llama_cpp_mmproj_check.py)
        from test_gguf import byte_level_tokenizer

        from tokenizers import AddedToken

        tok = byte_level_tokenizer("qwen")
        tok.add_tokens([AddedToken("[IMG_BREAK]", special=True)])  # llama.cpp's pixtral tower ends image rows with it
        tok.save_pretrained(path)
    if model_type == "gemma3":  # the processor says how many tokens an image becomes (Gemma 3: 256; here 1)
        (path / "processor_config.json").write_text(json.dumps({"image_seq_length": 1, "processor_class": "Gemma3Processor"}))
    return path


def randomize_zero_tensors(folder: Path, seed: int = 0) -> None:
    """Tensors a model starts at zero (Gemma 3's mm_input_projection_weight) made random in the saved file."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    path = folder / "model.safetensors"
    state = load_file(path)
    state = {k: (0.1 * torch.randn_like(v.float())).to(v.dtype) if v.ndim > 1 and not v.any() else v for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})


def expected_tensors(folder: Path, model_type: str) -> dict:
    """{GGUF name: (F16 | F32, array)} from transformers' own load, by the converter's rules."""
    import gguf
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    inner = model.model
    model_type = model_type.split(":")[0]
    if model_type == "gemma3":  # the converter's names: the hub's (vision_tower.*, multi_modal_projector.*)
        items = [("vision_tower.vision_model." + k, v) for k, v in inner.vision_tower.state_dict().items()]
        items += [("multi_modal_projector." + k.replace("_weight", ".weight"), v)
                  for k, v in inner.multi_modal_projector.state_dict().items()]
    elif model_type == "gemma4":  # transformers' names, then the converter's own renames (Gemma4VisionAudioModel)
        items = [("model.vision_tower." + k, v) for k, v in inner.vision_tower.state_dict().items()]
        items += [("model.embed_vision." + k, v) for k, v in inner.embed_vision.state_dict().items()]
        items = [(k.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
                  + (".weight" if k.endswith("position_embedding_table") else ""), v) for k, v in items]
    elif model_type in ("mistral3", "llava"):  # the hub's names: vision_tower.*, multi_modal_projector.*
        items = [("vision_tower." + k, v) for k, v in inner.vision_tower.state_dict().items()]
        items += [("multi_modal_projector." + k, v) for k, v in inner.multi_modal_projector.state_dict().items()]
        added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]  # the [IMG_BREAK] row of the embedding
        items.append(("img_break", model.get_input_embeddings().weight[next(t["id"] for t in added if t["content"] == "[IMG_BREAK]")]))
    else:
        items = [("visual." + k, v) for k, v in inner.visual.state_dict().items()]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 3)
    deep = VISION.get(model_type, {}).get("deepstack_visual_indexes", [])
    out = {}
    for hf, w in items:
        w = w.detach().float()
        parts = []
        if "soft_emb_norm" in hf:  # Gemma3VisionModel.modify_tensors: + 1
            parts = [(names.get_name(hf, try_suffixes=(".weight",)), w + 1)]
        elif hf.endswith("patch_embedder.input_proj.weight"):  # (n, p*p*3) -> (n, 3, p, p)
            p = int((w.shape[1] // 3) ** 0.5)
            parts = [("v.patch_embd.weight", w.reshape(w.shape[0], p, p, 3).permute(0, 3, 1, 2))]
        elif hf.endswith("patch_embed.proj.weight"):  # the Conv3D split along time
            parts = [("v.patch_embd.weight", w[:, :, 0]), ("v.patch_embd.weight.1", w[:, :, 1])]
        elif ".qkv." in hf and model_type in ("qwen2_vl", "qwen2_5_vl"):
            c = w.shape[0] // 3
            parts = [(names.get_name(hf.replace("qkv", p), try_suffixes=(".weight", ".bias")), w[i * c:(i + 1) * c])
                     for i, p in enumerate("qkv")]
        elif hf.startswith("visual.deepstack_merger_list."):
            i, part, suffix = hf.split(".")[2:5]
            parts = [(f"v.deepstack.{deep[int(i)]}.{ {'linear_fc1': 'fc1', 'linear_fc2': 'fc2'}.get(part, part)}.{suffix}", w)]
        elif model_type.startswith("qwen3") and hf.startswith("visual.merger."):
            part, suffix = hf.split(".")[2:4]
            parts = [({"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[part] + "." + suffix, w)]
        elif "vision_model.head." in hf:
            continue
        elif model_type in ("mistral3", "llava") and hf.endswith(("q_proj.weight", "k_proj.weight")):
            n = model.config.vision_config.num_attention_heads  # LlamaModel.permute(w, n_head, n_head)
            permuted = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
            parts = [(names.get_name(hf, try_suffixes=(".weight",)), permuted)]
        elif hf == "img_break":
            parts = [("v.token_embd.img_break", w)]
        else:  # the converter's suffixes (Gemma 4's clipped linears' bounds); a scalar as a 1-value tensor
            suffixes = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
            parts = [(names.get_name(hf, try_suffixes=suffixes), w.reshape(1) if w.ndim == 0 else w)]
        for new, t in parts:
            assert new is not None, hf
            out[new] = (_converter_type(model_type, hf, new, t.ndim), t.numpy())
    return out


def _converter_type(model_type: str, hf: str, new: str, ndim: int) -> str:
    """prepare_tensors at --outtype f16, with the towers' tensor_force_quant."""
    forced = None
    if model_type == "gemma3":
        forced = "F16" if "input_projection" in hf else "F32" if ".embeddings." in hf else None
    elif model_type in ("qwen2_vl", "qwen2_5_vl") and ".position_embd." in new:
        forced = "F32"
    elif model_type == "gemma4" and "position_embedding_table" in hf:
        forced = "F32"
    if forced is None and ".patch_embd.weight" in new:
        forced = "F16"
    if ndim <= 1 or new.endswith("_norm.weight"):
        return "F32"
    if forced is None and (new == "v.position_embd.weight" or not new.endswith(".weight")):
        return "F32"
    return forced or "F16"


def expected_keys(folder: Path, model_type: str) -> dict:
    from transformers import AutoConfig

    model_type = model_type.split(":")[0]

    cfg = AutoConfig.from_pretrained(folder).to_dict()
    v = dict(cfg["vision_config"])
    mean, std = MEAN_STD.get(model_type, CLIP)
    if model_type == "gemma4":
        mean, std = [0.0] * 3, [1.0] * 3
    keys = {"general.architecture": "clip", "general.type": "mmproj", "general.file_type": 1,
            "clip.has_vision_encoder": True, "clip.vision.projection_dim": cfg["text_config"]["hidden_size"],
            "clip.vision.image_mean": mean, "clip.vision.image_std": std}
    if model_type == "gemma3":
        keys.update({"clip.projector_type": "gemma3", "clip.vision.attention.layer_norm_epsilon": v["layer_norm_eps"],
                     "clip.use_gelu": True, "clip.vision.projector.scale_factor": (28 // 14) // 1})
        heads, layers, width, ff, size = v["num_attention_heads"], v["num_hidden_layers"], v["hidden_size"], v["intermediate_size"], v["image_size"]
    elif model_type == "gemma4":
        keys.update({"clip.vision.projector_type": "gemma4v", "clip.vision.attention.layer_norm_epsilon": v.get("layer_norm_eps", 1e-6)})
        heads, layers, width, ff, size = v["num_attention_heads"], v["num_hidden_layers"], v["hidden_size"], v["intermediate_size"], 224
    elif model_type in ("mistral3", "llava"):
        keys.update({"clip.projector_type": "pixtral", "clip.vision.attention.layer_norm_epsilon": 1e-5, "clip.use_gelu": True})
        if model_type == "mistral3":
            keys["clip.vision.spatial_merge_size"] = cfg["spatial_merge_size"]
        heads, layers, width, ff, size = v["num_attention_heads"], v["num_hidden_layers"], v["hidden_size"], v["intermediate_size"], v["image_size"]
    elif model_type in ("qwen2_vl", "qwen2_5_vl"):
        heads, layers, size = v["num_heads"], v["depth"], 560
        width, ff = (v["embed_dim"], v["hidden_size"]) if model_type == "qwen2_vl" else (v["hidden_size"], v["intermediate_size"])
        keys["clip.vision.attention.layer_norm_epsilon"] = cfg.get("rms_norm_eps", 1e-6)
        if model_type == "qwen2_vl":
            keys["clip.projector_type"] = "qwen2vl_merger"
        else:
            keys.update({"clip.projector_type": "qwen2.5vl_merger", "clip.use_silu": True, "clip.vision.n_wa_pattern": 2})
    else:
        heads, layers, width, ff = v["num_heads"], v["depth"], v["hidden_size"], v["intermediate_size"]
        size = int(v["num_position_embeddings"] ** 0.5 * v["patch_size"])
        keys.update({"clip.projector_type": "qwen3vl_merger", "clip.use_gelu": True, "clip.vision.spatial_merge_size": 2,
                     "clip.vision.attention.layer_norm_epsilon": cfg["text_config"]["rms_norm_eps"],
                     "clip.vision.is_deepstack_layers": [True]})
    keys.update({"clip.vision.image_size": size, "clip.vision.patch_size": v["patch_size"], "clip.vision.embedding_length": width,
                 "clip.vision.feed_forward_length": ff, "clip.vision.block_count": layers, "clip.vision.attention.head_count": heads})
    return keys


def read_back(path: Path) -> tuple[dict, dict]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in reader.tensors}
    keys = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    return tensors, keys


def _close(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4", "gemma4:clipped", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe",
                                        "mistral3", "llava"])
def test_mmproj_equals_converter_rules_on_transformers_weights(model_type, tmp_path):
    from tui_merger.core.ship.gguf import write_gguf
    from tui_merger.core.ship.gguf_mmproj import plan_mmproj

    folder = make_tower(tmp_path / model_type, model_type)
    result = write_gguf(plan_mmproj(folder, tmp_path / "mmproj.gguf"))
    tensors, keys = read_back(result.path)
    want = expected_tensors(folder, model_type)
    assert sorted(tensors) == sorted(want)
    for name, (qtype, data) in want.items():
        got_type, got = tensors[name]
        assert got_type == qtype, name
        ref = np.ascontiguousarray(data.astype(np.float16 if qtype == "F16" else np.float32))
        assert got.shape == ref.shape and np.array_equal(got.view(np.uint8), ref.view(np.uint8)), name
    for key, value in expected_keys(folder, model_type).items():
        assert key in keys and _close(keys[key], value), (key, keys.get(key), value)
    assert not [k for k in keys if k.startswith("clip.") and k not in expected_keys(folder, model_type)]


def test_mmproj_from_bf16_weights(tmp_path):
    """bf16 on disk: F16 matrices rounded once from the bf16 value, F32 norms exact, Gemma's 1 + w in float32."""
    from tui_merger.core.ship.gguf import write_gguf
    from tui_merger.core.ship.gguf_mmproj import plan_mmproj

    folder = make_tower(tmp_path / "g", "gemma3", dtype=torch.bfloat16)
    tensors, _ = read_back(write_gguf(plan_mmproj(folder, tmp_path / "m.gguf")).path)
    for name, (qtype, data) in expected_tensors(folder, "gemma3").items():
        ref = np.ascontiguousarray(data.astype(np.float16 if qtype == "F16" else np.float32))
        assert tensors[name][0] == qtype and np.array_equal(tensors[name][1], ref), name


def test_export_writes_mmproj_beside_the_gguf(tmp_path):
    """`tui-merger gguf` on a Gemma 3 VL folder: the language model's GGUF, mmproj-<name>-F16.gguf beside it (the
    same bytes as the mmproj written alone), a Modelfile with a second FROM, llama.cpp's multimodal run line; a
    second type uses the mmproj that is there; --no-mmproj writes none and says the tower is left out."""
    from test_gguf_vl_text import make_vl

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import write_gguf
    from tui_merger.core.ship.gguf_mmproj import plan_mmproj
    from tui_merger.core.ship.run_locally import make_local

    vl = make_vl(tmp_path / "vl", "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    (vl / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    out = tmp_path / "out"
    out.mkdir()
    events = []
    made = make_local(vl, "f16", out, check="none", on_event=events.append)
    mmproj = out / "mmproj-vl-F16.gguf"
    assert made.result.mmproj == mmproj and mmproj.is_file()
    assert made.mmproj_check.status == "not checked" and "--check none" in made.mmproj_check.summary
    said = [e.message for e in events if isinstance(e, Notice)]
    assert any(mmproj.name in s and "vision tower" in s for s in said)
    assert not any("not in this GGUF" in s for s in said)
    alone, _ = read_back(write_gguf(plan_mmproj(vl, tmp_path / "alone.gguf")).path)
    written, keys = read_back(mmproj)
    assert keys["clip.vision.projector.scale_factor"] == 1  # 2x2 patches, 4 tokens per image: pooled by 1
    assert sorted(written) == sorted(alone) and all(np.array_equal(written[n][1], alone[n][1]) for n in alone)
    text = made.modelfile.path.read_text()
    assert f"FROM ./{made.result.path.name}" in text and f"FROM ./{mmproj.name}" in text
    assert any(line.startswith("llama-mtmd-cli -m ") and f"--mmproj {mmproj}" in line for line in made.run_lines())
    before = mmproj.stat().st_mtime_ns
    events.clear()
    again = make_local(vl, "q8_0", out, check="none", on_event=events.append)
    assert again.result.mmproj == mmproj and mmproj.stat().st_mtime_ns == before
    assert any("already there" in e.message for e in events if isinstance(e, Notice))
    events.clear()
    none = make_local(vl, "bf16", out, check="none", on_event=events.append, mmproj=False)
    assert none.result.mmproj is None and "mmproj" not in none.modelfile.path.read_text()
    assert not any(line.startswith("llama-mtmd-cli") for line in none.run_lines())
    assert any("not in this GGUF" in e.message for e in events if isinstance(e, Notice))


def test_vl_folder_without_image_normalization_gets_text_gguf_and_a_sentence(tmp_path):
    from test_gguf_vl_text import make_vl

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_mmproj import companion

    vl = make_vl(tmp_path / "vl", "gemma3")
    events = []
    result = export_gguf(vl, "f16", tmp_path / "x.gguf", on_event=events.append, companion=companion)
    assert result.path.is_file() and result.mmproj is None
    assert not list(tmp_path.glob("mmproj-*"))
    said = [e.message for e in events if isinstance(e, Notice) and "The mmproj file is not written" in e.message]
    assert len(said) == 1 and "image_mean" in said[0] and said[0].endswith(".") and said[0].count(". ") == 0


@pytest.mark.parametrize("case", ["clip", "layer", "no_break"])
def test_llava_tower_llama_cpp_cannot_run_gets_text_gguf_and_a_sentence(case, tmp_path):
    """A Llava with a CLIP tower (LLaVA 1.5: the converter's LlavaVisionModel writes Pixtral towers only), one that takes
    its features from an inner vision layer (llama.cpp's pixtral graph uses the last), or a tokenizer without [IMG_BREAK]
    (clip.cpp requires its embedding): the language model's GGUF, no mmproj, one sentence why."""
    from test_gguf_vl_text import make_vl

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_mmproj import companion

    if case == "clip":
        vl = make_vl(tmp_path / "vl", "llava")  # test_gguf_vl_text's Llava: a CLIP vision tower, llama inside
        (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": CLIP[0], "image_std": CLIP[1]}))
    else:
        vl = make_tower(tmp_path / "vl", "llava")
        if case == "layer":
            config = json.loads((vl / "config.json").read_text())
            (vl / "config.json").write_text(json.dumps(dict(config, vision_feature_layer=-2)))
        else:
            from test_gguf import byte_level_tokenizer

            (vl / "tokenizer_config.json").unlink()
            byte_level_tokenizer("qwen").save_pretrained(vl)
    events = []
    result = export_gguf(vl, "f16", tmp_path / "x.gguf", on_event=events.append, companion=companion)
    assert result.path.is_file() and result.mmproj is None
    assert not list(tmp_path.glob("mmproj-*"))
    said = [e.message for e in events if isinstance(e, Notice) and "The mmproj file is not written" in e.message]
    want = {"clip": "clip_vision_model", "layer": "vision layer -2", "no_break": "[IMG_BREAK]"}[case]
    assert len(said) == 1 and want in said[0] and said[0].endswith("."), said


def test_gemma4_mmproj_beside_its_gguf_and_what_it_leaves_out(tmp_path):
    """Gemma 4 (E2B / E4B hear too): the mmproj holds the vision tower, a notice says the audio tower is not in it;
    a tower pooling other than 3 x 3 (llama.cpp's gemma4v, which no key can change) gets a sentence and no mmproj;
    another VL model type a sentence too."""
    import test_gguf_vl_text

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_mmproj import companion, tower_of

    vl = make_tower(tmp_path / "vl", "gemma4")
    events = []
    result = export_gguf(vl, "f16", tmp_path / "x.gguf", on_event=events.append, companion=companion)
    assert result.mmproj == tmp_path / "mmproj-vl-F16.gguf" and result.mmproj.is_file()
    said = [e.message for e in events if isinstance(e, Notice)]
    assert any("audio tower" in s and "not in mmproj-vl-F16.gguf" in s for s in said)
    tensors, keys = read_back(result.mmproj)
    assert keys["clip.vision.projector_type"] == "gemma4v" and not any(n.startswith("a.") for n in tensors)

    pooled2 = test_gguf_vl_text.make_vl(tmp_path / "p2", "gemma4")  # the text tests' tower pools 2 x 2
    (pooled2 / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.0] * 3, "image_std": [1.0] * 3}))
    events.clear()
    result = export_gguf(pooled2, "f16", tmp_path / "y.gguf", on_event=events.append, companion=companion)
    assert result.path.is_file() and result.mmproj is None and not (tmp_path / "mmproj-p2-F16.gguf").exists()
    said = [e.message for e in events if isinstance(e, Notice) and "The mmproj file is not written" in e.message]
    assert len(said) == 1 and "2 x 2" in said[0] and "3 x 3" in said[0]

    other = tmp_path / "paligemma"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "paligemma", "vision_config": {}, "text_config": {}}))
    model_type, why = tower_of(other)
    assert model_type == "paligemma" and "not of paligemma ones" in why and why.endswith(".")
    assert tower_of(tmp_path / "vl") == ("gemma4", None)


@pytest.mark.parametrize("model_type", ["gemma3", "gemma4", "qwen2_5_vl", "qwen3_vl", "mistral3"])
def test_check_reference_equals_the_whole_model(model_type, tmp_path):
    """The in-app check's transformers side loads the VL model with its language model cut to one layer (memory: the
    tower's); its image embeddings must be the whole model's get_image_features on the same pixels, bit for bit."""
    import transformers

    from tui_merger.core.ship import gguf_mmproj

    folder = make_tower(tmp_path / model_type, model_type)
    config = gguf_mmproj._config(folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    side = {"gemma3": 28, "gemma4": 36, "qwen2_5_vl": 56, "qwen3_vl": 64, "mistral3": 96}[model_type]
    rgb = np.random.default_rng(1).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    got = gguf_mmproj._transformers_image(folder, config, rgb, pre)
    model = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    x = torch.from_numpy(((rgb.astype(np.float32) / 255 - np.float32(pre["image_mean"])) / np.float32(pre["image_std"])).transpose(2, 0, 1).copy())
    with torch.no_grad():
        if model_type == "gemma3":
            want = model.model.get_image_features(x[None])
            want = getattr(want, "pooler_output", want)
        elif model_type == "mistral3":  # 3 x 3 merged tokens, [IMG_BREAK]'s embedding after the first two rows (llama.cpp's layout)
            t = model.model.get_image_features(pixel_values=x[None], image_sizes=torch.tensor([[side, side]])).pooler_output
            grid = torch.cat(list(t), dim=0).reshape(3, 3, -1)
            added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
            brk = model.get_input_embeddings().weight[next(a["id"] for a in added if a["content"] == "[IMG_BREAK]")][None]
            want = torch.cat([grid[0], brk, grid[1], brk, grid[2]])
        elif model_type == "gemma4":  # Gemma4ImageProcessor's convert_image_to_patches and (x, y) positions, written out again
            p = model.config.vision_config.patch_size
            g = side // p
            patches = x.reshape(3, g, p, g, p).permute(1, 3, 2, 4, 0).reshape(g * g, -1)
            pos = torch.stack(torch.meshgrid(torch.arange(g), torch.arange(g), indexing="xy"), dim=-1).reshape(1, -1, 2)
            want = torch.cat(list(model.model.get_image_features(patches[None], pos).pooler_output), dim=0)
        else:  # the image processor's own patch order: Qwen2VLImageProcessor's reshape, written out again here
            p, m = model.config.vision_config.patch_size, model.config.vision_config.spatial_merge_size
            g = side // p
            flat = x[None].repeat(2, 1, 1, 1).reshape(1, 2, 3, g // m, m, p, g // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            out = model.model.get_image_features(flat.reshape(g * g, -1), torch.tensor([[1, g, g]]))
            want = torch.cat(list(out.pooler_output), dim=0)
            if getattr(out, "deepstack_features", None):
                want = torch.cat([want] + [torch.cat(list(d), dim=0) for d in out.deepstack_features], dim=-1)
    want = want.reshape(-1, want.shape[-1]).numpy()
    assert got.shape == want.shape and np.array_equal(got, want)


def test_check_without_llama_cpp_is_not_checked(tmp_path, monkeypatch):
    """Only llama.cpp reads an mmproj file: without it (or with --check transformers / none), "not checked", never PASSED."""
    from tui_merger.core.ship import gguf_check
    from tui_merger.core.ship.gguf_mmproj import check_mmproj

    monkeypatch.setattr(gguf_check, "llama_cpp_version", lambda: None)
    for reader in ("auto", "llama.cpp", "transformers", "none"):
        verdict = check_mmproj(tmp_path, tmp_path / "x.gguf", tmp_path / "mmproj-x-F16.gguf", reader=reader)
        assert verdict.status == gguf_check.NOT_CHECKED and not verdict.passed and verdict.summary.endswith(".")


def test_tower_beyond_f16_leaves_the_gguf_and_writes_no_mmproj(tmp_path):
    """A vision weight beyond F16's range: the language model's GGUF stands, the mmproj is not written (no partial
    file), and a warning says why (not "choose --type bf16": the mmproj is F16 whatever the type)."""
    from safetensors.torch import load_file, save_file
    from test_gguf_vl_text import make_vl

    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_mmproj import companion

    vl = make_vl(tmp_path / "vl", "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_seq_length": 4}))
    state = load_file(vl / "model.safetensors")
    key = next(k for k in state if k.endswith("fc1.weight") and "vision" in k)
    state[key][0, 0] = 1e6
    save_file(state, vl / "model.safetensors", metadata={"format": "pt"})
    events = []
    result = export_gguf(vl, "f16", tmp_path / "x.gguf", on_event=events.append, companion=companion)
    assert result.path.is_file() and result.mmproj is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vl", "x.gguf"]
    said = [e.message for e in events if isinstance(e, Notice) and e.level == "warning"]
    assert len(said) == 1 and "mmproj file is not" in said[0] and "65504" in said[0] and "--type" not in said[0]


def test_cli_prints_and_records_the_mmproj(tmp_path, capsys):
    """`tui-merger gguf` on a Gemma 3 VL folder made by tui-merger: the mmproj's own manifest entry (architecture clip,
    its check), the GGUF's entry pointing at it, the printed lines; --no-mmproj on another folder writes none."""
    from test_gguf_vl_text import make_vl

    from tui_merger.cli import main
    from tui_merger.core.record.manifest import FORMAT, read_manifest, write_manifest

    vl = make_vl(tmp_path / "vl", "gemma3")
    (vl / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.5] * 3, "image_std": [0.5] * 3, "image_seq_length": 4}))
    write_manifest(vl, {"format": FORMAT})
    assert main(["gguf", str(vl), "--check", "none", "--plain"]) == 0
    out, _ = capsys.readouterr()
    gguf_path, mmproj = vl / "vl-F16.gguf", vl / "mmproj-vl-F16.gguf"
    assert f"  vision tower (mmproj) {mmproj}, " in out and "  mmproj check not checked: skipped (--check none)." in out
    assert f"  llama-mtmd-cli -m {gguf_path} --mmproj {mmproj} --image IMAGE.jpg -p 'Describe this image.'" in out
    entries = {e["path"]: e for e in read_manifest(vl)["gguf"]}
    assert entries["vl-F16.gguf"]["mmproj"] == "mmproj-vl-F16.gguf"
    assert entries["mmproj-vl-F16.gguf"]["architecture"] == "clip" and entries["mmproj-vl-F16.gguf"]["check"]["status"] == "not checked"
    assert "FROM ./mmproj-vl-F16.gguf" in (vl / "vl-F16.Modelfile").read_text()

    (vl / "vl-F16.gguf").unlink()
    mmproj.unlink()
    assert main(["gguf", str(vl), "--check", "none", "--plain", "--no-mmproj"]) == 0
    out, _ = capsys.readouterr()
    assert not mmproj.exists() and "mmproj" not in out.split("Run it:")[1]
