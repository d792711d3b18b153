"""Megatron checkpoints of vision-language models (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE) -> Hugging Face names.

A helper of the verl Megatron kind (not a kind). The language model is ``language_model.*`` in every Megatron VL
model and is mapped by the kind's own mapper (verl_megatron._Mapper) as the text model it is; the vision tower
comes in one of two forms:

- **Megatron-Bridge** (``megatron/bridge/models/qwen_vl``, 0.3.1): the tower is transformers' own vision module,
  embedded (``ReplicatedMapping("visual.**")`` for Qwen2.5-VL, ``"vision_model.**" -> "model.visual.**"`` for
  Qwen3-VL): its tensors carry the module's own parameter names under ``visual.`` / ``vision_model.``;
- **megatron-core's vision transformer** (mbridge, which verl uses with Megatron, and verl's own
  ``verl/models/mcore/qwen2_5_vl``): ``vision_model.patch_embed``, ``vision_model.decoder.layers.*`` (fused qkv
  interleaved per head, fused layer norms, fc1 as [gate; up] where the tower is gated),
  ``vision_model.decoder.final_layernorm`` + ``vision_model.projection.encoder.linear_fc{1,2}`` (Qwen2.5-VL's
  merger), ``vision_model.merger.*`` / ``vision_model.decoder.deepstack_merger_list.*`` (Qwen3-VL's).

Where each tensor lands is transformers' answer: the model built on the meta device for the config
(``hf_names.disk_layout``) says where its language model and vision tower are in memory, which parameters they
have and their shapes, and ``save_pretrained``'s names for them (Qwen2.5-VL writes ``model.*`` / ``visual.*``,
Qwen3-VL ``model.language_model.*`` / ``model.visual.*``); Qwen3-VL-MoE keeps its experts packed
(``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]), filled expert by expert.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from tui_merger.core.errors import MergeError

# the language model's family in verl_megatron's terms, per VL model_type (the text model each VL model wraps)
VL_FAMILIES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
SUPPORTED_VL = "Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE"
LANGUAGE = "language_model."
VISION = ("visual.", "vision_model.")


def vl_family(config: dict) -> str | None:
    """The text family of a vision-language config this module maps, None for any other config."""
    if not isinstance(config.get("vision_config"), dict):
        return None
    return VL_FAMILIES.get(config.get("model_type"))


def text_config(config: dict, family: str) -> dict:
    """The VL config as the text model's config (its text_config over the top level), for the mapper."""
    flat = {k: v for k, v in config.items() if not isinstance(v, dict) and k != "architectures"}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    flat.update({k: v for k, v in text.items() if k != "architectures"})
    flat["model_type"] = family
    return flat


# megatron-core's vision transformer (mbridge / verl) -> the transformers vision module's names; a target in
# braces is chosen by what the module has (Qwen2.5-VL's gated MLP, Qwen3-VL's plain one)
_NATIVE_TOP = [
    (r"patch_embed\.proj\.(weight|bias)", "patch_embed.proj.{1}"),
    (r"pos_embed\.weight", "pos_embed.weight"),
    (r"decoder\.final_layernorm\.(weight|bias)", "merger.ln_q.{1}"),
    (r"projection\.encoder\.linear_fc1\.(weight|bias)", "merger.mlp.0.{1}"),
    (r"projection\.encoder\.linear_fc2\.(weight|bias)", "merger.mlp.2.{1}"),
    (r"merger\.patch_norm\.(weight|bias)", "merger.norm.{1}"),
    (r"merger\.linear_fc([12])\.(weight|bias)", "merger.linear_fc{1}.{2}"),
    (r"decoder\.deepstack_merger_list\.(\d+)\.patch_norm\.(weight|bias)", "deepstack_merger_list.{1}.norm.{2}"),
    (r"decoder\.deepstack_merger_list\.(\d+)\.linear_fc([12])\.(weight|bias)", "deepstack_merger_list.{1}.linear_fc{2}.{3}"),
]
_NATIVE_LAYER = [  # after vision_model.decoder.layers.[i.]; kind: copy, qkv (per-head interleave), glu (gate; up)
    (r"self_attention\.linear_qkv\.layer_norm_(weight|bias)|input_layernorm\.(weight|bias)", "copy", "norm1.{1}"),
    (r"self_attention\.linear_qkv\.(weight|bias)", "qkv", "attn.qkv.{1}"),
    (r"self_attention\.linear_proj\.(weight|bias)", "copy", "attn.proj.{1}"),
    (r"mlp\.linear_fc1\.layer_norm_(weight|bias)|pre_mlp_layernorm\.(weight|bias)", "copy", "norm2.{1}"),
    (r"mlp\.linear_fc1\.(weight|bias)", "fc1", "mlp.linear_fc1.{1}"),
    (r"mlp\.linear_fc2\.(weight|bias)", "fc2", "mlp.linear_fc2.{1}"),
]
_NATIVE_TOP_RE = [(re.compile(f"^(?:{p})$"), n) for p, n in _NATIVE_TOP]
_NATIVE_LAYER_RE = [(re.compile(f"^(?:{p})$"), k, n) for p, k, n in _NATIVE_LAYER]
_STACKED = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _fill(name: str, m: re.Match) -> str:
    groups = [g for g in m.groups() if g is not None]
    for i, g in enumerate(groups, 1):
        name = name.replace("{%d}" % i, g)
    return name


class _VlMapper:
    def __init__(self, tensors: dict, config: dict, config_path: Path, parts) -> None:
        self.parts = parts  # verl_megatron's mapper and records (Mapper, Mapping, Spec, Piece): no import cycle
        self.tensors = tensors
        self.config = config
        self.path = Path(config_path)
        self.family = vl_family(config)
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        self.arch = (config.get("architectures") or text.get("architectures") or [config.get("model_type")])[0]

    def fail(self, text: str) -> MergeError:
        return MergeError(
            f"{self.path} does not match the checkpoint: {text}; copy the config.json saved with this checkpoint "
            "(or pass --base with the model it was trained from)."
        )

    def run(self):
        Spec, _Mapper, _Mapping = self.parts.Spec, self.parts.Mapper, self.parts.Mapping

        language = {k[len(LANGUAGE):]: k for k in self.tensors if k.startswith(LANGUAGE)}
        vision = [k for k in self.tensors if k.startswith(VISION)]
        other = [k for k in self.tensors if k not in vision and not k.startswith(LANGUAGE)]
        if not language:
            raise MergeError(
                f"{self.path} describes a vision-language model ({self.arch}), but the checkpoint holds no "
                "language_model.* tensors (it holds " + (f"{other[0]}, ..." if other else "no model tensors")
                + "): it was saved from a text-only model; pass --base with the text model it was trained from."
            )
        if other:
            raise MergeError(
                f"The checkpoint holds {other[0]}, which has no counterpart in a Hugging Face {self.arch} model; "
                f"tui-merger converts Megatron checkpoints of {SUPPORTED_VL} models (language_model.*, visual.* or "
                "vision_model.*)."
            )
        layout, state, modules, lm_prefix = _meta_model(self.path.parent, f"a {self.arch} model from {self.path}",
                                                        "where its vision tower goes")
        model = layout.model
        head = model.get_output_embeddings()
        head_name = f"{modules[id(head)]}.weight" if head is not None and id(head) in modules else None
        if not lm_prefix:
            raise MergeError(f"transformers' {self.arch} has no language model to place the checkpoint's language_model.* in.")

        text = text_config(self.config, self.family)
        mapping = _Mapper({short: self.tensors[full] for short, full in language.items()}, text, self.path).run()
        if mapping.head == "score.weight":
            raise MergeError(
                f"The checkpoint's output layer has one row (a value head), which a Hugging Face {self.arch} model "
                "does not have; tui-merger converts vision-language actors only."
            )
        specs: dict[str, Spec] = {}
        packed: dict[str, dict] = {}  # in-memory packed experts -> {expert: [(part, spec)]}
        for name, spec in mapping.specs.items():
            spec = replace(spec, pieces=[replace(p, key=language[p.key]) for p in spec.pieces])
            if name == "lm_head.weight" and head_name:
                mem = head_name
            elif name.startswith("model."):
                mem = f"{lm_prefix}.{name[len('model.'):]}"
            else:
                raise MergeError(f"The checkpoint's {name} has no place in transformers' {self.arch}.")
            m = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", mem)
            if mem not in state and m:
                target = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down' else 'gate_up_proj'}"
                packed.setdefault(target, {}).setdefault(int(m.group(2)), {})[m.group(3)] = spec
                continue
            specs[mem] = spec
        for target, experts in packed.items():
            specs[target] = self._pack(target, experts, state)
        embed = f"{lm_prefix}.embed_tokens.weight"

        vis_prefix, vis_specs = self._vision(vision, state, modules, model)
        specs.update(vis_specs)
        # every parameter transformers' model has, from the checkpoint, in the shape it has there
        for mem, spec in specs.items():
            want = tuple(state[mem].shape) if mem in state else None
            if want is None:
                raise MergeError(f"The checkpoint's tensor for {mem} has no place in transformers' {self.arch}.")
            if want != tuple(spec.shape):
                raise self.fail(f"{self.arch} has {mem} of shape {list(want)} but the checkpoint gives {list(spec.shape)}")
        params = [n for n, _ in model.named_parameters()]
        missing = [n for n in params if n not in specs and n != head_name]
        if missing:
            where = "vision tower" if vis_prefix and missing[0].startswith(vis_prefix + ".") or not vision else "model"
            if not vision:
                raise MergeError(
                    f"The checkpoint holds the language model of a {self.arch} but no vision tower (no visual.* or "
                    "vision_model.* tensors); it was saved without it (a pipeline stage or the vision module is "
                    "missing): copy the whole checkpoint again."
                )
            raise MergeError(
                f"The checkpoint has no tensor for {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                + f" of the {where}; it is incomplete or from another model: copy the whole checkpoint again."
            )
        # in-memory -> save_pretrained's names
        out: dict[str, Spec] = {}
        for mem, spec in specs.items():
            if mem in layout.groups:
                raise MergeError(f"transformers splits {mem} of {self.arch} when saving; tui-merger cannot write it yet.")
            out[layout.renames.get(mem, mem)] = spec
        head_disk = layout.renames.get(head_name, head_name) if mapping.head else None
        notices = list(mapping.notices)
        notices.append(
            f"A Megatron {self.arch} checkpoint: the language model and the vision tower ({len(vis_specs)} tensors, "
            f"{self._style}) are written under the names transformers' save_pretrained gives them."
        )
        return _Mapping(out, notices, head_disk, embed=layout.renames.get(embed, embed))

    def _pack(self, target: str, experts: dict, state):
        """Qwen3-VL-MoE's packed experts ([E, 2I, H] gate then up, [E, H, I]) from the per-expert specs."""
        Piece, Spec = self.parts.Piece, self.parts.Spec

        if target not in state:
            raise MergeError(f"transformers' {self.arch} has neither per-expert weights nor {target}.")
        n = len(experts)
        if sorted(experts) != list(range(n)):
            raise self.fail(f"the checkpoint's experts of {target} are numbered {sorted(experts)[:8]}")
        down = target.endswith("down_proj")
        parts = ("down",) if down else ("gate", "up")
        first = experts[0][parts[0]]
        rows = sum(experts[0][p].shape[0] for p in parts)
        shape = (n, rows) + tuple(first.shape[1:])
        if tuple(state[target].shape) != shape:
            raise self.fail(f"{self.arch} holds {target} as {list(state[target].shape)} but the checkpoint's experts make "
                            f"{list(shape)}")
        pieces = []
        for e in range(n):
            at = e * rows
            for part in parts:
                spec = experts[e].get(part)
                if spec is None:
                    raise MergeError(f"The checkpoint has no {part} projection for expert {e} of {target}; it is incomplete.")
                for p in spec.pieces:
                    count = p.rows[1] - p.rows[0] if p.rows else spec.shape[0]
                    pieces.append(Piece(p.key, p.index, p.rows or (0, count), at + p.at))
                at += spec.shape[0]
        return Spec(shape, first.dtype, pieces, flat=True)

    # -- the vision tower ---------------------------------------------------------------------------
    def _vision(self, keys: list[str], state, modules, model):
        """(the vision tower's in-memory prefix, {in-memory name: Spec}) for the checkpoint's vision tensors."""
        Piece, Spec = self.parts.Piece, self.parts.Spec

        self._style = "none"
        if not keys:
            return None, {}
        # Megatron-Bridge: transformers' module embedded, its own parameter names under visual. / vision_model.
        rel = {k: k.split(".", 1)[1] for k in keys}
        prefixes = None
        for k, r in rel.items():
            here = {n[: -len(r) - 1] for n in state if n.endswith("." + r)}
            prefixes = here if prefixes is None else prefixes & here
            if not prefixes:
                break
        if prefixes and len(prefixes) == 1:
            (prefix,) = prefixes
            saver = "ms-swift" if all(k.startswith("visual.visual.") for k in keys) else "Megatron-Bridge"
            self._style = f"transformers' own vision module, as {saver} saves it"
            specs = {}
            for k, r in rel.items():
                entry = self.tensors[k]
                specs[f"{prefix}.{r}"] = Spec(tuple(entry.shape), entry.dtype, [Piece(k, (), None)])
            return prefix, specs
        return self._native(keys, state)

    def _native(self, keys: list[str], state):
        """megatron-core's vision transformer (mbridge / verl): mapped by name, qkv de-interleaved per head."""
        Piece, Spec = self.parts.Piece, self.parts.Spec

        self._style = "megatron-core's vision transformer, as mbridge and verl save it"
        vc = self.config.get("vision_config") or {}
        heads = vc.get("num_heads") or vc.get("num_attention_heads")
        prefix = self._vision_prefix(state)
        if prefix is None or not isinstance(heads, int) or heads <= 0:
            raise MergeError(f"{self.path} names no vision tower transformers can place (vision_config.num_heads).")
        specs: dict = {}
        for key in keys:
            rest = key[len("vision_model."):] if key.startswith("vision_model.") else None
            if rest is None:
                raise self._unknown(key)
            for pattern, name in _NATIVE_TOP_RE:
                m = pattern.match(rest)
                if m:
                    entry = self.tensors[key]
                    specs[f"{prefix}.{_fill(name, m)}"] = Spec(tuple(entry.shape), entry.dtype, [Piece(key, (), None)])
                    break
            else:
                if rest.startswith("decoder.layers."):
                    self._native_layer(key, rest[len("decoder.layers."):], prefix, heads, state, specs)
                else:
                    raise self._unknown(key)
        return prefix, specs

    def _native_layer(self, key, rest, prefix, heads, state, specs) -> None:
        Piece, Spec = self.parts.Piece, self.parts.Spec

        entry = self.tensors[key]
        m = re.match(r"^(\d+)\.(.+)$", rest)
        if m:
            layers = [(int(m.group(1)), ())]
            rest = m.group(2)
        else:  # a dist checkpoint stacks the layers: [layers, ...]
            layers = [(i, (i,)) for i in range(entry.shape[0] if entry.shape else 0)]
        for pattern, kind, name in _NATIVE_LAYER_RE:
            m = pattern.match(rest)
            if m:
                break
        else:
            raise self._unknown(key)
        for i, index in layers:
            param = tuple(entry.shape[len(index):])
            base = f"{prefix}.blocks.{i}."
            target = base + _fill(name, m)
            if kind == "qkv":
                d = param[0] // (3 * heads) if param and param[0] % (3 * heads) == 0 else None
                if d is None:
                    raise self.fail(f"vision_config.num_heads {heads} does not divide {key}'s {param[0]} rows into q, k and v")
                pieces = [Piece(key, index, (h * 3 * d + part * d, h * 3 * d + (part + 1) * d), part * heads * d + h * d)
                          for part in range(3) for h in range(heads)]
                specs[target] = Spec(param, entry.dtype, pieces)
            elif kind == "fc1" and f"{base}mlp.gate_proj.weight" in state:
                half = param[0] // 2
                for part, r in (("gate", (0, half)), ("up", (half, 2 * half))):
                    specs[f"{base}mlp.{part}_proj.{target.rsplit('.', 1)[1]}"] = Spec(
                        (half,) + param[1:], entry.dtype, [Piece(key, index, r)])
            elif kind == "fc2" and f"{base}mlp.down_proj.weight" in state:
                specs[f"{base}mlp.down_proj.{target.rsplit('.', 1)[1]}"] = Spec(param, entry.dtype, [Piece(key, index, None)])
            else:
                specs[target] = Spec(param, entry.dtype, [Piece(key, index, None)])

    @staticmethod
    def _vision_prefix(state) -> str | None:
        """Where transformers keeps the vision tower: the module holding patch_embed and blocks."""
        found = {n.split(".patch_embed.")[0] for n in state if ".patch_embed." in n}
        return found.pop() if len(found) == 1 else None

    def _unknown(self, key: str) -> MergeError:
        return MergeError(
            f"The checkpoint holds {key}, which has no counterpart in a Hugging Face {self.arch} vision tower; "
            f"tui-merger converts the vision towers Megatron-Bridge, mbridge and verl save for {SUPPORTED_VL}."
        )


def _version() -> str:
    try:
        import transformers

        return transformers.__version__
    except ImportError:
        return "(not installed)"


def _meta_model(config_dir: Path, what: str, why: str):
    """``hf_names.disk_layout`` of ``config_dir`` (transformers' model on the meta device), the model's state dict, its
    modules' names by id and its language model's prefix; one sentence (``what`` cannot be built, so ``why`` is
    unknown) when this transformers cannot build it."""
    from tui_merger.core.formats import hf_names

    found = hf_names.disk_layout(config_dir)
    if found is None:
        raise MergeError(f"transformers {_version()} cannot build {what}, so {why} is unknown; install a transformers "
                         "that has it.")
    model = found.model
    modules = {id(m): n for n, m in model.named_modules()}
    return found, model.state_dict(), modules, modules.get(id(model.get_decoder()))


def map_vl(tensors: dict, config: dict, config_path: Path, parts):
    """verl_megatron's _Mapping for a Megatron VL checkpoint's tensors (canonical names); ``parts``: verl_megatron's
    text mapper and records (``Mapper``, ``Mapping``, ``Spec``, ``Piece``), handed in."""
    return _VlMapper(tensors, config, config_path, parts).run()


# -- LoRA runs of VL models (megatron_lora.read_dist_adapter) -----------------------------------------------------


def lora_names(config_dir: Path, vision_modules: list[str]) -> tuple[str, dict[str, str], dict[str, str]]:
    """Where a Megatron VL LoRA run's adapters go, under the names of transformers' model (as peft names an adapter
    of it): the prefix of the language model's layers (``model.language_model.layers.``), for each vision-tower
    module the run holds a LoRA pair on (its name inside transformers' vision module: Megatron-Bridge embeds that
    module, ``vision_model.*`` / ``visual.*``) that module's full name, and the renames in-memory -> save_pretrained
    name where they differ (Qwen2.5-VL's ``model.language_model.layers.*`` is saved as ``model.layers.*``)."""
    config_dir = Path(config_dir)
    layout, state, _, lm = _meta_model(config_dir, f"the model of {config_dir / 'config.json'}",
                                       "where the LoRA run's adapters go")
    probe = f"{lm}.layers.0.self_attn.q_proj.weight"
    if not lm or probe not in state:
        raise MergeError(f"transformers' model for {config_dir / 'config.json'} has no language model layers to merge "
                         "the LoRA run's adapters into.")
    layers = probe[: -len("0.self_attn.q_proj.weight")]
    found: dict[str, str] = {}
    prefixes = None
    for mod in vision_modules:
        here = {k[: -len(f".{mod}.weight")] for k in state if k.endswith(f".{mod}.weight")}
        prefixes = here if prefixes is None else prefixes & here
    if vision_modules:
        if not prefixes or len(prefixes) != 1:
            raise MergeError(
                f"The LoRA run holds adapters on the vision tower's {vision_modules[0]}, which transformers' model for "
                f"{config_dir / 'config.json'} has no single place for; it is from another model: pass --base with the "
                "model the run was trained from."
            )
        (prefix,) = prefixes
        for mod in vision_modules:
            name = f"{prefix}.{mod}.weight"
            found[mod] = name[: -len(".weight")]
    return layers, found, dict(layout.renames)


def packed_experts(config_dir: Path) -> dict[str, list[str]]:
    """The modules of transformers' model for ``config_dir`` that keep their MoE experts packed as 3-D parameters
    (Qwen3-VL-MoE's ``mlp.experts`` with ``gate_up_proj`` [experts, 2 * ffn, hidden] and ``down_proj`` [experts,
    hidden, ffn] in transformers 5) -> those parameters' names in the module's order (peft nests the LoRA of
    several parameters of one module in that order, the first innermost); {} when it has none."""
    from tui_merger.core.formats import hf_names

    layout = hf_names.disk_layout(Path(config_dir))
    if layout is None:
        return {}
    out: dict[str, list[str]] = {}
    for name, module in layout.model.named_modules():
        if name.endswith(".mlp.experts"):
            params = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
            if params:
                out[name] = params
    return out
