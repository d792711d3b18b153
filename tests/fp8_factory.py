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


def make_compressed_fp8_base(folder: Path, model) -> list[str]:
    """Save ``model`` (bf16) as llm-compressor's FP8-Dynamic writes it (compressed-tensors, channel scales)."""
    model.to(torch.bfloat16).save_pretrained(folder)
    return _rewrite(folder, fp8_channels, {**COMPRESSED_FP8, "_scale": "weight_scale"})
