"""NeMo 2: the Hugging Face config of a checkpoint, built from what its ``context/model.yaml`` records
(a helper of the verl Megatron kind's NeMo 2 layout, megatron_runs; not a kind).

NeMo 2 records no Hugging Face path, but its ``context/model.yaml`` (``io_dump``'s YAML of the model,
``nemo/lightning/io/mixin.py``) holds every field of the model's megatron-core config and the class it
was made from (``config._target_``, e.g. ``nemo.collections.llm.gpt.model.qwen2.Qwen2Config``), and
``context/nemo_tokenizer/`` is the Hugging Face tokenizer folder NeMo's ``AutoTokenizer`` loads. The
Hugging Face config is built from those fields as NeMo's own exporters build it (``HFLlamaExporter``,
``HFQwen2Exporter``, ``HFQwen3Exporter`` in ``nemo/collections/llm/gpt/model/{llama,qwen2,qwen3}.py``,
NeMo 2.7.3), through transformers' own config class for the family (``AutoConfig.for_model``), so
every other field gets transformers' default as ``save_pretrained`` would write it.

The YAML is read as data (megatron_runs.read_yaml: plain values, no tag constructed); ``io.json``
(fiddle's serialisation of Python objects) is not read, and nothing NeMo wrote runs. A field the
config needs that is missing, or a model these readers do not convert, is one sentence asking for
``--base``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError

MODEL_YAML = "model.yaml"
TOKENIZER_DIR = "nemo_tokenizer"  # nemo/lightning/io/connector.py: the HF tokenizer saved beside the context
GENERATION = ("artifacts", "generation_config.json")  # the importer's GenerationConfig, kept as an artifact
# the NeMo module of the config class -> the Hugging Face model type its exporter writes
_MODULES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_LLAMA31 = ("scale_factor", "low_freq_factor", "high_freq_factor", "old_context_len")  # Llama31Config's rope fields


@dataclass
class Nemo2Config:
    """The Hugging Face config built from a NeMo 2 checkpoint's context, and where it came from."""

    config: dict
    source: Path  # context/model.yaml
    nemo_class: str  # the config class NeMo recorded, e.g. Qwen2Config
    tokenizer: Path | None  # context/nemo_tokenizer when it holds a tokenizer
    generation: Path | None = None  # context/artifacts/generation_config.json


def _ask_base(folder: Path, why: str) -> MergeError:
    return MergeError(
        f"{folder} is a NeMo 2 checkpoint whose {why}, so its Hugging Face config cannot be built from it; pass "
        "--base with the Hugging Face model the run started from (its config.json and tokenizer are used)."
    )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _target(v) -> str:
    return str(v.get("_target_", "")) if isinstance(v, dict) else str(v or "")


def nemo2_config(folder: Path, model: dict | None) -> Nemo2Config:
    """The Hugging Face config of the NeMo 2 checkpoint ``folder`` (holding ``weights/`` and ``context/``)
    from ``model``, its context/model.yaml as megatron_runs.read_yaml reads it (None: not readable); a
    MergeError asking for --base when it cannot be built."""
    model_type, values, cls, path = _fields(folder, model)
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    hf = transformers.AutoConfig.for_model(model_type, **values)
    hf.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]]  # transformers' own name for the family
    config = hf.to_diff_dict()  # what save_pretrained writes
    tok = path.parent / TOKENIZER_DIR
    tok = tok if tok.is_dir() else None
    gen = path.parent.joinpath(*GENERATION)
    return Nemo2Config(config, path, cls, tok, gen if gen.is_file() else None)


def _fields(folder: Path, model: dict | None) -> tuple[str, dict, str, Path]:
    """(Hugging Face model type, the config's fields, NeMo's config class, model.yaml's path), checked; no
    transformers needed (inspect)."""
    context = folder / "context"
    path = context / MODEL_YAML
    if model is None:
        raise _ask_base(folder, f"context/ holds no readable {MODEL_YAML}")
    cfg = model.get("config")
    if not isinstance(cfg, dict):
        raise _ask_base(folder, f"{MODEL_YAML} records no model config")
    target = _target(cfg)
    parts = target.split(".")
    module, cls = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", target)
    model_type = _MODULES.get(module) if parts[:-2] == ["nemo", "collections", "llm", "gpt", "model"] else None
    if model_type == "llama" and cls.startswith("Llama4"):
        model_type = None
    experts = cfg.get("num_moe_experts")
    if model_type == "qwen3" and experts:
        model_type = "qwen3_moe"
    elif experts and model_type is not None:
        model_type = None  # a MoE variant NeMo's exporter for this family does not write
    if model_type is None:
        raise _ask_base(folder, f"{MODEL_YAML} records the model config {cls or 'of no class'} ({target or 'no _target_'}), "
                                "which tui-merger does not build a Hugging Face config for (it builds Llama, Qwen2, Qwen3 and "
                                "Qwen3-MoE ones)")

    def need(key, check=_is_int, what="a positive whole number"):
        v = cfg.get(key)
        if not check(v):
            raise _ask_base(folder, f"{MODEL_YAML} records no {key} ({what}) for its {cls}")
        return v

    def must(key, want, said):
        if cfg.get(key) != want:
            raise _ask_base(folder, f"{cls} in {MODEL_YAML} has {key}: {cfg.get(key)!r}, where a {said} model has {want!r}")

    layers, hidden, ffn, heads, vocab = (need(k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                           "num_attention_heads", "vocab_size"))
    eps = need("layernorm_epsilon", _is_num, "a number")
    theta = need("rotary_base", _is_num, "a number")
    tied = need("share_embeddings_and_output_weights", lambda v: isinstance(v, bool), "true or false")
    groups = cfg.get("num_query_groups") or heads
    head_dim = cfg.get("kv_channels") or hidden // heads  # megatron-core's default when unset
    if not (_is_int(groups) and _is_int(head_dim)):
        raise _ask_base(folder, f"{MODEL_YAML} records num_query_groups {groups!r} and kv_channels {head_dim!r}")
    family = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3-MoE"}[model_type]
    # what NeMo's exporters take for granted in each family, checked so that the config says what the weights are
    must("normalization", "RMSNorm", family)
    must("gated_linear_unit", True, family)
    must("position_embedding_type", "rope", family)
    must("add_bias_linear", False, family)
    must("add_qkv_bias", model_type == "qwen2", family)
    must("qk_layernorm", model_type.startswith("qwen3"), family)
    if _target(cfg.get("activation_func")) not in ("torch.nn.functional.silu", "torch.nn.functional.silu_"):
        raise _ask_base(folder, f"{cls} in {MODEL_YAML} has the activation {_target(cfg.get('activation_func')) or 'unrecorded'}, "
                                f"where a {family} model has SiLU")
    if cfg.get("rotary_percent", 1.0) != 1.0 or cfg.get("rotary_interleaved"):
        raise _ask_base(folder, f"{cls} in {MODEL_YAML} has a partial or interleaved rotary embedding, which a {family} "
                                "model has not")
    values = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=heads,
                  num_key_value_heads=groups, head_dim=head_dim, rms_norm_eps=eps, rope_theta=theta,
                  vocab_size=vocab, tie_word_embeddings=tied)
    # HFLlamaExporter: max_position_embeddings=seq_length; HFQwen2Exporter: seq_length; HFQwen3Exporter: max_position_embeddings
    positions = cfg.get("max_position_embeddings") if model_type.startswith("qwen3") else cfg.get("seq_length")
    positions = positions if _is_int(positions) else cfg.get("seq_length")
    if _is_int(positions):
        values["max_position_embeddings"] = positions
    if model_type == "llama" and all(k in cfg for k in _LLAMA31):  # HFLlamaExporter: isinstance(source, Llama31Config)
        if not all(_is_num(cfg[k]) for k in _LLAMA31):
            raise _ask_base(folder, f"{MODEL_YAML} records Llama 3.1 rope scaling fields that are not numbers")
        values["rope_scaling"] = {"rope_type": "llama3", "factor": cfg["scale_factor"],
                                  "low_freq_factor": cfg["low_freq_factor"], "high_freq_factor": cfg["high_freq_factor"],
                                  "original_max_position_embeddings": cfg["old_context_len"]}
    elif cfg.get("seq_len_interpolation_factor") or cfg.get("rope_scaling"):
        raise _ask_base(folder, f"{cls} in {MODEL_YAML} scales its rotary embedding in a way tui-merger does not carry over")
    if model_type == "qwen3_moe":  # HFQwen3Exporter: norm_topk_prob=True; every layer sparse
        if cfg.get("moe_shared_expert_intermediate_size") or cfg.get("moe_layer_freq", 1) != 1 \
                or cfg.get("moe_router_pre_softmax") or cfg.get("moe_router_score_function", "softmax") != "softmax":
            raise _ask_base(folder, f"{cls} in {MODEL_YAML} has shared experts, dense layers or a router Qwen3-MoE has not")
        values.update(num_experts=experts, num_experts_per_tok=need("moe_router_topk"),
                      moe_intermediate_size=need("moe_ffn_hidden_size"), norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])
    if model_type == "qwen2":
        values.pop("head_dim")  # Qwen2's head size is hidden_size / heads; NeMo checks the same
        if head_dim != hidden // heads:
            raise _ask_base(folder, f"{cls} in {MODEL_YAML} has kv_channels {head_dim}, where Qwen2 has hidden_size / heads")
    dtype = _target(cfg.get("params_dtype")).removeprefix("torch.") or (
        "bfloat16" if cfg.get("bf16") else "float16" if cfg.get("fp16") else None)
    if dtype in ("float32", "bfloat16", "float16"):
        values["dtype"] = dtype

    return model_type, values, cls, path


def inspect_sentence(folder: Path, model: dict | None) -> tuple[bool, str]:
    """inspect: whether the NeMo 2 checkpoint ``folder`` (its model.yaml read as ``model``) needs --base, and
    the sentence saying so or saying where its Hugging Face config comes from."""
    try:
        _, _, cls, _ = _fields(folder, model)
    except MergeError as err:
        return True, str(err)
    tok = ("its tokenizer from context/nemo_tokenizer" if (folder / "context" / TOKENIZER_DIR).is_dir()
           else "no tokenizer in its context")
    return False, f"its Hugging Face config: built from context/{MODEL_YAML} (NeMo's {cls}), {tok}."
