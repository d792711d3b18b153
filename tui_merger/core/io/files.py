"""Everything a merged model folder needs besides weights: config, generation config, tokenizer,
chat template, processor files, custom code, licence. Never fabricates a tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
TOKENIZER_DIRS = ("additional_chat_templates",)
TOKENIZER_MARKERS = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "image_processor_config.json",
    "feature_extractor_config.json",
)
LICENSE_FILES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "NOTICE", "NOTICE.txt", "USE_POLICY.md")


def has_tokenizer(folder: Path) -> bool:
    return any((folder / f).is_file() for f in TOKENIZER_MARKERS)


def json_object_or_none(path: Path) -> dict | None:
    """A JSON file holding an object, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_json_object(path: Path, fix: str) -> dict:
    """A JSON file that must hold an object; ``fix`` ends the error sentence ('re-save the adapter')."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MergeError(f"{path} is not valid JSON ({err}); {fix}.") from None
    if not isinstance(data, dict):
        raise MergeError(f"{path} does not hold a JSON object; {fix}.")
    return data


def read_config(base: Path) -> dict:
    path = base / "config.json"
    if not path.is_file():
        raise MergeError(
            f"{base} has no config.json, so it is not a Hugging Face model folder; "
            "point the base at the folder that holds config.json and the weights."
        )
    config = read_json_object(path, "copy it again from the original model")
    check_config_types(config, path)
    return config


# integer fields tui-merger reads (shapes, counts); null means "not given", as in transformers
_POSITIVE_INTS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size",
                  "num_key_value_heads", "head_dim", "moe_intermediate_size", "shared_expert_intermediate_size",
                  "decoder_sparse_step")
_COUNTS = ("num_experts", "num_local_experts", "num_labels")
_STRINGS = ("model_type",)
_DTYPES = ("dtype", "torch_dtype")  # a name, or per sub-config names ({"text_config": "bfloat16", ...})


def config_dtype(config: dict | None) -> str | None:
    """The dtype a config.json records for the (text) model, without "torch.": ``dtype`` or the older
    ``torch_dtype``, at the top or in text_config; transformers writes a map of sub-configs to names
    for some composite models (then the text model's, or the one name they all share)."""
    if not isinstance(config, dict):
        return None
    for cfg in (config, config.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(value, dict):
            names = {v for v in value.values() if isinstance(v, str)}
            value = value.get("text_config") if isinstance(value.get("text_config"), str) else (names.pop() if len(names) == 1 else None)
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def config_type_problems(config: dict) -> dict[str, str]:
    """{field: what is wrong with it} for the fields tui-merger uses that lack the types transformers
    writes (``text_config.`` prefixed for the nested ones)."""
    problems = {}
    for where, cfg in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(cfg, dict):
            continue
        for key in _POSITIVE_INTS + _COUNTS:
            value = cfg.get(key)
            low = 1 if key in _POSITIVE_INTS else 0
            if value is not None and (type(value) is not int or value < low):
                problems[where + key] = f"{where}{key} is {json.dumps(value)[:40]}, not a whole number of at least {low}"
        for key in _STRINGS:
            if cfg.get(key) is not None and not isinstance(cfg[key], str):
                problems[where + key] = f"{where}{key} is {json.dumps(cfg[key])[:40]}, not a name"
        for key in _DTYPES:
            value = cfg.get(key)
            if value is not None and not isinstance(value, str) and not (
                    isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
                problems[where + key] = f"{where}{key} is {json.dumps(value)[:40]}, not a dtype name"
        archs = cfg.get("architectures")
        if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
            problems[where + "architectures"] = f"{where}architectures is {json.dumps(archs)[:40]}, not a list of class names"
        tie = cfg.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            problems[where + "tie_word_embeddings"] = f"{where}tie_word_embeddings is {json.dumps(tie)[:40]}, not true or false"
    return problems


def check_config_types(config: dict, path: Path) -> None:
    """A damaged or hand-edited config.json is named here, in one sentence, instead of failing
    somewhere in the merge."""
    for problem in config_type_problems(config).values():
        raise MergeError(f"{path}: {problem}; fix config.json (copy it again from the original model).")


def without_problems(config: dict, problems: dict[str, str]) -> dict:
    """A copy of ``config`` without the fields named in ``problems`` (for display: inspect shows what
    it can and says what is wrong)."""
    clean = dict(config)
    nested = dict(clean["text_config"]) if isinstance(clean.get("text_config"), dict) else None
    for key in problems:
        if key.startswith("text_config.") and nested is not None:
            nested.pop(key[len("text_config."):], None)
        else:
            clean.pop(key, None)
    if nested is not None:
        clean["text_config"] = nested
    return clean


def edited_config(config: dict, changes: dict, dtype: str | None) -> dict:
    """config.json for the output: the changes applied at the top level and, where a nested
    text_config holds the same key, there too; a change to None removes the key."""
    out = json.loads(json.dumps(config))
    text = out.get("text_config") if isinstance(out.get("text_config"), dict) else None
    for key, value in changes.items():
        if value is None:  # a key the output must not have (a base's quantization_config)
            out.pop(key, None)
            if text is not None:
                text.pop(key, None)
            continue
        if key in out or text is None or key not in text:
            out[key] = value
        if text is not None and key in text:
            text[key] = value
    if dtype:
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
    return out


@dataclass
class FilePlan:
    """Files to carry: (source path, name in the output)."""

    copies: list[tuple[Path, str]] = field(default_factory=list)
    tokenizer_source: str | None = None
    notices: list[str] = field(default_factory=list)


def is_vision_language(config: dict) -> bool:
    """A model with a vision tower (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, ...): its config has a vision_config."""
    return isinstance(config.get("vision_config"), dict)


def architecture(config: dict) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else str(config.get("model_type") or "unknown")


def plan_files(base: Path, adapter: Path, config: dict, tokenizer_from: str) -> FilePlan:
    plan = FilePlan()
    adapter_tok, base_tok = has_tokenizer(adapter), has_tokenizer(base)
    if tokenizer_from == "adapter" and not adapter_tok:
        raise MergeError(
            f"--tokenizer-from adapter was asked, but {adapter} holds no tokenizer "
            "(no tokenizer_config.json, tokenizer.json or tokenizer.model)."
        )
    if tokenizer_from == "base" and not base_tok:
        raise MergeError(
            f"--tokenizer-from base was asked, but {base} holds no tokenizer "
            "(no tokenizer_config.json, tokenizer.json or tokenizer.model)."
        )
    if tokenizer_from == "adapter" or (tokenizer_from == "auto" and adapter_tok):
        tok_dir, plan.tokenizer_source = adapter, "adapter"
    elif base_tok:
        tok_dir, plan.tokenizer_source = base, "base"
    else:
        tok_dir = None
        where = str(base) if base == adapter else f"{base} or {adapter}"
        plan.notices.append(
            f"No tokenizer found in {where}; the merged model has none (copy one in before using it)."
        )
    if tok_dir is not None:
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                plan.copies.append((tok_dir / name, name))
        for name in TOKENIZER_DIRS:
            if (tok_dir / name).is_dir():
                for f in sorted((tok_dir / name).rglob("*")):
                    if f.is_file():
                        plan.copies.append((f, str(f.relative_to(tok_dir))))
    # processor files travel with the tokenizer when that folder has them, else from the base
    proc_dir = tok_dir if tok_dir is not None and any((tok_dir / f).is_file() for f in PROCESSOR_FILES) else base
    for name in PROCESSOR_FILES:
        if (proc_dir / name).is_file():
            plan.copies.append((proc_dir / name, name))
    if is_vision_language(config) and not any((proc_dir / name).is_file() for name in PROCESSOR_FILES):
        where = str(base) if tok_dir in (None, base) else f"{base} or {tok_dir}"
        plan.notices.append(
            f"This is a vision-language model ({architecture(config)}) but {where} has no preprocessor_config.json: "
            "the merged model will not take images until the processor files of the original model are copied in."
        )
    gen = base / "generation_config.json"
    if not gen.is_file() and (adapter / "generation_config.json").is_file():
        gen = adapter / "generation_config.json"
    if gen.is_file():
        plan.copies.append((gen, "generation_config.json"))
    for name in LICENSE_FILES:
        if (base / name).is_file():
            plan.copies.append((base / name, name))
    plan.copies.extend((p, p.name) for p in custom_code_files(base, config))
    return plan


def custom_code_files(base: Path, config: dict) -> list[Path]:
    """Python files of a trust_remote_code model: those named in auto_map, plus the other top-level
    .py files beside them (modeling files import their helpers)."""
    auto_map = config.get("auto_map")
    if not isinstance(auto_map, dict) or not auto_map:
        return []
    named = set()
    for value in auto_map.values():
        for ref in value if isinstance(value, list) else [value]:
            if isinstance(ref, str) and "--" not in ref and "." in ref:
                named.add(ref.rsplit(".", 1)[0] + ".py")
    missing = [n for n in sorted(named) if not (base / n).is_file()]
    if missing:
        raise MergeError(
            f"config.json's auto_map names {', '.join(missing)}, which {base} does not have; "
            "copy the model's custom code files into the base folder."
        )
    return sorted(p for p in base.glob("*.py") if p.is_file())


def copy_files(plan: FilePlan, dest: Path) -> list[str]:
    written = []
    for src, name in plan.copies:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, target)
        written.append(name)
    return written


def fsync_path(path: Path) -> None:
    """Make a file or folder durable (a folder: the names in it); a best effort where the system
    cannot (no error for the user: the data itself was written)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
