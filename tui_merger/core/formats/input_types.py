"""What the opened inputs of a merge are (shared by inputs.py and the checkpoint readers it calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.formats.adapter import PeftAdapter
from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import FilePlan
from tui_merger.core.options import MergeOptions


@dataclass
class Inputs:
    base: object  # a TensorSource (or a view of one)
    adapter: PeftAdapter
    config: dict
    files: FilePlan
    paths: list[Path]  # folders that must never be overwritten
    dtype: str | None = None  # default output dtype when the user chose none
    config_changes: dict = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    infos: list[str] = field(default_factory=list)  # said as information, not warnings ("alpha 32, from --lora-alpha")
    closers: list = field(default_factory=list)
    read_files: list[Path] = field(default_factory=list)  # every input file the output depends on
    base_weights: dict = field(default_factory=lambda: {"weights": "as stored"})  # or the --qlora-base round trip
    parts: list = field(default_factory=list)  # a weighted merge: [(PeftAdapter, weight, path), ...]
    format: object = None  # the checkpoint kind (a Format) that opened these; None: a base with adapters
    memory_adapter: object = None  # the adapter under the names transformers keeps in memory, where they differ (for peft)

    def close(self) -> None:
        for item in self.closers:
            item.close()


def paths_of(options: MergeOptions) -> list[Path]:
    extra = [p for p, _ in options.adapters[1:]]
    return [p for p in (options.base, options.adapter, options.checkpoint, *extra) if p is not None]


def _value_model(inputs: Inputs, options: MergeOptions, layout) -> None:
    """verl's critic is a TokenClassification model with one label, saved with the actor's config."""
    names = inputs.base.tensors
    score = names.get("score.weight")
    is_value = options.is_value_model or (layout.role == "critic" and score is not None)
    if not is_value:
        return
    if score is None or score.shape[0] != 1:
        raise MergeError(
            "--is-value-model was given but the checkpoint has no score.weight with one row; "
            "is it a critic checkpoint?"
        )
    archs = inputs.config.get("architectures") or []
    new = [a.replace("ForCausalLM", "ForTokenClassification") for a in archs] or None
    if new:
        inputs.config_changes["architectures"] = new
    inputs.config_changes["id2label"] = {"0": "LABEL_0"}
    inputs.config_changes["label2id"] = {"LABEL_0": 0}
