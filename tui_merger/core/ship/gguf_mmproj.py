"""The vision tower and projector of a vision-language folder as llama.cpp's mmproj GGUF.

llama.cpp (``llama-mtmd-cli``, ``llama-server --mmproj``) and Ollama 0.30+ (a second ``FROM`` in the
Modelfile) run a vision-language model as two files: the language model's GGUF (``gguf.py`` with
``gguf_vl.py``) and an mmproj file, ``general.architecture`` ``clip``, that holds the vision tower and the
projector into the language model's embeddings. This module writes that file as llama.cpp's converter
(``convert_hf_to_gguf.py --mmproj --outtype f16``) writes it: the ``clip.*`` keys, the image mean and std of
the folder's preprocessor config, the tensor names of the ``gguf`` package's own ``TensorNameMap`` for
``MODEL_ARCH.MMPROJ``, the converter's transforms (Qwen2-VL's fused qkv split into q, k, v; the 3-D patch
convolution split into two 2-D ones; Gemma 3's soft-embedding norm stored as 1 + w; Gemma 4's (p, p, 3) patch
embedding as a (3, p, p) convolution; Pixtral's q and k rows reordered per head for llama.cpp's rope, as
LlamaModel.permute does) and its types (matrices F16, norms, biases, 1-D and position embeddings F32, each tower's
own exceptions). Towers: Gemma 3, Gemma 4 (vision; its audio tower is left out in a notice), Qwen2-VL, Qwen2.5-VL,
Qwen3-VL, Qwen3-VL-MoE, Mistral 3 (Mistral Small 3.1 / 3.2: Pixtral tower, patch merger, projector) and Llava with a
Pixtral tower (Pixtral 12B; the converter's LlavaVisionModel writes no other Llava tower, so a CLIP one is refused).

``check_mmproj`` checks the written file where llama.cpp's Python binding (with libmtmd) is importable: one image
encoded by llama.cpp through the file and by transformers, the embeddings compared.

A tower is data: one ``Tower`` per model type in ``TOWERS``. A tower llama.cpp's converter does not
express, or one not done here, gets one sentence and no mmproj; the language model's GGUF is written all
the same. The file is streamed like the language model's (``gguf.write_gguf``: temporary name, renamed when
complete) and named as llama.cpp's converter prefixes it: ``mmproj-<folder name>-F16.gguf``, beside the GGUF.

gguf, numpy, torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tui_merger.core.errors import MergeError

MMPROJ_TYPE = "f16"  # what model pages publish beside every quantization of the language model (mmproj-F16)
NOT_SUPPORTED = (
    "tui-merger writes the mmproj file of Gemma 3, Gemma 4, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3 and Llava (Pixtral tower) "
    "folders, not of {model_type} ones: "
    "this GGUF runs on text only."
)


@dataclass(frozen=True)
class Tower:
    """How llama.cpp's converter writes one model type's vision tower (its ``MmprojModel`` subclass)."""

    projector: str  # clip.projector_type: the name of its gguf.VisionProjectorType
    prefixes: tuple[str, ...]  # the tower's and projector's tensors, by the converter's names
    # on-disk prefix -> the converter's (the released checkpoints' layout, which gguf's name map knows), the first
    # that matches: transformers 5 saves Gemma 3's SigLIP as vision_tower.* and Qwen3-VL's as model.visual.*, and
    # loads both layouts as the same model
    renames: tuple[tuple[str, str], ...] = ()
    vision: Callable[[dict, dict], dict] | None = None  # (vision config, whole config) -> the converter's hparams
    keys: Callable[[dict, dict, dict], list] | None = None  # (vision, whole config, preprocessor) -> [(writer method, value)]
    force: Callable[[str, str], str | None] | None = None  # (converter's HF name, GGUF name) -> F16 / F32 / None
    skip: tuple[str, ...] = ()  # HF name parts the converter leaves out
    split_qkv: bool = False  # a fused attn.qkv split into q, k, v (Qwen2-VL, Qwen2.5-VL)
    split_patch: bool = False  # the Conv3D patch embedding (temporal 2) split into two Conv2D
    plus_one: tuple[str, ...] = ()  # norms stored as 1 + w (Gemma's RMSNorm)
    special: Callable[[str, dict], str | None] | None = None  # a GGUF name the name map does not give (Qwen3-VL's merger)
    rename_weight: bool = False  # "..._weight" -> "....weight" (Gemma 3's mm_input_projection_weight)
    converter_name: Callable[[str], str] | None = None  # the converter's own renames before the name map (Gemma 4)
    patch_hwc: bool = False  # a linear patch embedding over (p, p, 3) pixels -> a (3, p, p) convolution (Gemma 4)
    projector_key: str = "add_clip_projector_type"  # Gemma 4: clip.vision.projector_type, as for vision + audio
    left_out: tuple[str, ...] = ()  # tensors of another tower the file does not hold (Gemma 4's audio), said once
    permute_qk: bool = False  # q_proj / k_proj rows reordered per head (LlamaModel.permute; Pixtral's 2-D rope)
    any_size: bool = False  # llama.cpp reads any image size, resizing only outside its token limits (Pixtral)
    img_break: bool = False  # v.token_embd.img_break: the [IMG_BREAK] token's embedding, put after each image row (Pixtral)


# -- the towers ----------------------------------------------------------------------------------------


def _gemma3_keys(vision: dict, config: dict, pre: dict) -> list:
    out = [("add_vision_attention_layernorm_eps", vision.get("layer_norm_eps", 1e-6)), ("add_vision_use_gelu", True)]
    seq = pre.get("image_seq_length", 256)
    factor = (vision["image_size"] // vision["patch_size"]) // int(seq ** 0.5)
    want = config.get("mm_tokens_per_image")
    if isinstance(want, int) and want != seq:
        raise MergeError(
            f"the processor config says {seq} image tokens (image_seq_length) and config.json {want} "
            "(mm_tokens_per_image); llama.cpp would pool the image to another number of tokens than the model"
        )
    if factor > 0 and factor != 4:  # llama.cpp's default is 4: the converter writes only another value
        out.append(("add_vision_projector_scale_factor", factor))
    return out


def _gemma3_force(name: str, new: str) -> str | None:
    if "input_projection" in name:
        return "F16"
    if ".embeddings." in name:
        return "F32"
    return None


def _qwen2vl_vision(vision: dict, config: dict) -> dict:
    vision = dict(vision)
    vision["image_size"] = vision.get("image_size", 560)
    vision["num_attention_heads"] = vision.get("num_heads")
    vision["num_hidden_layers"] = vision.get("depth")
    if "embed_dim" in vision:  # Qwen2-VL: hidden_size is the projector's output, embed_dim the tower's width
        vision["intermediate_size"] = vision.get("hidden_size")
        vision["hidden_size"] = vision.get("embed_dim")
    return vision


def _qwen2vl_keys(vision: dict, config: dict, pre: dict) -> list:
    out = []
    if config.get("model_type") == "qwen2_5_vl":
        full = vision.get("fullatt_block_indexes")
        if not full:
            raise MergeError("its vision config has no fullatt_block_indexes, which llama.cpp's qwen2.5vl tower needs")
        pattern = full[0] + 1
        if any(b - a != pattern for a, b in zip(full, full[1:])):
            raise MergeError(
                f"its full-attention vision blocks {full} are not evenly spaced, which llama.cpp's qwen2.5vl window "
                "pattern assumes"
            )
        if pattern == 1:  # llama.cpp's graph then leaves out its window mask, and setting that input aborts (clip.cpp)
            raise MergeError(
                f"every block of its vision tower attends fully (fullatt_block_indexes {full}), and llama.cpp's qwen2.5vl "
                "tower stops on a tower without window-attention blocks"
            )
        out += [("add_vision_use_silu", True), ("add_vision_n_wa_pattern", pattern)]
    out.append(("add_vision_attention_layernorm_eps", config.get("rms_norm_eps", 1e-6)))
    return out


def _qwen2vl_force(name: str, new: str) -> str | None:
    return "F32" if ".position_embd." in new else None


def _qwen3vl_vision(vision: dict, config: dict) -> dict:
    vision = dict(vision)
    if "image_size" not in vision:  # (image_size / patch_size)^2 = num_position_embeddings
        vision["image_size"] = int(vision.get("num_position_embeddings", 2304) ** 0.5 * vision.get("patch_size", 16))
    vision["num_attention_heads"] = vision.get("num_heads")
    vision["num_hidden_layers"] = vision.get("depth")
    return vision


def _qwen3vl_keys(vision: dict, config: dict, pre: dict) -> list:
    out = [("add_vision_use_gelu", True)]
    if vision.get("spatial_merge_size") is not None:
        out.append(("add_vision_spatial_merge_size", int(vision["spatial_merge_size"])))
    out.append(("add_vision_attention_layernorm_eps", (config.get("text_config") or {}).get("rms_norm_eps", 1e-6)))
    deep = [False] * int(vision["num_hidden_layers"] or 0)
    for i in vision.get("deepstack_visual_indexes") or []:
        deep[i] = True
    if deep:
        out.append(("add_vision_is_deepstack_layers", deep))
    return out


def _qwen3vl_special(name: str, vision: dict) -> str | None:
    """Qwen3-VL's merger and deepstack mergers: named by the converter itself, not by the name map."""
    import gguf

    T = gguf.MODEL_TENSOR
    if name.startswith("visual.deepstack_merger_list."):
        index, rest = name.split(".", 3)[2:]
        layer = (vision.get("deepstack_visual_indexes") or [])[int(index)]
        part, suffix = rest.split(".", 1)
        kind = {"norm": T.V_DS_NORM, "linear_fc1": T.V_DS_FC1, "linear_fc2": T.V_DS_FC2}.get(part)
        return None if kind is None else gguf.TENSOR_NAMES[kind].format(bid=layer) + "." + suffix
    if name.startswith("visual.merger."):
        part, suffix = name.split(".", 2)[2].split(".", 1)
        if part == "norm":
            return gguf.TENSOR_NAMES[T.V_POST_NORM] + "." + suffix
        fc = {"linear_fc1": 0, "linear_fc2": 2}.get(part)
        return None if fc is None else gguf.TENSOR_NAMES[T.V_MMPROJ].format(bid=fc) + "." + suffix
    return None


def _gemma4_vision(vision: dict, config: dict) -> dict:
    return {**vision, "image_size": 224}  # the converter's: unused by llama.cpp's gemma4v, which sizes by tokens


def _gemma4_keys(vision: dict, config: dict, pre: dict) -> list:
    pool = vision.get("pooling_kernel_size", 3)
    if pool != 3:  # no key says it: llama.cpp pools Gemma 4's patches 3 x 3, as every released Gemma 4 does
        raise MergeError(f"its vision tower pools {pool} x {pool} patches into one token and llama.cpp's gemma4v 3 x 3, "
                         "so llama.cpp would see images otherwise")
    return [("add_vision_attention_layernorm_eps", vision.get("layer_norm_eps", 1e-6))]


def _gemma4_force(name: str, new: str) -> str | None:
    return "F32" if "position_embedding_table" in name else None


def _gemma4_name(name: str) -> str:
    name = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
    return name + ".weight" if name.endswith(("layer_scalar", "position_embedding_table")) else name


def _pixtral_keys(vision: dict, config: dict, pre: dict) -> list:
    """LlavaVisionModel (Llava with a Pixtral tower, Mistral 3): what llama.cpp's pixtral graph computes, or a refusal."""
    kind = vision.get("model_type")
    if kind != "pixtral":
        raise MergeError(f"its vision tower is {kind}, and llama.cpp's converter writes the mmproj of a Llava with a "
                         "Pixtral vision tower only (LlavaVisionModel), not of a CLIP one such as LLaVA 1.5's")
    layers = int(vision["num_hidden_layers"])
    layer = config.get("vision_feature_layer", -1)
    if layer not in (-1, layers):  # llama.cpp's graph runs every block and uses the last one's output
        raise MergeError(f"it takes the image features from vision layer {layer} (vision_feature_layer), and llama.cpp's "
                         f"pixtral tower from the last of its {layers}")
    strategy = config.get("vision_feature_select_strategy", "full")
    if strategy != "full":  # "default" drops the first patch (a CLIP class token), which llama.cpp keeps
        raise MergeError(f"its vision_feature_select_strategy is {strategy!r}, which drops the first image patch that "
                         "llama.cpp's pixtral tower keeps")
    if config.get("projector_hidden_act", "gelu") != "gelu":
        raise MergeError(f"its projector uses {config.get('projector_hidden_act')} (projector_hidden_act), and "
                         "llama.cpp's pixtral projector always GELU")
    act = vision.get("hidden_act", "gelu")
    if act not in ("gelu", "silu"):  # the converter raises on any other
        raise MergeError(f"its vision tower uses {act} (hidden_act), and llama.cpp's pixtral tower gelu or silu")
    theta = (vision.get("rope_parameters") or {}).get("rope_theta", vision.get("rope_theta", 10000.0))
    if float(theta) != 10000.0:  # no key carries it: clip.cpp fixes the pixtral tower's rope base at 10000
        raise MergeError(f"its vision tower's rope_theta is {theta:g}, and llama.cpp's pixtral tower uses 10000")
    eps = vision.get("layer_norm_eps", 1e-5)  # not in the config: modeling_pixtral's 1e-5 (the converter's default)
    text_eps = (config.get("text_config") or {}).get("rms_norm_eps", eps)
    if config.get("model_type") == "mistral3" and abs(float(text_eps) - float(eps)) > 1e-12:
        raise MergeError(f"its patch merger's norm uses epsilon {text_eps:g} (the text rms_norm_eps), and llama.cpp's "
                         f"pixtral tower the vision one, {eps:g}")
    out = [("add_vision_attention_layernorm_eps", eps), ("add_vision_use_silu" if act == "silu" else "add_vision_use_gelu", True)]
    if "spatial_merge_size" in config:  # Mistral 3's patch merger (Llava's Pixtral 12B has none)
        out.append(("add_vision_spatial_merge_size", int(config["spatial_merge_size"])))
    return out


_PIXTRAL = dict(projector="PIXTRAL", prefixes=("multi_modal_projector.", "vision_tower."),
                renames=(("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector.")),
                keys=_pixtral_keys, permute_qk=True, any_size=True, img_break=True)
_QWEN2VL = dict(prefixes=("visual.",), renames=(("model.visual.", "visual."),), vision=_qwen2vl_vision,
                keys=_qwen2vl_keys, force=_qwen2vl_force, split_qkv=True, split_patch=True)
_QWEN3VL = dict(projector="QWEN3VL", prefixes=("visual.",), renames=(("model.visual.", "visual."),),
                vision=_qwen3vl_vision, keys=_qwen3vl_keys, split_patch=True, special=_qwen3vl_special)

# model_type -> its tower; tested in tests/test_gguf_mmproj.py, run by llama.cpp in benchmarks/llama_cpp_mmproj_check.py
TOWERS: dict[str, Tower] = {
    "gemma3": Tower(
        projector="GEMMA3",
        prefixes=("multi_modal_projector.", "vision_tower.", "multimodal_projector.", "vision_model."),
        renames=(("model.vision_tower.vision_model.", "vision_tower.vision_model."), ("vision_tower.vision_model.", "vision_tower.vision_model."),
                 ("model.vision_tower.", "vision_tower.vision_model."), ("vision_tower.", "vision_tower.vision_model."),
                 ("model.multi_modal_projector.", "multi_modal_projector.")),
        keys=_gemma3_keys, force=_gemma3_force, skip=("vision_model.head.",), plus_one=("soft_emb_norm.weight",),
        rename_weight=True,
    ),
    "gemma4": Tower(  # the vision tower; the audio tower of Gemma 4 E2B / E4B is left out in a notice
        projector="GEMMA4V", prefixes=("model.vision_tower.", "model.embed_vision."), vision=_gemma4_vision,
        keys=_gemma4_keys, force=_gemma4_force, converter_name=_gemma4_name, patch_hwc=True,
        projector_key="add_clip_vision_projector_type", left_out=("model.audio_tower.", "model.embed_audio."),
    ),
    "qwen2_vl": Tower(projector="QWEN2VL", **_QWEN2VL),
    "qwen2_5_vl": Tower(projector="QWEN25VL", **_QWEN2VL),
    "qwen3_vl": Tower(**_QWEN3VL),
    "qwen3_vl_moe": Tower(**_QWEN3VL),
    "mistral3": Tower(**_PIXTRAL),
    "llava": Tower(**_PIXTRAL),  # a Pixtral tower only (Pixtral 12B), as the converter; a CLIP one gets a sentence
}
_BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers", "vt_num_hidden_layers")


def mmproj_out(folder: Path, beside: Path) -> Path:
    """``mmproj-<folder name>-F16.gguf`` in the folder of the language model's GGUF: the converter's prefix; one
    file for every type of the language model (model pages ship one mmproj-F16 beside all quantizations)."""
    return Path(beside).absolute().parent / f"mmproj-{Path(folder).absolute().name}-{MMPROJ_TYPE.upper()}.gguf"


def tower_of(folder: Path) -> tuple[str | None, str | None]:
    """(the folder's model_type, None) when we write its mmproj; (model_type, why not) for another VL folder;
    (None, None) for a text folder."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(config, dict) or "vision_config" not in config:
        return None, None
    model_type = str(config.get("model_type"))
    if model_type not in TOWERS:
        return model_type, NOT_SUPPORTED.format(model_type=model_type)
    return model_type, None


def plan_mmproj(folder: Path, out: Path, overwrite: bool = False):
    """The mmproj file's plan (``gguf.GgufPlan``: keys and tensor infos, nothing written). Raises MergeError
    with the reason (a clause, for a sentence that says the mmproj is not written) when it cannot be."""
    import gguf

    from tui_merger.core.ship import gguf as main

    folder = Path(folder).expanduser().absolute()
    config = _config(folder)
    tower = TOWERS[config["model_type"]]
    vision = config["vision_config"]
    vision = tower.vision(vision, config) if tower.vision else dict(vision)
    pre = _preprocessor(folder)
    for key in ("image_mean", "image_std"):
        if not isinstance(pre.get(key), list):
            raise MergeError(
                f"{folder} has no {key} in preprocessor_config.json (or processor_config.json), which the mmproj must "
                "state; copy those files from the original model"
            )
    text = {**config, **(config.get("text_config") or {})}
    keys = [
        ("add_clip_has_vision_encoder", True),
        ("add_vision_projection_dim", _find(text, ("hidden_size", "n_embd"))),
        ("add_vision_image_size", _find(vision, ("image_size",))),
        ("add_vision_patch_size", _find(vision, ("patch_size",))),
        ("add_vision_embedding_length", _find(vision, ("hidden_size", "width", "vt_hidden_size"))),
        ("add_vision_feed_forward_length", _find(vision, ("intermediate_size", "vt_intermediate_size"))),
        ("add_vision_block_count", _find(vision, _BLOCK_KEYS)),
        ("add_vision_head_count", _find(vision, ("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads"))),
        ("add_vision_image_mean", pre["image_mean"]),
        ("add_vision_image_std", pre["image_std"]),
        (tower.projector_key, getattr(gguf.VisionProjectorType, tower.projector)),
    ]
    keys += tower.keys(vision, config, pre) if tower.keys else []
    if out.exists() and not overwrite:
        raise MergeError(f"{out} exists (pass --overwrite to replace it)")
    source = main._open_source(folder)
    try:
        tensors = _plan_tensors(folder, source, tower, vision, _find(vision, _BLOCK_KEYS))
        writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
        writer.add_type(gguf.GGUFType.MMPROJ)
        name = folder.name
        writer.add_name(name)
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
        for method, value in keys:
            getattr(writer, method)(value)
        for t in tensors:
            writer.add_tensor_info(t.name, t.shape, main._np_float32(), t.nbytes, raw_dtype=gguf.GGMLQuantizationType(t.qtype))
        others = [n for n in source.tensors if tower.left_out and n.startswith(tower.left_out)]
        notices = (f"The audio tower ({len(others)} tensors) is not in {out.name}: tui-merger writes the vision tower, so "
                   "llama.cpp and Ollama read images with it, not sound.",) if others else ()
        plan = main.GgufPlan(folder, out, MMPROJ_TYPE, "clip", name, tuple(tensors), notices, 0, writer, source)
    except BaseException:
        source.close()
        raise
    return plan


def _config(folder: Path) -> dict:
    """The whole config as llama.cpp's converter reads it: transformers' AutoConfig, as a dict (defaults filled)."""
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, local_files_only=True).to_dict()
    except Exception as err:  # the language model's plan has read it already: this is rare
        raise MergeError(f"transformers cannot read {folder / 'config.json'} ({str(err).splitlines()[0][:200]})") from None


def _preprocessor(folder: Path) -> dict:
    """preprocessor_config.json, then processor_config.json over it (its image_processor at the top), as the converter merges them."""
    out: dict = {}
    for name, inner in (("preprocessor_config.json", "media_proc_cfg"), ("processor_config.json", "image_processor")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError):
            raise MergeError(f"{path} is not valid JSON; copy it again from the original model") from None
        if isinstance(cfg, dict):
            out.update(cfg)
            if isinstance(cfg.get(inner), dict):
                out.update(cfg[inner])
    return out


def _find(obj: dict, keys) -> object:
    key = next((k for k in keys if k in obj), None)
    if key is None or obj[key] is None:
        raise MergeError(f"its vision config has none of {', '.join(keys)}, which the mmproj must state")
    return obj[key]


def _plan_tensors(folder: Path, source, tower: Tower, vision: dict, blocks: int) -> list:
    import gguf

    from tui_merger.core.ship.gguf import GgufTensor, _nbytes

    # the converter builds the map for the tower's block count; a projector's layer index (Qwen's mm.2) is
    # looked up in the same map, so a tower of fewer than 3 blocks (a test model) needs a few more indices
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(int(blocks), 3))
    out = []

    heads = int(vision.get("num_attention_heads") or 1)

    def add(new: str, ref, hf: str, shape: tuple, derive=None) -> None:
        qtype = _qtype(tower, hf, new, len(shape))
        permute = heads if tower.permute_qk and hf.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")) else None
        out.append(GgufTensor(new, (ref,), tuple(shape), int(qtype), _nbytes(shape, qtype), derive=derive, permute_heads=permute))

    for ref in source.tensors.values():
        name = ref.name
        for old, new in tower.renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if not name.startswith(tower.prefixes) or "language_model." in name or any(s in name for s in tower.skip):
            continue
        if tower.rename_weight:
            name = name.replace("_weight", ".weight")
        if tower.converter_name:
            name = tower.converter_name(name)
        if ref.dtype not in ("float32", "float16", "bfloat16"):
            raise MergeError(f"{ref.name} in {folder} is {ref.dtype}; the mmproj is written from float32, float16 and bfloat16 weights")
        shape = tuple(ref.shape)
        if tower.split_patch and name.endswith("patch_embed.proj.weight"):
            if len(shape) != 5 or shape[2] != 2:
                raise MergeError(f"{ref.name} is not a patch convolution over 2 frames, which llama.cpp's tower splits in two")
            base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            for frame, new in ((0, base), (1, base + ".1")):
                add(new, ref, name, shape[:2] + shape[3:], derive=_frame(frame))
            continue
        if tower.patch_hwc and name.endswith("patch_embedder.input_proj.weight"):
            p = int((shape[1] // 3) ** 0.5)
            if len(shape) != 2 or 3 * p * p != shape[1]:
                raise MergeError(f"{ref.name} is not a patch embedding over square RGB patches")
            add(_mapped(names, name, ref), ref, name, (shape[0], 3, p, p), derive=_hwc(p))
            continue
        if not shape:  # a scalar: a 1-value tensor, as the converter writes it
            add(_mapped(names, name, ref), ref, name, (1,), derive=_unsqueeze)
            continue
        special = tower.special(name, vision) if tower.special else None
        if tower.split_qkv and ".qkv." in name and special is None:
            if shape[0] % 3:
                raise MergeError(f"{ref.name} has {shape[0]} rows, not q, k and v of equal size")
            c = shape[0] // 3
            for i, part in enumerate("qkv"):
                new = _mapped(names, name.replace("qkv", part), ref)
                add(new, ref, name, (c,) + shape[1:], derive=_rows(i * c, (i + 1) * c))
            continue
        new = special or _mapped(names, name, ref)
        plus = any(name.endswith(p) for p in tower.plus_one)
        add(new, ref, name, shape, derive=_plus_one if plus else None)
    if not out:
        raise MergeError(f"{folder} holds no tensors of its vision tower")
    if tower.img_break:  # LlavaVisionModel: the language model's embedding of [IMG_BREAK], which llama.cpp's pixtral
        # tower requires (clip.cpp) and puts after each row of image tokens; the converter's modify_tensors writes it
        token = img_break_id(folder)
        embed = [r for r in source.tensors.values() if r.name.endswith("embed_tokens.weight") and "vision" not in r.name]
        if len(embed) != 1 or len(embed[0].shape) != 2 or not 0 <= token < embed[0].shape[0]:
            raise MergeError(f"{folder} has no language-model embedding row for its [IMG_BREAK] token (id {token}), which "
                             "llama.cpp's pixtral tower needs")
        add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK], embed[0], embed[0].name, (embed[0].shape[1],),
            derive=_rows(token, token + 1))
    return out


def img_break_id(folder: Path) -> int:
    """The [IMG_BREAK] token's id, looked up as the converter does: tokenizer_config.json's added_tokens_decoder, then
    tokenizer.json's added_tokens."""
    for name, key in (("tokenizer_config.json", "added_tokens_decoder"), ("tokenizer.json", "added_tokens")):
        try:
            found = json.loads((Path(folder) / name).read_text()).get(key) or {}
        except (OSError, ValueError, AttributeError):
            continue
        items = found.items() if isinstance(found, dict) else ((t.get("id"), t) for t in found if isinstance(t, dict))
        for token_id, token in items:
            if isinstance(token, dict) and token.get("content") == "[IMG_BREAK]":
                return int(token_id)
    raise MergeError(f"the tokenizer in {folder} has no [IMG_BREAK] token, whose embedding llama.cpp's pixtral tower puts "
                     "after each row of an image; copy the tokenizer files of the original model")


_SUFFIXES = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")  # Gemma 4's clipped linears


def _mapped(names, name: str, ref) -> str:
    new = names.get_name(name, try_suffixes=_SUFFIXES)
    if new is None:
        raise MergeError(f"{ref.name} has no place in llama.cpp's mmproj layout (gguf's TensorNameMap); the tower is not a plain one")
    return new


def _qtype(tower: Tower, hf: str, new: str, ndim: int):
    """The type llama.cpp's converter gives the tensor at --outtype f16 (its prepare_tensors and the tower's
    tensor_force_quant)."""
    import gguf

    T = gguf.GGMLQuantizationType
    forced = tower.force(hf, new) if tower.force else None
    if forced is None and (".patch_embd.weight" in new or ".patch_merger.weight" in new):
        forced = "F16"  # MmprojModel's own rule
    if ndim <= 1 or new.endswith("_norm.weight"):
        return T.F32
    if forced is None and (new == gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_POS] + ".weight" or not new.endswith(".weight")):
        return T.F32
    return T[forced] if forced else T.F16


def _frame(i: int):
    def derive(w):
        return w[:, :, i, ...]
    return derive


def _hwc(p: int):
    def derive(w):
        return w.reshape(w.shape[0], p, p, 3).permute(0, 3, 1, 2)
    return derive


def _unsqueeze(w):
    return w.reshape(1)


def _rows(start: int, stop: int):
    def derive(w):
        return w[start:stop]
    return derive


def _plus_one(w):
    """Gemma's RMSNorm scales by 1 + w; llama.cpp's by the stored value. In float32 unless the file is f16/f32
    already (the converter adds 1 after widening bf16 only)."""
    import torch

    return (w if w.dtype in (torch.float16, torch.float32) else w.to(torch.float32)) + 1


# -- beside the language model's GGUF ---------------------------------------------------------------------


@dataclass
class Beside:
    out: Path  # the mmproj file
    plan: object = None  # its GgufPlan; None: the file is there already and is used as it is


def beside(text_plan, overwrite: bool) -> Beside | None:
    """The mmproj to write beside the language model's GGUF of ``text_plan`` (a vision-language folder whose
    tower we write), its notice put in place of the "not in this GGUF" one; None (and a sentence why, for a
    vision-language folder) when there is none to write. Nothing is written."""
    from tui_merger.core.merge.output import check_space

    folder = text_plan.folder
    model_type, why = tower_of(folder)
    if model_type is None:
        return None
    notices = list(text_plan.notices)
    if why:
        text_plan.notices = tuple(notices + [why])
        return None
    out = mmproj_out(folder, text_plan.out)
    kept = [n for n in notices if not ("mmproj" in n and "not in this GGUF" in n)]  # gguf_vl's VISION_NOTICE
    if out.exists() and not overwrite:
        text_plan.notices = tuple(kept + [
            f"The vision tower's mmproj file {out.name} is already there beside it: used as it is (it does not depend on "
            "the GGUF type; --overwrite writes it again)."
        ])
        return Beside(out)
    try:
        plan = plan_mmproj(folder, out, overwrite=True)
    except MergeError as err:
        text_plan.notices = tuple(notices + [f"The mmproj file is not written: {str(err).rstrip('.')}."])
        return None
    try:
        check_space(out.parent, text_plan.tensor_bytes + plan.tensor_bytes, "The GGUF and its mmproj file", "an --out")
    except MergeError:  # nothing is written: both plans let go of the folder's files
        plan._source.close()
        text_plan._source.close()
        raise
    text_plan.notices = tuple(kept + [
        f"The vision tower and projector ({len(plan.tensors)} tensors) go to {out.name}, the mmproj file that llama.cpp "
        "(--mmproj) and Ollama load beside the language model's GGUF to read images."
    ])
    return Beside(out, plan)


def companion(text_plan, overwrite: bool):
    """``gguf.export_gguf``'s companion: the mmproj planned beside the GGUF (``beside``), written after it."""
    side = beside(text_plan, overwrite)
    if side is None:
        return None
    return lambda on_event, cancel: write_beside(side, on_event, cancel)


def write_beside(side: Beside, on_event, cancel) -> Path | None:
    """Write the planned mmproj (streamed: temporary name, renamed when complete) and record it in the folder's
    merge_manifest.json, as the GGUF is; the path of the file."""
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import Notice
    from tui_merger.core.ship.gguf import record_gguf, write_gguf

    if side.plan is None:
        return side.out
    try:
        result = write_gguf(side.plan, on_event, cancel)
    except MergeError as err:  # a weight beyond F16's range: the GGUF stands, the mmproj is not written (nothing left)
        if isinstance(err, MergeCancelled):
            raise
        on_event(Notice("warning", f"The GGUF is written, but its mmproj file is not: {str(err).split('; choose')[0].rstrip('.')}."))
        return None
    try:
        record_gguf(side.plan.folder, result)
    except OSError as err:  # a read-only folder: said once for the GGUF already
        on_event(Notice("warning", f"{result.path.name} is written, but merge_manifest.json could not be updated ({err.strerror or err})."))
    return result.path


# -- the check: llama.cpp's image embeddings against transformers' ------------------------------------------

# max |difference| / max |reference|, per tower; measured on tiny towers (docs/formats.md): 5e-5 to 8e-4 (Gemma 4: 2.8e-3
# to 3.7e-3, of which its f16 weights 3e-4), wrong files 2.8e-2 to 0.49 (Gemma 4: 3.9e-2)
CHECK_LIMIT = 5e-3
CHECK_LIMITS = {"gemma4": 1e-2}
_MEMORY_SHARE = 0.6  # of MemAvailable that the reference (the tower and one language-model layer, float32) may take


def check_mmproj(folder: Path, text_gguf: Path, mmproj: Path, reader: str = "auto", on_event=None, cancel=None):
    """Does llama.cpp see an image through the mmproj as transformers does? One random RGB image of a size
    llama.cpp does not resize (the tower's image size, at least 4 x 4 merged patches for Qwen), encoded by llama.cpp's
    libmtmd (``mtmd_init_from_file`` with the language model's GGUF, ``mtmd_tokenize``, ``mtmd_encode_chunk``) and by
    transformers' ``get_image_features`` on the same pixels preprocessed as llama.cpp does ((x / 255 - mean) / std,
    float32, the image processor's patch order); the number of image tokens must be equal and the embeddings within
    ``CHECK_LIMIT``. Only llama.cpp reads an mmproj file: without llama-cpp-python (or with ``reader`` transformers
    or none) the file is "not checked"."""
    from tui_merger.core.events import PhaseStarted
    from tui_merger.core.ship.gguf_check import FAILED, NOT_CHECKED, PASSED, GgufCheck, _first_line, llama_cpp_version

    if reader in ("none", "transformers"):
        why = "skipped (--check none)." if reader == "none" else "only llama.cpp reads an mmproj file (--check transformers)."
        return GgufCheck(NOT_CHECKED, None, why)
    version = llama_cpp_version()
    if version is None:
        return GgufCheck(NOT_CHECKED, None, "llama-cpp-python is not installed, and only llama.cpp reads an mmproj file.")
    name = f"llama.cpp's libmtmd (llama-cpp-python {version})"
    try:
        import llama_cpp.mtmd_cpp  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a binding without libmtmd, or built for another CPU
        return GgufCheck(NOT_CHECKED, None, f"llama_cpp's mtmd binding does not import ({_first_line(err)}).")
    import numpy as np

    folder = Path(folder).absolute()
    config = _config(folder)
    tower = TOWERS[config["model_type"]]
    vision = tower.vision(config["vision_config"], config) if tower.vision else dict(config["vision_config"])
    need = _reference_bytes(folder, config)
    available = _mem_available()
    if available is not None and need > _MEMORY_SHARE * available:
        return GgufCheck(NOT_CHECKED, None, f"transformers' reference (the vision tower and one language-model layer, "
                                            f"about {need >> 20} MiB in float32) does not fit this machine's free memory.")
    if on_event is not None:
        on_event(PhaseStarted("check", f"Checking {Path(mmproj).name}: one image through llama.cpp and transformers"))
    side = int(vision["image_size"])
    if tower.patch_hwc:  # Gemma 4: 9 x 9 tokens of 3 x 3 patches (llama.cpp enlarges an image of fewer tokens)
        side = 9 * 3 * int(vision["patch_size"])
    elif tower.split_patch:  # Qwen: whole merged patches, at least 4 x 4 of them (llama.cpp enlarges smaller images)
        unit = int(vision["patch_size"]) * int(vision.get("spatial_merge_size") or 2)
        side = max(4, -(-side // unit)) * unit
    elif tower.any_size:  # Pixtral: whole merged patches, 4 x 4 to 16 x 16 tokens (llama.cpp resizes outside 8 to 1024)
        unit = int(vision["patch_size"]) * int(config.get("spatial_merge_size") or 1)
        side = max(4, min(16, side // unit)) * unit
    rgb = np.random.default_rng(0).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
    pre = _preprocessor(folder)
    from tui_merger.core.ship.llama_child import LlamaStopped

    from tui_merger.core.errors import MergeCancelled

    try:
        got = _llama_cpp_image(text_gguf, mmproj, rgb, cancel)
    except MergeCancelled:  # the user's Stop: not a finding about the file
        raise
    except LlamaStopped as stop:
        said = stop.sentence(f"encoding an image with {Path(mmproj).name}")
        return GgufCheck(FAILED, name, said) if stop.crashed else GgufCheck(NOT_CHECKED, None, said)
    except Exception as err:  # noqa: BLE001 - llama.cpp refusing the file is the finding
        return GgufCheck(FAILED, name, f"llama.cpp did not load or encode with {Path(mmproj).name} ({_first_line(err)}).")
    try:
        want = _transformers_image(folder, config, rgb, pre)
    except Exception as err:  # noqa: BLE001 - a config the cut-down reference cannot take: said, never PASSED
        return GgufCheck(NOT_CHECKED, None, f"transformers could not build the image reference ({_first_line(err)}).")
    limit = CHECK_LIMITS.get(config["model_type"], CHECK_LIMIT)
    details = {"image": f"{side}x{side}", "tokens": [int(got.shape[0]), int(want.shape[0])], "limit": limit}
    if got.shape[0] != want.shape[0] and (tower.split_patch or tower.patch_hwc or tower.any_size):
        # a tower that reads any image size: llama.cpp resized this one (its pixel limits), so nothing comparable
        return GgufCheck(NOT_CHECKED, None, f"llama.cpp resized the {side}x{side} check image ({got.shape[0]} image "
                                            f"embeddings against transformers' {want.shape[0]}), so they were not compared.", details)
    if got.shape != want.shape:
        return GgufCheck(FAILED, name, f"llama.cpp makes {got.shape[0]} image embeddings of {got.shape[1]} values of a "
                                       f"{side}x{side} image, transformers {want.shape[0]} of {want.shape[1]}.", details)
    rel = float(np.abs(got - want).max() / max(float(np.abs(want).max()), 1e-30))
    details["embeddings_rel"] = rel
    said = (f"{got.shape[0]} image embeddings of a {side}x{side} image, max difference {rel:.2g} of the largest "
            f"(limit {limit:g}).")
    return GgufCheck(PASSED if rel <= limit else FAILED, name, said, details)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reference_bytes(folder: Path, config: dict) -> int:
    """float32 bytes of what the reference loads: every tensor but the language model's layers, and one of them."""
    from tui_merger.core.io.sources import open_model

    layers = int((config.get("text_config") or {}).get("num_hidden_layers") or 1)
    source = open_model(folder)
    try:
        lm = other = 0
        for ref in source.tensors.values():
            n = 1
            for d in ref.shape:
                n *= d
            if "language_model" in ref.name or ref.name.startswith(("model.layers.", "lm_head.", "model.embed_tokens.")):
                lm += n
            else:
                other += n
    finally:
        source.close()
    return 4 * (other + lm // max(1, layers))


def _llama_cpp_image(text_gguf: Path, mmproj: Path, rgb, cancel=None):
    """llama.cpp's embeddings of one image: (tokens, width) float32, from libmtmd in a child process (llama_child):
    a failed assert in llama.cpp aborts that process, not tui-merger (raises LlamaStopped)."""
    import os

    from tui_merger.core.ship.llama_child import run

    task = {"kind": "image", "model": str(text_gguf), "mmproj": str(mmproj), "threads": max(1, min(4, os.cpu_count() or 1))}
    out, arrays = run(task, image=rgb, cancel=cancel)
    if out.get("error"):
        raise RuntimeError(out["message"])
    return arrays["embd"]


def _transformers_image(folder: Path, config: dict, rgb, pre: dict):
    """transformers' embeddings of the image (``get_image_features``): the VL model loaded by transformers with its
    language model cut to one layer and an 8-token vocabulary (the image path does not use it; memory stays the
    tower's), the pixels preprocessed as llama.cpp does."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    text = cfg.get_text_config(decoder=True)
    text.num_hidden_layers = 1
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:1]
    text.vocab_size = 8
    for key, value in (("num_kv_shared_layers", 0), ("vocab_size_per_layer_input", 8)):  # Gemma 4's, for one layer
        if getattr(text, key, None) is not None:
            setattr(text, key, value)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the load report lists the layers left out on purpose
    try:
        model = transformers.AutoModelForImageTextToText.from_pretrained(
            folder, config=cfg, dtype=torch.float32, ignore_mismatched_sizes=True, local_files_only=True).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
    mean = np.array(pre["image_mean"], dtype=np.float32)
    std = np.array(pre["image_std"], dtype=np.float32)
    x = ((rgb.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)  # C, H, W
    inner = model.model
    with torch.no_grad():
        if config["model_type"] == "gemma4":  # Gemma4ImageProcessor's patches (p, p, C order), their (x, y), no padding
            p = cfg.vision_config.patch_size
            c, h, w = x.shape
            patches = x.reshape(c, h // p, p, w // p, p).transpose(1, 3, 2, 4, 0).reshape((h // p) * (w // p), -1)
            gx, gy = np.meshgrid(np.arange(w // p), np.arange(h // p), indexing="xy")
            pos = torch.from_numpy(np.stack([gx, gy], axis=-1).reshape(1, -1, 2))
            t = _as_tensor(inner.get_image_features(torch.from_numpy(np.ascontiguousarray(patches))[None], pos))
            return t.reshape(-1, t.shape[-1]).numpy()
        if config["vision_config"].get("model_type") == "pixtral":  # Llava, Mistral 3: the image and its size
            h, w = x.shape[1:]
            t = _as_tensor(inner.get_image_features(pixel_values=torch.from_numpy(np.ascontiguousarray(x[None])),
                                                    image_sizes=torch.tensor([[h, w]])))
            unit = int(cfg.vision_config.patch_size) * int(config.get("spatial_merge_size") or 1)
            rows = list(t.reshape(h // unit, w // unit, -1).numpy())
            brk = _img_break_row(folder)[None]  # llama.cpp ends each row but the last with [IMG_BREAK]'s embedding
            return np.concatenate([p for i, r in enumerate(rows) for p in ([r, brk] if i < len(rows) - 1 else [r])])
        if "temporal_patch_size" not in config["vision_config"]:  # Gemma 3: the image as it is
            t = _as_tensor(inner.get_image_features(torch.from_numpy(np.ascontiguousarray(x[None]))))
            return t.reshape(-1, t.shape[-1]).numpy()
        vc = cfg.vision_config
        patch, merge, temporal = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
        c, h, w = x.shape
        gh, gw = h // patch, w // patch
        frames = np.repeat(x[None], temporal, axis=0)  # one image: its frame repeated, as Qwen2VLImageProcessor does
        p = frames.reshape(1, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
        p = p.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, c * temporal * patch * patch)
        out = inner.get_image_features(torch.from_numpy(np.ascontiguousarray(p)), torch.tensor([[1, gh, gw]]))
        t = _as_tensor(out)
        deep = getattr(out, "deepstack_features", None)
        if deep:  # Qwen3-VL: llama.cpp's embedding is the merger's output and each deepstack merger's side by side
            t = torch.cat([t] + [_as_tensor(list(d)) for d in deep], dim=-1)
        return t.reshape(-1, t.shape[-1]).numpy()


def _img_break_row(folder: Path):
    """The language model's embedding of [IMG_BREAK], float32, read from the folder's own file (the cut-down reference
    model has no vocabulary)."""
    from tui_merger.core.io.sources import open_model

    token = img_break_id(folder)
    source = open_model(folder)
    try:
        ref = next(r for r in source.tensors.values() if r.name.endswith("embed_tokens.weight") and "vision" not in r.name)
        return ref.load()[token].float().numpy().copy()
    finally:
        source.close()


def _as_tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    pooled = getattr(out, "pooler_output", None)
    out = pooled if pooled is not None else out
    if isinstance(out, (list, tuple)):
        return torch.cat([o if o.ndim > 1 else o[None] for o in out], dim=0)
    return out
