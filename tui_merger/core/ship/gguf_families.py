"""The model families ``tui-merger gguf`` writes, as data: one ``Family`` per Hugging Face ``model_type``.

Adding a family is one entry in ``FAMILIES`` (and a tiny-model case in tests/test_gguf_families.py):

- ``arch``: llama.cpp's architecture name (``gguf.MODEL_ARCH_NAMES``). Tensor names then come from the
  ``gguf`` package's own ``TensorNameMap`` for that architecture, and only the tensors llama.cpp's
  layout has (``gguf.MODEL_TENSORS``) are accepted; nothing here names a tensor.
- the tensor transforms llama.cpp's converter (``convert_hf_to_gguf.py``, the class registered for the
  architecture) applies: ``permute_qk`` (Llama-style q/k rows reordered for llama.cpp's rope),
  ``norm_plus_one`` (Gemma's norms, which the model applies as ``1 + w``), experts stacked per layer
  (``experts``: the config field with their number), ``split`` (a packed tensor cut into equal row
  parts: GraniteMoE's gate/up) and ``derive`` (GGUF tensors computed from one HF tensor: DeepSeek's MLA
  k_b/v_b, GPT-OSS's interleaved experts).
- the metadata: the common hyperparameters are written for every family (context, widths, heads, the
  norm epsilon named by ``eps``, rope base and scaling, head sizes); ``keys`` adds the family's own
  (GGUF key after ``<arch>.`` -> a config field, or a function of the config giving the typed value;
  it may restate a common key; a list is written as a per-layer array), written when there is a value.
- ``keep_f32`` (tensors the converter always stores F32: LFM2's short convolution), ``unquantized`` (matrices
  llama.cpp's quantizer keeps 16-bit: Gemma 4's per-layer model projection), ``rope_kinds`` and
  ``computed`` (a rope scaling the family says with its own keys and tensors: Phi-3's longrope factors).
- what llama.cpp's graph fixes and the config could say otherwise: ``swa`` (its sliding-window layer
  pattern), ``norm_topk`` (whether it renormalizes the chosen experts' weights), ``checks`` (a function
  of the config returning the one sentence why a GGUF of it would compute another model, or None).

``REFUSED`` lists the families llama.cpp runs but tui-merger does not write (yet), each with its reason
in one sentence. This module imports nothing heavy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Family:
    title: str  # what people call it
    arch: str  # llama.cpp's architecture name
    eps: str = "rms_norm_eps"  # the config field of the norm epsilon; layer_norm_* and norm_epsilon mean LayerNorm (attention.layer_norm_epsilon)
    permute_qk: bool = False  # HF's rotate-half q/k rows -> llama.cpp's interleaved pairs (llama-style rope)
    norm_plus_one: bool = False  # norms stored as 1 + w (Gemma's RMSNorm multiplies by 1 + w)
    experts: str | None = None  # config field: number of experts (per-expert tensors are stacked per layer)
    experts_used: str = "num_experts_per_tok"
    expert_ff: str | None = None  # config field written as expert_feed_forward_length
    shared_ff: str | None = None  # config field written as expert_shared_feed_forward_length
    norm_topk: bool | None = None  # does llama.cpp renormalize the top-k expert weights (None: no config says)
    partial_rotary: bool = False  # rope on part of each head (rope.dimension_count = head_dim * factor)
    head_dim_keys: bool = False  # always write attention.key_length / value_length
    swa: int | None = None  # llama.cpp's sliding-window pattern: every swa-th layer full, the others sliding
    swa_layers: int | None = None  # llama.cpp applies that pattern only to models of this many layers (else none)
    swa_rope_theta: float | None = None  # the rope base llama.cpp fixes for sliding layers (Gemma 3)
    derive: dict = field(default_factory=dict)  # HF module -> function(config, shape) -> [(GGUF tensor, shape, fn of the tensor)]
    yarn_extra: tuple[str, ...] = ()  # YaRN parameters llama.cpp's graph for the family already follows
    yarn_mscale: bool = False  # YaRN's mscale / mscale_all_dim (equal) are expressible (DeepSeek's yarn_log_multiplier)
    split: dict = field(default_factory=dict)  # HF module -> GGUF tensors its rows are split into, in equal parts
    keys: dict = field(default_factory=dict)  # GGUF key (after "<arch>.") -> config field
    keep_f32: tuple[str, ...] = ()  # parts of GGUF names the converter always stores F32 (small conv kernels)
    unquantized: tuple[str, ...] = ()  # parts of GGUF names llama-quantize leaves as they are: 16-bit in q8_0 too
    rope_kinds: tuple[str, ...] = ()  # rope scalings beyond the common ones that the family's keys and tensors say
    computed: Callable[[object], list] | None = None  # config -> [(GGUF name, float32 numpy array)] the converter computes
    bare: tuple[str, ...] = ()  # derived GGUF tensors named without .weight (Gated DeltaNet's ssm_a)
    left_out: tuple[str, ...] = ()  # HF name prefixes transformers does not load (next-token-prediction modules: mtp.)
    unloaded: Callable[[object], tuple] | None = None  # config -> (HF name prefixes transformers does not load, why)
    notes: tuple[Callable[[object], str | None], ...] = ()  # config -> a sentence the export says (how llama.cpp runs it)
    checks: tuple[Callable[[object], str | None], ...] = ()  # config -> why llama.cpp would compute another model

    @property
    def rms_norm(self) -> bool:
        """RMSNorm (attention.layer_norm_rms_epsilon) unless the epsilon's field names a LayerNorm's."""
        return not self.eps.startswith(("layer_norm", "norm_epsilon"))


def _gemma3_local_base(config) -> float:
    """The sliding layers' rope base, which llama.cpp's gemma3 reads as rope.freq_base_swa (10000 when
    absent) and the converter writes; gguf._rope refuses any other than the family's swa_rope_theta."""
    local = (getattr(config, "rope_parameters", None) or {}).get("sliding_attention") or {}
    return float(local.get("rope_theta") or getattr(config, "rope_local_base_freq", None) or 10000.0)


def _attention_scale_is_head_dim(config) -> str | None:
    """Gemma 2/3: llama.cpp scales attention by 1/sqrt(head_dim) (by 1/sqrt(hidden/heads) for the 27B
    layouts), where transformers takes query_pre_attn_scalar."""
    scalar = getattr(config, "query_pre_attn_scalar", None)
    head_dim = getattr(config, "head_dim", None)
    if scalar is None or scalar == head_dim:
        return None
    if config.num_hidden_layers in (46, 62) and scalar == config.hidden_size // config.num_attention_heads:
        return None  # the 27B models, which llama.cpp recognises by their layer count
    return (f"query_pre_attn_scalar is {scalar} while head_dim is {head_dim}; llama.cpp scales attention by "
            "the head size, so a GGUF of it would compute another model")


def _no_qk_layernorm(config) -> str | None:
    if getattr(config, "qk_layernorm", False):
        return "it normalizes q and k per layer (qk_layernorm), which llama.cpp's phi2 layout does not have"
    return None


def _smollm3_nope_every_4th(config) -> str | None:
    layers = getattr(config, "no_rope_layers", None)
    want = [int((i + 1) % 4 != 0) for i in range(config.num_hidden_layers)]
    if layers is not None and list(layers) != want:
        return "its no_rope_layers are not llama.cpp's smollm3 pattern (every 4th layer without rope)"
    return None


def _moe_every_layer(config) -> str | None:
    if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
        return ("it has dense layers between its expert layers (mlp_only_layers / decoder_sparse_step), and "
                "llama.cpp's layout has experts in every layer")
    return None


def _olmoe_no_gqa(config) -> str | None:
    if (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) != config.num_attention_heads:
        return "it shares key/value heads (num_key_value_heads below num_attention_heads), and llama.cpp's olmoe layout has one per attention head"
    return None


def _cohere_no_qk_norm(config) -> str | None:
    if getattr(config, "use_qk_norm", False):
        return "it normalizes q and k (use_qk_norm), which llama.cpp's cohere2 layout does not have"
    return None


def _mla_kv_b(config, shape):
    """DeepSeek's MLA kv_b_proj (heads * (nope + v), kv_lora_rank) as llama.cpp's converter writes it for
    the absorbed attention: k_b (heads, kv_lora_rank, nope: each head's part transposed) and v_b
    (heads, v, kv_lora_rank)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    nope, v, rank = config.qk_nope_head_dim, config.v_head_dim, shape[-1]

    def k_b(w):
        return w.reshape(heads, nope + v, rank)[:, :nope].transpose(1, 2)

    def v_b(w):
        return w.reshape(heads, nope + v, rank)[:, nope:]

    return [("attn_k_b", (heads, rank, nope), k_b), ("attn_v_b", (heads, v, rank), v_b)]


def _gpt_oss_experts(config, shape):
    """GPT-OSS's packed experts as llama.cpp's converter writes them from 16-bit weights: gate_up_proj
    (experts, hidden, 2 * ff, gate and up interleaved) -> ffn_gate_exps / ffn_up_exps (experts, ff,
    hidden); its bias (experts, 2 * ff) likewise."""
    if len(shape) == 3:
        e, hidden, ff2 = shape
        return [("ffn_gate_exps", (e, ff2 // 2, hidden), lambda w: w.transpose(1, 2)[:, 0::2]),
                ("ffn_up_exps", (e, ff2 // 2, hidden), lambda w: w.transpose(1, 2)[:, 1::2])]
    e, ff2 = shape
    return [("ffn_gate_exps.bias", (e, ff2 // 2), lambda w: w[:, 0::2]), ("ffn_up_exps.bias", (e, ff2 // 2), lambda w: w[:, 1::2])]


def _gpt_oss_down(config, shape):
    e, ff, hidden = shape
    return [("ffn_down_exps", (e, hidden, ff), lambda w: w.transpose(1, 2))]


def _gpt_oss_yarn_truncate(config) -> str | None:
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "yarn" and rope.get("truncate", True) is not False:
        return "its YaRN rope truncates (truncate true), while llama.cpp's gpt-oss follows the released models (truncate false)"
    return None


def _deepseek_moe_every_layer(config) -> str | None:
    if getattr(config, "moe_layer_freq", 1) != 1:
        return "it has experts only in some layers after the dense ones (moe_layer_freq), which llama.cpp's deepseek2 layout does not have"
    if not getattr(config, "q_lora_rank", None) and config.num_hidden_layers != 27:
        return ("its queries have no low-rank projection (q_lora_rank null), which llama.cpp's deepseek2 layout allows only "
                "for the 27-layer DeepSeek-V2-Lite")
    if (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) != config.num_attention_heads:
        return "its kv_b_proj has fewer heads than its attention, which llama.cpp's deepseek2 layout does not split"
    return None


def _yarn_log_multiplier(config):
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    mscale = rope.get("mscale_all_dim") if rope.get("rope_type", rope.get("type")) == "yarn" else None
    return None if mscale is None else 0.1 * float(mscale)


_DEEPSEEK_KEYS = {  # llama.cpp's DeepseekV2Model: MLA as MQA with one KV head of kv_lora_rank + rope
    "attention.head_count_kv": lambda c: 1,
    "leading_dense_block_count": lambda c: int(getattr(c, "first_k_dense_replace", 0) or 0),
    "attention.q_lora_rank": lambda c: int(c.q_lora_rank) if getattr(c, "q_lora_rank", None) else None,
    "attention.kv_lora_rank": lambda c: int(c.kv_lora_rank),
    "attention.key_length": lambda c: int(c.kv_lora_rank + c.qk_rope_head_dim),
    "attention.value_length": lambda c: int(c.kv_lora_rank),
    "attention.key_length_mla": lambda c: int(c.qk_nope_head_dim + c.qk_rope_head_dim),
    "attention.value_length_mla": lambda c: int(c.v_head_dim),
    "rope.dimension_count": lambda c: int(c.qk_rope_head_dim),
    "expert_shared_count": lambda c: int(getattr(c, "n_shared_experts", 0) or 0),
    "expert_weights_scale": lambda c: float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
    "expert_weights_norm": lambda c: True if getattr(c, "norm_topk_prob", False) else None,
    "expert_group_count": lambda c: int(c.n_group) if getattr(c, "n_group", None) else None,
    "expert_group_used_count": lambda c: int(c.topk_group) if getattr(c, "topk_group", None) else None,
    "rope.scaling.yarn_log_multiplier": _yarn_log_multiplier,
}


def _longrope(config) -> dict | None:
    """Phi-3's longrope parameters (transformers 5's rope_parameters, or the older rope_scaling), or None."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params if params.get("rope_type", params.get("type")) == "longrope" else None


def _longrope_original(config, params: dict) -> int | None:
    return params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)


def _longrope_factors(config) -> list:
    """Phi-3's longrope as llama.cpp's converter writes it: the long and short per-frequency divisors as
    the rope_factors_long / rope_factors_short tensors (llama.cpp takes the long ones when its context
    is longer than original_max_position_embeddings)."""
    import numpy as np

    params = _longrope(config)
    if params is None:
        return []
    return [(f"rope_factors_{which}.weight", np.asarray(params[f"{which}_factor"], dtype=np.float32)) for which in ("long", "short")]


def _longrope_switch(config) -> str | None:
    params = _longrope(config)
    if params is None:
        return None
    original = _longrope_original(config, params)
    return (f"The GGUF holds both longrope factor sets; llama.cpp rotates with the long ones whenever its context (n_ctx) "
            f"is above {original} tokens (original_max_position_embeddings), transformers only once the sequence is, so "
            f"for shorter sequences the two agree when n_ctx is at most {original}.")


def _longrope_attn_factor(config) -> float | None:
    """The factor transformers multiplies cos and sin by (its attention_factor, else from the
    context's growth), which llama.cpp takes as rope.scaling.attn_factor; the converter's formula."""
    params = _longrope(config)
    if params is None:
        return None
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = _longrope_original(config, params)
    factor = params.get("factor") or config.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _ernie_moe_layers(config) -> str | None:
    if getattr(config, "moe_layer_interval", 1) != 1:
        return ("it has dense layers between its expert layers (moe_layer_interval), and llama.cpp's ernie4_5-moe loader "
                "expects experts in every layer after the leading dense ones")
    end = getattr(config, "moe_layer_end_index", None)
    if end is not None and end < config.num_hidden_layers - 1:
        return "its last layers are dense (moe_layer_end_index), and llama.cpp's ernie4_5-moe layout has experts up to the last layer"
    return None


def _ernie_shared_ff(config) -> int | None:
    """The shared experts' width as transformers builds them (moe_intermediate_size per shared expert);
    for the released models it is the value llama.cpp's converter derives another way."""
    shared = int(getattr(config, "moe_num_shared_experts", 0) or 0)
    return int(config.moe_intermediate_size) * shared if shared else None


def _lfm2_kv_heads(config) -> list:
    """LFM2's KV heads per layer, 0 in its short-convolution layers: how llama.cpp tells them apart."""
    kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    return [0 if t == "conv" else kv for t in config.layer_types]


def _lfm2_ff(config) -> int:
    """LFM2's feed-forward width as its MLP computes it from the config (block_auto_adjust_ff_dim)."""
    ff = int(getattr(config, "block_ff_dim", None) or config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", False):
        ff = int(2 * ff / 3)
        if getattr(config, "block_ffn_dim_multiplier", None) is not None:
            ff = int(config.block_ffn_dim_multiplier * ff)
        multiple = int(config.block_multiple_of)
        ff = multiple * ((ff + multiple - 1) // multiple)
    return ff


def _lfm2_conv(config, shape):
    """LFM2's depthwise conv kernel (channels, 1, L) as llama.cpp's 2-D (channels, L)."""
    return [("shortconv.conv", (shape[0], shape[-1]), lambda w: w.reshape(w.shape[0], w.shape[-1]))]


def _lfm2_no_conv_bias(config) -> str | None:
    if getattr(config, "conv_bias", False):
        return "its short-convolution layers have biases (conv_bias), which llama.cpp's lfm2 layout does not have"
    return None


def _gdn_heads(config) -> tuple[int, int, int, int]:
    """Gated DeltaNet's key heads, value heads per key head, key and value head sizes."""
    nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    return nk, nv // nk, int(config.linear_key_head_dim), int(config.linear_value_head_dim)


def _tiled(w, dim: int, nk: int, per: int, size: int):
    """Value heads grouped by key head (k0: v0..v{per-1}, k1: ...) -> tiled (v0 of every key head, then
    v1 ...), along ``dim``: the order llama.cpp's qwen35 graph broadcasts them in (its converter's reorder)."""
    shape = list(w.shape)
    grouped = w.reshape(*shape[:dim], nk, per, size, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).reshape(shape)


def _qwen35_linear_attention(part: str, how):
    """A Qwen3.5 Gated DeltaNet tensor as llama.cpp's converter writes it (value heads tiled): ``how`` takes
    the HF shape and gives the GGUF shape and a function of (_gdn_heads, the tensor)."""
    def derive(config, shape):
        heads = _gdn_heads(config)
        new_shape, fn = how(shape)
        return [(part, new_shape, lambda w: fn(heads, w))]
    return derive


def _qkv_tiled(heads, w):  # q and k rows as they are, the value rows tiled
    nk, per, dk, dv = heads
    return _torch_cat([w[: 2 * nk * dk], _tiled(w[2 * nk * dk:], 0, nk, per, dv)])


def _torch_cat(parts):
    import torch

    return torch.cat(parts, dim=0)


_QWEN35_DERIVE = {  # Qwen3_5TextModel / _LinearAttentionVReorderBase in llama.cpp's converter
    "linear_attn.in_proj_qkv": _qwen35_linear_attention("attn_qkv", lambda s: (s, _qkv_tiled)),
    "linear_attn.in_proj_z": _qwen35_linear_attention("attn_gate", lambda s: (s, lambda h, w: _tiled(w, 0, h[0], h[1], h[3]))),
    "linear_attn.in_proj_a": _qwen35_linear_attention("ssm_alpha", lambda s: (s, lambda h, w: _tiled(w, 0, h[0], h[1], 1))),
    "linear_attn.in_proj_b": _qwen35_linear_attention("ssm_beta", lambda s: (s, lambda h, w: _tiled(w, 0, h[0], h[1], 1))),
    "linear_attn.out_proj": _qwen35_linear_attention("ssm_out", lambda s: (s, lambda h, w: _tiled(w, 1, h[0], h[1], h[3]))),
    # the decay stored as the -exp(A_log) it is used as; dt_bias as ssm_dt's bias
    "linear_attn.A_log": _qwen35_linear_attention("ssm_a", lambda s: (s, lambda h, w: -_tiled(w.float(), 0, h[0], h[1], 1).exp())),
    "linear_attn.dt_bias": _qwen35_linear_attention("ssm_dt.bias", lambda s: (s, lambda h, w: _tiled(w, 0, h[0], h[1], 1))),
    # the depthwise conv kernel (channels, 1, K) as 2-D (channels, K), its value channels tiled
    "linear_attn.conv1d": _qwen35_linear_attention(
        "ssm_conv1d", lambda s: ((s[0], s[-1]), lambda h, w: _qkv_tiled(h, w.reshape(w.shape[0], w.shape[-1])))),
    # the gated norm multiplies by w itself (the model's other norms by 1 + w)
    "linear_attn.norm": lambda config, shape: [("ssm_norm", shape, lambda w: w)],
}


def _qkvz_split(config, shape):
    """Qwen3-Next's in_proj_qkvz, rows grouped per key head as [q, k, v, z], as llama.cpp's converter
    splits it: attn_qkv (every q, then every k, then every v) and attn_gate (every z)."""
    nk, per, dk, dv = _gdn_heads(config)
    hidden = shape[-1]

    def part(w, start, size):
        return w.reshape(nk, 2 * dk + 2 * per * dv, hidden)[:, start:start + size].reshape(-1, hidden)

    return [("attn_qkv", (nk * (2 * dk + per * dv), hidden),
             lambda w: _torch_cat([part(w, 0, dk), part(w, dk, dk), part(w, 2 * dk, per * dv)])),
            ("attn_gate", (nk * per * dv, hidden), lambda w: part(w, 2 * dk + per * dv, per * dv))]


_QWEN3_NEXT_DERIVE = {  # Qwen3NextModel.modify_tensors: value heads stay grouped by key head
    "linear_attn.in_proj_qkvz": _qkvz_split,
    "linear_attn.A_log": lambda config, shape: [("ssm_a", shape, lambda w: -w.float().exp())],
    "linear_attn.dt_bias": lambda config, shape: [("ssm_dt.bias", shape, lambda w: w)],
    "linear_attn.conv1d": lambda config, shape: [("ssm_conv1d", (shape[0], shape[-1]), lambda w: w.reshape(w.shape[0], w.shape[-1]))],
    "linear_attn.norm": lambda config, shape: [("ssm_norm", shape, lambda w: w)],
}


def _mrope(default: list):
    """The M-RoPE sections (rope pairs turned by time, height, width) padded to 4 as llama.cpp reads them
    (``rope.dimension_sections``), as the converter writes ``mrope_section``; without one, the sections the
    model's transformers code takes (``default``). On text, where the three positions are equal, any
    sections give the same rope."""
    def sections(config) -> list:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        return [int(x) for x in (list(rope.get("mrope_section") or default) + [0, 0, 0, 0])[:4]]
    return sections


_mrope_sections = _mrope([11, 11, 10])  # Qwen3.5's interleaved MRoPE (llama.cpp's converter's default)
_qwen2vl_sections = _mrope([16, 24, 24])


def _sections_fit(sections):
    """llama.cpp stops (abort(): ``GGML_ASSERT(sect_dims <= ne0)`` in ggml's M-RoPE) on a model whose M-RoPE sections
    (``rope.dimension_sections``, as ``sections`` gives them) add up to more than its head size."""
    def check(config) -> str | None:
        got = sections(config)
        head = getattr(config, "head_dim", None) or int(config.hidden_size) // int(config.num_attention_heads)
        if sum(got) > int(head):
            return (f"its M-RoPE sections {[x for x in got if x] or got} (mrope_section) add up to {sum(got)}, more than "
                    f"its head size {head}, and llama.cpp stops on such a model (GGML_ASSERT(sect_dims <= ne0))")
        return None
    return check


def _deepstack_layers(config) -> int:
    """Qwen3-VL's vision features added to the first layers' outputs (deepstack_visual_indexes of the vision
    config, kept beside the language model's config by gguf_vl.text_hf_config), as the converter writes it:
    llama.cpp widens its input embedding for them (zeros on text)."""
    vision = getattr(config, "gguf_vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or [])


def _packed_layout(shape, loaded: tuple) -> bool:
    """Is a packed experts tensor on disk as transformers holds it in memory (``loaded``), or transposed (as the
    released Qwen3-VL-MoE checkpoints keep it)? transformers' own rule (its Transpose with check_dims): the
    shape equal to the parameter's is taken as it is, any other is transposed."""
    return tuple(shape) == tuple(loaded)


def _packed_gate_up(config, shape):
    """Qwen3-VL-MoE's packed gate_up_proj as llama.cpp's converter writes it (Qwen3VLMoeTextModel.modify_tensors):
    in memory (experts, 2 * ff, hidden), gate rows then up rows -> ffn_gate_exps and ffn_up_exps (experts, ff, hidden)."""
    e, ff, hidden = shape[0], int(config.moe_intermediate_size), int(config.hidden_size)
    as_is = _packed_layout(shape, (e, 2 * ff, hidden))

    def part(i):
        return lambda w: (w if as_is else w.transpose(1, 2))[:, i * ff:(i + 1) * ff]
    return [("ffn_gate_exps", (e, ff, hidden), part(0)), ("ffn_up_exps", (e, ff, hidden), part(1))]


def _packed_down(config, shape):
    """Qwen3-VL-MoE's packed down_proj: in memory (experts, hidden, ff), what llama.cpp's ffn_down_exps is."""
    e, ff, hidden = shape[0], int(config.moe_intermediate_size), int(config.hidden_size)
    as_is = _packed_layout(shape, (e, hidden, ff))
    return [("ffn_down_exps", (e, hidden, ff), (lambda w: w) if as_is else (lambda w: w.transpose(1, 2)))]


_QWEN3_VL_KEYS = {  # Qwen3VLTextModel / Qwen3VLMoeTextModel.set_gguf_parameters
    "rope.dimension_sections": _mrope([24, 20, 20]),
    "n_deepstack_layers": _deepstack_layers,
}


_GDN_KEYS = {  # Qwen3NextModel.set_gguf_parameters: the Gated DeltaNet's sizes and which layers are recurrent
    "ssm.conv_kernel": lambda c: int(c.linear_conv_kernel_dim),
    "ssm.state_size": lambda c: int(c.linear_key_head_dim),
    "ssm.group_count": lambda c: int(c.linear_num_key_heads),
    "ssm.time_step_rank": lambda c: int(c.linear_num_value_heads),
    "ssm.inner_size": lambda c: int(c.linear_value_head_dim * c.linear_num_value_heads),
    "attention.recurrent_layers": lambda c: [t == "linear_attention" for t in c.layer_types],
    "full_attention_interval": lambda c: int(getattr(c, "full_attention_interval", None) or 4),
}


def _gdn_heads_divide(config) -> str | None:
    if config.linear_num_value_heads % config.linear_num_key_heads:
        return "its linear-attention value heads are not a multiple of its key heads, which llama.cpp's layout needs"
    if config.linear_key_head_dim != config.linear_value_head_dim:
        return "its linear-attention key and value heads differ in size, and llama.cpp's layout has one state size for both"
    return None


def _gemma4_layer(config, i: int):
    """transformers' view of one Gemma 4 layer (its head size and KV heads: full-attention layers have their own)."""
    per_layer = getattr(config, "per_layer_config", None)
    return per_layer[i] if per_layer is not None else config


def _gemma4_full_head_dim(config) -> int:
    """The full-attention layers' head size (global_head_dim), what llama.cpp takes as key_length."""
    full = [i for i, t in enumerate(config.layer_types) if t != "sliding_attention"]
    return int(_gemma4_layer(config, full[-1]).head_dim) if full else int(config.head_dim)


def _gemma4_kv_heads(config) -> list | None:
    """KV heads per layer when the full-attention layers have other than the sliding ones (num_global_key_value_heads)."""
    heads = [int(_gemma4_layer(config, i).num_key_value_heads) for i in range(config.num_hidden_layers)]
    return heads if len(set(heads)) > 1 else None


def _gemma4_ff(config) -> list | None:
    """use_double_wide_mlp: the layers that reuse another layer's keys and values have twice the MLP width."""
    if not getattr(config, "use_double_wide_mlp", False) or not config.num_kv_shared_layers:
        return None
    first = config.num_hidden_layers - config.num_kv_shared_layers
    return [int(config.intermediate_size) * (2 if i >= first else 1) for i in range(config.num_hidden_layers)]


def _gemma4_rope_freqs(config) -> list:
    """Gemma 4's proportional rope for the full-attention layers as llama.cpp's converter writes it: llama.cpp
    rotates the whole head (rope.dimension_count = the head size) and divides each frequency by rope_freqs,
    1 for the rotated pairs and 1e30 (no rotation) for the rest."""
    import numpy as np

    rope = (config.rope_parameters or {}).get("full_attention") or {}
    head_dim = _gemma4_full_head_dim(config)
    rotated = head_dim // 2
    if rope.get("rope_type") == "proportional":  # transformers' _compute_proportional_rope_parameters
        rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    values = [1.0] * rotated + [1e30] * (head_dim // 2 - rotated)
    return [("rope_freqs.weight", np.asarray(values, dtype=np.float32))]


def _gemma4_graph(config) -> str | None:
    """What llama.cpp's gemma4 graph fixes: causal attention, default rope on the sliding layers,
    proportional (or default) rope without a factor on the others, one vocabulary for both embeddings,
    and shared keys/values taken from the last two layers before the sharing (sliding, then full)."""
    if getattr(config, "use_bidirectional_attention", None) == "all":
        return "it attends in both directions (use_bidirectional_attention all), and llama.cpp's gemma4 graph is causal"
    rope = config.rope_parameters or {}
    local, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
    if (local.get("rope_type") or "default") != "default":
        return f"its sliding-window layers use {local.get('rope_type')} rope, and llama.cpp's gemma4 rotates them with default rope"
    if (full.get("rope_type") or "default") not in ("default", "proportional") or float(full.get("factor", 1.0) or 1.0) != 1.0:
        return (f"its full-attention layers use {full.get('rope_type')} rope with factor {full.get('factor')}, and llama.cpp's "
                "gemma4 rotates them with proportional rope only")
    if getattr(config, "hidden_size_per_layer_input", 0) and config.vocab_size_per_layer_input != config.vocab_size:
        return ("its per-layer embeddings have another vocabulary size (vocab_size_per_layer_input) than its embeddings, and "
                "llama.cpp's gemma4 takes one per token for both")
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    first = config.num_hidden_layers - shared
    for i in range(first, config.num_hidden_layers) if shared else ():
        kind = config.layer_types[i]
        source = max(j for j in range(first) if config.layer_types[j] == kind)
        want = first - (2 if kind == "sliding_attention" else 1)
        if source != want:
            return (f"its layer {i} reuses the keys and values of layer {source}, and llama.cpp's gemma4 takes them from "
                    f"layer {want} (the last two layers before the sharing: sliding, then full attention)")
    return None


_GEMMA4_KEYS = {  # Gemma4Model.set_gguf_parameters in llama.cpp's converter (Gemma3Model's with per-type heads)
    "attention.head_count_kv": _gemma4_kv_heads,
    "feed_forward_length": _gemma4_ff,
    "attention.key_length": _gemma4_full_head_dim,
    "attention.value_length": _gemma4_full_head_dim,
    "attention.key_length_swa": lambda c: int(c.head_dim),
    "attention.value_length_swa": lambda c: int(c.head_dim),
    "rope.dimension_count": _gemma4_full_head_dim,  # proportional rope: the whole head, rope_freqs says which pairs
    "rope.dimension_count_swa": lambda c: int(c.head_dim),
    "rope.freq_base_swa": lambda c: float(((c.rope_parameters or {}).get("sliding_attention") or {}).get("rope_theta", 10000.0)),
    "attention.sliding_window": "sliding_window",
    "attention.sliding_window_pattern": lambda c: [t == "sliding_attention" for t in c.layer_types],
    "attention.shared_kv_layers": lambda c: int(getattr(c, "num_kv_shared_layers", 0) or 0),
    "embedding_length_per_layer_input": lambda c: int(getattr(c, "hidden_size_per_layer_input", 0) or 0),
    "final_logit_softcapping": "final_logit_softcapping",
    # the mixture of experts (26B-A4B): its experts are stored stacked already
    "expert_count": lambda c: int(c.num_experts) if getattr(c, "enable_moe_block", False) else None,
    "expert_used_count": lambda c: int(c.top_k_experts) if getattr(c, "enable_moe_block", False) else None,
    "expert_feed_forward_length": lambda c: int(c.moe_intermediate_size) if getattr(c, "enable_moe_block", False) else None,
}

def _gemma4_shared_kv(config) -> tuple:
    """The keys and values of the layers that reuse earlier ones' (num_kv_shared_layers): transformers does not
    load them (_keys_to_ignore_on_load_unexpected) and llama.cpp's graph does not use them."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    first = config.num_hidden_layers - shared
    names = tuple(f"model.layers.{i}.self_attn.{part}." for i in range(first, config.num_hidden_layers)
                  for part in ("k_proj", "v_proj", "k_norm", "v_norm"))
    return names, "those layers reuse the keys and values of earlier layers, in llama.cpp's gemma4 too"


_GEMMA4_DERIVE = {  # the router's input scale and its per-expert output scale, as the converter names them
    "router.scale": lambda config, shape: [("ffn_gate_inp.scale", shape, lambda w: w)],
    "router.per_expert_scale": lambda config, shape: [("ffn_down_exps.scale", shape, lambda w: w)],
}


# model_type in config.json -> its family. Order: how often people fine-tune them (the CLI lists them so).
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", "llama", permute_qk=True),
    "qwen3": Family("Qwen3", "qwen3", head_dim_keys=True),
    "qwen2": Family("Qwen2", "qwen2"),
    "qwen3_5_text": Family("Qwen3.5", "qwen35", norm_plus_one=True, partial_rotary=True, head_dim_keys=True,
                           derive=_QWEN35_DERIVE, keep_f32=("ssm_conv1d",), bare=("ssm_a",), left_out=("mtp.",),
                           keys={**_GDN_KEYS, "rope.dimension_sections": _mrope_sections},
                           checks=(_gdn_heads_divide, _sections_fit(_mrope_sections))),
    "mistral": Family("Mistral", "llama", permute_qk=True),
    "gemma3_text": Family("Gemma 3", "gemma3", norm_plus_one=True, head_dim_keys=True, swa=6, swa_rope_theta=10000.0,
                          keys={"final_logit_softcapping": "final_logit_softcapping", "attention.sliding_window": "sliding_window",
                                "rope.freq_base_swa": _gemma3_local_base},
                          checks=(_attention_scale_is_head_dim,)),
    "gemma2": Family("Gemma 2", "gemma2", norm_plus_one=True, head_dim_keys=True, swa=2,
                     keys={"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping",
                           "attention.sliding_window": "sliding_window"},
                     checks=(_attention_scale_is_head_dim,)),
    "phi3": Family("Phi-3", "phi3", rope_kinds=("longrope",), computed=_longrope_factors,
                   keys={"attention.sliding_window": "sliding_window", "rope.scaling.attn_factor": _longrope_attn_factor,
                         "rope.scaling.original_context_length":
                             lambda c: int(_longrope_original(c, _longrope(c))) if _longrope(c) else None},
                   notes=(_longrope_switch,)),
    "qwen3_moe": Family("Qwen3-MoE", "qwen3moe", head_dim_keys=True, experts="num_experts", expert_ff="moe_intermediate_size",
                        norm_topk=True, checks=(_moe_every_layer,)),
    "mixtral": Family("Mixtral", "llama", permute_qk=True, experts="num_local_experts"),
    "qwen2_moe": Family("Qwen2-MoE", "qwen2moe", experts="num_experts", expert_ff="moe_intermediate_size",
                        shared_ff="shared_expert_intermediate_size", norm_topk=False, checks=(_moe_every_layer,)),
    "olmo2": Family("OLMo 2", "olmo2"),
    "granite": Family("Granite", "granite", permute_qk=True,
                      keys={"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                            "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}),
    "glm4": Family("GLM-4", "glm4", partial_rotary=True, head_dim_keys=True),
    "starcoder2": Family("StarCoder2", "starcoder2", eps="norm_epsilon"),
    "smollm3": Family("SmolLM3", "smollm3", permute_qk=True, checks=(_smollm3_nope_every_4th,)),
    "gemma": Family("Gemma", "gemma", norm_plus_one=True, head_dim_keys=True),
    "phi": Family("Phi-2", "phi2", eps="layer_norm_eps", partial_rotary=True, checks=(_no_qk_layernorm,)),
    "granitemoe": Family("GraniteMoE", "granitemoe", permute_qk=True, experts="num_local_experts",
                         split={"input_linear": ("ffn_gate_exps", "ffn_up_exps")},
                         keys={"attention.scale": "attention_multiplier", "embedding_scale": "embedding_multiplier",
                               "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling"}),
    "olmo3": Family("OLMo 3", "olmo2", swa=4, keys={"attention.sliding_window": "sliding_window"}),
    "olmoe": Family("OLMoE", "olmoe", experts="num_experts", norm_topk=False, checks=(_olmoe_no_gqa,)),
    "cohere2": Family("Cohere2", "cohere2", eps="layer_norm_eps", swa=4, head_dim_keys=True,
                      keys={"logit_scale": "logit_scale", "attention.sliding_window": "sliding_window"},
                      checks=(_cohere_no_qk_norm,)),
    "exaone4": Family("EXAONE 4", "exaone4", swa=4, head_dim_keys=True, keys={"attention.sliding_window": "sliding_window"},
                      swa_layers=64),
    "deepseek_v3": Family("DeepSeek-V3", "deepseek2", experts="n_routed_experts", expert_ff="moe_intermediate_size",
                          derive={"kv_b_proj": _mla_kv_b}, yarn_mscale=True,
                          keys={**_DEEPSEEK_KEYS, "expert_gating_func": lambda c: 2},  # transformers' V3 router: sigmoid
                          checks=(_deepseek_moe_every_layer,)),
    "deepseek_v2": Family("DeepSeek-V2", "deepseek2", experts="n_routed_experts", expert_ff="moe_intermediate_size",
                          derive={"kv_b_proj": _mla_kv_b}, yarn_mscale=True,
                          keys={**_DEEPSEEK_KEYS, "expert_gating_func": lambda c: 1},  # V2's router: softmax
                          checks=(_deepseek_moe_every_layer,)),
    "gpt_oss": Family("GPT-OSS", "gpt-oss", experts="num_local_experts", expert_ff="intermediate_size", swa=2,
                      head_dim_keys=True, yarn_extra=("truncate",),
                      derive={"experts.gate_up_proj": _gpt_oss_experts, "experts.gate_up_proj_bias": _gpt_oss_experts,
                              "experts.down_proj": _gpt_oss_down},
                      keys={"attention.sliding_window": "sliding_window"}, checks=(_gpt_oss_yarn_truncate,)),
    "glm4_moe": Family("GLM-4.5", "glm4moe", experts="n_routed_experts", expert_ff="moe_intermediate_size", partial_rotary=True,
                       head_dim_keys=True,
                       keys={"leading_dense_block_count": lambda c: int(getattr(c, "first_k_dense_replace", 0) or 0),
                             "expert_shared_count": lambda c: int(getattr(c, "n_shared_experts", 0) or 0),
                             "expert_weights_scale": lambda c: float(getattr(c, "routed_scaling_factor", 1.0) or 1.0),
                             "expert_weights_norm": lambda c: bool(getattr(c, "norm_topk_prob", False)),
                             "expert_gating_func": lambda c: 2,  # transformers' Glm4Moe router: sigmoid
                             "expert_group_count": lambda c: int(c.n_group) if getattr(c, "n_group", None) else None,
                             "expert_group_used_count": lambda c: int(c.topk_group) if getattr(c, "topk_group", None) else None}),
    "ernie4_5": Family("ERNIE-4.5", "ernie4_5", head_dim_keys=True),
    "seed_oss": Family("Seed-OSS", "seed_oss", head_dim_keys=True),
    "ernie4_5_moe": Family("ERNIE-4.5-MoE", "ernie4_5-moe", head_dim_keys=True, experts="moe_num_experts", experts_used="moe_k",
                           expert_ff="moe_intermediate_size",  # its router: softmax, the score-correction bias only chooses
                           keys={"interleave_moe_layer_step": lambda c: int(c.moe_layer_interval),
                                 "leading_dense_block_count": lambda c: int(c.moe_layer_start_index),
                                 "expert_shared_count": lambda c: int(getattr(c, "moe_num_shared_experts", 0) or 0),
                                 "expert_shared_feed_forward_length": _ernie_shared_ff},
                           checks=(_ernie_moe_layers,)),
    "qwen3_next": Family("Qwen3-Next", "qwen3next", norm_plus_one=True, partial_rotary=True, head_dim_keys=True,
                         experts="num_experts", expert_ff="moe_intermediate_size", shared_ff="shared_expert_intermediate_size",
                         norm_topk=True, derive=_QWEN3_NEXT_DERIVE, keep_f32=("ssm_conv1d",), bare=("ssm_a",), left_out=("mtp.",),
                         keys=_GDN_KEYS, checks=(_moe_every_layer, _gdn_heads_divide)),
    "gemma4_text": Family("Gemma 4", "gemma4", partial_rotary=True, head_dim_keys=True, rope_kinds=("proportional",),
                          computed=_gemma4_rope_freqs, derive=_GEMMA4_DERIVE, unquantized=("per_layer_model_proj",), bare=("ffn_gate_inp.scale", "ffn_down_exps.scale"),
                          keys=_GEMMA4_KEYS, unloaded=_gemma4_shared_kv, checks=(_gemma4_graph,)),
    "lfm2": Family("LFM2", "lfm2", eps="norm_eps", derive={"conv.conv": _lfm2_conv}, keep_f32=("shortconv.conv",),
                   keys={"attention.head_count_kv": _lfm2_kv_heads, "shortconv.l_cache": lambda c: int(c.conv_L_cache),
                         "feed_forward_length": _lfm2_ff},
                   checks=(_lfm2_no_conv_bias,)),
    # the language models of vision-language folders (gguf_vl.TEXT_OF says which folder gives which): llama.cpp's
    # converter writes them under their own architectures, with M-RoPE (on text the same as plain rope)
    "qwen2_5_vl_text": Family("Qwen2.5-VL", "qwen2vl", keys={"rope.dimension_sections": _qwen2vl_sections},
                              checks=(_sections_fit(_qwen2vl_sections),)),
    "qwen3_vl_text": Family("Qwen3-VL", "qwen3vl", head_dim_keys=True, keys=_QWEN3_VL_KEYS,
                           checks=(_sections_fit(_QWEN3_VL_KEYS["rope.dimension_sections"]),)),
    "qwen3_vl_moe_text": Family("Qwen3-VL-MoE", "qwen3vlmoe", head_dim_keys=True, experts="num_experts",
                                expert_ff="moe_intermediate_size",  # its router always renormalizes, as llama.cpp's
                                derive={"experts.gate_up_proj": _packed_gate_up, "experts.down_proj": _packed_down},
                                keys=_QWEN3_VL_KEYS, checks=(_moe_every_layer, _sections_fit(_QWEN3_VL_KEYS["rope.dimension_sections"]))),
    "qwen2_vl_text": Family("Qwen2-VL", "qwen2vl", keys={"rope.dimension_sections": _qwen2vl_sections},
                          checks=(_sections_fit(_qwen2vl_sections),)),
    # Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration): the converter's Mistral3Model writes the language
    # model as mistral3 with LlamaModel's layout
    "mistral3": Family("Mistral 3", "mistral3", permute_qk=True),
}

# Families llama.cpp runs that tui-merger does not write yet: why, in one sentence (after "<folder> is a ... model;").
REFUSED: dict[str, str] = {}


def family_names() -> str:
    """The families, for a sentence: "Llama, Qwen3, ... and Seed-OSS"."""
    titles = list(dict.fromkeys(f.title for f in FAMILIES.values()))
    return ", ".join(titles[:-1]) + " and " + titles[-1]
