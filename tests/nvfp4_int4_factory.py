"""Tiny bases in NVFP4 (ModelOpt and compressed-tensors' nvfp4-pack-quantized) and INT4 pack-quantized
(Kimi-K2's experts), written with compressed-tensors' own compressors (never with the code under test),
and the reference dequantized tensors from compressed-tensors' own decompressors.

- NVFP4: per weight a global scale ``gs = 448 * 6 / amax`` (fp32), per 16 values a block scale
  ``gs * block_amax / 6`` cast to float8_e4m3fn; ``NVFP4PackedCompressor.compress`` quantizes and packs.
  ModelOpt stores the packed bytes as ``weight``, the global scale inverted as ``weight_scale_2`` (a scalar):
  compressed-tensors' own ``ModelOptNvfp4Converter`` maps one onto the other.
- INT4 pack-quantized: scale per 32 values ``amax / 7.5`` in bf16 (compressed-tensors' symmetric int4
  range); ``PackedQuantizationCompressor.compress`` quantizes and packs eight to an int32.

Imported as a plain module by the tests (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR = re.compile(r"\.layers\.\d+\..*_proj\.weight$")
EXPERTS = re.compile(r"\.mlp\.experts\.\d+\.\w+_proj\.weight$")

NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                 "dynamic": False}
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True,
                "dynamic": False}
MODELOPT_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "producer": {"name": "modelopt", "version": "0.37.0"},
                   "ignore": ["lm_head"], "config_groups": {"group_0": {
                       "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False},
                       "input_activations": {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}}}}


def _scheme(weights: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


def nvfp4_compress(w: torch.Tensor) -> dict:
    """{weight_packed, weight_scale, weight_global_scale} of one bf16 weight, by compressed-tensors."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    rows, cols = w.shape
    amax = w.float().abs().amax()
    gs = (448.0 * 6.0 / amax).reshape(1).to(torch.float32)
    block_amax = w.float().reshape(rows, cols // 16, 16).abs().amax(dim=-1)
    scale = (gs * block_amax / 6.0).clamp(min=2 ** -9, max=448.0).to(torch.float8_e4m3fn)
    state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": gs}
    out = NVFP4PackedCompressor.compress(state, _scheme(NVFP4_WEIGHTS))
    return {"weight_packed": out["weight_packed"], "weight_scale": out["weight_scale"],
            "weight_global_scale": out["weight_global_scale"]}


def nvfp4_reference(module_tensors: dict, modelopt: bool) -> torch.Tensor:
    """compressed-tensors' dequantized weight of one module's stored tensors (ModelOpt's through its converter)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    state = {f"m.{k}": v for k, v in module_tensors.items()}
    if modelopt:
        state = ModelOptNvfp4Converter(targets=["re:.*"]).process(state)
    state = {k[2:]: v for k, v in state.items()}
    return NVFP4PackedCompressor.decompress(state, _scheme(NVFP4_WEIGHTS))["weight"]


def int4_compress(w: torch.Tensor) -> dict:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    rows, cols = w.shape
    scale = (w.float().reshape(rows, cols // 32, 32).abs().amax(dim=-1) / 7.5).to(w.dtype)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, _scheme(INT4_WEIGHTS))
    return {"weight_packed": out["weight_packed"], "weight_scale": scale, "weight_shape": out["weight_shape"]}


def int4_reference(module_tensors: dict) -> torch.Tensor:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    return PackedQuantizationCompressor.decompress(dict(module_tensors), _scheme(INT4_WEIGHTS))["weight"]


def _write(folder: Path, model, select, compress, rename, qconfig: dict, dims=(2,)) -> dict:
    """Save ``model`` in bf16, compress the selected weights; returns {weight name: stored tensors}."""
    model.to(torch.bfloat16).save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    out, done = {}, {}
    for name, w in tensors.items():
        if select.search(name) and w.dim() in dims:
            module = name[: -len(".weight")]
            parts = rename(compress(w))
            done[name] = parts
            out.update({f"{module}.{k}": v for k, v in parts.items()})
        else:
            out[name] = w
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((Path(folder) / "config.json").read_text())
    config["quantization_config"] = qconfig
    (Path(folder) / "config.json").write_text(json.dumps(config, indent=2))
    return done


def _as_modelopt(parts: dict) -> dict:
    return {"weight": parts["weight_packed"], "weight_scale": parts["weight_scale"],
            "weight_scale_2": (1.0 / parts["weight_global_scale"]).reshape(()),
            "input_scale": torch.tensor(0.02, dtype=torch.float32)}


def make_nvfp4_base(folder: Path, model, modelopt: bool = True) -> dict:
    """A ModelOpt NVFP4 release (or compressed-tensors nvfp4-pack-quantized) of ``model``'s decoder Linear weights."""
    if modelopt:
        return _write(folder, model, LINEAR, nvfp4_compress, _as_modelopt, MODELOPT_CONFIG)
    qconfig = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
               "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_WEIGHTS,
                                                                    "format": "nvfp4-pack-quantized"}}}
    return _write(folder, model, LINEAR, nvfp4_compress, lambda p: p, qconfig)


def make_int4_experts_base(folder: Path, model) -> dict:
    """Kimi-K2's layout: routed experts INT4 pack-quantized (group 32), everything else bf16."""
    qconfig = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
               "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": INT4_WEIGHTS, "format": "pack-quantized"}}}
    return _write(folder, model, EXPERTS, int4_compress, lambda p: p, qconfig)


def write_reference(base: Path, ref: Path, dequantized: dict) -> None:
    """``ref``: the base with every quantized weight replaced by its reference dequantized value, no
    quantization_config (what transformers and peft load as the dequantized base)."""
    ref.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    out = {k: v for k, v in tensors.items() if k.rpartition(".")[0] + ".weight" not in dequantized}
    out.update(dequantized)
    save_file(out, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config.pop("quantization_config")
    (ref / "config.json").write_text(json.dumps(config, indent=2))


EXPERTS_3D = re.compile(r"\.block_sparse_moe\.(input|output)_linear\.weight$")


def nvfp4_compress_experts(w: torch.Tensor, modelopt: bool) -> dict:
    """Experts stacked in one tensor ([experts, rows, cols], GraniteMoE's ``input_linear`` / ``output_linear``,
    what transformers 5 fuses experts into) compressed expert by expert by compressed-tensors and stacked:
    values [experts, rows, cols/2], block scales [experts, rows, cols/16], one global scale per expert
    (ModelOpt: ``weight_scale_2`` [experts], as its QuantMoELinear export stacks them; compressed-tensors
    [experts, 1])."""
    parts = [nvfp4_compress(w[e]) for e in range(w.shape[0])]
    stacked = {k: torch.stack([p[k] for p in parts]) for k in parts[0]}
    if not modelopt:
        return stacked
    return {"weight": stacked["weight_packed"], "weight_scale": stacked["weight_scale"],
            "weight_scale_2": (1.0 / stacked["weight_global_scale"]).reshape(-1),
            "input_scale": torch.full((w.shape[0],), 0.02, dtype=torch.float32)}


def nvfp4_reference_experts(module_tensors: dict, modelopt: bool) -> torch.Tensor:
    """compressed-tensors' dequantized experts: its decompressor (ModelOpt's through its converter) on each
    expert's slice, with that expert's global scale stored as one expert's would be (a scalar for ModelOpt, [1]
    for compressed-tensors)."""
    values = module_tensors["weight" if modelopt else "weight_packed"]
    out = []
    for e in range(values.shape[0]):
        if modelopt:
            one = {"weight": values[e], "weight_scale": module_tensors["weight_scale"][e],
                   "weight_scale_2": module_tensors["weight_scale_2"][e].reshape(())}
        else:
            one = {"weight_packed": values[e], "weight_scale": module_tensors["weight_scale"][e],
                   "weight_global_scale": module_tensors["weight_global_scale"][e].reshape(1)}
        out.append(nvfp4_reference(one, modelopt))
    return torch.stack(out)


def make_nvfp4_experts_base(folder: Path, model, modelopt: bool = True) -> dict:
    """A GraniteMoE in NVFP4: attention Linear weights 2-D, the experts 3-D ([experts, rows, cols/2])."""
    def compress(w):
        return nvfp4_compress_experts(w, modelopt) if w.dim() == 3 else nvfp4_compress(w)

    def rename(parts):
        if not modelopt or "weight" in parts:
            return parts
        return _as_modelopt(parts)

    select = re.compile(LINEAR.pattern + "|" + EXPERTS_3D.pattern)
    if modelopt:
        return _write(folder, model, select, compress, rename, MODELOPT_CONFIG, dims=(2, 3))
    qconfig = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
               "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": NVFP4_WEIGHTS,
                                                                    "format": "nvfp4-pack-quantized"}}}
    return _write(folder, model, select, compress, rename, qconfig, dims=(2, 3))
