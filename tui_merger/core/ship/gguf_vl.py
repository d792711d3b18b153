"""The language model of a vision-language folder, as GGUF export sees a text model.

Every released Gemma 3 (4B and up) and Gemma 4 checkpoint is a ``...ForConditionalGeneration`` folder:
``config.json`` with ``text_config`` and ``vision_config``, the language model under
``language_model.model.*`` or ``model.language_model.*``, the vision tower and its projector beside it.
llama.cpp's converter writes the language model of such a folder into the main GGUF under the text
architecture (gemma3, gemma4) and the vision tower into a separate mmproj file (``--mmproj``), which
tui-merger does not write. This module gives ``gguf.py`` that language model:

- ``text_config``: the text config's dict (what the top level says for the whole model, e.g.
  ``tie_word_embeddings``, overrides it), with the text causal LM's class as ``architectures``;
- ``text_hf_config``: the same as transformers' config object (``get_text_config``);
- ``TextSource``: the folder's tensors under the text model's names, the others left out. The names
  are transformers' own: on-disk -> in-memory by the VL class's loading rules (``hf_names.renamer``), then
  the decoder module's prefix and the output embedding's name in the VL model replaced by the text
  model's (both models built on the meta device, the modules found by ``get_decoder`` and
  ``get_output_embeddings``), then in-memory -> on-disk by the text class's saving rules.

transformers is imported inside functions only.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tui_merger.core.errors import MergeError

VISION_NOTICE = (
    "{n} tensor(s) of the vision tower and projector{audio} ({first}...) are not in this GGUF: it holds the language "
    "model only, which llama.cpp, Ollama and LM Studio run on text; llama.cpp keeps a vision tower in a separate "
    "mmproj file, which tui-merger does not write."
)


# the vision-language model types whose language model GGUF export writes -> that language model's type (a text
# family of gguf_families); tested in tests/test_gguf_vl_text.py, run by llama.cpp in benchmarks/llama_cpp_check.py
TEXT_OF = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}


def is_vl(config: dict) -> bool:
    return "text_config" in config or "vision_config" in config


def text_config(folder: Path, config: dict, families: dict, family_names: str) -> dict:
    """The text model's config dict of a VL folder; one sentence when its language model is not a family we write."""
    text = config.get("text_config")
    model_type = config.get("model_type")
    inner = text.get("model_type") if isinstance(text, dict) else None
    if TEXT_OF.get(model_type) != inner or inner not in families:
        raise MergeError(
            f"{folder} is a vision-language model ({model_type}) whose language model "
            f"({inner or 'of unknown type'}) is not one GGUF export writes; tui-merger writes the language model of "
            f"Gemma 3 and Gemma 4 vision-language folders and the text families {family_names}."
        )
    out = dict(text)
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in config:
            out[key] = config[key]
    name = _causal_class_name(inner)
    out["architectures"] = [name] if name else []
    return out


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
    return text


def text_names(folder: Path, disk_names, text_cfg) -> tuple[dict[str, str], list[str]]:
    """({text model's on-disk name: the folder's on-disk name}, [the folder's names left out: vision, projector])."""
    import torch
    import transformers

    from tui_merger.core.formats import hf_names

    vl = hf_names._meta_of(folder)
    name = _causal_class_name(text_cfg.model_type)
    cls = getattr(transformers, name, None) if name else None
    if vl is None or cls is None:
        raise MergeError(f"transformers cannot build the model of {folder} to place its language model's tensors.")
    text = hf_names.meta_model(cls, text_cfg)

    def path_of(model, module) -> str | None:
        return next((n for n, m in model.named_modules() if m is module), None)

    vl_dec, text_dec = path_of(vl, vl.get_decoder()), path_of(text, text.get_decoder())
    vl_head, text_head = path_of(vl, vl.get_output_embeddings()), path_of(text, text.get_output_embeddings())
    if not vl_dec or not text_dec:
        raise MergeError(f"transformers names no language model (decoder) inside {folder}'s {type(vl).__name__}.")
    vl_state = dict(vl.state_dict(keep_vars=True))
    text_state = dict(text.state_dict(keep_vars=True))
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
        if converter is not None or target not in text_state:
            raise MergeError(
                f"{disk} in {folder} belongs to the language model but has no place in transformers' "
                f"{cls.__name__}; the folder is not a plain {type(vl).__name__}."
            )
        if revert_weight_conversion is not None:
            saved = revert_weight_conversion(text, {target: torch.empty(0)})
            target = next(iter(saved)) if len(saved) == 1 else target
        mapping[target] = disk
    return mapping, left_out


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


def text_source(folder: Path, source, text_cfg, notices: list) -> TextSource:
    """``source`` (the VL folder's) under the text model's names; a notice for what is left out."""
    mapping, left_out = text_names(folder, list(source.tensors), text_cfg)
    if left_out:
        audio = " and of the audio tower" if any("audio" in name for name in left_out) else ""  # Gemma 4 E2B / E4B
        notices.append(VISION_NOTICE.format(n=len(left_out), first=left_out[0], audio=audio))
    return TextSource(source, mapping)
