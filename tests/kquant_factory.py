"""Tiny models for the k-quant fixtures (tests/fixtures/gguf/, tests/test_kquants.py): made from a config
with transformers, their weights then replaced by values computed from an integer hash of the tensor
name and index (numpy integer arithmetic only), so that the same float16 weights come out on any
machine and any torch or numpy version. The fixture script gave these folders' F16 GGUF to llama.cpp's
quantizer; the tests rebuild the folders and quantize them with tui-merger.

Imported as a plain module by the tests (pytest puts tests/ on sys.path) and by
tests/fixtures/gguf/make_kquant_fixtures.py.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

# name -> (family, config overrides). Row lengths: hidden 256 (a k-quant super-block); where a
# projection's rows are 128 or 96 values long, llama.cpp falls back to Q5_0 / Q8_0 / Q5_1 / Q4_0.
MODELS = {
    # untied output (output.weight Q6_K, token_embd the mix's type); attn_output rows of 128 (fallback);
    # two layers: use_more_bits gives layer 1, not layer 0, Q6_K in attn_v and ffn_down
    "llama": ("llama", dict(hidden_size=256, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=64, num_hidden_layers=2, tie_word_embeddings=False)),
    # tied embeddings (token_embd gets the output's Q6_K); ffn_down rows of 96 (fallback)
    "qwen3": ("qwen3", dict(hidden_size=256, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=128, num_hidden_layers=2, tie_word_embeddings=True)),
    # experts stacked per layer (ffn_*_exps, 3-D), the router kept in F32, layers read from the names
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                                    num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                                    num_hidden_layers=2, tie_word_embeddings=False)),
}
VOCAB = 288


def hashed_values(name: str, n: int) -> np.ndarray:
    """n float32 values, roughly normal (a sum of four uniforms), with a heavier tail on every 61st
    value, all from a 64-bit integer hash of (name, index): the same bits on every machine."""
    mask = np.uint64(0xFFFFFFFFFFFFFFFF)
    seed = np.uint64(zlib.crc32(name.encode()))
    with np.errstate(over="ignore"):
        h = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + seed * np.uint64(0xBF58476D1CE4E5B9)
        h &= mask
        h ^= h >> np.uint64(31)
        h = (h * np.uint64(0x94D049BB133111EB)) & mask
        h ^= h >> np.uint64(29)
    parts = [((h >> np.uint64(16 * k)) & np.uint64(0xFFFF)).astype(np.float32) / np.float32(65535) for k in range(4)]
    v = (parts[0] + parts[1] + parts[2] + parts[3] - np.float32(2)) * np.float32(1.7)
    v[::61] *= np.float32(6)
    return v


def tokenizer():
    """A byte-level BPE (Qwen2's split, NFC) with a few merges: 288 ids, the model's vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tui_merger.core.ship.gguf import _QWEN2_SPLIT

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the merged model runs locally " * 8, "quantized weights, k-quants and blocks " * 8], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def make_kquant_model(path: Path, name: str) -> Path:
    """The model ``name`` of MODELS, saved in float16 with its tokenizer, weights from hashed_values."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    family, overrides = MODELS[name]
    config = AutoConfig.for_model(family, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                                  rope_theta=10000.0, bos_token_id=None, eos_token_id=None, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            v = hashed_values(pname, p.numel()).reshape(p.shape)
            if p.ndim == 1:
                v = 1 + np.float32(0.05) * v if "norm" in pname else np.float32(0.02) * v
            else:
                v = v * np.float32(0.02)
            p.copy_(torch.from_numpy(v.astype(np.float16).astype(np.float32)))
    model.to(torch.float16).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path
