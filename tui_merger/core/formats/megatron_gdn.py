"""Megatron checkpoints of Qwen3-Next (Gated DeltaNet layers, gated attention, its MTP layer) -> Hugging Face names.

A helper of the verl Megatron kind (not a kind): the kind's own mapper (verl_megatron._Mapper, handed in as
``parts``) maps what Qwen3-Next shares with Qwen3-MoE (norms, q/k norms, router, experts, shared expert and its
gate); this module adds the rest, learnt from megatron-core 0.16.1 (``ssm/gated_delta_net.py``,
``transformer/attention.py``, ``transformer/multi_token_prediction.py``) and Megatron-Bridge 0.3.1
(``models/qwen/qwen3_next_bridge.py``, ``conversion/param_mapping.py``):

- **Gated DeltaNet** (``layer_types`` "linear_attention"): megatron-core saves ``self_attention.in_proj.weight``
  split into six global tensors, ``.query`` / ``.key`` [key heads * key dim, H], ``.value`` / ``.z`` [value heads *
  value dim, H], ``.beta`` / ``.alpha`` [value heads, H], each in head order; transformers keeps them interleaved per
  key head: ``in_proj_qkvz`` = for each key head [q; k; its value heads' v; their z], ``in_proj_ba`` = for each key
  head [its b; its a]. ``conv1d.weight.{query,key,value}`` are ``conv1d.weight`` [q; k; v]. ``A_log``, ``dt_bias``,
  ``out_proj`` are copied; ``out_norm`` is zero-centered in Megatron (every norm of the model is) while transformers'
  gated norm is not: its weight is Megatron's + 1 (Bridge's ``RMSNorm2ZeroCenteredRMSNormMapping`` subtracts 1 on
  import; for weights in [0.5, 2] both steps are exact). The input norm is ``input_layernorm`` (local modules) or
  fused into ``in_proj`` (Transformer Engine: ``in_proj.layer_norm_weight``; Bridge's local-to-TE renaming saves
  ``linear_qkv.layer_norm_weight``).
- **Gated attention** (``attention_output_gate``): ``linear_qkv`` holds, per query group, [the group's q heads;
  their gates; k; v]; transformers' ``q_proj`` is per head [q; gate].
- **MTP** (``mtp.layers.0.*``, ``mtp_num_layers`` 1): ``enorm`` / ``hnorm`` / ``eh_proj`` / ``final_layernorm``
  are the release's ``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` / ``mtp.fc`` / ``mtp.norm``, and
  ``transformer_layer.*`` is the decoder layer ``mtp.layers.0.*`` (transformers' model does not build it and
  ignores it on load, ``_keys_to_ignore_on_load_unexpected``; vLLM and SGLang read it for speculative decoding).
  Those names are Qwen3-Next's entry in ``verl_megatron.MTP_PLACES``, written by the kind's ``_mtp`` as for
  GLM-4.5 and DeepSeek-V3; this module maps the MTP decoder layer (a full-attention layer) like any other.
"""

from __future__ import annotations

import re
from pathlib import Path

from tui_merger.core.errors import MergeError

FAMILY = "qwen3_next"
_IN_PROJ = ("query", "key", "value", "z", "beta", "alpha")

# after decoder.layers.[i.] of a Gated DeltaNet layer; kinds: copy, in_proj, conv (this module), plus_one
_GDN_KEYS = [
    (r"input_layernorm\.weight|self_attention\.(?:in_proj|linear_qkv)\.layer_norm_weight", "copy",
     "input_layernorm.weight"),
    (r"self_attention\.in_proj\.weight\.(query|key|value|z|beta|alpha)", "in_proj", "linear_attn.in_proj_{}.weight"),
    (r"self_attention\.conv1d\.weight\.(query|key|value)", "conv", "linear_attn.conv1d.weight"),
    (r"self_attention\.A_log", "copy", "linear_attn.A_log"),
    (r"self_attention\.dt_bias", "copy", "linear_attn.dt_bias"),
    (r"self_attention\.out_norm\.weight", "plus_one", "linear_attn.norm.weight"),
    (r"self_attention\.out_proj\.weight", "copy", "linear_attn.out_proj.weight"),
]
_GDN_PATTERNS = [(re.compile(f"(?:{p})$"), kind, name) for p, kind, name in _GDN_KEYS]


def is_gdn_model(config: dict) -> bool:
    """Whether a config is one this module maps (Qwen3-Next)."""
    return config.get("model_type") == FAMILY


def map_gdn(tensors: dict, config: dict, config_path: Path, parts):
    """verl_megatron's _Mapping for a Megatron Qwen3-Next checkpoint's tensors (canonical names); ``parts``: the
    kind's mapper, its records and layer patterns (``Mapper``, ``Mapping``, ``Spec``, ``Piece``, ``patterns``)."""
    return _mapper_class(parts)(tensors, config, config_path, parts).run()


def _mapper_class(parts):
    Piece, Spec = parts.Piece, parts.Spec

    class GdnMapper(parts.Mapper):
        layer_patterns = _GDN_PATTERNS + list(parts.patterns)
        attention_kinds = {"qkv": "linear_qkv", "in_proj": "in_proj"}

        def __init__(self, tensors, config, config_path, parts) -> None:
            super().__init__(tensors, config, config_path)
            n = self.layers
            types = config.get("layer_types")
            if types is None:
                every = config.get("full_attention_interval") or 4
                types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
            if not isinstance(types, list) or len(types) != n:
                raise MergeError(f"{config_path} has no layer_types for its {n} layers; copy the config saved with the "
                                 "checkpoint.")
            self.types = types
            dims = {}
            for what in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim"):
                dims[what] = config.get(what)
                if "linear_attention" in types and (not isinstance(dims[what], int) or dims[what] <= 0):
                    raise MergeError(f"{config_path} has no valid {what}; copy the config saved with the checkpoint.")
            self.nk, self.nv = dims["linear_num_key_heads"], dims["linear_num_value_heads"]
            self.dk, self.dv = dims["linear_key_head_dim"], dims["linear_value_head_dim"]
            if "linear_attention" in types and self.nv % self.nk:
                raise MergeError(f"{config_path} says {self.nv} value heads in {self.nk} key heads, which do not "
                                 "divide; the config is damaged.")

        # -- what the checkpoint holds against the config ------------------------------------------------------
        def _features(self) -> None:
            keys = " ".join(k for k in self.tensors if not k.startswith("mtp."))  # the decoder's layers
            experts = (self._experts() or 0) > 0
            features = [
                ("linear_qkv.bias" in keys, bool(self.config.get("attention_bias", False)), "linear_qkv biases"),
                ("mlp.router.weight" in keys, experts, "MoE routers"),
                (".in_proj.weight." in keys, "linear_attention" in self.types, "Gated DeltaNet layers"),
            ]
            for held, wanted, what in features:
                if held != wanted:
                    raise self.fail(f"it describes a Qwen3-Next model {'with' if wanted else 'without'} {what} but the "
                                    f"checkpoint {'has' if held else 'has no'} them")

        # -- one layer ------------------------------------------------------------------------------------------
        def _layer(self, i: int, entries, prefix: str | None = None) -> None:
            # past the decoder (i >= num_hidden_layers): the MTP layer's decoder layer, a full-attention layer
            kind = self.types[i] if i < self.layers else "full_attention"
            linear = kind == "linear_attention"
            for rest, key, _ in entries:
                gdn = any(p.match(rest) for p, _, _ in _GDN_PATTERNS[1:])
                if rest.endswith("self_attention.in_proj.weight"):
                    raise MergeError(
                        f"The checkpoint holds {key} as one tensor, not split into query/key/value/z/beta/alpha as "
                        "megatron-core's dist checkpoint saves a Gated DeltaNet layer; tui-merger reads only that."
                    )
                if gdn != linear and ("self_attention." in rest and "layer_norm" not in rest):
                    raise self.fail(
                        f"layer {i} is a {'Gated DeltaNet' if gdn else 'full-attention'} layer in the checkpoint but "
                        f"{kind} by its layer_types"
                    )
            sparse = any(rest == "mlp.router.weight" for rest, _, _ in entries)
            if sparse != self._hf_sparse(i):
                raise self.fail(
                    f"layer {i} is {'an MoE' if sparse else 'a dense'} layer in the checkpoint but "
                    f"{'dense' if sparse else 'MoE'} by its mlp_only_layers / decoder_sparse_step"
                )
            self._gdn_parts = {}
            super()._layer(i, entries, prefix)
            if linear:
                self._gdn_layer(i, prefix or f"model.layers.{i}.")

        def _special(self, kind, hf, key, index, param, m) -> None:
            if kind in ("in_proj", "conv"):
                self._gdn_parts[(kind, m.group(1))] = (key, index, tuple(param))
            elif kind == "plus_one":
                if len(param) != 1 or param[0] != self.dv:
                    raise self.fail(f"linear_value_head_dim {self.dv} makes {key} [{self.dv}], but it is {list(param)}")
                self.add(hf, key, index, param)
                self.specs[hf].offset = 1.0
            else:
                super()._special(kind, hf, key, index, param, m)

        def _gdn_layer(self, i: int, layer: str) -> None:
            prefix = layer + "linear_attn."
            nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
            per = nv // nk  # value heads per key head
            rows = {"query": nk * dk, "key": nk * dk, "value": nv * dv, "z": nv * dv, "beta": nv, "alpha": nv}
            got = {}
            for part in _IN_PROJ:
                if ("in_proj", part) not in self._gdn_parts:
                    raise MergeError(f"Layer {i} has no Gated DeltaNet in_proj.weight.{part} in the checkpoint; it is "
                                     "incomplete.")
                key, index, param = got[part] = self._gdn_parts[("in_proj", part)]
                if param != (rows[part], self.hidden):
                    raise self.fail(
                        f"{nk} key heads of dim {dk} and {nv} value heads of dim {dv} make in_proj.weight.{part} "
                        f"[{rows[part]}, {self.hidden}], but {key} is {list(param)}"
                    )
            # in_proj_qkvz: per key head g, [q_g; k_g; v of its value heads; z of them]; in_proj_ba: [b_g; a_g]
            qkvz, ba, at, at_ba = [], [], 0, 0
            for g in range(nk):
                for part, size in (("query", dk), ("key", dk), ("value", per * dv), ("z", per * dv)):
                    key, index, _ = got[part]
                    qkvz.append(Piece(key, index, (g * size, (g + 1) * size), at))
                    at += size
                for part in ("beta", "alpha"):
                    key, index, _ = got[part]
                    ba.append(Piece(key, index, (g * per, (g + 1) * per), at_ba))
                    at_ba += per
            dtype = self.tensors[got["query"][0]].dtype
            self.specs[prefix + "in_proj_qkvz.weight"] = Spec((at, self.hidden), dtype, qkvz)
            self.specs[prefix + "in_proj_ba.weight"] = Spec((at_ba, self.hidden), dtype, ba)
            # conv1d: [q; k; v] channels, each [channels, 1, kernel]
            conv, at, rest = [], 0, None
            for part, size in (("query", nk * dk), ("key", nk * dk), ("value", nv * dv)):
                if ("conv", part) not in self._gdn_parts:
                    raise MergeError(f"Layer {i} has no Gated DeltaNet conv1d.weight.{part} in the checkpoint; it is "
                                     "incomplete.")
                key, index, param = self._gdn_parts[("conv", part)]
                if not param or param[0] != size or len(param) != 3 or (rest is not None and param[1:] != rest):
                    raise self.fail(f"the Gated DeltaNet dimensions make conv1d.weight.{part} {size} channels, but "
                                    f"{key} is {list(param)}")
                rest = param[1:]
                conv.append(Piece(key, index, None, at))
                at += size
            self.specs[prefix + "conv1d.weight"] = Spec((at,) + rest, self.tensors[conv[0].key].dtype, conv)

        def _check_copy(self, hf: str, key: str, param: tuple) -> None:
            if hf.endswith(("linear_attn.A_log", "linear_attn.dt_bias")) and tuple(param) != (self.nv,):
                raise self.fail(f"linear_num_value_heads {self.nv} makes {key} [{self.nv}], but it is {list(param)}")
            if hf.endswith("linear_attn.out_proj.weight") and tuple(param) != (self.hidden, self.nv * self.dv):
                raise self.fail(f"the Gated DeltaNet value heads make out_proj [{self.hidden}, {self.nv * self.dv}], "
                                f"but {key} is {list(param)}")
            super()._check_copy(hf, key, param)

        def _qkv(self, hf: str, key: str, index: tuple, param: tuple) -> None:
            """Gated attention: per query group [q heads; their gates; k; v] -> q_proj per head [q; gate], k, v."""
            per, d = self.heads // self.kv, self.head_dim
            rows = (2 * self.heads + 2 * self.kv) * d
            if not param or param[0] != rows or (len(param) == 2 and param[1] != self.hidden):
                raise self.fail(
                    f"{self.heads} gated attention heads and {self.kv} key-value heads of dim {d} make "
                    f"[{rows}, {self.hidden}] for linear_qkv, but {key} is {list(param)} per layer"
                )
            rest = tuple(param[1:])
            group = (2 * per + 2) * d
            q = []
            for g in range(self.kv):
                for j in range(per):
                    h = g * per + j
                    q.append(Piece(key, index, (g * group + j * d, g * group + (j + 1) * d), 2 * h * d))
                    q.append(Piece(key, index, (g * group + (per + j) * d, g * group + (per + j + 1) * d),
                                   (2 * h + 1) * d))
            k = [Piece(key, index, (g * group + 2 * per * d, g * group + (2 * per + 1) * d), g * d)
                 for g in range(self.kv)]
            v = [Piece(key, index, (g * group + (2 * per + 1) * d, (g + 1) * group), g * d) for g in range(self.kv)]
            for part, pieces, n in (("q", q, 2 * self.heads * d), ("k", k, self.kv * d), ("v", v, self.kv * d)):
                self.add(hf.replace("{}", part), key, index, (n,) + rest, pieces=pieces)

    return GdnMapper
