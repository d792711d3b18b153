"""Before anything is written: the merge plan (what will be read, written, how big, how long) and every
check of the inputs, each with a severity (an error blocks the merge, a warning needs acknowledgement,
info is for reading), one sentence saying what is wrong and one saying what to do.

``make_plan`` is shared by the three front ends: the TUI's Review step shows it, the plain flow asks
about its warnings, and ``tui-merger merge --dry-run`` prints it. It reads configs, headers and the
(small) adapter tensors; the base's tensor data only for the fp16 overflow check.
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.hf_refs import names_of_base, resolve_model_reference
from tui_merger.core.io.files import json_object_or_none
from tui_merger.core.options import MergeOptions, human_bytes

ERROR, WARNING, INFO = "error", "warning", "info"
# errors that another base model fixes (the adapter does not fit the base given or named): the assistant
# shows its base field, with the models here that fit, beside them
BASE_FINDINGS = frozenset({"adapter-fit", "architecture", "experts-missing", "merged-twice"})
ENGINE_SAYS = ("notice", "tokenizer", "lora-alpha")  # findings the merge itself reports again as notices
MERGE_BYTES_PER_S = 0.5e9  # output bytes per second, measured on this project's 2-core machine (~2 s/GB)
FP16_MAX = 65504.0


@dataclass
class Finding:
    id: str  # stable: what the TUI and tests key on
    severity: str  # error | warning | info
    message: str  # what is wrong, one sentence
    fix: str = ""  # what to do, one sentence

    def text(self) -> str:
        return f"{self.message} {self.fix}".strip()


@dataclass
class MergePlan:
    options: dict
    suggested_out: str
    inputs: dict = field(default_factory=dict)  # role -> path
    dtype: str | None = None
    shard_size: int = 0
    tokenizer_source: str | None = None
    tensors: int = 0
    merged_tensors: int = 0
    shards: int = 0
    output_bytes: int = 0
    estimated_seconds: float = 0.0
    verify_seconds: float = 0.0  # the default verification, estimated
    verify_bytes: int = 0  # its peak memory, estimated
    adapter: dict | None = None
    findings: list[Finding] = field(default_factory=list)
    suggested_base: str | None = None  # a local 16-bit model to use instead of a quantized base
    suggested_roundtrip: str | None = None  # the --qlora-base value that reproduces the training's rounding
    base_format: str | None = None  # a base released quantized: what it is ("FP8 (e4m3), 128x128 blocks, as released")
    output_format: str | None = None  # and what the output will be
    base_scheme: str | None = None  # that base's format in words ("FP8 (e4m3), 128x128 blocks")
    # the output formats the assistant offers, default first: [(words, MergeOptions.output_quantization)];
    # empty when there is no choice (a checkpoint, an exported adapter, inputs that could not be read)
    output_choices: list = field(default_factory=list)
    resume: dict | None = None  # a partial folder of an earlier run: state, kept, kept_bytes (see journal.resumable)

    @property
    def blocked(self) -> bool:
        return any(f.severity == ERROR for f in self.findings)

    def of(self, severity: str) -> list[Finding]:
        return [f for f in self.findings if f.severity == severity]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["blocked"] = self.blocked
        return data


def import_ahead(base: Path | None) -> None:
    """Start importing, in a daemon thread, the code ``make_plan`` asks transformers with: torch,
    transformers' model code (the class ``base``'s config.json names) and accelerate. The plan names the
    embeddings and the output head as transformers builds the model (``plan.embeddings_of``), and those
    imports are seconds of Python (3B merge: 2 of torch, 3-4 of transformers' modeling chain) that the
    merge cannot start before; begun at once, they run while the command line checks its arguments,
    reads the configs and headers and loads the adapter, and the plan's own imports wait for them (the
    import system's module locks). The cycle collector is paused meanwhile: the imports make ~670,000
    objects and no garbage cycles, and its full passes over them cost 10-20 % of the imports' CPU time.
    Never fails: an import error shows where the plan imports the same. For the command line's merge
    only (a process that plans at once): the app imports nothing before its first screen is drawn."""
    import threading

    def load() -> None:
        from tui_merger.core.formats.inputs import cycle_collector_paused

        try:
            with cycle_collector_paused():
                import torch  # noqa: F401
                import transformers  # noqa: F401

                from tui_merger.core.formats.hf_names import model_class

                config = json_object_or_none(Path(base) / "config.json") if base is not None else None
                if config:
                    model_class(config)
                import accelerate  # noqa: F401
        except Exception:  # noqa: BLE001 - the plan's own import says what is wrong
            pass

    threading.Thread(target=load, name="tui-merger-import-ahead", daemon=True).start()


def make_plan(options: MergeOptions, today: datetime.date | None = None) -> MergePlan:
    """The plan and all findings for ``options``; never raises MergeError for bad input (that becomes
    an error finding), never writes anything."""
    from tui_merger.core.formats.inputs import open_inputs, paths_of
    from tui_merger.core.merge.requant import output_plan

    plan = MergePlan(options=options.to_dict(), suggested_out="", shard_size=options.shard_size)
    plan.inputs = {k: str(v) for k, v in (("checkpoint", options.checkpoint), ("base", options.base), ("adapter", options.adapter)) if v}
    for number, (path, _) in enumerate(options.adapters[1:], start=2):
        plan.inputs[f"adapter {number}"] = str(path)
    add = plan.findings.append
    raw = _raw_adapter(options, add)
    _check_merged_twice(options, add)
    try:
        inputs = open_inputs(options)
    except MergeError as err:
        if not plan.blocked:
            add(Finding(_inputs_refused(options) or "inputs", ERROR, str(err)))
        plan.suggested_out = suggest_name(options, None, raw, today)
        _check_output(options, plan, paths_of(options), add)
        return plan
    try:
        config = {**inputs.config, **inputs.config_changes}
        dtype = options.dtype or inputs.dtype
        merged_adapter = inputs.adapter
        if options.export_adapter:
            from tui_merger.core.formats.adapter import empty_adapter

            merged_adapter = empty_adapter(inputs.adapter.folder)
        for note in inputs.infos:
            add(Finding("notice", INFO, note))
        for note in inputs.notices:
            if "has no lora_alpha" not in note:  # said by the lora-alpha check
                add(_notice_finding(note))
        try:
            tplan = output_plan(inputs.base, merged_adapter, config, dtype, options.shard_size)
        except MergeError as err:
            add(Finding(_output_refused(options, inputs, merged_adapter, config, dtype) or "adapter-fit", ERROR, str(err)))
            tplan = None
        plan.dtype = dtype
        plan.tokenizer_source = inputs.files.tokenizer_source
        plan.adapter = _adapter_summary(inputs.adapter)
        plan.suggested_out = suggest_name(options, inputs, raw, today)
        if tplan is not None:
            plan.tensors = len(tplan.tensors)
            plan.merged_tensors = sum(1 for t in tplan.tensors if t.ops or (  # or quantized again from merged values
                getattr(t.source.source, "computes", False) and _quantized_weight(t)))
            plan.shards = len(tplan.shards)
            plan.output_bytes = tplan.total_bytes
            plan.estimated_seconds = round(1.0 + tplan.total_bytes / MERGE_BYTES_PER_S, 1)
            from tui_merger.core.verify.behaviour import estimate

            passes = 1 if (options.checkpoint is not None and not inputs.adapter.lora) else 2
            plan.verify_seconds, plan.verify_bytes = estimate(tplan, passes, inputs.adapter)
            plan.resume = _resumable(options, inputs, tplan, add)
            _check_tied(config, inputs.config, tplan, add)
            _check_experts(config, tplan, add)
            _check_fp16(tplan, options, add)
            _check_memory(tplan, add)
        base_config = inputs.config if options.checkpoint is None else {}
        if options.checkpoint is None:
            _check_targets(inputs.adapter, inputs.base, add, inputs.config)
            adapters = options.adapter_weights()
            for path, _ in adapters:  # a weighted merge: every adapter against the one base
                who = "The adapter" if len(adapters) == 1 else f"The adapter {Path(path).name}"
                _check_against_adapter_side(Path(path), who, Path(options.base), base_config, add)
            _check_vocab(options, inputs, add)
        plan.suggested_roundtrip, plan.suggested_base = _check_quantized(options, inputs, add)
        if getattr(inputs.base, "dequantized", None) is not None:
            plan.base_scheme = inputs.base.scheme.label
            plan.base_format = f"{inputs.base.scheme.label}, as released ({len(inputs.base.dequantized)} weights)"
            removed = ("quantization_config removed" if "quantization_config" in inputs.config
                       else "without the base's hf_quant_config.json")  # a ModelOpt release records it there alone
            plan.output_format = f"{dtype or inputs.base.dtype}, a plain model ({removed})"
        if tplan is not None and options.output_quantization is not None:
            plan.output_format = _quantized_output(options.output_quantization, tplan, inputs, dtype)
        _check_remote_code(inputs.config, add)
        _check_nan(inputs.adapter, add)
        if options.checkpoint is None and not options.export_adapter:
            plan.output_choices = output_choices(plan.base_scheme, dtype or getattr(inputs.base, "dtype", None))
    finally:
        inputs.close()
    _check_output(options, plan, paths_of(options), add)
    return plan


def _check_merged_twice(options: MergeOptions, add) -> None:
    """An adapter already merged into the base (its merge_manifest.json records it): an error, which
    --force does not pass (the change would be applied twice; weight 2 says so on purpose)."""
    from tui_merger.core.plan.lineage import merged_twice

    if options.base is None or options.checkpoint is not None:
        return
    for path, _ in options.adapter_weights():
        said = merged_twice(options.base, path)
        if said is not None:
            add(Finding("merged-twice", ERROR, *said))


# -- the adapter as written, before the parser (which refuses what these checks explain) -------------


def _raw_adapter(options: MergeOptions, add) -> dict | None:
    """adapter_config.json of the (first) PEFT adapter, with the checks that make the parser refuse
    it; each adapter of a weighted merge is checked."""
    configs = [_raw_one(Path(path), add, options.lora_alpha) for path, _ in options.adapter_weights()]
    return configs[0] if configs else None


def _raw_one(folder: Path, add, given_alpha=None) -> dict | None:
    path = folder / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # the parser says what is wrong with it
    if not isinstance(cfg, dict):
        return None
    from tui_merger.core.formats.adapter import check_adapter_config

    try:
        check_adapter_config(cfg, path)
    except MergeError:
        return None  # the parser says what is wrong with it
    if cfg.get("lora_alpha") is None:
        if given_alpha is None:  # given: the merge uses it and says so (a notice of the inputs)
            from tui_merger.core.formats.adapter import no_alpha_sentence

            add(Finding("lora-alpha", WARNING, no_alpha_sentence(path)))
    elif not cfg.get("lora_alpha") and not cfg.get("alpha_pattern") and given_alpha is None:
        add(Finding(
            "lora-alpha", ERROR,
            f"lora_alpha is 0 in {path}, so the adapter would change nothing; pass --lora-alpha with the value used in training.",
        ))
    _check_rank(folder, cfg, add)
    return cfg


def _check_rank(folder: Path, cfg: dict, add) -> None:
    from tui_merger.core.formats.adapter import pattern_key, targeted_parameters
    from tui_merger.core.io.safetensors_io import SafetensorsFile

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        return
    try:
        header = SafetensorsFile(path)
    except MergeError:
        return  # the parser says what is wrong with the file
    try:
        wrong = []
        for key, info in header.tensors.items():
            m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_A(?:\.[\w\-]+)?\.weight$", key)
            if not m or len(info.shape) != 2:
                continue
            module = m.group(1)
            if targeted_parameters(module, cfg.get("target_parameters"))[2]:
                continue  # LoRA on parameters (experts): rank r per expert, checked when the adapter is read
            pattern = pattern_key(cfg.get("rank_pattern") or {}, module)
            r = int((cfg.get("rank_pattern") or {})[pattern]) if pattern else int(cfg.get("r") or 8)
            if info.shape[0] != r:
                wrong.append((module, r, info.shape[0]))
    finally:
        header.close()
    if wrong:
        module, r, rank = wrong[0]
        more = f" (and {len(wrong) - 1} more modules)" if len(wrong) > 1 else ""
        add(Finding(
            "lora-rank", ERROR,
            f"{module}: adapter_config.json says r={r} but the saved tensors have rank {rank}{more}; "
            "the config does not belong to these weights.",
            "Use the adapter_config.json saved with these weights.",
        ))


# -- checks on opened inputs ---------------------------------------------------------------------------


def _notice_finding(note: str) -> Finding:
    if "No tokenizer" in note:
        return Finding("tokenizer", WARNING, note, "Copy the tokenizer files into the adapter or base folder.")
    if "will not take images" in note:
        return Finding("processor", WARNING, note, "Copy preprocessor_config.json (and the other processor files) from the original model.")
    return Finding("notice", WARNING if "differs" in note else INFO, note)


def _adapter_summary(adapter) -> dict | None:
    if not adapter.lora:
        return None
    from tui_merger.core.formats.adapter import parameter_kinds

    cfg = adapter.config
    every = [m for name, entry in adapter.lora.items() if name not in adapter.expert_slices for m in (entry, *entry.terms)]
    every = every or [m for entry in adapter.lora.values() for m in (entry, *entry.terms)]
    ranks = sorted({m.r for m in every})
    alphas = sorted({m.alpha for m in every})
    ranked = getattr(adapter, "parameter_ranks", {}) or {}
    experts = {
        "expert_parameters": len([n for n, v in ranked.items() if v[2] > 1]) or len(adapter.expert_parameters),
        "router_parameters": len([n for n, v in ranked.items() if v[2] <= 1]),
        "target_parameters": cfg.get("target_parameters") or sorted({n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1]
                                                                      for n in adapter.expert_parameters}),
        # {"mlp.experts.gate_up_proj": {"r": 16, "alpha": 32, "count": 2, "experts": 4}, ...}
        "parameters": {tail: {"r": r, "alpha": alpha, "count": n, "router": tail.endswith(".weight")}
                       for tail, (r, alpha, n) in parameter_kinds(ranked).items()},
    } if adapter.expert_parameters else {}
    return {
        "modules": len([name for name in adapter.lora if name not in adapter.expert_slices]),
        **experts,
        "r": ranks[0] if len(ranks) == 1 else ranks,
        "alpha": alphas[0] if len(alphas) == 1 else alphas,
        "alpha_from": getattr(adapter, "alpha_from", ""),  # "" recorded, "--lora-alpha", "peft's default"...
        "variant": "dora" if cfg.get("use_dora") else ("rslora" if cfg.get("use_rslora") else "lora"),
        "target_modules": cfg.get("target_modules") or sorted({m.rsplit(".", 1)[-1] for m in adapter.lora}),
        "modules_to_save": cfg.get("modules_to_save") or [],
        **(_weighted_summary(adapter) if cfg.get("combined") else {}),
    }


def _g(value):
    """A number as people write it (32, not 32.0); lists and the rest as they are."""
    return f"{value:g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _weighted_summary(adapter) -> dict:
    from tui_merger.core.formats.combine import overlap_summary, overlaps

    parts = adapter.config["adapters"]
    return {
        "variant": "weighted lora",
        "adapters": [{k: d.get(k, "") for k in ("path", "weight", "r", "lora_alpha", "alpha_from", "modules")} for d in parts],
        "overlaps": overlap_summary(adapter),
        "overlap_modules": {mod: [parts[i]["path"] for i in who] for mod, who in overlaps(adapter).items()},
    }


def _module_names(base) -> set[str]:
    return {n.rsplit(".", 1)[0] for n in base.tensors if "." in n}


def _check_targets(adapter, base, add, config=None) -> None:
    """target_modules names that match no module of the base (peft matches a name on its last parts).
    peft matches the modules of the model in memory; a family whose files keep other names (DeepSeek-V4's
    ``wq_a`` is ``q_a_proj`` in memory) is matched against both: the files' names and the meta model's."""
    targets = adapter.config.get("target_modules")
    if not isinstance(targets, list) or not targets:
        return
    modules = _module_names(base)
    if isinstance(config, dict) and not all(any(m == t or m.endswith("." + t) for m in modules) for t in targets
                                            if isinstance(t, str)):
        from tui_merger.core.formats.hf_names import meta_of_config

        meta = meta_of_config(config)
        if meta is not None:
            modules = modules | {name for name, _ in meta.named_modules() if name}
    leaves = sorted({m.rsplit(".", 1)[-1] for m in modules})
    absent = [t for t in targets if isinstance(t, str) and not any(m == t or m.endswith("." + t) for m in modules)]
    if absent:
        near = {t: difflib.get_close_matches(t.rsplit(".", 1)[-1], leaves, n=2) for t in absent}
        shown = "; ".join(f"{t} (nearest: {', '.join(n) or 'none'})" for t, n in near.items())
        add(Finding(
            "targets", WARNING,
            f"target_modules names modules the base does not have: {shown}.",
            "Check that the base is the model the adapter was trained on; those targets received no LoRA.",
        ))


def _adapter_side_config(folder: Path) -> tuple[dict | None, str]:
    """The config the adapter was trained against: a config.json saved beside the adapter, else the
    base_model_name_or_path it names when that is a local folder or in the HF cache."""
    if (folder / "config.json").is_file():
        return json_object_or_none(folder / "config.json"), str(folder / "config.json")
    try:
        named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None, ""
    path = resolve_model_reference(named)
    if path is None:
        return None, ""
    return json_object_or_none(path / "config.json"), str(path / "config.json")



def _check_against_adapter_side(adapter: Path, who: str, base: Path, base_config: dict, add) -> None:
    """The base the adapter names, and the config it was trained against, vs the base given.
    ``who``: how the sentences name the adapter ("The adapter", or its folder name in a blend)."""
    try:
        named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        named = None
    if named:
        names = names_of_base(base, base_config)
        resolved = resolve_model_reference(named)
        same = named in names or Path(str(named)).name in names or (resolved is not None and resolved.resolve() == base.resolve())
        if not same and resolved is not None:  # QLoRA: trained on a quantized model made from this base
            from tui_merger.core.formats.quant import find_unquantized_base, quantization_info

            try:
                qcfg = json.loads((resolved / "config.json").read_text())
            except (OSError, ValueError):
                qcfg = {}
            if isinstance(qcfg, dict) and quantization_info(qcfg) is not None:
                origin = find_unquantized_base(qcfg, resolved)
                same = origin is not None and origin.resolve() == base.resolve()
        if not same:
            add(Finding(
                "base-name", WARNING,
                f"{who} names {named} as its base, but the base given is {base}.",
                "Check that this folder holds the model the adapter was trained on (the one it names, or a copy).",
            ))
    other, where = _adapter_side_config(adapter)
    whose = "the adapter's" if who == "The adapter" else f"{who[4:]}'s"
    if not other:
        return
    if other.get("model_type") and base_config.get("model_type") and other["model_type"] != base_config["model_type"]:
        add(Finding(
            "architecture", ERROR,
            f"{who} was trained on a {other['model_type']} model ({where}) but the base is {base_config['model_type']}.",
            "Give the base model the adapter was trained on.",
        ))
    elif (other.get("architectures") or None) != (base_config.get("architectures") or None) and other.get("architectures") and base_config.get("architectures"):
        add(Finding(
            "architecture", WARNING,
            f"{whose[0].upper()}{whose[1:]} base config ({where}) names {other['architectures']} but the base has {base_config['architectures']}.",
            "Check that the model head is the one the adapter was trained with.",
        ))
    va, vb = _field(other, "vocab_size"), _field(base_config, "vocab_size")
    if va and vb and va != vb:
        add(Finding(
            "vocab-size", WARNING,
            f"vocab_size is {va} in {whose} base config ({where}) but {vb} in the base given.",
            "Check that the base is the one the adapter was trained on (a resized vocabulary needs the "
            "adapter to carry the embeddings: modules_to_save).",
        ))
    a, b = _rope(other), _rope(base_config)
    differ = [f"{k} {a[k]} vs {b[k]}" for k in a if k in b and a[k] != b[k]]
    if a.get("rope_scaling") != b.get("rope_scaling") and not ("rope_scaling" in a and "rope_scaling" in b):
        differ.append(f"rope_scaling {a.get('rope_scaling')} vs {b.get('rope_scaling')}")
    if differ:
        add(Finding(
            "rope", WARNING,
            f"{whose[0].upper()}{whose[1:]} base config ({where}) and the base given differ in position encoding: {'; '.join(differ)}.",
            "Merge into the same base the adapter was trained on, or the merged model's long-context behaviour will differ.",
        ))


def _rope(config: dict) -> dict:
    """rope_theta, the scaling and max_position_embeddings, wherever the config keeps them
    (transformers 5 moved theta and scaling into rope_parameters)."""
    params = _field(config, "rope_parameters")
    params = params if isinstance(params, dict) else {}
    found = {
        "rope_theta": _field(config, "rope_theta") if _field(config, "rope_theta") is not None else params.get("rope_theta"),
        "rope_scaling": _field(config, "rope_scaling") or ({k: v for k, v in params.items() if k != "rope_theta"} or None),
        "max_position_embeddings": _field(config, "max_position_embeddings"),
    }
    if found["rope_scaling"] in ({"rope_type": "default"}, {"type": "default"}):
        found["rope_scaling"] = None  # the same as no scaling
    return {k: v for k, v in found.items() if v is not None}


def _field(config: dict, key: str):
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get(key, text.get(key))


def _check_vocab(options: MergeOptions, inputs, add) -> None:
    """A tokenizer beside the adapter with more tokens than the base embedding has rows, and no
    resized embedding saved in the adapter: the new tokens would point past the embedding."""
    from tui_merger.core.plan.plan import _Resolver, embeddings_of

    embed = embeddings_of(inputs.config, inputs.base.tensors).input
    ref = inputs.base.tensors.get(embed or "")
    rows = ref.shape[0] if ref is not None and len(ref.shape) == 2 else None
    resolver = _Resolver(inputs.base.tensors)
    saved = [n for n in inputs.adapter.replacements if embed and resolver.find(*_module_param(n)) == embed]
    if saved:
        new_rows = inputs.adapter.replacements[saved[0]].shape[0]
        if rows and new_rows != rows:
            add(Finding("vocab", INFO, f"The adapter carries a resized embedding: {rows} -> {new_rows} rows; vocab_size will be updated."))
        return
    names = embeddings_of(inputs.config, inputs.base.tensors)
    leaves = [n.rsplit(".", 2)[-2] for n in (names.input, names.output) if n and n.count(".") >= 1]
    to_save = ", ".join(f"'{leaf}'" for leaf in dict.fromkeys(leaves)) or "'embed_tokens', 'lm_head'"
    adapters = options.adapter_weights()
    for path, _ in adapters:
        tokens = _tokenizer_size(Path(path))
        whose = "The adapter's" if len(adapters) == 1 else f"Adapter {Path(path).name}'s"
        if rows and tokens and tokens > rows:
            add(Finding(
                "vocab", ERROR,
                f"{whose} tokenizer has {tokens} tokens but the base embedding has {rows} rows, and the adapter "
                "does not carry a resized embedding (modules_to_save).",
                f"Save the adapter with modules_to_save=[{to_save}] after resizing, or use the base's tokenizer (--tokenizer-from base).",
            ))


def _module_param(name: str) -> tuple[str, str]:
    """``model.embed_tokens.weight`` -> (``model.embed_tokens``, ``weight``)."""
    module, _, param = name.rpartition(".")
    return module, param


def _tokenizer_size(folder: Path) -> int | None:
    data = json_object_or_none(folder / "tokenizer.json")
    if not data:
        return None
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE / WordPiece: token -> id
        ids = {i for i in vocab.values() if type(i) is int and i >= 0}
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs
        ids = set(range(len(vocab)))
    else:
        ids = set()
    added = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
    ids.update(t["id"] for t in added if isinstance(t, dict) and type(t.get("id")) is int and t["id"] >= 0)
    return max(ids) + 1 if ids else None


def _check_quantized(options: MergeOptions, inputs, add) -> tuple[str | None, str | None]:
    """A quantized base (explained, with the local 16-bit model it was made from when there is one);
    the --qlora-base round trip in use; an adapter trained on a quantized model (QLoRA) merged into
    16-bit weights, which is right, with the round trip offered. Returns (the --qlora-base value to
    suggest, the 16-bit base to use instead of a quantized one), each or None."""
    from tui_merger.core.formats.quant import FLAG, find_unquantized_base, origin_fix, quantization_info

    scheme = getattr(inputs.base, "scheme", None) if getattr(inputs.base, "dequantized", None) is not None else None
    if scheme is not None:
        _check_released_quantized(options, inputs, scheme, add)
        return None, None
    info = quantization_info(inputs.config)
    if info is not None:
        found = find_unquantized_base(inputs.config, options.base or options.checkpoint)
        fix = origin_fix(inputs.config, options.base or options.checkpoint, found)
        if info.can_roundtrip:
            fix += f" With it, {FLAG} {info.flag_value()} merges into the rounded weights QLoRA training saw."
        add(Finding("quantized", ERROR, f"The base model is quantized ({info.method}). {info.explanation}", fix))
        return None, str(found) if found is not None and options.checkpoint is None else None
    if options.checkpoint is not None:
        return None, None
    _check_trained_on_released_quantized(options, add)
    return _check_roundtrip(options, inputs, add), None


def _quantized_weight(t) -> bool:
    """An output tensor holding quantized values (not their scales): FP8, or MXFP4's packed blocks."""
    return t.dtype.startswith("float8") or (t.dtype == "uint8" and t.name.endswith("_blocks"))


def _quantized_output(mode: str, tplan, inputs, dtype) -> str:
    """What an output written quantized will be, for the plan's "output is" line."""
    requantized = [t for t in tplan.tensors if getattr(t.source.source, "computes", False) and _quantized_weight(t)]
    if mode == "keep":
        kept = sum(1 for t in tplan.tensors if _quantized_weight(t) and t not in requantized)
        return (f"{inputs.base.scheme.label} as the base: {kept} weights copied with their scales, "
                f"{len(requantized)} changed by the adapter quantized again; quantization_config kept")
    rest = dtype or inputs.dtype or next((t.dtype for t in tplan.tensors if t not in requantized
                                          and t.dtype in ("bfloat16", "float16", "float32")), "16-bit")
    said = tplan.quantized or {}
    # which modules stay 16-bit is transformers' FP8 load's own answer (merge/requant.py, hf_names.fp8_layout)
    shapes = {t.name: t.shape for t in tplan.tensors}
    packed = said.get("packed") or {}
    packed_tensors = [n for names in packed.values() for n in names if len(shapes.get(n, ())) == 3]
    whole = len(said.get("skipped", ())) + sum(1 for names in packed.values()
                                                if not any(len(shapes.get(n, ())) == 3 for n in names))
    left = ", ".join([*(said.get("defaults") or ()), *(said.get("others") or ())])
    return (f"FP8 (e4m3), 128x128 blocks, weight-only: {len(requantized)} Linear weights transformers' FP8 load "
            f"quantizes; " + (f"what it leaves alone ({left}), " if left else "") + f"embeddings and norms stay {rest}"
            + (f" (and {whole} Linear weights or expert modules that are not whole blocks)" if whole > 0 else "")
            + (f"; the {len(packed_tensors)} packed expert tensors ({packed_tensors[0]}, ...) stay {rest} too, "
               "named in modules_to_not_convert (FP8 is written for one matrix per expert and projection only)"
               if packed_tensors else ""))


def _check_released_quantized(options: MergeOptions, inputs, scheme, add) -> None:
    """A base released quantized (FP8 blocks, compressed-tensors FP8): merged into its dequantized weights,
    what training saw; the 16-bit original, when one is on this machine, is the other choice."""
    from tui_merger.core.formats.quant import find_unquantized_base

    count = len(inputs.base.dequantized)
    output = (f"the output is written in the same format again (--keep-quantization)" + (
              "; MXFP4 keeps one mantissa bit, so a change to an expert smaller than half a step of its group's "
              "grid is rounded away (verification says how far that moves the logits)" if scheme.method == "mxfp4" else "")
              if options.output_quantization == "keep" else
              f"the output is a plain {options.dtype or inputs.base.dtype} model without quantization_config")
    add(Finding(
        "released-quantized", INFO,
        f"The base is released as {scheme.label}: its {count} quantized weights are dequantized exactly as "
        f"transformers' {scheme.loader} loads them (what training on it saw), the adapter is merged into those, "
        f"and {output}.",
    ))
    found = find_unquantized_base(inputs.config, options.base) if options.base else None
    if found is not None:
        add(Finding(
            "released-quantized-origin", INFO,
            f"A 16-bit model it was made from is on this machine ({found}); the adapter was trained on the FP8 "
            "weights, so they are the default.",
            f"To merge into the 16-bit weights instead, pass --base {found}.",
        ))


def _check_trained_on_released_quantized(options: MergeOptions, add) -> None:
    """An adapter trained on a base released quantized (it names that model) merged into a 16-bit model:
    allowed (it is the other choice), but the weights differ from what training saw by the rounding."""
    from tui_merger.core.formats.dequant import scheme_of

    try:
        named = json.loads((Path(options.adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError, TypeError):
        return
    path = resolve_model_reference(named) if isinstance(named, str) and named else None
    if path is None or options.base is None or path.resolve() == Path(options.base).resolve():
        return
    try:
        scheme = scheme_of(json_object_or_none(path / "config.json"))
    except MergeError:
        return
    if scheme is not None:
        add(Finding(
            "trained-on-quantized", INFO,
            f"The adapter was trained on {named}, released as {scheme.label}; it is merged into the 16-bit "
            "weights of the base given, which differ from what training saw by the FP8 rounding.",
            f"To merge into the weights training saw, pass --base {path}.",
        ))


def _check_roundtrip(options: MergeOptions, inputs, add) -> str | None:
    from tui_merger.core.formats.quant import FLAG, parse_roundtrip

    named, trained = _trained_quantized(options)
    if options.base_roundtrip:
        chosen = parse_roundtrip(options.base_roundtrip)
        count = len(getattr(inputs.base, "round_tripped", []))
        if not count:
            add(Finding(
                "qlora-base", WARNING,
                f"{FLAG} was given but the base has no Linear weights bitsandbytes would quantize, so nothing is round-tripped.",
                f"Check the skip= setting of {FLAG}.",
            ))
            return
        add(Finding(
            "qlora-base", INFO,
            f"The adapter is merged into {count} Linear weights of the base round-tripped through {chosen.label} "
            f"(blocksize {chosen.blocksize}), the weights QLoRA training saw, not into the 16-bit weights.",
        ))
        suggested = trained.flag_value() if trained is not None and trained.can_roundtrip else chosen.flag_value()
        if trained is not None and trained.can_roundtrip and trained.flag_value() != chosen.flag_value():
            add(Finding(
                "qlora-settings", WARNING,
                f"{FLAG} {options.base_roundtrip} differs from {named}, the quantized model the adapter names ({trained.label}).",
                f"Use {FLAG} {trained.flag_value()} to reproduce that model's rounding.",
            ))
        return suggested
    if named is None or (trained is not None and not trained.can_roundtrip):
        return
    label = trained.label if trained is not None else "4-bit bitsandbytes"
    value = trained.flag_value() if trained is not None else "nf4"
    add(Finding(
        "qlora", INFO,
        f"The adapter was trained on {named}, a {label} model (QLoRA); it is merged into the 16-bit weights of "
        "the base given, the usual choice.",
        f"To merge into the rounded weights training saw instead, add {FLAG} {value}.",
    ))
    return value


_QUANTIZED_NAME = re.compile(r"bnb|[-_.](?:4bit|nf4)(?:$|[-_.])", re.I)


def _trained_quantized(options: MergeOptions):
    """(name, QuantInfo or None) when the adapter names a quantized base: by its config when that model
    is local, else by a name like ``...-bnb-4bit`` (settings unknown); (name or None, None) otherwise."""
    from tui_merger.core.formats.quant import quantization_info

    try:
        named = json.loads((Path(options.adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError, TypeError):
        return None, None
    if not named or not isinstance(named, str):
        return None, None
    path = resolve_model_reference(named)
    if path is not None:
        info = quantization_info(json_object_or_none(path / "config.json"))
        return (named, info) if info is not None else (None, None)
    return (named, None) if _QUANTIZED_NAME.search(named) else (None, None)


def _check_remote_code(config: dict, add) -> None:
    if isinstance(config.get("auto_map"), dict) and config["auto_map"]:
        add(Finding(
            "remote-code", INFO,
            "The model uses custom code (auto_map): its .py files are copied, never run, so the logits check is skipped.",
            "Load the merged model with trust_remote_code=True once you have read that code.",
        ))


def _check_tied(config: dict, base_config: dict, tplan, add) -> None:
    was_tied = bool(_field(base_config, "tie_word_embeddings"))
    if was_tied and tplan.config_changes.get("tie_word_embeddings") is False:
        from tui_merger.core.plan.plan import embeddings_of

        name = embeddings_of(base_config, {t.name: t.shape for t in tplan.tensors}).output
        head = next((t for t in tplan.tensors if t.name == name), None)
        extra = f" (+{human_bytes(head.nbytes)})" if head else ""
        module = name.removesuffix(".weight") if name else "output head"
        add(Finding(
            "tied", WARNING,
            f"The base ties its input and output embeddings, but the adapter changes only one of them, so the "
            f"merged model gets its own {module}{extra} and tie_word_embeddings false.",
            "Nothing to do if that is what training did; it is what the unmerged model computes.",
        ))


def _check_experts(config: dict, tplan, add) -> None:
    """A model is never written with an expert missing: the experts its config declares, layer by
    layer, against the tensors the plan writes."""
    from tui_merger.core.formats.hf_names import expert_gaps

    gaps = expert_gaps(config, {t.name: tuple(t.shape) for t in tplan.tensors})
    if gaps:
        more = f" (and {len(gaps) - 1} more)" if len(gaps) > 1 else ""
        add(Finding(
            "experts-missing", ERROR,
            f"The model would be written with experts missing: {gaps[0]}{more}; nothing was written.",
            "The base or checkpoint is incomplete: check that every weight file (and every expert-parallel "
            "rank's file) was copied.",
        ))


def _check_fp16(tplan, options: MergeOptions, add) -> None:
    """Values beyond fp16's range in tensors converted to fp16 (reads those base tensors)."""
    converted = [t for t in tplan.tensors if t.dtype == "float16" and t.source.dtype != "float16"]
    over = []
    for t in converted:
        if t.source.load().abs().max().item() > FP16_MAX:
            over.append(t.name)
        t.source.release()
    if over:
        add(Finding(
            "fp16-overflow", WARNING if options.force_fp16_overflow else ERROR,
            f"{len(over)} tensor(s) hold values beyond float16's range ({', '.join(over[:3])}).",
            "Use --dtype bf16, or --force to clamp them to ±65504." if not options.force_fp16_overflow else "They will be clamped (--force).",
        ))


def _check_memory(tplan, add) -> None:
    from tui_merger.core.verify.checks import _available_memory

    from tui_merger.core.merge.merge_math import expert_block_values, experts_streamed

    available = _available_memory()
    # packed experts are merged a few experts at a time: a block of them counts, not the tensor
    biggest = max((expert_block_values(t.shape) if experts_streamed(t) else math.prod(t.shape)
                   for t in tplan.tensors if t.ops), default=0)
    need = biggest * 4 * 3 + (400 << 20)  # fp32 working copies of the largest merged tensor + torch
    if available is not None and need > available:
        add(Finding(
            "memory", ERROR,
            f"Merging needs about {human_bytes(need)} of memory (the largest merged tensor, or block of experts, in "
            f"fp32, three times) but {human_bytes(available)} is available.",
            "Close other programs or merge on a machine with more memory.",
        ))


def _check_nan(adapter, add) -> None:
    import torch

    bad = []
    refs = [r for m in adapter.lora.values() for r in (m.A, m.B, m.emb_A, m.emb_B, m.magnitude, m.B_bias) if r is not None]
    refs += list(adapter.replacements.values())
    for ref in refs:
        t = ref.load()
        if t.is_floating_point() and not torch.isfinite(t).all():
            bad.append(ref.name)
    if bad:
        add(Finding(
            "adapter-nan", ERROR,
            f"The adapter holds NaN or Inf values in {len(bad)} tensor(s) ({', '.join(bad[:3])}); training diverged or the file is damaged.",
            "Use an earlier checkpoint of the adapter.",
        ))


def _resumable(options: MergeOptions, inputs, tplan, add) -> dict | None:
    """What the merge will keep of the partial folder an earlier run of it left (the engine's own
    journal check), said as a finding; the free-space check then counts only what is left to write."""
    from tui_merger.core.merge.journal import fingerprint, resumable
    from tui_merger.core.merge.output import OutputFolder

    if options.out is None:
        return None
    tmp = OutputFolder(Path(options.out)).tmp
    try:
        found = resumable(tmp, fingerprint(options, inputs.read_files, tplan))
    except OSError:
        return None
    if found.state == "none":
        return None
    shards = len(tplan.shards)
    if found.state == "match" and found.kept:
        left = max(tplan.total_bytes - found.kept_bytes, 0)
        add(Finding(
            "resume", INFO,
            f"Resuming: {len(found.kept)} of {shards} shards kept ({human_bytes(found.kept_bytes)}), "
            f"{human_bytes(left)} to write (the partial folder {tmp} of an earlier run of this merge).",
        ))
    else:
        add(Finding(
            "resume", INFO,
            f"The partial folder {tmp} does not match these inputs/options (or holds no finished shard) and "
            "will be replaced.",
        ))
    return {"state": found.state, "kept": len(found.kept), "shards": shards, "kept_bytes": found.kept_bytes}


def _check_output(options: MergeOptions, plan: MergePlan, inputs, add) -> None:
    from tui_merger.core.merge.output import UnverifiedOutput, check_target

    out = options.out
    if out is None:
        return
    try:
        check_target(Path(out), inputs, options.overwrite)
    except UnverifiedOutput as err:
        if err.fingerprint is None:
            add(Finding("output", ERROR, str(err)))
        else:
            add(Finding(
                "output", INFO,
                f"{out} holds a model an earlier run of a merge wrote and never verified; if it is this merge "
                "(same inputs and options) it is kept and verified, else the merge stops.",
            ))
        return
    except MergeError as err:
        add(Finding("output", ERROR, str(err)))
        return
    if options.overwrite and Path(out).is_dir() and any(Path(out).iterdir()):
        add(Finding("output", WARNING, f"{out} exists and will be replaced once the new model is complete (--overwrite)."))
    parent = Path(out).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        add(Finding(
            "output", ERROR,
            f"Cannot write in {parent} ({_unwritable_why(parent)}), so the merged model cannot be created there.",
            "Choose an output folder you can write to.",
        ))
        return
    if Path(out).is_dir() and (not os.access(out, os.W_OK) or _immutable(Path(out))):  # append-only: writable, not removable
        # the finished model replaces this folder at the end (removed when empty, swapped out with
        # --overwrite): an immutable one, or one not writable, fails only then, after the whole merge
        add(Finding(
            "output", ERROR,
            f"Cannot write in {out} ({_unwritable_why(Path(out))}), so the merged model cannot be put there.",
            "Choose another output folder" + (", or clear the flag (chattr -i -a)." if _immutable(Path(out)) else "."),
        ))
        return
    if plan.output_bytes:
        from tui_merger.core.merge.output import check_space

        try:
            kept = plan.resume["kept_bytes"] if plan.resume and plan.resume["state"] == "match" else 0
            check_space(parent, max(plan.output_bytes - kept, 0))  # the engine's own check, with its sentence
        except MergeError as err:
            add(Finding("disk", ERROR, str(err)))


def _immutable(path: Path) -> bool:
    """The folder carries Linux's immutable or append-only flag (chattr +i / +a): even root may not
    remove, rename or fill it. Read with FS_IOC_GETFLAGS; False where that cannot be asked."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            buf = bytearray(8)
            fcntl.ioctl(fd, 0x80086601, buf)  # FS_IOC_GETFLAGS
        finally:
            os.close(fd)
    except (OSError, ImportError):
        return False
    return bool(int.from_bytes(buf[:4], "little") & (0x10 | 0x20))  # FS_IMMUTABLE_FL | FS_APPEND_FL


def _unwritable_why(path: Path) -> str:
    if os.statvfs(path).f_flag & os.ST_RDONLY:
        return "Read-only file system"
    return "immutable or append-only: lsattr -d shows i or a" if _immutable(path) else "Permission denied"


# -- the output formats the assistant offers -------------------------------------------------------

OUTPUT_REFUSED = "output-format"  # the finding of an output format the engine cannot write for these inputs


def _output_refused(options: MergeOptions, inputs, adapter, config: dict, dtype) -> str | None:
    """OUTPUT_REFUSED when the tensor plan fails only because of the output format asked for (the same
    plan without it is fine): the assistant then says the sentence and keeps the format it had."""
    from tui_merger.core.plan.plan import build_plan

    if options.output_quantization is None:
        return None
    try:
        build_plan(inputs.base, adapter, config, dtype, options.shard_size)  # output_plan without the rewrite
    except MergeError:
        return None
    return OUTPUT_REFUSED


def _inputs_refused(options: MergeOptions) -> str | None:
    """OUTPUT_REFUSED when the inputs open without the output format asked for."""
    import dataclasses

    from tui_merger.core.formats.inputs import open_inputs

    if options.output_quantization is None:
        return None
    try:
        open_inputs(dataclasses.replace(options, output_quantization=None)).close()
    except Exception:  # noqa: BLE001 - not the format's fault: the plan reports the first error
        return None
    return OUTPUT_REFUSED


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def output_choices(base_scheme: str | None, dtype: str | None) -> list[tuple[str, str | None]]:
    """The output formats the assistant offers (Review's select, the plain flow's question), default
    first, as (words, MergeOptions.output_quantization). Which of them the engine can write for a given
    base is its own to say (a refused one becomes an OUTPUT_REFUSED finding), not decided here."""
    if base_scheme is not None:  # released quantized: a plain model, or the base's own format again
        return [(f"{SHORT_DTYPES.get(dtype, dtype or '16-bit')}, a plain model (default)", None),
                (f"{base_scheme} as the base (--keep-quantization)", "keep")]
    return [("as merged (default)", None), ("FP8 128x128 blocks for serving (--quantize fp8)", "fp8")]


def output_refusal(plan: MergePlan) -> str | None:
    """The engine's sentence refusing the output format of ``plan`` (None: it can be written)."""
    return next((f.message for f in plan.findings if f.id == OUTPUT_REFUSED), None)



# -- the suggested output name -------------------------------------------------------------------------

_GENERIC = re.compile(r"^(adapter|adapters|lora|lora_adapter|lora-adapter|output|outputs|actor|critic|final|checkpoint-\d+|global_step_\d+|\d+)$", re.I)


_STEP_NAME = re.compile(r"^(?:checkpoint-|global_step_)(\d+)$")


def _children(folder: Path) -> list[Path]:
    try:
        return [p for p in folder.iterdir() if p.is_dir()]
    except OSError:
        return []


def suggest_name(options: MergeOptions, inputs, raw: dict | None, today: datetime.date | None = None) -> str:
    """``{base}-{task}-r{rank}-{date}``, e.g. ``Qwen2.5-0.5B-alpaca-r16-20261130`` (editable)."""
    today = today or datetime.date.today()
    cfg = (inputs.adapter.config if inputs is not None else raw) or {}
    base_ref = cfg.get("base_model_name_or_path") or (inputs.config.get("_name_or_path") if inputs else None) or (options.base and str(options.base))
    if options.base is not None:  # the base this merge uses, not the one the adapter names (it may be elsewhere)
        used = Path(str(options.base))
        base_ref = next((p[len("models--"):].split("--")[-1] for p in used.parts if p.startswith("models--")), None) or used.name
    base = Path(str(base_ref or "model")).name or "model"
    source = Path(options.adapter or options.checkpoint or "merged")
    source = source.with_suffix("") if source.suffix == ".safetensors" else source  # a kohya LoRA file
    task = next((p.name for p in (source, *source.parents) if p.name and not _GENERIC.match(p.name)), "merged")
    parts = [base, task]
    r = cfg.get("r")
    if inputs is not None and inputs.adapter.lora:
        ranks = {m.r for m in inputs.adapter.lora.values()}
        r = ranks.pop() if len(ranks) == 1 else max(ranks)
    if r:
        parts.append(f"r{r}")
    step = next((m for p in (source, source.parent) if (m := _STEP_NAME.match(p.name))), None)
    if step:  # which step of the run this is
        parts.append(f"step{step.group(1)}")
    elif source.is_dir() and any(_STEP_NAME.match(p.name) for p in _children(source)):
        parts.append("final")  # the final save at the top of a run, beside its checkpoint-N folders
    parts.append(today.strftime("%Y%m%d"))
    name = "-".join(dict.fromkeys(p for p in parts if p))
    return re.sub(r"[^\w.\-]+", "-", name)


def describe(plan: MergePlan) -> list[str]:
    """The plan as lines of text (for --dry-run and the plain flow)."""
    lines = []
    for role, path in plan.inputs.items():
        lines.append(f"  {role:10} {path}")
    out = plan.options.get("out")
    lines.append(f"  {'output':10} {out or '(not given)'}" + ("" if out else f"  suggested: {plan.suggested_out}"))
    if plan.base_format:
        lines.append(f"  {'base is':10} {plan.base_format}; merged into its dequantized weights")
    if plan.output_format:
        lines.append(f"  {'output is':10} {plan.output_format}")
    if plan.adapter:
        a = plan.adapter
        targets = a["target_modules"] if isinstance(a["target_modules"], str) else ", ".join(sorted(map(str, a["target_modules"])))
        experts = ""
        if a.get("parameters"):
            kinds = a["parameters"]
            packed = [f"{t} r={k['r']} alpha={k['alpha']}" for t, k in kinds.items() if not k["router"]]
            routers = [f"{t} r={k['r']} alpha={k['alpha']}" for t, k in kinds.items() if k["router"]]
            if packed:
                experts += f" + LoRA on {a['expert_parameters']} expert parameter(s) ({', '.join(packed)}; rank per expert)"
            if routers:
                experts += f" + LoRA on {a['router_parameters']} router weight(s) ({', '.join(routers)})"
        elif a.get("expert_parameters"):
            experts = (f" + LoRA on {a['expert_parameters']} expert parameter(s) "
                       f"({', '.join(sorted(map(str, a['target_parameters'])))}; rank r per expert)")
        alpha_from = f" (from {a['alpha_from']})" if a.get("alpha_from") else ""
        lines.append(f"  {'LoRA':10} r={a['r']} alpha={_g(a['alpha'])}{alpha_from} {a['variant']}, {a['modules']} modules ({targets}){experts}")
        for number, part in enumerate(a.get("adapters") or [], start=1):
            alpha_from = f" (from {part['alpha_from']})" if part.get("alpha_from") else ""
            lines.append(
                f"  {'weight':10} {part['weight']:g} x adapter {number} ({Path(part['path']).name}: r={part['r']} "
                f"alpha={_g(part['lora_alpha'])}{alpha_from}, {part['modules']} modules)"
            )
        for line in a.get("overlaps") or []:
            lines.append(f"  {'touches':10} {line}")
    checkpoint = bool(plan.options.get("checkpoint"))  # a training checkpoint (verl): its own weights, config, tokenizer
    if plan.tensors:
        what = f"{plan.merged_tensors} merged" if plan.adapter else "converted, no adapter to merge"
        lines.append(
            f"  {'writes':10} {plan.tensors} tensors ({what}), {human_bytes(plan.output_bytes)} in {plan.shards} "
            f"shard(s), dtype {plan.dtype or ('as the checkpoint' if checkpoint else 'as the base')}, "
            f"about {plan.estimated_seconds:.0f} s"
        )
        resume = plan.resume
        if resume and resume["state"] == "match" and resume["kept"]:
            lines.append(
                f"  {'resuming':10} {resume['kept']} of {resume['shards']} shards kept ({human_bytes(resume['kept_bytes'])}), "
                f"{human_bytes(max(plan.output_bytes - resume['kept_bytes'], 0))} to write"
            )
        if plan.verify_seconds:
            lines.append(
                f"  {'verify':10} about {plan.verify_seconds:.0f} s and {human_bytes(plan.verify_bytes)} of memory "
                "(every value recomputed; the models run layer by layer)"
            )
        tok = {"adapter": "from the checkpoint" if checkpoint else "from the adapter folder", "base": "from the base",
               None: "none found"}[plan.tokenizer_source]
        lines.append(f"  {'tokenizer':10} {tok}")
    return lines
