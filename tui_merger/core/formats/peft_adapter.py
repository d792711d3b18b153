"""The PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``/``.bin``), as peft's
``save_pretrained`` writes it; also a trainer's ``checkpoint-N`` folder that holds one.

Detect: a folder with ``adapter_config.json`` (r, alpha, targets from it; the LoRA modules counted from
the safetensors header). Open: ``adapter.open_adapter`` (config checked, tensors grouped by module).
Reference: peft loads the folder itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from shlex import quote

from tui_merger.core.formats.adapter import ADAPTER_WEIGHTS, PEFT_DEFAULT_ALPHA, open_adapter
from tui_merger.core.formats.base import ALL, TRAINER_STEP, Candidate, Format, Found, lora_info, step_of
from tui_merger.core.io.files import TOKENIZER_MARKERS, architecture, is_vision_language

_LORA_A = re.compile(r"^(.+)\.lora_(?:embedding_)?A\b")


def _parameter_pair(cfg: dict, module: str) -> bool:
    """Whether a LoRA pair saved under ``module`` belongs to a parameter (peft's target_parameters:
    packed experts, a router's weight), as the adapter reader decides it; such pairs are no modules."""
    from tui_merger.core.formats.adapter import PEFT_PREFIX, module_targeted, targeted_parameters

    module = module.removeprefix(PEFT_PREFIX)
    targets = cfg.get("target_parameters") if isinstance(cfg, dict) else None
    if not targets:
        return False
    _owner, depth, params = targeted_parameters(module, targets)
    return bool(params) and (depth > 0 or not module_targeted(cfg, module))


class PeftAdapterFormat(Format):
    kind = "peft-adapter"
    role = "adapter"
    label = "a PEFT adapter folder"

    def detect(self, s, folder: Path, names: dict) -> Found | None:
        if "adapter_config.json" not in names:
            return None
        step = step_of(folder.name, TRAINER_STEP)
        c = Candidate(
            "trainer-checkpoint" if step is not None else self.kind,
            str(folder), step=step, run=str(folder.parent) if step is not None else None, needs_base=True,
        )
        cfg = s.json(folder / "adapter_config.json", quiet_missing=False)
        weights = next((w for w in ADAPTER_WEIGHTS if w in names), None)
        n_modules = None
        if weights is None:
            c.notes.append("no adapter_model.safetensors or adapter_model.bin: the adapter weights are missing.")
        elif weights.endswith(".safetensors"):
            c.dtype, infos = s.headers_dtype(folder, [weights])
            modules = {m.group(1) for i in infos if (m := _LORA_A.match(i.name))}
            n_modules = len([m for m in modules if not _parameter_pair(cfg or {}, m)]) if infos else None
        if cfg is not None:
            peft_type = str(cfg.get("peft_type", "LORA")).upper()
            if peft_type == "LORA":
                c.lora = lora_info(cfg, n_modules)
                if c.lora["alpha"] is None:
                    c.notes.append("adapter_config.json has no lora_alpha: peft, and the merge, would use 8.")
                elif not c.lora["alpha"] and not c.lora["alpha_pattern"]:
                    c.notes.append("lora_alpha is 0, so the adapter changes nothing: the merge needs --lora-alpha.")
            else:
                c.notes.append(f"a {peft_type} adapter: tui-merger merges LoRA adapters only.")
            base = cfg.get("base_model_name_or_path")
            c.base_model = base if isinstance(base, str) and base else None
            if c.base_model is None:
                c.notes.append("adapter_config.json names no base model: pass --base with the model it was trained on.")
            s.resolve_base(c, folder)
            base_config = s.json(Path(c.base_path) / "config.json") if c.base_path else None
            if base_config and is_vision_language(base_config):
                c.notes.append(f"for a vision-language model ({architecture(base_config)}).")
        if "latest" in names:  # a LoRA run under DeepSpeed: its ZeRO files are beside the adapter
            from tui_merger.core.formats.deepspeed_zero import zero_files_note

            note = zero_files_note(folder, names)
            if note:
                c.notes.append(note)
        c.tokenizer = any(m in names for m in TOKENIZER_MARKERS)
        s.sized(c, names.values(), recursive=step is not None)
        return Found(c, ALL if step is not None else {"adapter_config.json", *ADAPTER_WEIGHTS})

    def recognizes(self, path: Path) -> bool:
        """A folder (a missing one too: opening it says what is wrong), or the adapter_model file in
        a folder with adapter_config.json."""
        if path.is_dir() or not path.exists():
            return True
        return path.name in ADAPTER_WEIGHTS and (path.parent / "adapter_config.json").is_file()

    def why_not_mergeable(self, c: Candidate) -> str | None:
        if c.step is not None and not c.lora:
            return "This checkpoint holds full weights, already a model: there is nothing to merge."
        return None

    def can_weight(self, c: Candidate) -> bool:
        return True

    def needs_alpha(self, c: Candidate) -> bool:  # none recorded, or a 0 that would change nothing
        return bool(c.lora) and (c.lora.get("alpha") is None or not (c.lora.get("alpha") or c.lora.get("alpha_pattern")))

    def alpha_default(self, c: Candidate) -> float | None:
        if c.lora and c.lora.get("alpha") is not None:  # a recorded 0: the user's value is needed
            return None
        return PEFT_DEFAULT_ALPHA  # what peft itself uses

    def next_step(self, c: Candidate, path: str, base_arg: str, out: str) -> str:
        return f"tui-merger merge --base {base_arg} --adapter {quote(path)} --out {quote(out)}"

    def open_adapter(self, path: Path, base_names, config: dict | None = None, alpha_given: bool = False):
        return open_adapter(path if path.is_dir() or not path.exists() else path.parent, alpha_given=alpha_given)

    def reference_folder(self, adapter, tmp: Path, name: str) -> Path:
        if adapter.relayout:  # expert LoRA in an older peft's layout: the installed peft reads its own
            from tui_merger.core.formats.adapter import relaid_copy

            return relaid_copy(adapter, Path(tmp) / name)
        if adapter.alpha_from == "--lora-alpha":  # the user's alpha, which the folder's config does not say
            from tui_merger.core.formats.adapter import alpha_copy

            return alpha_copy(adapter, Path(tmp) / name)
        return adapter.folder
