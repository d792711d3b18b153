"""GGUF export of every family tui-merger writes (core/ship/gguf_families.py), one tiny random model each
(its config, random norms and biases, tests/test_gguf.py's trained byte-level BPE tokenizer), exported F16.

Two checks that do not use our code:
- the file's tensors against what the ``gguf`` package itself says llama.cpp's layout is: every name is
  one of ``gguf.MODEL_TENSORS[arch]`` (``TENSOR_NAMES``, per block), every weight of the Hugging Face model
  is in the file once, found through gguf's own ``TensorNameMap`` and equal to it after F16 rounding and
  the transform llama.cpp's converter applies for that family (written here from its definition:
  Llama-style q/k rows reordered, Gemma's norms + 1, experts stacked); the metadata keys llama.cpp's
  converter writes for the family with the config's values;
- where transformers' own GGUF reader knows the architecture, the model it builds from the file alone
  gives the folder's logits within F16 rounding.
The real llama.cpp runs them all in benchmarks/llama_cpp_check.py (its table is in docs/formats.md).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_gguf import SMALL, byte_level_tokenizer, gguf_fields, load_gguf, load_hf, logits, probe
from tui_merger.core.errors import MergeError
from tui_merger.core.ship.gguf import export_gguf

NOT_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
# model_type -> (config overrides, transformers' GGUF reader reads it back)
CASES = {
    "llama": (dict(NOT_SPECIAL), True),
    "qwen2": ({}, True),
    "qwen3": (dict(head_dim=128), True),  # transformers' reader takes Qwen3's head_dim from the class default
    "mistral": (dict(NOT_SPECIAL, sliding_window=None), True),
    "gemma3_text": (dict(NOT_SPECIAL, head_dim=16, query_pre_attn_scalar=16, num_hidden_layers=6, sliding_window=4,
                         rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), False),
    "gemma2": (dict(NOT_SPECIAL, head_dim=16, query_pre_attn_scalar=16, sliding_window=4), False),
    "phi3": (dict(NOT_SPECIAL), False),
    "qwen3_moe": (dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True), True),
    "mixtral": (dict(NOT_SPECIAL, num_local_experts=4, num_experts_per_tok=2, sliding_window=None), False),
    "qwen2_moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64), False),
    "olmo2": (dict(NOT_SPECIAL), False),
    "granite": (dict(NOT_SPECIAL, attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5,
                     logits_scaling=4.0), False),
    "glm4": (dict(NOT_SPECIAL), False),
    "starcoder2": (dict(NOT_SPECIAL, norm_epsilon=1e-5), False),
    "smollm3": (dict(NOT_SPECIAL, num_hidden_layers=4), False),
    "gemma": (dict(NOT_SPECIAL, head_dim=16), False),
    "phi": (dict(NOT_SPECIAL, layer_norm_eps=1e-5), False),
    "granitemoe": (dict(NOT_SPECIAL, num_local_experts=4, num_experts_per_tok=2, attention_multiplier=0.2,
                        embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0), False),
    "olmo3": (dict(NOT_SPECIAL, num_hidden_layers=4, sliding_window=4,
                   rope_parameters={t: {"rope_type": "default", "rope_theta": 50000.0} for t in ("full_attention", "sliding_attention")}), False),
    "olmoe": (dict(NOT_SPECIAL, num_experts=4, num_experts_per_tok=2, num_key_value_heads=4), False),
    "cohere2": (dict(NOT_SPECIAL, num_hidden_layers=4, sliding_window=4, layer_norm_eps=1e-5), False),
    "exaone4": (dict(NOT_SPECIAL, num_hidden_layers=4, sliding_window=None, layer_types=["full_attention"] * 4), False),
    "deepseek_v3": (dict(NOT_SPECIAL, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, n_group=1, topk_group=1), False),
    "deepseek_v2": (dict(NOT_SPECIAL, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_shared_experts=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                         v_head_dim=16, topk_method="greedy"), False),
    "gpt_oss": (dict(NOT_SPECIAL, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"]), False),
    "glm4_moe": (dict(NOT_SPECIAL, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                      n_shared_experts=1, routed_scaling_factor=1.5, use_qk_norm=True), False),
    "ernie4_5": (dict(NOT_SPECIAL, head_dim=16), False),
    "seed_oss": (dict(NOT_SPECIAL, head_dim=16), False),
    "ernie4_5_moe": (dict(NOT_SPECIAL, head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2), False),
    "lfm2": (dict(NOT_SPECIAL, num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]), True),
    # M-RoPE sections that fit its 16-wide heads (the default [11, 11, 10] sums to 32: llama.cpp stops on it); as the
    # released models' they cover the rotated quarter of the head (2 pairs); on text any sections give the same rope
    "qwen3_5_text": (dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                          layer_types=["linear_attention", "full_attention"], full_attention_interval=2,
                          rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                               mrope_section=[1, 1, 0])), False),
    "qwen3_next": (dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        layer_types=["linear_attention", "full_attention"], full_attention_interval=2, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64), False),
    # per-layer embeddings, full-attention layers with their own head size and KV heads (k = v) and proportional
    # rope, the last two layers reusing keys and values, double-wide MLPs there, logit soft-capping
    "gemma4_text": (dict(NOT_SPECIAL, num_hidden_layers=6, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                         attention_k_eq_v=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=448, sliding_window=4,
                         num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0,
                         layer_types=["sliding_attention", "full_attention"] * 3), False),
    # a second case of a family: "<model_type>:<what>"
    "gemma4_text:moe": (dict(NOT_SPECIAL, num_hidden_layers=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                             attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=4, enable_moe_block=True,
                             num_experts=4, top_k_experts=2, moe_intermediate_size=32), False),
    "phi3:longrope": (dict(NOT_SPECIAL, max_position_embeddings=1024, original_max_position_embeddings=256,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 50000.0, "long_factor": [1.0 + i for i in range(8)],
                                            "short_factor": [1.0 + 0.125 * i for i in range(8)]}), False),
}
PERMUTED = {"llama", "mistral", "mixtral", "granite", "granitemoe", "smollm3"}  # llama.cpp's LlamaModel and its subclasses
PLUS_ONE = {"gemma", "gemma2", "gemma3_text", "qwen3_5_text", "qwen3_next"}  # norms the model applies as 1 + w: llama.cpp stores 1 + w


def _qwen35_linear_attention(hf_name: str, w: torch.Tensor, config) -> tuple[str, torch.Tensor]:
    """A Qwen3.5 Gated DeltaNet tensor as llama.cpp's converter writes it (_LinearAttentionVReorderBase and
    Qwen3NextModel.modify_tensors): value heads from grouped by key head to tiled, A_log as -exp(A_log),
    the conv kernel 2-D, dt_bias as ssm_dt's bias. Written here with index lists."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim

    def tiled(size):  # the new order of value-head rows: head v of key group g goes to place v * nk + g
        return torch.arange(nv * size).reshape(nk, nv // nk, size).permute(1, 0, 2).reshape(-1)

    qkv = torch.cat([torch.arange(2 * nk * dk), 2 * nk * dk + tiled(dv)])
    bid, part = hf_name.split(".")[2], hf_name.split(".linear_attn.")[1]
    name, value = {
        "in_proj_qkv.weight": ("attn_qkv.weight", lambda: w[qkv]),
        "in_proj_z.weight": ("attn_gate.weight", lambda: w[tiled(dv)]),
        "in_proj_a.weight": ("ssm_alpha.weight", lambda: w[tiled(1)]),
        "in_proj_b.weight": ("ssm_beta.weight", lambda: w[tiled(1)]),
        "out_proj.weight": ("ssm_out.weight", lambda: w[:, tiled(dv)]),
        "A_log": ("ssm_a", lambda: -torch.exp(w[tiled(1)])),
        "dt_bias": ("ssm_dt.bias", lambda: w[tiled(1)]),
        "conv1d.weight": ("ssm_conv1d.weight", lambda: w[:, 0][qkv]),
        "norm.weight": ("ssm_norm.weight", lambda: w),
    }[part]
    return f"blk.{bid}.{name}", value()


def _qwen3_next_linear_attention(hf_name: str, w: torch.Tensor, config) -> dict[str, torch.Tensor]:
    """A Qwen3-Next Gated DeltaNet tensor as llama.cpp's converter writes it (Qwen3NextModel.modify_tensors):
    in_proj_qkvz's rows, grouped per key head as [q, k, v, z], regrouped into attn_qkv (all q, all k, all v)
    and attn_gate (all z); A_log as -exp(A_log); the conv kernel 2-D; dt_bias as ssm_dt's bias."""
    nk, per = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    group = 2 * dk + 2 * per * dv

    def rows(start, size):  # the rows of one part in every key head's group
        return torch.tensor([g * group + start + i for g in range(nk) for i in range(size)])

    bid, part = hf_name.split(".")[2], hf_name.split(".linear_attn.")[1]
    if part == "in_proj_qkvz.weight":
        qkv = torch.cat([rows(0, dk), rows(dk, dk), rows(2 * dk, per * dv)])
        return {f"blk.{bid}.attn_qkv.weight": w[qkv], f"blk.{bid}.attn_gate.weight": w[rows(2 * dk + per * dv, per * dv)]}
    name, value = {"A_log": ("ssm_a", lambda: -torch.exp(w)), "dt_bias": ("ssm_dt.bias", lambda: w),
                   "conv1d.weight": ("ssm_conv1d.weight", lambda: w[:, 0]), "norm.weight": ("ssm_norm.weight", lambda: w),
                   "in_proj_ba.weight": ("ssm_ba.weight", lambda: w), "out_proj.weight": ("ssm_out.weight", lambda: w)}[part]
    return {f"blk.{bid}.{name}": value()}


def make_family(path: Path, case: str, dtype=torch.float32, seed=0, **overrides) -> Path:
    """A tiny random model of the family (random norms and biases, so that a misplaced or untransformed
    one shows) with the byte-level tokenizer, saved by transformers. ``case``: a key of CASES."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model_type = case.split(":")[0]
    kw = dict(SMALL, vocab_size=448, **CASES[case][0])
    kw.update(overrides)
    config = AutoConfig.for_model(model_type, **kw)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
            if model_type == "gemma4_text" and name.endswith(("q_norm.weight", "k_norm.weight")):
                # Gemma 4 attends with scale 1 and relies on its trained q/k norms: random ones near 1 make attention
                # so sharp that rounding flips it; head_dim ** -1/4 each scales q.k as 1/sqrt(head_dim) does elsewhere
                p.mul_(p.numel() ** -0.25)
    model.to(dtype).save_pretrained(path)
    byte_level_tokenizer({"llama": "llama3", "gpt_oss": "o200k"}.get(model_type, "qwen")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """model_type -> (folder, F16 GGUF in a folder of its own), made once for the module."""
    root = tmp_path_factory.mktemp("families")
    cache: dict = {}

    def get(model_type: str):
        if model_type not in cache:
            # named by its place, not its family: transformers' reader guesses a Mistral from general.name
            folder = make_family(root / f"tiny-{list(CASES).index(model_type)}", model_type)
            out = root / "gguf" / model_type
            out.mkdir(parents=True, exist_ok=True)
            cache[model_type] = (folder, export_gguf(folder, "f16", out / f"{model_type.replace(':', '-')}.gguf").path)
        return cache[model_type]

    return get


def _config(folder: Path):
    """The folder's config as transformers builds it; a per-layer one (Gemma 4) answers with its base values."""
    config = load_hf(folder).config
    if getattr(config, "is_heterogeneous", False):
        config.allow_global_per_layer_attribute_access = True
    return config


def _gguf_name_of(hf_name: str, tmap) -> tuple[str, int | None]:
    """gguf's own TensorNameMap: the GGUF name of an HF tensor, and its expert index (None when not one)."""
    m = re.match(r"^(.+\.experts)\.(\d+)\.([^.]+)\.weight$", hf_name)
    if m:
        found = tmap.get_name(f"{m[1]}.{m[3]}.weight", try_suffixes=(".weight",))
        if found:
            return found, int(m[2])
    found = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert found, f"gguf's TensorNameMap has no name for {hf_name}"
    return found, None


def _llama_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter for LlamaModel: per head, rows (first half, second half) interleaved."""
    shape = w.shape
    return w.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@pytest.mark.parametrize("model_type", list(CASES))
def test_every_weight_is_where_llama_cpps_layout_puts_it(built, model_type):
    import gguf

    folder, path = built(model_type)
    case, model_type = model_type, model_type.split(":")[0]
    fields = gguf_fields(path)
    arch_name = fields["general.architecture"]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    config = _config(folder)
    layers = config.num_hidden_layers
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) + s for t in gguf.MODEL_TENSORS[arch] for b in range(layers)
               for s in (".weight", ".bias", ".scale", "")}  # "": a name llama.cpp takes bare (ssm_a); .scale: Gemma 4's router
    reader = gguf.GGUFReader(path)
    stored = {t.name: torch.from_numpy(t.data.copy()).float() for t in reader.tensors}
    assert set(stored) <= allowed, sorted(set(stored) - allowed)
    tmap = gguf.get_tensor_name_map(arch, layers)
    want = {}  # the tensors as transformers saved them (on disk: one matrix per expert)
    for file in sorted(folder.glob("*.safetensors")):
        want.update(load_file(file))
    if getattr(config, "tie_word_embeddings", False):
        want.pop("lm_head.weight", None)
        assert "output.weight" not in stored
    experts: dict[str, dict[int, torch.Tensor]] = {}
    heads = {"attn_q": config.num_attention_heads, "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    seen = set()
    for hf_name, w in want.items():
        if hf_name.endswith(".input_linear.weight"):  # GraniteMoE: llama.cpp's converter splits it: gate rows, then up rows
            bid, half = hf_name.split(".")[2], w.shape[1] // 2
            for name, part in ((f"blk.{bid}.ffn_gate_exps.weight", w[:, :half]), (f"blk.{bid}.ffn_up_exps.weight", w[:, half:])):
                assert torch.equal(stored[name].reshape(part.shape), part.half().float()), name
                seen.add(name)
            continue
        if hf_name.endswith(".kv_b_proj.weight"):  # DeepSeek's MLA: llama.cpp's converter splits it per head
            bid, heads = hf_name.split(".")[2], config.num_attention_heads
            nope = config.qk_nope_head_dim
            per_head = w.reshape(heads, nope + config.v_head_dim, w.shape[-1])
            for name, part in ((f"blk.{bid}.attn_k_b.weight", per_head[:, :nope].transpose(1, 2)),
                               (f"blk.{bid}.attn_v_b.weight", per_head[:, nope:])):
                assert torch.equal(stored[name].reshape(part.shape), part.half().float()), name
                seen.add(name)
            continue
        if model_type in ("qwen3_5_text", "qwen3_next") and ".linear_attn." in hf_name:
            parts = (dict([_qwen35_linear_attention(hf_name, w, config)]) if model_type == "qwen3_5_text"
                     else _qwen3_next_linear_attention(hf_name, w, config))
            for name, value in parts.items():
                f32 = value.ndim == 1 or "conv1d" in hf_name  # the converter keeps the conv kernel F32
                assert torch.equal(stored[name].reshape(value.shape), value if f32 else value.half().float()), name
                seen.add(name)
            continue
        gpt_oss = {  # GPT-OSS's packed experts, as llama.cpp's converter writes them from 16-bit weights
            "gate_up_proj": lambda w: {"ffn_gate_exps.weight": w.transpose(1, 2)[:, 0::2], "ffn_up_exps.weight": w.transpose(1, 2)[:, 1::2]},
            "gate_up_proj_bias": lambda w: {"ffn_gate_exps.bias": w[:, 0::2], "ffn_up_exps.bias": w[:, 1::2]},
            "down_proj": lambda w: {"ffn_down_exps.weight": w.transpose(1, 2)},
        }
        if model_type == "gpt_oss" and ".experts." in hf_name and hf_name.split(".")[-1] in gpt_oss:
            bid = hf_name.split(".")[2]
            for part, value in gpt_oss[hf_name.split(".")[-1]](w).items():
                name = f"blk.{bid}.{part}"
                want_value = value.half().float() if part.endswith(".weight") else value  # biases F32
                assert torch.equal(stored[name].reshape(want_value.shape), want_value), name
                seen.add(name)
            continue
        gemma4_router = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}
        if model_type == "gemma4_text" and hf_name.split(".", 3)[-1] in gemma4_router:  # Gemma4Model.modify_tensors
            name = f"blk.{hf_name.split('.')[2]}.{gemma4_router[hf_name.split('.', 3)[-1]]}"
            assert torch.equal(stored[name], w), name  # 1-D: F32
            seen.add(name)
            continue
        name, expert = _gguf_name_of(hf_name.replace("_bias", ".bias"), tmap)
        if not name.endswith((".weight", ".bias")):  # GPT-OSS's sinks: the converter adds .weight
            name += ".weight"
        if expert is not None:
            experts.setdefault(name, {})[expert] = w
            continue
        if model_type in PLUS_ONE and hf_name.endswith("norm.weight"):
            w = w + 1
        kind = name.split(".")[-2]
        if model_type in PERMUTED and kind in heads:
            w = _llama_rope_rows(w, heads[kind])
        # F32 as llama.cpp's converter keeps them: routers, the score-correction bias, LFM2's conv kernel
        rounded = w.half().float() if w.ndim >= 2 and kind not in ("ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b", "conv") else w
        assert name in stored, (hf_name, name)
        assert torch.equal(stored[name].reshape(w.shape), rounded), (hf_name, name)
        seen.add(name)
    for name, by_index in experts.items():
        stack = torch.stack([by_index[e] for e in range(len(by_index))])
        assert torch.equal(stored[name].reshape(stack.shape), stack.half().float()), name
        seen.add(name)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":  # Phi-3: the converter writes the factors as two F32 tensors
        for which in ("long", "short"):
            assert torch.equal(stored[f"rope_factors_{which}.weight"], torch.tensor(rope[f"{which}_factor"]))
            seen.add(f"rope_factors_{which}.weight")
    if model_type == "gemma4_text":  # Gemma4Model.generate_extra_tensors: proportional rope as per-pair divisors
        full = json.loads((folder / "config.json").read_text())["rope_parameters"]["full_attention"]
        global_head_dim = CASES[case][0]["global_head_dim"]
        rotated = int(global_head_dim * full["partial_rotary_factor"] / 2)
        want_freqs = torch.tensor([1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated), dtype=torch.float32)
        assert torch.equal(stored["rope_freqs.weight"], want_freqs)
        seen.add("rope_freqs.weight")
    extra = set(stored) - seen - {"rope_freqs.weight"}
    assert not extra, extra


def _expected_keys(model_type: str, config, folder: Path) -> dict:
    """The keys llama.cpp's convert_hf_to_gguf.py writes for the family, with the config's values
    (written here from the converter's classes, as llama.cpp reads them)."""
    case, model_type = model_type, model_type.split(":")[0]
    a = {"gemma4_text": "gemma4", "ernie4_5_moe": "ernie4_5-moe", "qwen3_5_text": "qwen35", "qwen3_next": "qwen3next", "gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama", "mistral": "llama", "qwen2_moe": "qwen2moe",
         "phi": "phi2", "olmo3": "olmo2", "gpt_oss": "gpt-oss", "glm4_moe": "glm4moe", "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}.get(model_type, model_type)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = config.rope_parameters
    rope = rope.get("full_attention", rope)
    keys = {
        f"{a}.context_length": config.max_position_embeddings,
        f"{a}.embedding_length": config.hidden_size,
        f"{a}.block_count": config.num_hidden_layers,
        f"{a}.feed_forward_length": config.intermediate_size,
        f"{a}.attention.head_count": config.num_attention_heads,
        f"{a}.attention.head_count_kv": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        f"{a}.rope.freq_base": rope["rope_theta"],
        f"{a}.rope.dimension_count": int(head_dim * rope.get("partial_rotary_factor", 1.0)),
    }
    if model_type == "lfm2":
        keys[f"{a}.attention.layer_norm_rms_epsilon"] = config.norm_eps
    elif model_type in ("phi", "cohere2"):
        keys[f"{a}.attention.layer_norm_epsilon"] = config.layer_norm_eps
    elif model_type == "starcoder2":
        keys[f"{a}.attention.layer_norm_epsilon"] = config.norm_epsilon
    else:
        keys[f"{a}.attention.layer_norm_rms_epsilon"] = config.rms_norm_eps
    if model_type in ("gemma", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "cohere2", "exaone4", "ernie4_5", "seed_oss", "glm4",
                      "gpt_oss", "glm4_moe", "ernie4_5_moe", "qwen3_5_text", "qwen3_next"):
        keys[f"{a}.attention.key_length"] = keys[f"{a}.attention.value_length"] = head_dim
    if model_type == "gemma2":
        keys.update({f"{a}.attn_logit_softcapping": config.attn_logit_softcapping,
                     f"{a}.final_logit_softcapping": config.final_logit_softcapping,
                     f"{a}.attention.sliding_window": config.sliding_window})
    if model_type in ("gemma3_text", "cohere2", "olmo3", "gpt_oss"):
        keys[f"{a}.attention.sliding_window"] = config.sliding_window
    if model_type == "gemma3_text":  # llama.cpp's gemma3 reads the sliding layers' rope base (else 10000); the converter writes it
        keys[f"{a}.rope.freq_base_swa"] = config.rope_parameters["sliding_attention"]["rope_theta"]
    if model_type == "cohere2":
        keys[f"{a}.logit_scale"] = config.logit_scale
    if model_type in ("granite", "granitemoe"):
        keys.update({f"{a}.attention.scale": config.attention_multiplier, f"{a}.embedding_scale": config.embedding_multiplier,
                     f"{a}.residual_scale": config.residual_multiplier, f"{a}.logit_scale": config.logits_scaling})
    if model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"):
        keys[f"{a}.expert_count"] = getattr(config, "num_local_experts", None) or config.num_experts
        keys[f"{a}.expert_used_count"] = config.num_experts_per_tok
    if model_type in ("qwen2_moe", "qwen3_moe"):
        keys[f"{a}.expert_feed_forward_length"] = config.moe_intermediate_size
    if model_type == "gpt_oss":
        keys[f"{a}.expert_feed_forward_length"] = config.intermediate_size
    if model_type == "qwen2_moe":
        keys[f"{a}.expert_shared_feed_forward_length"] = config.shared_expert_intermediate_size
    if model_type == "glm4_moe":
        keys.update({f"{a}.expert_count": config.n_routed_experts, f"{a}.expert_used_count": config.num_experts_per_tok,
                     f"{a}.expert_feed_forward_length": config.moe_intermediate_size,
                     f"{a}.expert_shared_count": config.n_shared_experts, f"{a}.leading_dense_block_count": config.first_k_dense_replace,
                     f"{a}.expert_weights_scale": config.routed_scaling_factor, f"{a}.expert_weights_norm": config.norm_topk_prob,
                     f"{a}.expert_gating_func": 2})
    if model_type == "ernie4_5_moe":  # Ernie4_5MoeModel.set_gguf_parameters
        keys.update({f"{a}.expert_count": config.moe_num_experts, f"{a}.expert_used_count": config.moe_k,
                     f"{a}.interleave_moe_layer_step": config.moe_layer_interval,
                     f"{a}.leading_dense_block_count": config.moe_layer_start_index,
                     f"{a}.expert_feed_forward_length": config.moe_intermediate_size,
                     f"{a}.expert_shared_count": config.moe_num_shared_experts,
                     # the converter derives it as intermediate_size // num_key_value_heads, which is this for the
                     # released models; transformers builds the shared experts this wide
                     f"{a}.expert_shared_feed_forward_length": config.moe_intermediate_size * config.moe_num_shared_experts})
    if model_type in ("qwen3_5_text", "qwen3_next"):  # Qwen3NextModel (and _Qwen35MRopeMixin)'s set_gguf_parameters
        keys.update({f"{a}.ssm.conv_kernel": config.linear_conv_kernel_dim, f"{a}.ssm.state_size": config.linear_key_head_dim,
                     f"{a}.ssm.group_count": config.linear_num_key_heads, f"{a}.ssm.time_step_rank": config.linear_num_value_heads,
                     f"{a}.ssm.inner_size": config.linear_value_head_dim * config.linear_num_value_heads,
                     f"{a}.attention.recurrent_layers": [t == "linear_attention" for t in config.layer_types],
                     f"{a}.full_attention_interval": config.full_attention_interval})
    if model_type == "qwen3_5_text":
        # _Qwen35MRopeMixin: the config's mrope_section (default [11, 11, 10]) padded to 4
        keys[f"{a}.rope.dimension_sections"] = (list(config.rope_parameters.get("mrope_section") or [11, 11, 10]) + [0] * 4)[:4]
    if model_type == "qwen3_next":  # Qwen2MoeModel's and TextModel's expert keys
        keys.update({f"{a}.expert_count": config.num_experts, f"{a}.expert_used_count": config.num_experts_per_tok,
                     f"{a}.expert_feed_forward_length": config.moe_intermediate_size,
                     f"{a}.expert_shared_feed_forward_length": config.shared_expert_intermediate_size})
    if model_type == "lfm2":  # LFM2Model.set_gguf_parameters: KV heads per layer, 0 for the convolutions
        ff = int(2 * config.intermediate_size / 3)
        ff = config.block_multiple_of * -(-int(config.block_ffn_dim_multiplier * ff) // config.block_multiple_of)
        keys.update({f"{a}.attention.head_count_kv": [0 if t == "conv" else config.num_key_value_heads for t in config.layer_types],
                     f"{a}.shortconv.l_cache": config.conv_L_cache, f"{a}.feed_forward_length": ff})
    if case == "phi3:longrope":  # Phi3MiniModel: attn_factor from the context's growth, the original context
        growth = config.max_position_embeddings / config.original_max_position_embeddings
        keys.update({f"{a}.rope.scaling.attn_factor": math.sqrt(1 + math.log(growth) / math.log(config.original_max_position_embeddings)),
                     f"{a}.rope.scaling.original_context_length": config.original_max_position_embeddings})
    if model_type.startswith("deepseek"):  # MLA written as MQA: one KV head of kv_lora_rank + rope
        rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
        keys.update({f"{a}.attention.head_count_kv": 1, f"{a}.attention.key_length": rank + rope_dim,
                     f"{a}.attention.value_length": rank, f"{a}.rope.dimension_count": rope_dim,
                     f"{a}.attention.kv_lora_rank": rank, f"{a}.leading_dense_block_count": config.first_k_dense_replace,
                     f"{a}.attention.key_length_mla": config.qk_nope_head_dim + rope_dim,
                     f"{a}.attention.value_length_mla": config.v_head_dim, f"{a}.expert_count": config.n_routed_experts,
                     f"{a}.expert_used_count": config.num_experts_per_tok, f"{a}.expert_shared_count": config.n_shared_experts,
                     f"{a}.expert_feed_forward_length": config.moe_intermediate_size,
                     f"{a}.expert_gating_func": 2 if model_type == "deepseek_v3" else 1})  # transformers: V3 sigmoid, V2 softmax
        if config.q_lora_rank:
            keys[f"{a}.attention.q_lora_rank"] = config.q_lora_rank
    if model_type == "gemma4_text":  # Gemma4Model.set_gguf_parameters, from config.json as saved
        raw = json.loads((folder / "config.json").read_text())
        per_layer = {int(i): v for i, v in raw["per_layer_config"].items()}  # the full-attention layers' own values
        sliding = [t == "sliding_attention" for t in raw["layer_types"]]
        full_head = per_layer[sliding.index(False)]["head_dim"]
        first_shared = raw["num_hidden_layers"] - raw["num_kv_shared_layers"]
        keys.update({f"{a}.attention.key_length": full_head, f"{a}.attention.value_length": full_head,
                     f"{a}.attention.key_length_swa": raw["head_dim"], f"{a}.attention.value_length_swa": raw["head_dim"],
                     f"{a}.rope.dimension_count": full_head, f"{a}.rope.dimension_count_swa": raw["head_dim"],
                     f"{a}.rope.freq_base": raw["rope_parameters"]["full_attention"]["rope_theta"],
                     f"{a}.rope.freq_base_swa": raw["rope_parameters"]["sliding_attention"]["rope_theta"],
                     f"{a}.attention.sliding_window": raw["sliding_window"], f"{a}.attention.sliding_window_pattern": sliding,
                     f"{a}.attention.shared_kv_layers": raw["num_kv_shared_layers"],
                     f"{a}.embedding_length_per_layer_input": raw["hidden_size_per_layer_input"],
                     f"{a}.final_logit_softcapping": raw["final_logit_softcapping"],
                     f"{a}.feed_forward_length": [raw["intermediate_size"] * (2 if i >= first_shared else 1)
                                                  for i in range(raw["num_hidden_layers"])],
                     f"{a}.attention.head_count_kv": [raw["num_key_value_heads"] if s else per_layer[i]["num_key_value_heads"]
                                                      for i, s in enumerate(sliding)]})
        if not raw["use_double_wide_mlp"] or not raw["num_kv_shared_layers"]:  # the common key
            keys[f"{a}.feed_forward_length"] = raw["intermediate_size"]
        if raw["enable_moe_block"]:
            keys.update({f"{a}.expert_count": raw["num_experts"], f"{a}.expert_used_count": raw["top_k_experts"],
                         f"{a}.expert_feed_forward_length": raw["moe_intermediate_size"]})
        if raw["final_logit_softcapping"] is None:
            del keys[f"{a}.final_logit_softcapping"]
    return keys


@pytest.mark.parametrize("model_type", list(CASES))
def test_the_metadata_is_what_llama_cpps_converter_writes(built, model_type):
    folder, path = built(model_type)
    fields = gguf_fields(path)
    config = _config(folder)
    for key, value in _expected_keys(model_type, config, folder).items():
        assert key in fields, key
        got = fields[key]
        assert (got == pytest.approx(value, rel=1e-6)) if isinstance(value, float) else got == value, (key, got, value)
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == 448


@pytest.mark.parametrize("model_type", [m for m, (_, reads) in CASES.items() if reads])
def test_transformers_reads_the_file_back_with_the_folders_logits(built, model_type):
    folder, path = built(model_type)
    ours, theirs = load_hf(folder), load_gguf(path)
    ids = probe()
    reference = logits(ours, ids)
    out = logits(theirs, ids)
    matrices = sum(1 for w in ours.state_dict().values() if w.ndim >= 2)
    rel = ((out - reference).abs().max() / reference.abs().max()).item()
    assert rel < 8 * 2.0**-11 * math.sqrt(matrices), rel


REFUSALS = {
    # a config llama.cpp's graph cannot compute: one sentence, nothing written
    "qwen2_moe": (dict(norm_topk_prob=True), "llama.cpp's qwen2moe never renormalizes"),
    "gemma2": (dict(query_pre_attn_scalar=32), "llama.cpp scales attention by the head size"),
    "gemma3_text": (dict(layer_types=["full_attention"] * 6), "other than llama.cpp's gemma3 pattern (every 6th layer"),
    "smollm3": (dict(no_rope_layers=[1, 0, 1, 0]), "not llama.cpp's smollm3 pattern"),
    "mistral": (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8),
                "uses sliding-window attention, which llama.cpp's llama layout does not describe"),
    "phi3": (dict(partial_rotary_factor=0.5), "rotates only part of each head"),
    "olmoe": (dict(num_key_value_heads=2), "llama.cpp's olmoe layout has one per attention head"),
    "deepseek_v2": (dict(q_lora_rank=None), "allows only for the 27-layer DeepSeek-V2-Lite"),
    "exaone4": (dict(sliding_window=4, layer_types=None), "uses sliding-window attention, which llama.cpp's exaone4 layout"),
    "lfm2": (dict(conv_bias=True), "its short-convolution layers have biases (conv_bias)"),
    "ernie4_5_moe": (dict(moe_layer_interval=2), "llama.cpp's ernie4_5-moe loader expects experts in every layer"),
    "qwen3_5_text": (dict(linear_value_head_dim=32), "key and value heads differ in size"),
    "qwen3_next": (dict(mlp_only_layers=[0]), "llama.cpp's layout has experts in every layer"),
    "gemma4_text": (dict(use_bidirectional_attention="all"), "and llama.cpp's gemma4 graph is causal"),
}


@pytest.mark.parametrize("model_type", list(REFUSALS))
def test_a_config_llama_cpp_would_compute_differently_is_one_sentence(tmp_path, model_type):
    overrides, says = REFUSALS[model_type]
    try:
        folder = make_family(tmp_path / "m", model_type, **overrides)
    except Exception as err:  # transformers itself refuses the combination: nothing to test
        pytest.skip(f"transformers does not build it: {err}")
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(MergeError) as err:
        export_gguf(folder, "f16")
    message = str(err.value)
    assert says in message and "\n" not in message and message.endswith("."), message
    assert sorted(p.name for p in folder.iterdir()) == before


def test_mrope_sections_wider_than_the_head_are_refused(tmp_path):
    """llama.cpp aborts (GGML_ASSERT(sect_dims <= ne0) in ggml's M-RoPE) on sections that add up to more than the
    head size: refused in one sentence, nothing written. Qwen3.5's default sections [11, 11, 10] with 16-wide heads."""
    folder = make_family(tmp_path / "m", "qwen3_5_text",
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(MergeError) as err:
        export_gguf(folder, "f16")
    message = str(err.value)
    assert "its M-RoPE sections [11, 11, 10] (mrope_section) add up to 32, more than its head size 16, and llama.cpp stops" in message, message
    assert "\n" not in message and message.endswith(".")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_every_family_with_mrope_sections_checks_them():
    """The check is data of every family that writes rope.dimension_sections: transformers' own VL text configs with
    their default sections (Qwen2-VL [16, 24, 24], Qwen3-VL [24, 20, 20]) and 16-wide heads are refused, fitting ones not."""
    from transformers import Qwen2VLTextConfig, Qwen3VLMoeTextConfig, Qwen3VLTextConfig

    from tui_merger.core.ship.gguf_families import FAMILIES

    configs = {"qwen2_vl_text": Qwen2VLTextConfig, "qwen2_5_vl_text": Qwen2VLTextConfig, "qwen3_vl_text": Qwen3VLTextConfig,
               "qwen3_vl_moe_text": Qwen3VLMoeTextConfig}
    assert {k for k, f in FAMILIES.items() if "rope.dimension_sections" in f.keys} == set(configs) | {"qwen3_5_text"}
    for model_type, cls in configs.items():
        narrow = cls(hidden_size=64, num_attention_heads=4, head_dim=16)
        said = [why for why in (check(narrow) for check in FAMILIES[model_type].checks) if why]
        assert len(said) == 1 and "more than its head size 16, and llama.cpp stops" in said[0], (model_type, said)
        wide = cls(hidden_size=512, num_attention_heads=4, head_dim=128)
        assert not [why for why in (check(wide) for check in FAMILIES[model_type].checks) if why], model_type


def test_gemma4_sharing_keys_and_values_of_other_layers_than_llama_cpps_is_refused(tmp_path):
    """transformers' Gemma 4 reuses the keys and values of the last layer of each type before the sharing;
    llama.cpp takes the last two layers (sliding, then full): another order would attend to other values."""
    folder = make_family(tmp_path / "m", "gemma4_text", layer_types=["sliding_attention", "full_attention", "full_attention",
                                                                     "sliding_attention", "sliding_attention", "full_attention"])
    before = sorted(p.name for p in folder.iterdir())
    with pytest.raises(MergeError) as err:
        export_gguf(folder, "f16")
    message = str(err.value)
    assert "its layer 4 reuses the keys and values of layer 3, and llama.cpp's gemma4 takes them from layer 2" in message, message
    assert "\n" not in message and message.endswith(".")
    assert sorted(p.name for p in folder.iterdir()) == before


def test_mistral_with_a_sliding_window_shorter_than_its_context_says_so(tmp_path):
    from tui_merger.core.events import Notice

    folder = make_family(tmp_path / "m", "mistral", sliding_window=64)
    said = []
    export_gguf(folder, "f16", tmp_path / "m.gguf", on_event=lambda e: said.append(e.message) if isinstance(e, Notice) else None)
    assert any("attends to the last 64 tokens only (sliding_window)" in s and "computes the same up to 64 tokens" in s
               for s in said), said


def test_next_token_prediction_layers_past_the_model_are_left_out_and_said(tmp_path):
    """DeepSeek-V3 and GLM-4.5 releases hold a next-token-prediction layer past num_hidden_layers, which
    transformers does not load: the GGUF leaves it out too and says so; the rest is the same file."""
    from safetensors.torch import save_file

    from tui_merger.core.events import Notice

    folder = make_family(tmp_path / "m", "glm4_moe")
    plain = export_gguf(folder, "f16", tmp_path / "plain.gguf")
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64)},
              folder / "mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in load_file(folder / "model.safetensors")},
                                           "model.layers.2.eh_proj.weight": "mtp.safetensors",
                                           "model.layers.2.enorm.weight": "mtp.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    said = []
    with_mtp = export_gguf(folder, "f16", tmp_path / "mtp.gguf",
                           on_event=lambda e: said.append(e.message) if isinstance(e, Notice) else None)
    assert any(s.startswith("2 tensor(s) of layers past num_hidden_layers (model.layers.2.") for s in said), said
    import gguf

    def names(path):
        return [t.name for t in gguf.GGUFReader(path).tensors]

    assert names(with_mtp.path) == names(plain.path)


def test_phi3_longrope_says_when_llama_cpp_takes_the_long_factors(tmp_path):
    from tui_merger.core.events import Notice

    folder = make_family(tmp_path / "m", "phi3:longrope")
    said = []
    export_gguf(folder, "f16", tmp_path / "m.gguf", on_event=lambda e: said.append(e.message) if isinstance(e, Notice) else None)
    assert any("llama.cpp rotates with the long ones whenever its context (n_ctx) is above 256 tokens" in s for s in said), said


def test_phi3_longrope_is_not_called_checked_by_transformers_reader_which_drops_the_factors(built):
    """transformers' GGUF reader builds a Phi-3 with default rope from the file (it does not read
    rope_factors_long/short): a comparison with it would check another model, so the file is not checked."""
    from transformers import AutoModelForCausalLM

    from tui_merger.core.ship.gguf_check import NOT_CHECKED, check_gguf

    folder, path = built("phi3:longrope")
    read = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    assert read.config.rope_parameters.get("rope_type") == "default"  # what makes the check meaningless
    check = check_gguf(folder, path, "f16", reader="transformers")
    assert check.status == NOT_CHECKED and "without its longrope factors" in check.summary, check.line()


def test_gemma4_shared_layers_keys_and_values_transformers_does_not_load_are_left_out_and_said(tmp_path):
    """A Gemma 4 checkpoint may hold k/v projections for the layers that reuse earlier keys and values;
    transformers does not load them and llama.cpp's graph does not use them (it loads them if present: dead weight)."""
    from safetensors.torch import save_file

    from tui_merger.core.events import Notice

    folder = make_family(tmp_path / "m", "gemma4_text")
    plain = export_gguf(folder, "f16", tmp_path / "plain.gguf")
    tensors = load_file(folder / "model.safetensors")
    tensors.update({"model.layers.4.self_attn.k_proj.weight": torch.zeros(32, 64), "model.layers.5.self_attn.k_norm.weight": torch.ones(32)})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    said = []
    extra = export_gguf(folder, "f16", tmp_path / "extra.gguf", on_event=lambda e: said.append(e.message) if isinstance(e, Notice) else None)
    assert any(s.startswith("2 tensor(s) (model.layers.4.self_attn.k_proj.weight...) are left out, as transformers does not load them")
               for s in said), said
    import gguf

    assert [t.name for t in gguf.GGUFReader(extra.path).tensors] == [t.name for t in gguf.GGUFReader(plain.path).tensors]


def test_gemma4_is_not_called_checked_by_transformers_reader_which_builds_another_model(built):
    """transformers' GGUF reader knows the gemma4 architecture by name but reads none of its per-type keys:
    from our file it builds a model of Gemma 4's default sizes (or none at all), so the file is not checked."""
    from transformers import AutoModelForCausalLM

    from tui_merger.core.ship.gguf_check import NOT_CHECKED, check_gguf

    folder, path = built("gemma4_text")
    with pytest.raises(Exception):  # what makes the check meaningless: it cannot even hold the file's tensors
        AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    check = check_gguf(folder, path, "f16", reader="transformers")
    assert check.status == NOT_CHECKED and "reader builds Gemma 4 without" in check.summary, check.line()


def test_qwen35_next_token_prediction_module_is_left_out_and_said(tmp_path):
    """Qwen3.5 and Qwen3-Next releases hold their next-token-prediction module under mtp.*, which transformers
    does not load (_keys_to_ignore_on_load_unexpected): the GGUF leaves it out and says so."""
    from safetensors.torch import save_file

    from tui_merger.core.events import Notice

    folder = make_family(tmp_path / "m", "qwen3_5_text")
    plain = export_gguf(folder, "f16", tmp_path / "plain.gguf")
    save_file({"mtp.fc.weight": torch.zeros(64, 128), "mtp.layers.0.input_layernorm.weight": torch.ones(64)},
              folder / "mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in load_file(folder / "model.safetensors")},
                                           "mtp.fc.weight": "mtp.safetensors", "mtp.layers.0.input_layernorm.weight": "mtp.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    said = []
    with_mtp = export_gguf(folder, "f16", tmp_path / "mtp.gguf",
                           on_event=lambda e: said.append(e.message) if isinstance(e, Notice) else None)
    assert any(s.startswith("2 tensor(s) of a module transformers does not load (mtp.") for s in said), said
    import gguf

    assert [t.name for t in gguf.GGUFReader(with_mtp.path).tensors] == [t.name for t in gguf.GGUFReader(plain.path).tensors]
