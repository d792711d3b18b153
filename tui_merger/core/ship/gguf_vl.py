"""The language model of a vision-language folder, as GGUF export sees a text model.

Vision-language checkpoints are ``...ForConditionalGeneration`` folders: ``config.json`` with ``text_config``
(Qwen2-VL and Qwen2.5-VL as released: the text fields at the top level) and ``vision_config``, the language
model under ``model.language_model.*``, ``language_model.model.*`` or ``model.*``, the vision tower and its
projector beside it. llama.cpp's converter writes the language model of such a folder into the main GGUF
(Gemma 3 / Gemma 4 under the text architecture; Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE under their own
M-RoPE architectures qwen2vl, qwen3vl, qwen3vlmoe; Llava under its language model's; Mistral 3 as mistral3) and
the vision tower into a separate mmproj file (``--mmproj``). ``TEXT_OF`` says which folder's language model is
written as which family of ``gguf_families``. This module gives ``gguf.py`` that language model:

- ``text_config``: the text config's dict (what the top level says for the whole model, e.g.
  ``tie_word_embeddings``, overrides it), its ``model_type`` the family's, with the text causal LM's class
  as ``architectures`` where transformers has one;
- ``text_hf_config``: the same as transformers' config object (``get_text_config``), the vision config beside it;
- ``TextSource``: the folder's tensors under the text model's names, the others left out. The names
  are transformers' own: on-disk -> in-memory by the VL class's loading rules (``hf_names.renamer``), then
  the decoder module's prefix and the output embedding's name in the VL model replaced by the text
  model's (both models built on the meta device, the modules found by ``get_decoder`` and
  ``get_output_embeddings``; where transformers has no causal LM for the text model, as for the Qwen VL
  ones, its base model under ``base_model_prefix`` and the VL model's own head), then in-memory -> on-disk
  by the text class's saving rules.

transformers is imported inside functions only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tui_merger.core.errors import MergeError

VISION_NOTICE = (
    "{n} tensor(s) of the vision tower and projector{audio} ({first}...) are not in this GGUF: it holds the language "
    "model only, which llama.cpp, Ollama and LM Studio run on text; llama.cpp keeps a vision tower in a separate "
    "mmproj file (written beside it where tui-merger knows the tower, unless --no-mmproj)."
)


# vision-language model_type -> (what its folders are called, {its language model's model_type: the family of
# gguf_families it is written as}), as llama.cpp's converter writes them (its Llava class: LlamaModel's layout;
# Mistral3Model: mistral3); tested in tests/test_gguf_vl_text.py, run by llama.cpp in benchmarks/llama_cpp_check.py
TEXT_OF = {
    "gemma3": ("Gemma 3", {"gemma3_text": "gemma3_text"}),
    "gemma4": ("Gemma 4", {"gemma4_text": "gemma4_text"}),
    "qwen2_vl": ("Qwen2-VL", {"qwen2_vl_text": "qwen2_vl_text"}),
    "qwen2_5_vl": ("Qwen2.5-VL", {"qwen2_5_vl_text": "qwen2_5_vl_text"}),
    "qwen3_vl": ("Qwen3-VL", {"qwen3_vl_text": "qwen3_vl_text"}),
    "qwen3_vl_moe": ("Qwen3-VL-MoE", {"qwen3_vl_moe_text": "qwen3_vl_moe_text"}),
    "llava": ("Llava (with a Llama, Mistral or Qwen2 language model)", {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}),
    "mistral3": ("Mistral 3 (Mistral Small 3.1 and 3.2, with a Mistral language model)", {"mistral": "mistral3"}),
}


def is_vl(config: dict) -> bool:
    return "text_config" in config or "vision_config" in config


def vl_names() -> str:
    """The vision-language folders whose language model GGUF export writes, for a sentence."""
    titles = [title for title, _ in TEXT_OF.values()]
    return ", ".join(titles[:-1]) + " and " + titles[-1]


def text_config(folder: Path, config: dict, families: dict) -> dict:
    """The text model's config dict of a VL folder; one sentence when its language model is not a family we write."""
    model_type = config.get("model_type")
    _title, written_as = TEXT_OF.get(model_type, ("", {}))
    text = config.get("text_config")
    if not isinstance(text, dict) and written_as:  # the text fields at the top level (Qwen2-VL, Qwen2.5-VL as released)
        text = _text_dict(folder)
    inner = text.get("model_type") if isinstance(text, dict) else None
    family = written_as.get(inner)
    if family is None or family not in families:
        raise MergeError(
            f"{folder} is a vision-language model ({model_type}) whose language model "
            f"({inner or 'of unknown type'}) is not one GGUF export writes; tui-merger writes the language model of "
            f"{vl_names()} vision-language folders."
        )
    out = dict(text)
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in config:
            out[key] = config[key]
    name = _causal_class_name(inner)
    out["architectures"] = [name] if name else []
    out["model_type"] = family
    return out


def _text_dict(folder: Path) -> dict | None:
    """transformers' text config of a VL folder whose config.json keeps the text fields at its top level."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        return config.get_text_config(decoder=True).to_dict()
    except Exception:  # noqa: BLE001 - a config transformers cannot build: the caller says so in one sentence
        return None


def _causal_class_name(model_type: str) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def text_hf_config(config):
    """transformers' text config of a VL config object, with the whole model's ``tie_word_embeddings``."""
    text = config.get_text_config(decoder=True)
    if text is config:
        return config
    tie = getattr(config, "tie_word_embeddings", None)
    if tie is not None:
        text.tie_word_embeddings = bool(tie)
    # what the language model's keys may say of the vision tower (Qwen3-VL's deepstack layers: gguf_families)
    text.gguf_vision_config = getattr(config, "vision_config", None)
    return text


def text_names(folder: Path, disk_names, text_cfg, derived: tuple = ()) -> tuple[dict[str, str], list[str]]:
    """({text model's on-disk name: the folder's on-disk name}, [the folder's names left out: vision, projector]).

    ``derived``: the modules whose GGUF tensors the family computes from the on-disk tensor itself (Qwen3-VL-MoE's
    packed experts, whose layout it tells by shape as transformers' loading does); a tensor transformers converts on
    load is taken only there."""
    import torch
    import transformers

    from tui_merger.core.formats import hf_names

    vl = hf_names._meta_of(folder)
    name = _causal_class_name(text_cfg.model_type)
    cls = getattr(transformers, name, None) if name else None
    base = None if cls is not None else _base_class(text_cfg.model_type)
    if vl is None or (cls is None and base is None):
        raise MergeError(f"transformers cannot build the model of {folder} to place its language model's tensors.")

    def path_of(model, module) -> str | None:
        return next((n for n, m in model.named_modules() if m is module), None)

    vl_dec, vl_head = path_of(vl, vl.get_decoder()), path_of(vl, vl.get_output_embeddings())
    if cls is not None:
        text = hf_names.meta_model(cls, text_cfg)
        text_dec, text_head = path_of(text, text.get_decoder()), path_of(text, text.get_output_embeddings())
        text_state = dict(text.state_dict(keep_vars=True))
        owner = cls.__name__
    else:  # no causal LM class (the Qwen VL text models): as one, its base model under base_model_prefix, the VL's head
        text = hf_names.meta_model(base, text_cfg)
        text_dec, text_head = base.base_model_prefix, vl_head
        text_state = {f"{text_dec}.{k}": v for k, v in text.state_dict(keep_vars=True).items()}
        owner = base.__name__
    if not vl_dec or not text_dec:
        raise MergeError(f"transformers names no language model (decoder) inside {folder}'s {type(vl).__name__}.")
    vl_state = dict(vl.state_dict(keep_vars=True))
    rename = hf_names.renamer(vl, vl_state)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # older transformers: in-memory names are the on-disk ones
        revert_weight_conversion = None
    mapping: dict[str, str] = {}
    left_out: list[str] = []
    for disk in disk_names:
        memory, _pattern, converter = rename(disk)
        if memory.startswith(vl_dec + "."):
            target = text_dec + memory[len(vl_dec):]
        elif vl_head and text_head and memory.startswith(vl_head + "."):
            target = text_head + memory[len(vl_head):]
        else:
            left_out.append(disk)
            continue
        head = vl_head and memory.startswith(vl_head + ".")
        placed = target in text_state or (cls is None and head and memory in vl_state)
        if converter is not None and any(target.endswith(f".{module}") for module in derived):
            converter = None  # the family reads this tensor as it is on disk (gguf_families' derive)
        if converter is not None or not placed:
            raise MergeError(
                f"{disk} in {folder} belongs to the language model but has no place in transformers' "
                f"{owner}; the folder is not a plain {type(vl).__name__}."
            )
        if revert_weight_conversion is not None and cls is not None:
            saved = revert_weight_conversion(text, {target: torch.empty(0)})
            target = next(iter(saved)) if len(saved) == 1 else target
        mapping[target] = disk
    return mapping, left_out


def _base_class(model_type: str):
    """transformers' base model class of a text model_type (Qwen2_5_VLTextModel), or None."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if isinstance(name, str) else None


class TextSource:
    """The folder's source seen under the text model's names: refs renamed, the rest left out; reads go to the
    folder's own refs."""

    def __init__(self, inner, mapping: dict[str, str]) -> None:
        self.inner = inner
        self.folder = getattr(inner, "folder", None)
        self.files = inner.files
        self._old = {}
        self.tensors = {}
        for new, old in mapping.items():
            ref = inner.tensors[old]
            self.tensors[new] = replace(ref, source=self, name=new)
            self._old[new] = ref

    def _ref(self, ref):
        return self._old[ref.name]

    def load(self, ref):
        return self.inner.load(self._ref(ref))

    def load_into(self, ref, out) -> None:
        self.inner.load_into(self._ref(ref), out)

    def row_blocks(self, ref):
        return self.inner.row_blocks(self._ref(ref))

    def raw_ranges(self, ref):
        return self.inner.raw_ranges(self._ref(ref))

    def prefetch(self, ref) -> None:
        self._ref(ref).prefetch()

    def prefetch_rows(self, ref, start: int, stop: int) -> None:
        self._ref(ref).prefetch_rows(start, stop)

    def release_rows(self, ref, start: int, stop: int) -> None:
        self._ref(ref).release_rows(start, stop)

    def release(self, ref) -> None:
        self.inner.release(self._ref(ref))

    def close(self) -> None:
        self.inner.close()


def tied(source: TextSource, tie: bool, notices: list) -> bool:
    """Whether the GGUF leaves the output matrix out (llama.cpp then uses the embedding): the whole model's
    ``tie_word_embeddings``, unless the folder holds its own output matrix. transformers 5 ties by the top level of
    the config, whose default is true (Mistral Small 3.1's config.json says nothing there, its text_config says
    false), but does not tie a head that the checkpoint holds with other values; llama.cpp's converter writes a
    head that is there."""
    if tie and "lm_head.weight" in source.tensors:
        notices.append("The folder holds its own output matrix although its config ties it to the embedding "
                       "(tie_word_embeddings): the GGUF keeps it, as transformers and llama.cpp's converter do.")
        return False
    return tie


def text_source(folder: Path, source, text_cfg, notices: list, derived: tuple = ()) -> TextSource:
    """``source`` (the VL folder's) under the text model's names; a notice for what is left out."""
    mapping, left_out = text_names(folder, list(source.tensors), text_cfg, derived)
    if left_out:
        audio = " and of the audio tower" if any("audio" in name for name in left_out) else ""  # Gemma 4 E2B / E4B
        notices.append(VISION_NOTICE.format(n=len(left_out), first=left_out[0], audio=audio))
    return TextSource(source, mapping)
