"""Tiny bases written the way quantized releases are, from the formats' definitions (never with the code
under test):

- FP8 blocks (DeepSeek-V3/R1, Kimi-K2, Qwen3 -FP8; transformers' ``quant_method: fp8``): every Linear
  weight of the decoder layers is cut into 128x128 blocks (the last ones may be short); a block's scale is
  its absolute maximum / 448 (the largest float8_e4m3fn), stored in fp32 as ``<module>.weight_scale_inv``;
  the weight is ``(W / scale)`` clamped to +-448 and cast to float8_e4m3fn. That is DeepSeek's published
  recipe (and what transformers' own Fp8Quantize computes). Routers (``mlp.gate``), norms, embeddings and
  lm_head stay 16-bit, as in the released checkpoints.
- compressed-tensors FP8 (llm-compressor's FP8-Dynamic): one scale per output row (channel strategy),
  ``absmax / 448`` in the model dtype, stored as ``<module>.weight_scale`` [rows, 1]; ``ignore: [lm_head]``.

Imported as a plain module by the tests (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
QUANTIZED = re.compile(r"\.layers\.\d+\..*_proj(?:_with_mqa)?\.weight$")  # Linear weights of the decoder layers, not routers


def fp8_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 scale per block), block by block in plain loops."""
    w = w.float()
    rows, cols = w.shape
    bm, bn = block
    grid = torch.empty(-(-rows // bm), -(-cols // bn), dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            part = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            scale = part.abs().max() / FP8_MAX
            grid[i, j] = scale
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (part / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, grid


def fp8_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scale per output row [rows, 1] in w's dtype)."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).to(w.dtype)
    q = (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _rewrite(folder: Path, quantize, config_entry: dict) -> list[str]:
    """Quantize the decoder layers' Linear weights of a saved model in place; returns their names."""
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    done = []
    for path in files:
        tensors = load_file(str(path))
        out = {}
        for name, w in tensors.items():
            if QUANTIZED.search(name) and w.dim() == 2:
                q, scale = quantize(w)
                out[name] = q
                out[name[: -len("weight")] + config_entry["_scale"]] = scale
                if weight_map is not None:
                    weight_map[name[: -len("weight")] + config_entry["_scale"]] = path.name
                done.append(name)
            else:
                out[name] = w
        save_file(out, str(path), metadata={"format": "pt"})
    if weight_map is not None:
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {k: v for k, v in config_entry.items() if not k.startswith("_")}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return done


def fp8_blocks_ue8m0(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float8_e8m0fnu scale per block) from the format's definition (DeepSeek-V3.1's
    ``scale_fmt: "ue8m0"``): each block's scale is the power of two at or above amax / 448, stored as its
    biased exponent byte (2^(byte - 127)); the values are the block divided by it, cast to e4m3."""
    w = w.float()
    rows, cols = w.shape
    bm, bn = block
    exponents = torch.empty(-(-rows // bm), -(-cols // bn), dtype=torch.uint8)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(exponents.shape[0]):
        for j in range(exponents.shape[1]):
            part = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            e = math.ceil(math.log2(part.abs().max().item() / FP8_MAX))
            exponents[i, j] = e + 127
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (part / 2.0 ** e).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, exponents.view(torch.float8_e8m0fnu)


def make_fp8_ue8m0_base(folder: Path, model) -> list[str]:
    """Save ``model`` (bf16) as an FP8-block release with power-of-two scales stored as float8_e8m0fnu."""
    model.to(torch.bfloat16).save_pretrained(folder)
    return _rewrite(folder, fp8_blocks_ue8m0, {**FP8_CONFIG, "scale_fmt": "ue8m0", "_scale": "weight_scale_inv"})


def make_fp8_block_base(folder: Path, model) -> list[str]:
    """Save ``model`` (bf16) as an FP8-block release (quant_method fp8, 128x128 blocks)."""
    model.to(torch.bfloat16).save_pretrained(folder)
    return _rewrite(folder, fp8_blocks, {**FP8_CONFIG, "_scale": "weight_scale_inv"})


COMPRESSED_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
        }
    },
}


def fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, one scale [1] in w's dtype): the tensor strategy."""
    scale = (w.float().abs().max() / FP8_MAX).to(w.dtype).reshape(1)
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_ct_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, a scale per 128x128 block in w's dtype): the block strategy."""
    q, grid = fp8_blocks(w)
    return q, grid.to(w.dtype)


def make_compressed_fp8_base(folder: Path, model, strategy: str = "channel") -> list[str]:
    """Save ``model`` (bf16) as llm-compressor writes FP8 weights with compressed-tensors: one scale per
    output row (FP8-Dynamic, the default), per tensor, or per 128x128 block."""
    model.to(torch.bfloat16).save_pretrained(folder)
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    config = json.loads(json.dumps(COMPRESSED_FP8))
    config["config_groups"]["group_0"]["weights"] = weights
    quantize = {"channel": fp8_channels, "tensor": fp8_tensor, "block": fp8_ct_blocks}[strategy]
    return _rewrite(folder, quantize, {**config, "_scale": "weight_scale"})


# -- MXFP4 (GPT-OSS's experts) ---------------------------------------------------------------------------

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 4-bit float (1 sign, 2 exponent, 1 mantissa bit)


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP Microscaling format for one [rows, cols] matrix, in plain steps: each row is cut into groups
    of 32 values; a group's shared scale is 2**(floor(log2(absmax)) - 2) (2: e2m1's largest exponent),
    stored as the biased byte exponent + 127; each value / scale goes to the nearest e2m1 value (ties to
    the even code), clamped to 6, sign in bit 3; two values per byte, the even one in the low nibble.
    Returns (blocks [rows, cols/32, 16] uint8, scales [rows, cols/32] uint8)."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // 32, 32)
    amax = groups.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    x = groups / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1)
    dist = (x.abs()[..., None] - mags).abs()
    best = dist.min(dim=-1, keepdim=True).values
    tied = dist == best
    # ties to the even code (an even index in the table: mantissa bit 0)
    index = torch.where(tied[..., ::2].any(dim=-1), (tied * torch.arange(8).remainder(2).eq(0)).float().argmax(dim=-1),
                        tied.float().argmax(dim=-1))
    codes = index + 8 * (x < 0).long()
    codes = codes.reshape(rows, cols // 32, 16, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def make_mxfp4_base(folder: Path, model) -> list[str]:
    """Save a GPT-OSS ``model`` (bf16) as GPT-OSS is released: its experts' ``gate_up_proj`` [E, in, out]
    and ``down_proj`` written as ``*_blocks`` + ``*_scales`` of each expert's [out, in] matrix."""
    model.to(torch.bfloat16).save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    out, done = {}, []
    for name, w in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            pairs = [mxfp4(w[e].T.contiguous()) for e in range(w.shape[0])]
            out[name + "_blocks"] = torch.stack([b for b, _ in pairs])
            out[name + "_scales"] = torch.stack([s for _, s in pairs])
            done.append(name)
        else:
            out[name] = w
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((Path(folder) / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))
    return done


def make_fp8_release_workspace(ws: Path) -> Path:
    """``ws/Qwen3-tiny-FP8`` (a Qwen3 base written as an FP8-block release, with a tokenizer) and
    ``ws/qv-lora`` (a peft LoRA on q_proj and v_proj made on transformers' dequantizing load of it, which
    names the base): what the assistant's tests start from. Returns ws."""
    import transformers
    from peft import LoraConfig, get_peft_model
    from test_gguf import byte_level_tokenizer, config_of

    base = Path(ws) / "Qwen3-tiny-FP8"
    torch.manual_seed(0)
    make_fp8_block_base(base, transformers.AutoModelForCausalLM.from_config(config_of("qwen3")))
    byte_level_tokenizer("qwen").save_pretrained(base)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        base, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    torch.manual_seed(2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(loaded, lora).save_pretrained(Path(ws) / "qv-lora")
    return Path(ws)
