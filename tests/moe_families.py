"""Tiny configs of the causal-LM families of transformers 5, MoE and dense, one line each: the model
class (a ``...ForCausalLM``, or a vision-language ``...ForConditionalGeneration`` whose language
model the LoRA goes into) and the config keyword arguments. Sizes are chosen so that a LoRA pair fits
one parameter only where it should (hidden 64, expert width 48: fused gate_up [96, 64], down [64, 48]),
with one family (``olmoe-square``) whose fused gate_up is square, the case where only peft's
nesting and version tell the layout.

A family added later is one line in ``FAMILIES``."""

from __future__ import annotations

from functools import lru_cache

H = 64  # hidden size
E = 4  # experts
I = 48  # an expert's intermediate size (2 x 48 = 96 rows of a fused gate_up)
ATTN = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
            max_position_embeddings=128)
MLA = dict(num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=8)
ROUTED = dict(n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=I, n_group=1, topk_group=1)
LINEAR_ATTN = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)

# name -> (transformers class name, config kwargs)
FAMILIES: dict[str, tuple[str, dict]] = {
    # dense families (the sweep covers them too: a family added later is one line)
    "llama": ("LlamaForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2)),
    "qwen3": ("Qwen3ForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2)),
    "gemma3": ("Gemma3ForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2, sliding_window=16)),
    # MoE families
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2, num_experts=E,
                                              num_experts_per_tok=2, moe_intermediate_size=I,
                                              shared_expert_intermediate_size=I)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2, num_experts=E,
                                              num_experts_per_tok=2, moe_intermediate_size=I)),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(ATTN, **LINEAR_ATTN, intermediate_size=96, num_hidden_layers=2,
                                                layer_types=["linear_attention", "full_attention"], num_experts=E,
                                                num_experts_per_tok=2, moe_intermediate_size=I,
                                                shared_expert_intermediate_size=I)),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", dict(ATTN, **LINEAR_ATTN, num_hidden_layers=2,
                                                  layer_types=["linear_attention", "full_attention"], num_experts=E,
                                                  num_experts_per_tok=2, moe_intermediate_size=I,
                                                  shared_expert_intermediate_size=I)),
    "mixtral": ("MixtralForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                           num_experts_per_tok=2)),
    "phimoe": ("PhimoeForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                         num_experts_per_tok=2)),
    "minimax": ("MiniMaxForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                           num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
                                           block_size=16)),
    "minimax_m2": ("MiniMaxM2ForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                                num_experts_per_tok=2)),
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(ATTN, **MLA, **ROUTED, intermediate_size=96, num_hidden_layers=2,
                                                  n_shared_experts=1, first_k_dense_replace=1, topk_method="greedy")),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(ATTN, **MLA, **ROUTED, intermediate_size=96, num_hidden_layers=2,
                                                  n_shared_experts=1, first_k_dense_replace=1)),
    "deepseek_v32": ("DeepseekV32ForCausalLM", dict(ATTN, **MLA, **ROUTED, intermediate_size=96, num_hidden_layers=2,
                                                    n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                                                    index_n_heads=2, index_head_dim=16, index_topk=8)),
    "glm_moe_dsa": ("GlmMoeDsaForCausalLM", dict(ATTN, **MLA, **ROUTED, intermediate_size=96, num_hidden_layers=2,
                                                 n_shared_experts=1, mlp_layer_types=["dense", "sparse"],
                                                 index_n_heads=2, index_head_dim=16, index_topk=8)),
    "glm4_moe": ("Glm4MoeForCausalLM", dict(ATTN, **ROUTED, intermediate_size=96, num_hidden_layers=2, n_shared_experts=1,
                                            first_k_dense_replace=1)),
    "dots1": ("Dots1ForCausalLM", dict(ATTN, **ROUTED, intermediate_size=96, num_hidden_layers=2, n_shared_experts=1,
                                       first_k_dense_replace=1)),
    "olmoe": ("OlmoeForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_experts=E,
                                       num_experts_per_tok=2)),
    "olmoe-square": ("OlmoeForCausalLM", dict(ATTN, intermediate_size=H // 2, num_hidden_layers=2, num_experts=E,
                                              num_experts_per_tok=2)),
    "flex_olmo": ("FlexOlmoForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_experts=E,
                                              num_experts_per_tok=2, pad_token_id=0, eos_token_id=1)),
    "granitemoe": ("GraniteMoeForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                                 num_experts_per_tok=2)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2,
                                                             num_local_experts=E, num_experts_per_tok=2,
                                                             shared_intermediate_size=I,
                                                             layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                             mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
                                                             mamba_chunk_size=16)),
    "jamba": ("JambaForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_experts=E,
                                       num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                       attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                                       mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False)),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", dict(ATTN, intermediate_size=96, num_hidden_layers=2, moe_num_experts=E,
                                                     moe_k=2, moe_intermediate_size=I, moe_num_shared_experts=1,
                                                     moe_layer_start_index=1)),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_experts=E,
                                                       moe_topk=2)),
    "longcat_flash": ("LongcatFlashForCausalLM", dict(ATTN, **MLA, num_layers=1, ffn_hidden_size=96,
                                                      expert_ffn_hidden_size=I, n_routed_experts=E, moe_topk=2,
                                                      zero_expert_num=2)),
    "gpt_oss": ("GptOssForCausalLM", dict(ATTN, intermediate_size=I, num_hidden_layers=2, num_local_experts=E,
                                          num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])),
    "llama4": ("Llama4ForCausalLM", dict(ATTN, intermediate_size=I, intermediate_size_mlp=96, num_hidden_layers=2,
                                         num_local_experts=E, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                         no_rope_layers=[1, 0])),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", dict(  # all-linear reaches the Conv3d patch embedding
        text_config=dict(ATTN, intermediate_size=96, num_hidden_layers=2,
                         rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1]),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)),
    # vision-language MoE models: the LoRA reaches the language model (and, with all-linear, the vision tower)
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", dict(
        text_config=dict(ATTN, intermediate_size=96, num_hidden_layers=2, num_experts=E, num_experts_per_tok=2,
                         moe_intermediate_size=I, decoder_sparse_step=1,
                         rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[1]),
        image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", dict(
        text_config=dict(ATTN, **ROUTED, intermediate_size=96, num_hidden_layers=2, n_shared_experts=1,
                         first_k_dense_replace=1,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=H, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=300, video_token_id=301, image_start_token_id=302, image_end_token_id=303)),
    # transformers 5.24 cannot run Llama4ForConditionalGeneration on text (its forward reads ``image_outputs``
    # its language model never returns; 5.25 can): text_only() asks the installed transformers
    "llama4_vl": ("Llama4ForConditionalGeneration", dict(
        text_config=dict(ATTN, intermediate_size=I, intermediate_size_mlp=96, num_hidden_layers=2, num_local_experts=E,
                         num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 0]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14, projector_input_dim=64, projector_output_dim=64, vision_output_dim=64,
                           pixel_shuffle_ratio=0.5),
        image_token_index=300)),
}


@lru_cache(maxsize=None)
def text_only(family: str) -> bool:
    """Whether the installed transformers cannot run the family's whole model on text (a multimodal
    model's forward failing on text alone, as transformers 5.24's Llama4ForConditionalGeneration did):
    its language model alone then runs, here and in tui-merger's behaviour check. Asked of transformers
    itself (a tiny random model of the family, one forward), never a list of ours, so a test holds on
    whichever version is installed and says which path ran."""
    import torch

    cls, config = build(family)
    if not cls.__name__.endswith("ForConditionalGeneration"):
        return False
    torch.manual_seed(0)
    model = cls(config).eval()
    try:
        with torch.no_grad():
            model(torch.zeros((1, 4), dtype=torch.long))
    except AttributeError:
        return True
    return False


def forward(model, family: str, ids):
    """The logits of the family's model (a peft model too) on ``ids``: the language model's alone where
    transformers cannot run the whole model (``text_only``), as tui-merger's behaviour check then runs it."""
    if text_only(family):
        model = (model.get_base_model() if hasattr(model, "get_base_model") else model).language_model
    return model(ids).logits


def build(name: str):
    """(model class, config) of a family."""
    import transformers

    cls_name, kwargs = FAMILIES[name]
    cls = getattr(transformers, cls_name)
    return cls, cls.config_class(**kwargs)
