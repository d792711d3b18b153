"""LoRA adapters as the merge sees them (every kind becomes a PeftAdapter), and the PEFT adapter folder: its config, and its tensors grouped by the module they belong to."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.io.files import read_json_object
from tui_merger.core.options import is_finite_number
from tui_merger.core.io.sources import TensorRef, TensorSource, flattened, not_a_folder

PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

# (regex on the key without the PEFT prefix, role). Group "mod" is the module path. An optional
# ".<adapter name>" infix is accepted: peft strips it when saving, other trainers do not always.
_NAME = r"(?:\.[A-Za-z0-9_\-]+)?"
_PATTERNS = [
    (re.compile(rf"^(?P<mod>.+)\.lora_A{_NAME}\.weight$"), "A"),
    (re.compile(rf"^(?P<mod>.+)\.lora_B{_NAME}\.weight$"), "B"),
    (re.compile(rf"^(?P<mod>.+)\.lora_B{_NAME}\.bias$"), "B_bias"),
    (re.compile(rf"^(?P<mod>.+)\.lora_embedding_A{_NAME}$"), "emb_A"),
    (re.compile(rf"^(?P<mod>.+)\.lora_embedding_B{_NAME}$"), "emb_B"),
    (re.compile(rf"^(?P<mod>.+)\.lora_magnitude_vector{_NAME}(?:\.weight)?$"), "magnitude"),
    (re.compile(r"^(?P<mod>.+)\.(?:base_layer|original_module)\.(?P<param>weight|bias)$"), "base_override"),
    (re.compile(rf"^(?P<mod>.+)\.modules_to_save{_NAME}\.(?P<param>weight|bias)$"), "replacement"),
    (re.compile(rf"^(?P<mod>.+)\.token_adapter\.trainable_tokens_delta{_NAME}$"), "token_rows"),
]


def pattern_key(patterns, module: str) -> str | None:
    """The first rank/alpha pattern that matches a module name, matched as peft matches it:
    the pattern must match a dotted suffix of the name (``(.*\\.)?(pattern)$``)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass
class LoraModule:
    """The LoRA tensors of one module (e.g. ``model.layers.0.self_attn.q_proj``)."""

    module: str
    A: TensorRef | None = None
    B: TensorRef | None = None
    B_bias: TensorRef | None = None
    emb_A: TensorRef | None = None
    emb_B: TensorRef | None = None
    magnitude: TensorRef | None = None
    r: int = 0
    alpha: float = 0.0
    scale: float = 0.0  # alpha / r (or / sqrt(r)), times the adapter's weight in a weighted merge
    origin: int = 0  # which adapter of a weighted merge (index into config["adapters"])
    terms: list["LoraModule"] = field(default_factory=list)  # the same module in the other adapters
    experts: int = 0  # LoRA on packed experts kept packed (expert_lora): how many
    candidates: tuple = ()  # parameter LoRA before it is placed: (nesting depth, parameter names)
    transposed: bool = False  # those experts' delta is (B_e @ A_e)^T: lora_A reads dim 1 of [experts, d1, d2]

    @property
    def is_embedding(self) -> bool:
        return self.emb_A is not None or self.emb_B is not None


@dataclass
class PeftAdapter:
    folder: Path
    config: dict
    source: TensorSource | None
    lora: dict[str, LoraModule] = field(default_factory=dict)
    # full replacement tensors (modules_to_save, saved embedding base layers): param name -> ref
    replacements: dict[str, TensorRef] = field(default_factory=dict)
    base_overrides: dict[str, TensorRef] = field(default_factory=dict)
    # trainable_token_indices: module -> (row indices, ref of the stored rows)
    token_rows: dict[str, tuple[list[int], TensorRef]] = field(default_factory=dict)
    # peft target_parameters (LoRA on a parameter, e.g. packed MoE experts): in-memory param name ->
    # its LoRA pair (rank r x experts); made into per-tensor LoRA against the base (formats/hf_names.py)
    param_lora: dict[str, LoraModule] = field(default_factory=dict)
    expert_lora: dict[str, LoraModule] = field(default_factory=dict)  # ... whose base keeps them packed on disk
    expert_parameters: list[str] = field(default_factory=list)  # the parameters target_parameters reached
    expert_slices: set[str] = field(default_factory=set)  # entries of ``lora`` made from them (not target_modules)
    parameter_ranks: dict[str, tuple] = field(default_factory=dict)  # those parameters' (r, alpha)
    # expert LoRA saved in the layout of another peft version than the one installed (peft <= 0.18):
    # lora_A key -> (lora_B key, experts); the reference peft loads gets them converted (relaid_copy)
    relayout: dict[str, tuple] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    # where config["lora_alpha"] came from when the adapter did not record it ("": recorded): "peft's
    # default" (peft's LoraConfig default, 8), "kohya's default" (alpha = rank) or "--lora-alpha" (``use_alpha``)
    alpha_from: str = ""
    alpha_notices: list[str] = field(default_factory=list)  # the notices about that default (gone with --lora-alpha)
    per_module_alpha: bool = False  # alphas are recorded per module (kohya): --lora-alpha sets every module's
    # a --lora-alpha follows the opening (``use_alpha``): a recorded lora_alpha of 0 is not refused, it is replaced
    alpha_given: bool = False

    @property
    def fan_in_fan_out(self) -> bool:
        return bool(self.config.get("fan_in_fan_out", False))

    @property
    def use_dora(self) -> bool:
        return bool(self.config.get("use_dora", False))

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def empty_adapter(folder: Path) -> PeftAdapter:
    """No adapter: a full-weights checkpoint is converted as it is."""
    return PeftAdapter(folder=Path(folder), config={}, source=None)


def adapter_from_source(folder: Path, config: dict, source) -> PeftAdapter:
    """An adapter whose LoRA tensors live in another container (e.g. a verl FSDP checkpoint)."""
    adapter = PeftAdapter(folder=Path(folder), config=config, source=source)
    _group(adapter)
    _param_loras(adapter)
    _resolve_scales(adapter)
    return adapter


def module_params(adapter: PeftAdapter) -> list[str]:
    """The base parameters the adapter changes or replaces (``<module>.weight`` for a LoRA module)."""
    names = [f"{m}.weight" for m in adapter.lora] + [f"{m}.weight" for m in adapter.token_rows]
    return names + list(adapter.replacements) + list(adapter.base_overrides) + list(adapter.param_lora) + list(adapter.expert_lora)


def renamed(adapter: PeftAdapter, rename) -> PeftAdapter:
    """The same adapter with its module and parameter names passed through ``rename`` (parameter name
    -> parameter name; names it does not know come back unchanged): in-memory names -> on-disk ones."""
    import dataclasses

    def module(name: str) -> str:
        return rename(f"{name}.weight").removesuffix(".weight")

    lora = {}
    for name, entry in adapter.lora.items():
        entry.module = module(name)
        lora[entry.module] = entry
    return dataclasses.replace(
        adapter,
        lora=lora,
        replacements={rename(n): r for n, r in adapter.replacements.items()},
        base_overrides={rename(n): r for n, r in adapter.base_overrides.items()},
        token_rows={module(n): v for n, v in adapter.token_rows.items()},
    )


def _is_names(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def _is_patterns(value, ok) -> bool:
    if not isinstance(value, dict):
        return False
    for key, v in value.items():
        try:
            re.compile(key)
        except re.error:
            return False
        if not ok(v):
            return False
    return True


def _is_indices(value) -> bool:
    ints = lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)  # noqa: E731
    return ints(value) or (isinstance(value, dict) and all(ints(v) for v in value.values()))


# field -> (check of a present, non-null value, what it should be)
_CONFIG_FIELDS = {
    "peft_type": (lambda v: isinstance(v, str), "a name such as LORA"),
    "r": (lambda v: type(v) is int and v >= 1, "a whole number of at least 1"),
    "lora_alpha": (is_finite_number, "a number"),
    "rank_pattern": (lambda v: _is_patterns(v, lambda r: type(r) is int and r >= 1), "a map of module patterns to ranks"),
    "alpha_pattern": (lambda v: _is_patterns(v, is_finite_number), "a map of module patterns to numbers"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "use_dora": (lambda v: isinstance(v, bool), "true or false"),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "lora_bias": (lambda v: isinstance(v, bool), "true or false"),
    "target_modules": (_is_names, "a module name or a list of them"),
    "modules_to_save": (_is_names, "a list of module names"),
    "exclude_modules": (_is_names, "a module name or a list of them"),
    "base_model_name_or_path": (lambda v: isinstance(v, str), "a model name or path"),
    "task_type": (lambda v: isinstance(v, str), "a task name such as CAUSAL_LM"),
    "trainable_token_indices": (_is_indices, "a list of token ids (or a map of modules to lists)"),
}


def adapter_config_problems(config: dict) -> dict[str, str]:
    """{field: what is wrong with it} for the fields tui-merger reads that lack the types peft writes."""
    problems = {}
    for key, (ok, what) in _CONFIG_FIELDS.items():
        value = config.get(key)
        if value is not None and not ok(value):
            problems[key] = f"{key} is {json.dumps(value)[:40]}, not {what}"
    return problems


def check_adapter_config(config: dict, path: Path) -> None:
    """A damaged or hand-edited adapter_config.json is named in one sentence instead of failing
    somewhere in the merge."""
    for problem in adapter_config_problems(config).values():
        raise MergeError(f"{path}: {problem}; fix adapter_config.json or save the adapter again with peft.")


def _read_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    if not folder.is_dir():
        raise not_a_folder(folder, "--adapter", "adapter")
    if not path.is_file():
        hint = ""
        if (folder / "config.json").is_file():
            hint = " It looks like a full model, not an adapter."
        raise MergeError(
            f"{folder} has no adapter_config.json, so it is not a PEFT adapter folder.{hint} "
            "Point --adapter at the folder that peft's save_pretrained wrote."
        )
    config = read_json_object(path, "fix or re-save the adapter")
    check_adapter_config(config, path)
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise MergeError(
            f"{folder} is a {peft_type} adapter; tui-merger merges LoRA adapters only (peft_type LORA)."
        )
    return config


def _module_names_to_save(config: dict) -> list[str]:
    names = list(config.get("modules_to_save") or [])
    return [n for n in names if isinstance(n, str)]


def open_adapter(folder: Path, alpha_given: bool = False) -> PeftAdapter:
    """A PEFT adapter folder. ``alpha_given``: the user gave --lora-alpha, which ``use_alpha`` puts in
    place of the recorded lora_alpha, so a recorded 0 (which would change nothing) is not refused here."""
    folder = Path(folder)
    config = _read_config(folder)
    files = [f for f in ADAPTER_WEIGHTS if (folder / f).is_file()]
    if not files:
        raise MergeError(
            f"{folder} has adapter_config.json but no adapter_model.safetensors or adapter_model.bin; "
            "the adapter weights were not saved or not copied."
        )
    source = TensorSource(folder, files[:1])
    adapter = PeftAdapter(folder=folder, config=config, source=source, alpha_given=alpha_given)
    try:
        _group(adapter)
        _param_loras(adapter)
        _resolve_scales(adapter)
    except BaseException:
        source.close()
        raise
    return adapter


def module_targeted(config: dict, module: str) -> bool:
    """Whether ``target_modules`` names ``module``, matched as peft matches it: a string is a regex
    the whole name must match; a list names modules exactly or by dotted suffix."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        return re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in map(str, targets or []))


def targeted_parameters(module: str, targets) -> tuple[str, int, list[str]]:
    """For a LoRA pair saved under ``module`` (``mlp.experts`` or, nested, ``mlp.experts.base_layer``):
    (the module owning the parameters, the nesting depth, the names of the parameters of that module
    that ``target_parameters`` may name). peft targets a parameter when ``<module>.<parameter>`` is a
    target or ends with ``.<target>``: a bare target (``gate_up_proj``, what ``all-linear`` writes) may
    name a parameter of any module; which of them the module really has is for the base to say."""
    owner, depth = module, 0
    while owner.endswith(".base_layer"):
        owner, depth = owner[: -len(".base_layer")], depth + 1
    params = []
    for target in map(str, targets or []):
        where, _, param = target.rpartition(".")
        if (not where or owner == where or owner.endswith("." + where)) and param not in params:
            params.append(param)
    return owner, depth, params


def _param_loras(adapter: PeftAdapter) -> None:
    """peft ``target_parameters``: a parameter's LoRA is saved under its module (``mlp.experts.lora_A``);
    several parameters of one module nest, in the module's parameter order, the first innermost
    (``base_layer.lora_A``). Those pairs move to ``param_lora`` (keyed by module and nesting); the
    base decides which parameter each changes and so its rank and alpha (``rank_pattern`` is keyed by
    the parameter: ``.*\\.gate_up_proj``). A pair under a module that ``target_modules`` names is the
    module's own LoRA (peft refuses to target a module both ways)."""
    targets = [str(t) for t in adapter.config.get("target_parameters") or []]
    if not targets:
        return
    for mod in list(adapter.lora):
        owner, depth, params = targeted_parameters(mod, targets)
        if not params or (depth == 0 and module_targeted(adapter.config, mod)):
            continue
        if depth >= len(params):
            raise MergeError(
                f"{mod}: the adapter's LoRA pairs for {owner} do not fit its target_parameters ({', '.join(params)}); "
                "the adapter file is inconsistent."
            )
        entry = adapter.lora.pop(mod)
        entry.module = owner
        entry.candidates = (depth, tuple(params))
        adapter.param_lora[f"{owner}.{'base_layer.' * depth}lora"] = entry


def param_rank(config: dict, name: str) -> tuple[int, float, float]:
    """(r, alpha, scale) of the LoRA on parameter ``name`` (``model.layers.0.mlp.experts.gate_up_proj``),
    as peft resolves them: ``rank_pattern`` / ``alpha_pattern`` matched against the parameter's name."""
    r = config.get("r") or 8
    alpha = config.get("lora_alpha")
    alpha = 8 if alpha is None else alpha
    key = pattern_key(config.get("rank_pattern") or {}, name)
    if key is not None:
        r = config["rank_pattern"][key]
    key = pattern_key(config.get("alpha_pattern") or {}, name)
    if key is not None:
        alpha = config["alpha_pattern"][key]
    if not alpha:
        raise MergeError(f"lora_alpha is 0 for {name}, so the adapter would change nothing; set the training value.")
    r = int(r)
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return r, alpha, scale


def _group(adapter: PeftAdapter) -> None:
    save_names = _module_names_to_save(adapter.config)
    leftovers = []
    for key, ref in adapter.source.tensors.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        for regex, role in _PATTERNS:
            m = regex.match(name)
            if not m:
                continue
            mod = m.group("mod")
            if role == "base_override":
                adapter.base_overrides[f"{mod}.{m.group('param')}"] = ref
            elif role == "replacement":
                adapter.replacements[f"{mod}.{m.group('param')}"] = ref
            elif role == "token_rows":
                adapter.token_rows[mod] = ([], ref)
            else:
                entry = adapter.lora.setdefault(mod, LoraModule(mod))
                setattr(entry, role, ref)
            break
        else:
            # modules_to_save copies are usually saved as plain "<module>.<param>"
            mod, _, _param = name.rpartition(".")
            # with ensure_weight_tying peft also saves the output embedding tied to a trained input one
            tied_head = bool(adapter.config.get("ensure_weight_tying")) and mod.endswith("lm_head")
            if mod and (tied_head or any(mod == s or mod.endswith("." + s) for s in save_names)):
                adapter.replacements[name] = ref
            else:
                leftovers.append(key)
    if leftovers:
        shown = ", ".join(leftovers[:5]) + (f" and {len(leftovers) - 5} more" if len(leftovers) > 5 else "")
        raise MergeError(
            f"The adapter holds tensors tui-merger does not know how to merge ({shown}); "
            "nothing was written. Is it a LoRA adapter saved by peft?"
        )
    _resolve_token_rows(adapter)


def _resolve_token_rows(adapter: PeftAdapter) -> None:
    if not adapter.token_rows:
        return
    spec = adapter.config.get("trainable_token_indices")
    for mod in list(adapter.token_rows):
        indices = None
        if isinstance(spec, dict):
            for key, value in spec.items():
                if mod == key or mod.endswith("." + key):
                    indices = value
                    break
        elif isinstance(spec, list):
            indices = spec  # a plain list means the input embedding
        if indices is None:
            raise MergeError(
                f"The adapter stores trainable token rows for {mod} but trainable_token_indices in "
                "adapter_config.json does not say which rows; the adapter config is incomplete."
            )
        ref = adapter.token_rows[mod][1]
        if len(ref.shape) != 2 or ref.shape[0] != len(indices):
            raise MergeError(
                f"{mod}: {len(indices)} trainable token indices but {ref.shape[0]} stored rows; "
                "adapter_config.json does not match the adapter weights."
            )
        adapter.token_rows[mod] = ([int(i) for i in indices], ref)


def _resolve_scales(adapter: PeftAdapter) -> None:
    cfg = adapter.config
    if "lora_alpha" not in cfg or cfg.get("lora_alpha") is None:
        cfg["lora_alpha"] = cfg_alpha = PEFT_DEFAULT_ALPHA  # recorded as the value used (the manifest says it)
        adapter.alpha_from = "peft's default"
        if adapter.lora:
            adapter.alpha_notices.append(no_alpha_sentence(adapter.folder / "adapter_config.json"))
            adapter.notices.append(adapter.alpha_notices[-1])
    else:
        cfg_alpha = cfg["lora_alpha"]
    cfg_r = cfg.get("r") or 8  # peft's default; null counts as not given
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    for mod, entry in adapter.lora.items():
        a_ref, b_ref = (entry.emb_A, entry.emb_B) if entry.is_embedding else (entry.A, entry.B)
        if a_ref is None or b_ref is None:
            half = "A" if a_ref is None else "B"
            raise MergeError(
                f"The adapter has only half of the LoRA pair for {mod} (lora_{half} is missing); "
                "the adapter file is incomplete."
            )
        if not entry.is_embedding and _conv_pair(a_ref, b_ref):
            # peft's convolution LoRA (a VL model's patch embedding, which all-linear reaches): lora_A is a
            # conv [r, in, k...], lora_B a 1x1 one [out, r, 1...]; its delta, conv(A^T, B)^T, is B @ A on
            # the flattened kernels: merged as a LoRA on the weight seen as [out, in * k...]
            entry.A, entry.B = a_ref, b_ref = flattened(a_ref), flattened(b_ref)
            if entry.magnitude is not None:
                raise MergeError(f"{mod}: DoRA on convolution layers is not supported yet.")
        if len(a_ref.shape) != 2 or len(b_ref.shape) != 2:
            raise MergeError(
                f"{mod}: LoRA tensors of shape {list(a_ref.shape)} / {list(b_ref.shape)} are not matrices "
                "(nor a convolution LoRA: lora_B not 1x1); this LoRA layout is not supported."
            )
        if a_ref.shape[0] != b_ref.shape[1]:
            raise MergeError(
                f"{mod}: lora_A has rank {a_ref.shape[0]} but lora_B has rank {b_ref.shape[1]}; "
                "the adapter file is inconsistent."
            )
        key = pattern_key(rank_pattern, mod)
        r = int(rank_pattern[key]) if key is not None else int(cfg_r)
        key = pattern_key(alpha_pattern, mod)
        alpha = alpha_pattern[key] if key is not None else cfg_alpha
        if a_ref.shape[0] != r:
            raise MergeError(
                f"{mod}: adapter_config.json says r={r} but the saved tensors have rank {a_ref.shape[0]}; "
                "the config does not belong to these weights."
            )
        if not alpha and key is None and adapter.alpha_given:
            alpha = 0  # the recorded lora_alpha, which the user's --lora-alpha replaces (use_alpha)
        elif not alpha and key is not None:  # --lora-alpha leaves alpha_pattern's entries as they are
            raise MergeError(
                f"alpha_pattern gives lora_alpha 0 for {mod} in {adapter.folder / 'adapter_config.json'}, so the "
                "adapter would change nothing there; set that entry to the value used in training."
            )
        elif not alpha:
            raise MergeError(
                f"lora_alpha is 0 for {mod} in {adapter.folder / 'adapter_config.json'}, so the adapter "
                "would change nothing; pass --lora-alpha with the value used in training."
            )
        entry.r = r
        entry.alpha = alpha
        entry.scale = alpha / math.sqrt(r) if rslora else alpha / r
        if entry.magnitude is not None and entry.is_embedding:
            raise MergeError(f"{mod}: DoRA on embedding layers is not supported yet.")
    for name, entry in adapter.param_lora.items():  # rank and alpha: once the base says which parameter
        a, b = entry.A, entry.B
        if a is None or b is None or len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
            raise MergeError(
                f"{name}: the LoRA pair for this parameter is incomplete or inconsistent "
                f"(lora_A {list(a.shape) if a else None}, lora_B {list(b.shape) if b else None}); "
                "the adapter file is damaged or not peft's."
            )


PEFT_DEFAULT_ALPHA = 8  # peft's LoraConfig default


def no_alpha_sentence(config_path) -> str:
    """The one wording of "the adapter records no alpha" (the plan's finding and the merge's notice)."""
    return (
        f"{config_path} has no lora_alpha, so peft's default of {PEFT_DEFAULT_ALPHA} is used, as peft itself "
        "would; if training used another alpha, give it with --lora-alpha."
    )


def use_alpha(adapter: PeftAdapter, alpha: float) -> str | None:
    """--lora-alpha on an opened adapter: it takes the place of the config's lora_alpha (modules that
    a PEFT adapter's alpha_pattern names keep theirs, as with the value written into adapter_config.json;
    a file that records an alpha per module, kohya's, gets it for every module), and every module's
    scale follows. Returns the sentence that says so, or None when the adapter records that very value.
    A value recorded in the adapter is replaced too, and said: the user typed it."""
    if not math.isfinite(alpha) or alpha <= 0:
        raise MergeError(f"--lora-alpha {alpha:g} would make the adapter change nothing; give the lora_alpha used in training (above 0).")
    cfg = adapter.config
    patterns = cfg.get("alpha_pattern") or {}
    recorded = None if adapter.alpha_from else cfg.get("lora_alpha")
    if recorded is not None and float(recorded) == float(alpha) and not (adapter.per_module_alpha and patterns):
        return None
    adapter.notices = [n for n in adapter.notices if n not in adapter.alpha_notices]
    adapter.alpha_notices = []
    replaced = {"lora_alpha": alpha, **({"alpha_pattern": {}} if adapter.per_module_alpha else {})}
    adapter.config = {**cfg, **replaced}
    adapter.alpha_from = "--lora-alpha"
    _resolve_scales(adapter)
    where = adapter.folder / "adapter_config.json" if adapter.folder.is_dir() else adapter.folder
    kept = 0 if adapter.per_module_alpha else len(patterns)
    still = f"; the {kept} alpha_pattern entr{'y' if kept == 1 else 'ies'} in it still appl{'ies' if kept == 1 else 'y'}" if kept else ""
    if recorded is None:
        return f"alpha {alpha:g}, from --lora-alpha ({where} records none){still}."
    if adapter.per_module_alpha and patterns:
        return f"alpha {alpha:g} for every module, from --lora-alpha, instead of the alphas recorded in {where}."
    return f"alpha {alpha:g}, from --lora-alpha, instead of the {recorded:g} recorded in {where}{still}."


def _conv_pair(a, b) -> bool:
    return 3 <= len(a.shape) <= 5 and len(b.shape) == len(a.shape) and all(d == 1 for d in b.shape[2:])


_ADAPTER_NAME = re.compile(
    r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)\.(?!weight$|bias$)[A-Za-z0-9_\-]+(?=\.weight$|\.bias$|$)"
)


def export_peft_adapter(adapter: PeftAdapter, dest: Path, fsync: bool = True) -> list[str]:
    """Write the adapter's LoRA tensors as a PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors, peft's key names) that peft and vLLM load. Returns the files written."""
    dest.mkdir(parents=True)
    entries = []
    for key, ref in adapter.source.tensors.items():
        name = key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key
        name = _ADAPTER_NAME.sub(r".\1", name)  # peft saves keys without the adapter name
        entries.append((name, ref))
    _write_tensors(dest / ADAPTER_WEIGHTS[0], [(n, r, r.shape, r.load) for n, r in entries], fsync)
    cfg = adapter.config
    modules = [mod for mod in adapter.lora if mod not in adapter.expert_slices]  # not the experts' slices
    targets = sorted({mod.rsplit(".", 1)[-1] for mod in modules})
    if any(name.isdigit() for name in targets):
        # a module named by its index ("merger.mlp.0") would, as a suffix, also match other modules
        # ("blocks.0", a whole vision block): name each module exactly (peft full-matches a string)
        targets = "^(?:" + "|".join(re.escape(mod) for mod in sorted(modules)) + ")$"
    if isinstance(cfg.get("target_modules"), str):  # a regex the reader chose (megatron_lora: a VL model's language
        targets = cfg["target_modules"]  # model only, whose names a vision tower shares); peft full-matches it
    config = {
        "peft_type": "LORA",
        "task_type": cfg.get("task_type", "CAUSAL_LM"),
        "r": int(cfg.get("r", next(iter(adapter.lora.values())).r if adapter.lora else 8)),
        "lora_alpha": cfg.get("lora_alpha"),
        "rank_pattern": cfg.get("rank_pattern") or {},
        "alpha_pattern": cfg.get("alpha_pattern") or {},
        "target_modules": targets,
        "use_rslora": bool(cfg.get("use_rslora", False)),
        "use_dora": adapter.use_dora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out", False)),
        "base_model_name_or_path": "..",
        "inference_mode": True,
        **({"target_parameters": list(cfg["target_parameters"])} if cfg.get("target_parameters") else {}),
    }
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return [f"{dest.name}/adapter_config.json", f"{dest.name}/{ADAPTER_WEIGHTS[0]}"]


def relaid_copy(adapter: PeftAdapter, dest: Path) -> Path:
    """A copy of a PEFT adapter folder whose expert LoRA pairs saved in another peft version's layout
    (``adapter.relayout``) are rewritten in the installed peft's, so that it loads them: expert e's
    delta ``(B_e @ A_e).T`` is ``A_e.T @ B_e.T``, so the new lora_A's rows for expert e are B_e's
    columns and the new lora_B's columns are A_e's rows (values moved, none computed). The config
    names the installed peft. Everything else is copied as it is."""
    from importlib.metadata import version

    dest.mkdir(parents=True)
    pairs = {b: a for a, (b, _) in adapter.relayout.items()}

    def relaid(key, ref):
        def load():
            if key in adapter.relayout:  # new lora_A[e*r + k] = B[:, k*E + e]
                b_key, experts = adapter.relayout[key]
                b = adapter.source.tensors[b_key].load()
                return b.reshape(b.shape[0], -1, experts).permute(2, 1, 0).reshape(-1, b.shape[0])
            if key in pairs:  # new lora_B[:, k*E + e] = A[e*r + k]
                experts = adapter.relayout[pairs[key]][1]
                a = adapter.source.tensors[pairs[key]].load()
                return a.reshape(experts, -1, a.shape[1]).permute(2, 1, 0).reshape(a.shape[1], -1)
            return ref.load()

        return load

    entries = []
    for key, ref in adapter.source.tensors.items():
        shape = ref.shape
        if key in adapter.relayout:
            shape = (shape[0], adapter.source.tensors[adapter.relayout[key][0]].shape[0])
        elif key in pairs:
            shape = (adapter.source.tensors[pairs[key]].shape[1], shape[1])
        entries.append((key, ref, shape))
    _write_tensors(dest / ADAPTER_WEIGHTS[0], [(k, r, shape, relaid(k, r)) for k, r, shape in entries], fsync=False)
    config = dict(adapter.config, peft_version=version("peft"))
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dest


def alpha_copy(adapter: PeftAdapter, dest: Path) -> Path:
    """The PEFT adapter folder as peft must load it for the reference when --lora-alpha replaced its
    lora_alpha: its adapter_config.json with that value, its weights linked (not copied)."""
    dest.mkdir(parents=True)
    config = json.loads((adapter.folder / "adapter_config.json").read_text())
    config["lora_alpha"] = adapter.config["lora_alpha"]
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in adapter.source.files:
        (dest / name).symlink_to((adapter.folder / name).resolve())
    return dest


def parameter_kinds(ranks: dict) -> dict:
    """{``mlp.experts.gate_up_proj``: (r, alpha, how many)} from {parameter name: (r, alpha, experts)}:
    the layers' parameters of one kind once (ranks and alphas as lists where the layers differ)."""
    kinds: dict = {}
    for name, (r, alpha, _experts) in ranks.items():
        tail = ".".join(name.split(".")[-3:])
        rs, alphas, n = kinds.get(tail, (set(), set(), 0))
        kinds[tail] = (rs | {r}, alphas | {alpha}, n + 1)
    one = lambda v: next(iter(v)) if len(v) == 1 else sorted(v)  # noqa: E731
    return {tail: (one(rs), one(alphas), n) for tail, (rs, alphas, n) in kinds.items()}


def _write_tensors(path: Path, entries, fsync: bool) -> None:
    """One safetensors file from [(name, ref, shape, load)], each tensor loaded, written and handed back."""
    from tui_merger.core.io.safetensors_io import SafetensorsWriter

    writer = SafetensorsWriter(path, [(n, r.dtype, shape) for n, r, shape, _ in entries], early_writeback=False)
    try:
        for name, ref, _, load in entries:
            writer.write_tensor(name, load().contiguous())
            ref.release()
        writer.close(fsync=fsync)
    except BaseException:
        writer.abort()
        raise


LORA_TRAIN_META = "lora_train_meta.json"  # verl: {"r", "lora_alpha", "task_type"}


def lora_train_meta_path(folder: Path) -> Path | None:
    """Where verl recorded a LoRA run's r and lora_alpha: ``lora_train_meta.json`` in the folder of the
    engine's files (the FSDP checkpoint manager), else in the ``global_step_N`` folder above an actor /
    critic folder (the SFT trainer's checkpoint handler writes it there, beside the engine's files)."""
    folder = Path(folder)
    for place in (folder, folder.parent) if folder.name in ("actor", "critic") else (folder,):
        if (place / LORA_TRAIN_META).is_file():
            return place / LORA_TRAIN_META
    return None


def read_lora_train_meta(folder: Path) -> tuple[dict, Path] | None:
    """verl's lora_train_meta.json for the checkpoint in ``folder`` (checked like an adapter_config.json),
    or None when verl wrote none."""
    import json

    path = lora_train_meta_path(folder)
    if path is None:
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        raise MergeError(f"{path} is not valid JSON; fix it or pass --lora-alpha.") from None
    if not isinstance(meta, dict):
        raise MergeError(f"{path} does not hold a JSON object; fix it or pass --lora-alpha.")
    check_adapter_config(meta, path)
    return meta, path


def chosen_alpha(given: float | None, recorded, where: str) -> tuple[float | None, str | None]:
    """lora_alpha for a merge: the one the user gave (``--lora-alpha``) is used, and said when the run
    records another; else the recorded one, said with where it comes from. (alpha or None, sentence)."""
    if given is not None:
        if recorded and float(recorded) != float(given):
            return given, f"lora_alpha {given:g} (--lora-alpha) is used; {where} records {float(recorded):g}."
        return given, None
    if recorded:
        return float(recorded), f"alpha {float(recorded):g}, from {where}."
    return None, None
