"""Multi-latent attention (DeepSeek-V3) in a megatron-core checkpoint -> transformers' names and shapes.

megatron-core's ``MLASelfAttention`` keeps each of transformers' ``DeepseekV3Attention`` projections as one linear,
in the same row order (learned from megatron-core's ``multi_latent_attention.py`` and Megatron-Bridge's DeepSeek
mappings, ``models/deepseek/common.py``): q is ``linear_q_down_proj`` -> norm -> ``linear_q_up_proj`` (or one
``linear_q_proj`` without ``q_lora_rank``), k/v ``linear_kv_down_proj`` (the compressed kv, then the shared rope key)
-> norm -> ``linear_kv_up_proj`` (per head: the key's no-rope part, then the value). The two norms are saved as
``q_layernorm`` / ``kv_layernorm`` (megatron-core's local spec) or as the ``layer_norm_weight`` of the up-projection
they are fused into (Transformer Engine's spec). Nothing is split or reordered: each tensor is a copy.
"""

from __future__ import annotations

# (pattern on the key after "decoder.layers.[i.]", kind, HF name after "model.layers.{i}."), ahead of the common ones
MLA_LAYER_KEYS = [
    (r"self_attention\.linear_q_down_proj\.weight", "copy", "self_attn.q_a_proj.weight"),
    (r"self_attention\.linear_q_up_proj\.layer_norm_weight|self_attention\.q_layernorm\.weight", "copy",
     "self_attn.q_a_layernorm.weight"),
    (r"self_attention\.linear_q_up_proj\.weight", "copy", "self_attn.q_b_proj.weight"),
    (r"self_attention\.linear_q_proj\.weight", "copy", "self_attn.q_proj.weight"),
    (r"self_attention\.linear_kv_down_proj\.weight", "copy", "self_attn.kv_a_proj_with_mqa.weight"),
    (r"self_attention\.linear_kv_up_proj\.layer_norm_weight|self_attention\.kv_layernorm\.weight", "copy",
     "self_attn.kv_a_layernorm.weight"),
    (r"self_attention\.linear_kv_up_proj\.weight", "copy", "self_attn.kv_b_proj.weight"),
]

# the keys that say a layer has its attention weights
MLA_ATTENTION = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_q_proj.weight")


def _sizes(config: dict, get) -> dict | None:
    names = ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    values = {n: get(config, n) for n in names}
    if not all(isinstance(v, int) and v > 0 for v in values.values()):
        return None
    values["q_lora_rank"] = get(config, "q_lora_rank")
    return values


def mla_shape(config: dict, get, hf: str) -> tuple[tuple[int, ...], str] | None:
    """The shape transformers' DeepseekV3Attention gives the tensor ``hf`` (a name ending in ``self_attn.*``), and
    the config fields it follows from; None for a name MLA does not shape."""
    s = _sizes(config, get)
    if s is None:
        return None
    h, n, kv, nope, rope, v, q = (s["hidden_size"], s["num_attention_heads"], s["kv_lora_rank"], s["qk_nope_head_dim"],
                                  s["qk_rope_head_dim"], s["v_head_dim"], s["q_lora_rank"])
    q = q if isinstance(q, int) and q > 0 else None
    shapes = {
        "self_attn.q_a_proj.weight": ((q, h), "q_lora_rank and hidden_size") if q else None,
        "self_attn.q_a_layernorm.weight": ((q,), "q_lora_rank") if q else None,
        "self_attn.q_b_proj.weight": ((n * (nope + rope), q), "heads, qk_nope_head_dim, qk_rope_head_dim and q_lora_rank")
        if q else None,
        "self_attn.q_proj.weight": ((n * (nope + rope), h), "heads, qk_nope_head_dim, qk_rope_head_dim and hidden_size")
        if not q else None,
        "self_attn.kv_a_proj_with_mqa.weight": ((kv + rope, h), "kv_lora_rank, qk_rope_head_dim and hidden_size"),
        "self_attn.kv_a_layernorm.weight": ((kv,), "kv_lora_rank"),
        "self_attn.kv_b_proj.weight": ((n * (nope + v), kv), "heads, qk_nope_head_dim, v_head_dim and kv_lora_rank"),
        "self_attn.o_proj.weight": ((h, n * v), "hidden_size, heads and v_head_dim"),
    }
    for suffix, shape in shapes.items():
        if hf.endswith(suffix):
            return shape if shape is not None else ((), "q_lora_rank")
    return None
