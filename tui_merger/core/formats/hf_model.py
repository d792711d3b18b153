"""A Hugging Face model folder (``config.json`` + ``model*.safetensors`` or ``pytorch_model*.bin``), as
``save_pretrained`` writes it; also a trainer's ``checkpoint-N`` folder with full weights.

Detect: a folder with config.json and weight files (their index read, the dtype from the headers); a
``checkpoint-N`` folder with weights or ``trainer_state.json``. Nothing to merge: it is what adapters are
merged into. Open: ``io.sources.open_model`` (the base of an adapter merge).
"""

from __future__ import annotations

from pathlib import Path

from tui_merger.core.formats.base import ALL, TRAINER_STEP, Candidate, Format, Found, step_of
from tui_merger.core.io.files import PROCESSOR_FILES, TOKENIZER_MARKERS, architecture, config_dtype, is_vision_language
from tui_merger.core.io.sources import BIN_INDEX, SAFE_INDEX, open_model


class HfModelFormat(Format):
    kind = "hf-model"
    role = "model"
    label = "a Hugging Face model folder"

    def detect(self, s, folder: Path, names: dict) -> Found | None:
        step = step_of(folder.name, TRAINER_STEP)
        weights = s.weight_files(folder, names)
        if step is not None and (weights or "trainer_state.json" in names):
            return Found(self._candidate(s, folder, names, weights, step), ALL)
        if "config.json" in names and weights:
            return Found(self._candidate(s, folder, names, weights, None), {*weights, SAFE_INDEX, BIN_INDEX})
        return None

    def _candidate(self, s, folder: Path, names: dict, weights: list[str], step: int | None) -> Candidate:
        kind = "trainer-checkpoint" if step is not None else self.kind
        c = Candidate(kind, str(folder), step=step, run=str(folder.parent) if step is not None else None)
        config = s.json(folder / "config.json")
        present = [w for w in weights if w in names]
        header_dtype, _ = s.headers_dtype(folder, present)
        said_dtype = config_dtype(config)
        c.dtype = header_dtype or said_dtype
        released = _released_quantized(config, folder)
        if released:
            c.notes.append(released)
            c.dtype = said_dtype or header_dtype
        elif header_dtype and said_dtype and header_dtype != said_dtype:
            c.notes.append(f"config.json says {said_dtype} but the weights are stored in {header_dtype}.")
        missing = [w for w in weights if w not in names]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            c.notes.append(f"the weight index names missing files ({', '.join(missing[:3])}{more}): the weights are incomplete.")
        if not weights:
            zero = "zero_to_fp32.py" in names or any(n.startswith("global_step") for n in names)
            c.notes.append(
                "no model weights: only DeepSpeed ZeRO shards (run its zero_to_fp32.py to get them)."
                if zero else "no model weights or adapter: only trainer state."
            )
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        if config and is_vision_language(config):
            c.notes.append(vision_note(config, names))
        s.sized(c, names.values(), recursive=step is not None)
        return c

    def recognizes(self, path: Path) -> bool:
        return (path / "config.json").is_file()

    def why_not_mergeable(self, c: Candidate) -> str | None:
        if _weightless(c):
            return f"This checkpoint has {_weightless(c).rstrip('.')}, so there is nothing to merge."
        if c.step is not None:
            return "This checkpoint holds full weights, already a model: there is nothing to merge."
        return "This is already a complete Hugging Face model: there is nothing to merge."

    def needs_base(self, c: Candidate) -> bool:
        return False

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        if _weightless(c):
            return f"{path} holds no model weights (see its notes): nothing to merge or load."
        return f"{path} is a full model, not an adapter: nothing to merge; load it as it is."

    def open_base(self, path: Path):
        return open_model(path)


def _weightless(c: Candidate) -> str | None:
    """The note of a trainer checkpoint that holds no weights (only trainer state), if it is one."""
    return next((n for n in c.notes if n.startswith("no model weights")), None)


def vision_note(config: dict, names) -> str:
    """What inspect says of a vision-language model."""
    note = f"vision-language model ({architecture(config)}): the vision tower is copied as it is unless an adapter targets it"
    if not any(n in names for n in PROCESSOR_FILES):
        note += "; no preprocessor_config.json here, so it will not take images until the processor files are added"
    return note + "."


def _released_quantized(config, folder=None) -> str | None:
    """What inspect says of a model released quantized (FP8 blocks, compressed-tensors FP8; ModelOpt's
    hf_quant_config.json beside the config)."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.dequant import model_dtype, scheme_for

    try:
        scheme = scheme_for(config, folder)
    except MergeError as err:
        return f"quantized, but its quantization_config cannot be read: {err}"
    if scheme is None:
        return None
    return (f"{scheme.label}, as released: an adapter merges into its weights dequantized to {model_dtype(config)} "
            f"(as transformers' {scheme.loader} loads them); the output is a plain {model_dtype(config)} model.")
