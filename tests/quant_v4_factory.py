"""A tiny DeepSeek-V4 in the layout DeepSeek released it (DeepSeek-V4-Flash), written from the format's
definition, never with the code under test:

- the dense Linear weights (attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``; the shared expert's ``w1``-``w3``):
  ``W.weight`` float8_e4m3fn and ``W.scale`` float8_e8m0fnu, one power of two per block of
  ``weight_block_size`` (the block's absmax over 448 rounded up to a power of two, so nothing clips);
- the routed experts (``ffn.experts.E.w1``-``w3``): MXFP4, ``W.weight`` int8 [rows, cols/2] (two e2m1 codes a
  byte, the even-indexed value in the low nibble), ``W.scale`` float8_e8m0fnu [rows, cols/32] (the group's
  absmax over 6 rounded up to a power of two); each value the nearest e2m1 code;
- ``config.json``: ``quantization_config`` {quant_method fp8, fmt e4m3, scale_fmt ue8m0, weight_block_size},
  and ``expert_dtype: "fp4"`` at the top, where DeepSeek writes it (transformers moves it into the
  quantization config).

Names, suffixes, dtypes and packing are those of transformers 5.25's DeepSeek-V4 loading
(``conversion_mapping`` "deepseek_v4", the FP8 quantizer's ``^(.+)\\.scale`` -> ``weight_scale_inv``
rename, ``FP8Experts(expert_dtype="fp4")``, ``Fp8Dequantize._unpack_fp4``) and of vLLM's
``DeepseekV4FP8Config`` loader. The tensors keep the names ``save_pretrained`` writes (``model.layers.N...``;
the release itself has no ``model.`` prefix, see docs/quantized-bases.md).

The reference dequantized values are transformers' own: ``from_pretrained(...,
quantization_config=FineGrainedFP8Config(dequantize=True, ...))``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = [32, 32]
EXPERTS = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
DENSE = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_b)|ffn\.shared_experts\.w[123])\.weight$")
QCONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK,
           "scale_fmt": "ue8m0"}


def config():
    """DeepSeek-V4 (transformers 5.25), tiny: a sliding and a compressed-sparse attention layer, a hash-routed
    and a top-k routed MoE layer; widths multiples of 32 (MXFP4 groups)."""
    return transformers.DeepseekV4Config(
        hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320,
        max_position_embeddings=128, num_hidden_layers=2, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        layer_types=["sliding_attention", "compressed_sparse_attention"], mlp_layer_types=["hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, index_n_heads=2,
        index_head_dim=16, index_topk=4, hc_mult=2, qk_rope_head_dim=8, sliding_window=8)


def fp8_ue8m0(w: torch.Tensor, block=BLOCK):
    """(float8_e4m3fn values, float8_e8m0fnu scale per block): scale = 2^ceil(log2(absmax / 448))."""
    rows, cols = w.shape
    br, bc = block
    grid = (-(-rows // br), -(-cols // bc))
    scale = torch.empty(grid)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float()
            s = 2.0 ** math.ceil(math.log2(max(tile.abs().max().item(), 1e-30) / 448.0))
            scale[i, j] = s
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def mxfp4(w: torch.Tensor):
    """(int8 [rows, cols/2] two e2m1 codes a byte, low nibble first; float8_e8m0fnu [rows, cols/32])."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)))
    x = groups / scale[..., None]
    code = (x.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (x < 0).long()
    code = code.reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


# the release's own top-level names (transformers' conversion_mapping "deepseek_v4" renames them as it loads:
# ``^embed\.weight`` -> ``embed_tokens.weight``, ``^hc_head_fn`` -> ``hc_head.hc_fn``...; vLLM's loader adds the
# ``model.`` prefix the release leaves out)
RELEASE_NAMES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                 "hc_head.hc_scale": "hc_head_scale"}


def release_name(name: str) -> str:
    """``model.layers.0.attn.wq_a.weight`` -> ``layers.0.attn.wq_a.weight``, as DeepSeek-V4-Flash names it."""
    name = name.removeprefix("model.")
    return RELEASE_NAMES.get(name, name)


def make_base(folder: Path, seed: int = 0, release_names: bool = False) -> list[str]:
    """The quantized base in ``folder`` (with ``release_names``: under the release's names, no ``model.``
    prefix); returns the names of the quantized weights."""
    torch.manual_seed(seed)
    transformers.DeepseekV4ForCausalLM(config()).to(torch.bfloat16).save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    out, quantized = {}, []
    for name, w in load_file(str(path)).items():
        module = name[: -len(".weight")]
        if EXPERTS.search(name):
            out[name], out[module + ".scale"] = mxfp4(w)
        elif DENSE.search(name):
            out[name], out[module + ".scale"] = fp8_ue8m0(w)
        else:
            out[name] = w
            continue
        quantized.append(name)
    if release_names:
        out = {release_name(k): v for k, v in out.items()}
        quantized = [release_name(k) for k in quantized]
    save_file(out, str(path), metadata={"format": "pt"})
    cfg = json.loads((Path(folder) / "config.json").read_text())
    cfg["quantization_config"] = dict(QCONFIG)
    cfg["expert_dtype"] = "fp4"
    (Path(folder) / "config.json").write_text(json.dumps(cfg, indent=2))
    return quantized


def loader():
    return transformers.FineGrainedFP8Config(dequantize=True, scale_fmt="ue8m0", weight_block_size=BLOCK,
                                             expert_dtype="fp4")


def dequantized_load(base: Path, dtype=torch.bfloat16):
    """transformers' own dequantizing load of the base."""
    return transformers.AutoModelForCausalLM.from_pretrained(base, quantization_config=loader(), dtype=dtype)


def reference_folder(base: Path, ref: Path) -> dict:
    """``ref``: transformers' dequantized load saved by ``save_pretrained`` (disk names, bf16, no
    quantization_config); returns its tensors."""
    dequantized_load(base).save_pretrained(ref)
    cfg = json.loads((ref / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("expert_dtype", None)
    (ref / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = {}
    for f in sorted(ref.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors
