"""Checks every base read dequantized shares (``dequant.DequantSource``, ``dequant_packed.PackedSource``):
no tensor of a format the quantization_config does not declare passes through, and packed values give the
shapes the model the config describes has (asked of transformers' meta model). No torch at import time.
"""

from __future__ import annotations

from tui_merger.core.errors import MergeError


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# dtypes that hold quantized values or scales, never a weight as it is; and the names quantizers give scales
_QUANT_DTYPES = ("int8", "uint8", "int32", "int4", "uint4", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
                 "float4_e2m1fn_x2")
_QUANT_LEAVES = ("weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2", "weight_global_scale",
                 "weight_zero_point", "weight_shape", "qweight", "qzeros", "g_idx")


def unknown_tensors(tensors: dict, source, label: str) -> None:
    """A base read dequantized must not pass a tensor through that holds quantized values of no format it
    reads (a mixed checkpoint): the first one is named in one sentence."""
    for name, ref in tensors.items():
        if ref.source is source:  # dequantized here
            continue
        leaf = name.rpartition(".")[2]
        if leaf in _QUANT_LEAVES or (ref.dtype in _QUANT_DTYPES and (leaf == "weight" or name.endswith(("_blocks", "_scales")))):
            raise MergeError(
                f"{name} ({ref.dtype} {_shape_text(ref.shape)}) is of no format the base's quantization_config "
                f"declares ({label}): expected 16-bit floats or a quantized weight with its scales, so its values "
                "cannot be told. Nothing was written."
            )


def saved_shapes(config: dict) -> dict:
    """{tensor name as ``save_pretrained`` writes it: shape} of the model transformers builds for ``config``
    on the meta device (experts it fuses in memory under their per-expert disk names); {} when it cannot
    build one here."""
    from tui_merger.core.formats.hf_names import meta_of_config

    model = meta_of_config(config)
    if model is None:
        return {}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        out = {}
        for name, tensor in model.state_dict().items():
            for disk, t in revert_weight_conversion(model, {name: tensor}).items():
                out[disk] = tuple(t.shape)
        return out
    except Exception:  # noqa: BLE001 - rules this model cannot take: nothing to compare with
        return {}


def check_against_config(source, config: dict, stored: dict) -> None:
    """Each dequantized weight's shape (from the packed values and their scales) against the model the config
    describes, where transformers names the same tensor: packed values that do not fit are said, naming the
    stored tensor (``stored``: {dequantized name: stored ref})."""
    if not stored:
        return
    expected = saved_shapes({k: v for k, v in config.items() if k != "quantization_config"})
    for name, ref in stored.items():
        want, got = expected.get(name), tuple(source.tensors[name].shape)
        if want is not None and tuple(want) != got:
            raise MergeError(
                f"{ref.name} is {ref.dtype} {_shape_text(ref.shape)}, the packed values of a {_shape_text(got)} weight, "
                f"but the model config.json describes has {name} of shape {_shape_text(want)}; the packed values do "
                "not fit the config. Nothing was written."
            )
