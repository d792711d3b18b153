"""GGUF export (``tui-merger gguf``, core/ship/gguf.py): tiny random models of each family exported and
read back with transformers' own GGUF loader (``from_pretrained(..., gguf_file=...)``): the weights equal
the folder's (bf16), the logits within the type's rounding (f16, q8_0 against gguf's own quantization
round trip), the tokenizer read from the GGUF gives the folder tokenizer's ids; the metadata llama.cpp
reads; bad input is one sentence with nothing written; cancel; the manifest and the upload; the CLI;
the assistant's Finish step."""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path

import pytest
import torch

from factory import refused_by_cli
from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import CancelToken, TensorProgress
from tui_merger.core.ship.gguf import _LLAMA3_SPLIT, _O200K_SPLIT, _QWEN2_SPLIT, export_gguf, plan_gguf

SAMPLES = [
    "Hello, world! The merge is done.",
    "Numbers: 3.14159, 2026-12-01, 1234567890 and 42.",
    "中文文本：模型合并完成了。",
    "emoji 🤖🚀 and accents: café, naïve",
    "  leading spaces\nand\ttabs\n\n",
]
TRAINING_TEXT = SAMPLES * 3 + ["the quick brown fox jumps over the lazy dog " * 4, "模型 合并 测试 " * 5, "0123456789 " * 5]
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0)
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}"
)


def byte_level_tokenizer(style: str):
    """A real byte-level BPE trained on the samples, shaped like Qwen2's (NFC, Qwen2's split regex),
    GPT-OSS's (o200k's split regex) or Llama 3's (its split regex, <|begin_of_text|> added in front),
    with special and added tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
    split = {"llama3": _LLAMA3_SPLIT, "o200k": _O200K_SPLIT}.get(style, _QWEN2_SPLIT)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    if style == "qwen":
        tok.normalizer = normalizers.NFC()
    if style in ("qwen", "o200k"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    if style in ("qwen", "o200k"):
        tok.add_tokens(["<think>", "</think>"])  # added, not special (as Qwen3 has them)
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                       chat_template=QWEN_TEMPLATE)
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))],
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   chat_template=LLAMA3_TEMPLATE)


def config_of(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = dict(SMALL, vocab_size=448)
    if family == "qwen3":
        kw.update(head_dim=128)  # transformers' GGUF reader takes Qwen3's head_dim from the class default
    if family == "qwen3_moe":  # and Qwen3-MoE's expert width
        kw.update(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True)
    if family == "llama":
        kw.update(bos_token_id=None, eos_token_id=None)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[family]
    return cls(**{**kw, **overrides})


def make_model(path: Path, family: str, dtype=torch.float32, seed=0, tokenizer=True, **overrides) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = config_of(family, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norms and biases too, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.to(dtype).save_pretrained(path)
    if tokenizer:
        byte_level_tokenizer("llama3" if family == "llama" else "qwen").save_pretrained(path)
    return path


def load_gguf(gguf: Path):
    """The model as transformers builds it from the GGUF alone (config and weights from the file; the
    GGUF is in a folder of its own, as when it is shared without the Hugging Face files)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(alone(gguf), gguf_file=gguf.name, dtype=torch.float32).eval()


def alone(gguf: Path) -> Path:
    others = {p.name for p in gguf.parent.iterdir()} - {gguf.name}
    # the Ollama Modelfile written beside it is nothing transformers reads; any other file could be
    assert all(name.endswith(".Modelfile") for name in others), f"the GGUF must lie in a folder of its own: {others}"
    return gguf.parent


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def probe(vocab=420, seed=3):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return {
        "llama": make_model(root / "llama-tiny", "llama", torch.bfloat16),
        "qwen2": make_model(root / "qwen2-tiny", "qwen2", torch.bfloat16),
        "qwen3": make_model(root / "qwen3-tiny", "qwen3", torch.bfloat16, tie_word_embeddings=True),
        "qwen3_moe": make_model(root / "qwen3-moe-tiny", "qwen3_moe", torch.bfloat16),
        "llama-f32": make_model(root / "llama-f32", "llama", seed=1),
        "qwen2-f32": make_model(root / "qwen2-f32", "qwen2", seed=1),
    }


@pytest.fixture(scope="module")
def exported(models, tmp_path_factory):
    """Each bf16 model as a BF16 GGUF (outside its folder, which stays untouched)."""
    root = tmp_path_factory.mktemp("exported")
    return {f: export_gguf(models[f], "bf16", mkdir(root / f) / f"{f}.gguf").path for f in ("llama", "qwen2", "qwen3", "qwen3_moe")}


def mkdir(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def q8_0_round_trip(w: torch.Tensor) -> torch.Tensor:
    """ggml's Q8_0, written here in torch from its definition (blocks of 32 along a row; d = max|x| / 127
    stored as float16; q = x * (1/d) rounded half away from zero), then dequantized: what a Q8_0 weight
    holds."""
    x = w.float().reshape(-1, 32)
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    v = (x * inv).abs()
    q = torch.sign(x) * (torch.floor(v) + torch.floor(2 * (v - torch.floor(v))))
    return (q * d.half().float()).reshape(w.shape)


def gguf_fields(path: Path) -> dict:
    """The file's metadata as llama.cpp's own reader (gguf.GGUFReader) parses it."""
    from gguf import GGUFReader

    return {name: field.contents() for name, field in GGUFReader(path).fields.items()}


def files_in(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_bf16_export_reads_back_with_every_weight_equal(models, exported, family):
    """bf16 weights into a BF16 GGUF: transformers' loader (which undoes Llama's q/k permutation and
    unstacks the experts) gives back every weight bit for bit, hence the same logits."""
    folder = models[family]
    ours, theirs = load_hf(folder), load_gguf(exported[family])
    want, got = ours.state_dict(), theirs.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = probe()
    assert torch.equal(logits(theirs, ids), logits(ours, ids))


@pytest.mark.parametrize("family", ["llama-f32", "qwen2-f32"])
def test_f16_and_q8_0_hold_the_weights_rounded_once_and_the_logits_follow(models, family, tmp_path):
    """float32 weights: F16 holds each one rounded to float16 and Q8_0 what ggml's quantization gives
    (1-D tensors stay float32); the logits stay within the limit of one rounding per tensor."""
    folder = models[family]
    ours = load_hf(folder)
    want = ours.state_dict()
    ids = probe()
    reference = logits(ours, ids)
    matrices = [n for n, w in want.items() if w.ndim == 2]
    for type_, unit, rounded in (("f16", 2.0**-11, lambda w: w.half().float()), ("q8_0", 1 / 254, q8_0_round_trip)):
        path = export_gguf(folder, type_, mkdir(tmp_path / type_) / "m.gguf").path
        theirs = load_gguf(path)
        got = theirs.state_dict()
        for name, w in want.items():
            assert torch.equal(got[name], rounded(w) if w.ndim == 2 else w), (type_, name)
        out = logits(theirs, ids)
        rel = ((out - reference).abs().max() / reference.abs().max()).item()
        assert 0 < rel < 8 * unit * math.sqrt(len(matrices)), (type_, rel)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_the_tokenizer_read_from_the_gguf_gives_the_folders_ids(models, exported, family):
    from transformers import AutoTokenizer

    folder = models[family]
    want = AutoTokenizer.from_pretrained(folder)
    got = AutoTokenizer.from_pretrained(alone(exported[family]), gguf_file=exported[family].name)
    chat = want.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2=? 中文 🤖"}],
        tokenize=False, add_generation_prompt=True,
    )
    texts = SAMPLES + [chat, "<think>\nplan</think> done"]
    for text in texts:
        assert got.encode(text) == want.encode(text), text
        assert got.decode(want.encode(text)) == want.decode(want.encode(text)), text
    specials = [t for t in want.all_special_tokens]
    assert len(specials) >= 2 and all(got.convert_tokens_to_ids(t) == want.convert_tokens_to_ids(t) for t in specials)
    assert (got.eos_token, got.bos_token) == (want.eos_token, want.bos_token)
    assert got.chat_template == want.chat_template


def test_the_metadata_is_what_llama_cpp_reads(models, exported):
    import gguf

    qwen = gguf_fields(exported["qwen2"])
    assert qwen["general.architecture"] == "qwen2" and qwen["general.name"] == "qwen2-tiny"
    assert qwen["general.file_type"] == gguf.LlamaFileType.MOSTLY_BF16
    for key, value in {"context_length": 256, "embedding_length": 64, "block_count": 2, "feed_forward_length": 128,
                       "attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 50000.0}.items():
        assert qwen[f"qwen2.{key}"] == value, key
    assert qwen["qwen2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert qwen["tokenizer.ggml.model"] == "gpt2" and qwen["tokenizer.ggml.pre"] == "qwen2"
    tokens = qwen["tokenizer.ggml.tokens"]
    assert len(tokens) == 448 and tokens[-1] == "[PAD447]"  # the embedding's padding rows
    types = dict(zip(tokens, qwen["tokenizer.ggml.token_type"]))
    assert types["<|im_end|>"] == gguf.TokenType.CONTROL and types["<think>"] == gguf.TokenType.USER_DEFINED
    assert types["[PAD447]"] == gguf.TokenType.UNUSED and types["Ġthe"] == gguf.TokenType.NORMAL
    assert tokens[qwen["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert qwen["tokenizer.chat_template"] == QWEN_TEMPLATE
    assert len(qwen["tokenizer.ggml.merges"]) > 100

    llama = gguf_fields(exported["llama"])
    assert llama["tokenizer.ggml.pre"] == "llama-bpe" and llama["llama.rope.dimension_count"] == 16
    assert llama["tokenizer.ggml.tokens"][llama["tokenizer.ggml.bos_token_id"]] == "<|begin_of_text|>"
    assert llama["tokenizer.ggml.add_bos_token"] is True
    moe = gguf_fields(exported["qwen3_moe"])
    assert (moe["qwen3moe.expert_count"], moe["qwen3moe.expert_used_count"], moe["qwen3moe.expert_feed_forward_length"]) == (4, 2, 768)
    assert moe["qwen3moe.attention.key_length"] == 32
    reader = gguf.GGUFReader(exported["qwen3_moe"])
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}  # ggml order: innermost first
    assert shapes["blk.0.ffn_gate_exps.weight"] == (64, 768, 4) and shapes["blk.0.ffn_down_exps.weight"] == (768, 64, 4)
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(exported["qwen3"]).tensors}  # tied


def test_the_file_is_byte_for_byte_what_gguf_writers_own_tensor_writing_makes(models, tmp_path):
    """The tensor data is streamed a row block at a time at the offsets GGUFWriter declared: the file
    equals the one GGUFWriter.write_tensor_data writes from whole tensors (Llama: permuted q/k;
    Qwen3-MoE: stacked experts), and the sha256 taken on the way is the file's."""
    import hashlib

    import numpy as np

    from tui_merger.core.ship.gguf import _pieces

    for family, type_ in (("llama-f32", "q8_0"), ("qwen3_moe", "f16")):
        ours = export_gguf(models[family], type_, tmp_path / f"{family}-ours.gguf")
        theirs = tmp_path / f"{family}-writer.gguf"
        plan = plan_gguf(models[family], type_, theirs)
        writer = plan._writer
        writer.write_header_to_file(theirs)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan.tensors:
            writer.write_tensor_data(np.concatenate([p.reshape(-1).view(np.uint8) for p in _pieces(t, None, [])]))
        writer.close()
        assert theirs.read_bytes() == ours.path.read_bytes(), family
        assert ours.sha256 == hashlib.sha256(theirs.read_bytes()).hexdigest()


def test_q8_0_stores_matrices_quantized_and_norms_in_float32(models, tmp_path):
    import gguf

    path = export_gguf(models["qwen2-f32"], "q8_0", tmp_path / "q.gguf").path
    kinds = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert kinds["blk.0.attn_norm.weight"] == kinds["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32
    assert gguf_fields(path)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0


def test_the_name_comes_from_the_model_card(models, tmp_path):
    import shutil

    folder = shutil.copytree(models["qwen2"], tmp_path / "folder")
    (folder / "README.md").write_text("---\nmodel_name: Qwen2 Tiny SQL\nlicense: apache-2.0\n---\n# Card\n")
    fields = gguf_fields(export_gguf(folder, "bf16", tmp_path / "x.gguf").path)
    assert fields["general.name"] == "Qwen2 Tiny SQL" and fields["general.license"] == "apache-2.0"


def test_rope_scaling_is_written_as_llama_cpp_reads_it(tmp_path):
    """linear and YaRN as keys; llama3's divisors as the rope_freqs tensor, equal to transformers' own
    llama3 frequencies; Llama's q/k biases permuted the way transformers' reader undoes."""
    import gguf
    from transformers import LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    linear = make_model(tmp_path / "linear", "qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0})
    f = gguf_fields(export_gguf(linear, "f16", tmp_path / "linear.gguf").path)
    assert f["qwen2.rope.scaling.type"] == "linear" and f["qwen2.rope.scaling.factor"] == 2.0
    yarn = make_model(tmp_path / "yarn", "qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    f = gguf_fields(export_gguf(yarn, "f16", tmp_path / "yarn.gguf").path)
    assert (f["qwen2.rope.scaling.type"], f["qwen2.rope.scaling.factor"], f["qwen2.rope.scaling.original_context_length"]) == ("yarn", 4.0, 64)

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = make_model(tmp_path / "llama3", "llama", rope_scaling=scaling, attention_bias=True)
    path = export_gguf(folder, "f16", tmp_path / "llama3.gguf").path
    reader = gguf.GGUFReader(path)
    raw = {t.name: t.data for t in reader.tensors}
    config = LlamaConfig.from_pretrained(folder)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert torch.allclose(torch.from_numpy(raw["rope_freqs.weight"].copy()), plain / scaled, rtol=1e-6)
    assert not any(k.startswith("llama.rope.scaling") for k in gguf_fields(path))
    hf = load_hf(folder).state_dict()
    undo = LlamaTensorProcessor({"num_attention_heads": 4, "num_key_value_heads": 2})
    for gguf_name, hf_name in (("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
                               ("blk.1.attn_k.bias", "model.layers.1.self_attn.k_proj.bias"),
                               ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight")):
        back = torch.from_numpy(undo.process(raw[gguf_name].astype("float32"), gguf_name).weights.copy())
        want = hf[hf_name] if hf[hf_name].ndim == 1 else hf[hf_name].half().float()  # biases stay float32
        assert torch.equal(back.reshape(want.shape), want), gguf_name


# -- bad input, cancel ---------------------------------------------------------------------------


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def _tokenizer(folder: Path, edit) -> None:
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _extra_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.adapter_gate.weight"] = torch.zeros(4, 4)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _overflow(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = 1e6  # late in the file: found while writing
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


BAD = {
    "gpt2": ("a gpt2 model; GGUF export writes Llama, Qwen3, Qwen2, Qwen3.5, Mistral", None),
    "adapter": ("is a LoRA adapter, not a model", lambda f: [(f / "config.json").unlink(), (f / "adapter_config.json").write_text("{}")]),
    "vl": ("vision-language model", lambda f: _edit_json(f / "config.json", vision_config={"depth": 2})),
    "quantized": ("holds gptq weights", lambda f: _edit_json(f / "config.json", quantization_config={"quant_method": "gptq"})),
    "dynamic rope": ("dynamic rope scaling, which has no GGUF equivalent",
                     lambda f: _edit_json(f / "config.json", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
    "no tokenizer": ("has no tokenizer (no tokenizer.json or tokenizer.model)", lambda f: (f / "tokenizer.json").unlink()),
    # byte fallback (SentencePiece-style) with a byte-level pre-tokenizer: neither kind llama.cpp reads
    "sentencepiece": ("in a way llama.cpp's SentencePiece tokenizer does not",
                      lambda f: _tokenizer(f, lambda d: d["model"].update(byte_fallback=True))),
    "pre-tokenizer": ("pre-tokenizer llama.cpp does not know by name",
                      lambda f: _tokenizer(f, lambda d: d.update(pre_tokenizer={"type": "Whitespace"}))),
    "wordpiece": ("is a WordPiece tokenizer", lambda f: _tokenizer(f, lambda d: d["model"].update(type="WordPiece"))),
    "vocabulary": ("has token id 460, beyond the model's 448 embedding rows", lambda f: _tokenizer(
        f, lambda d: d["added_tokens"].append({"id": 460, "content": "<|tool|>", "special": True, "single_word": False,
                                               "lstrip": False, "rstrip": False, "normalized": False}))),
    "embedding rows": ("has 448 rows but config.json says vocab_size 300", lambda f: _edit_json(f / "config.json", vocab_size=300)),
    "extra tensor": ("model.layers.0.adapter_gate.weight in", _extra_tensor),
    "float16 overflow": ("beyond float16's range", _overflow),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_sentence_and_nothing_is_written(models, tmp_path, case):
    import shutil

    says, edit = BAD[case]
    if case == "gpt2":
        from factory import gpt2_config, save_base

        folder = save_base(tmp_path / "model", gpt2_config())
    else:
        folder = shutil.copytree(models["qwen2-f32"], tmp_path / "model")
        edit(folder)
    before = files_in(tmp_path)
    with pytest.raises(MergeError) as err:
        export_gguf(folder, "f16")
    message = str(err.value)
    assert says in message and "\n" not in message and message.endswith("."), message
    assert files_in(tmp_path) == before  # no GGUF, no temporary file


def test_the_target_is_checked_before_anything_is_read(models, tmp_path):
    taken = tmp_path / "taken.gguf"
    taken.write_bytes(b"mine")
    with pytest.raises(MergeError, match="exists; choose another --out, or pass --overwrite"):
        plan_gguf(models["qwen2"], "f16", taken)
    with pytest.raises(MergeError, match="does not end in .gguf"):
        plan_gguf(models["qwen2"], "f16", tmp_path / "model.bin")
    with pytest.raises(MergeError, match="does not exist; create it"):
        plan_gguf(models["qwen2"], "f16", tmp_path / "nowhere" / "m.gguf")
    with pytest.raises(MergeError, match="'q4_k' is not a GGUF type"):
        plan_gguf(models["qwen2"], "q4_k")
    assert taken.read_bytes() == b"mine"
    assert export_gguf(models["qwen2"], "f16", taken, overwrite=True).path == taken and taken.stat().st_size > 1000


def test_cancel_between_tensors_leaves_nothing(models, tmp_path):
    cancel = CancelToken()
    seen = []

    def on_event(event):
        if isinstance(event, TensorProgress):
            seen.append(event)
            if len(seen) == 3:
                cancel.cancel()

    with pytest.raises(MergeCancelled, match="GGUF export cancelled; nothing was written"):
        export_gguf(models["qwen3_moe"], "q8_0", tmp_path / "m.gguf", on_event=on_event, cancel=cancel)
    assert len(seen) == 3 and files_in(tmp_path) == set()
    # what a killed export leaves (its process gone) is removed by the next one
    (tmp_path / ".m.gguf.tmp-999999999").write_bytes(b"half")
    export_gguf(models["qwen2"], "bf16", tmp_path / "m.gguf")
    assert files_in(tmp_path) == {"m.gguf"}


# -- the manifest, the upload, the command line ------------------------------------------------------


@pytest.fixture(scope="module")
def merged(models, tmp_path_factory) -> Path:
    """A real merge into a Qwen2 base (with its tokenizer), recorded in merge_manifest.json."""
    import shutil

    from factory import save_adapter

    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.record.provenance import record_merge

    root = tmp_path_factory.mktemp("merged")
    base = shutil.copytree(models["qwen2"], root / "base")
    adapter = save_adapter(root / "adapter", base, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    options = MergeOptions(base=base, adapter=adapter, out=root / "qwen2-sql-merged")
    result = run_merge(options)
    record_merge(options, result)
    return result.out


def test_the_gguf_is_recorded_in_the_manifest_and_the_readers_still_read_it(merged, tmp_path):
    import hashlib
    import shutil

    from tui_merger.core.record.manifest import read_manifest

    folder = shutil.copytree(merged, tmp_path / "qwen2-sql-merged")
    inside = export_gguf(folder, "q8_0")
    assert inside.path == folder / "qwen2-sql-merged-Q8_0.gguf" and inside.recorded
    outside = export_gguf(folder, "bf16", tmp_path / "elsewhere.gguf")
    again = export_gguf(folder, "q8_0", overwrite=True)  # replaces its entry
    manifest = read_manifest(folder)
    assert manifest is not None and manifest["outputs"] == read_manifest(merged)["outputs"]  # the merge's own record
    entries = {e["path"]: e for e in manifest["gguf"]}
    assert set(entries) == {"qwen2-sql-merged-Q8_0.gguf", str(outside.path)}
    for result in (again, outside):
        entry = entries["qwen2-sql-merged-Q8_0.gguf" if result is again else str(result.path)]
        assert entry["sha256"] == hashlib.sha256(result.path.read_bytes()).hexdigest() == result.sha256
        assert (entry["size"], entry["type"], entry["architecture"]) == (result.path.stat().st_size, result.type, "qwen2")
    assert gguf_fields(again.path)["general.name"] == "qwen2-sql-merged"


def test_upload_sends_the_gguf_inside_the_folder_and_the_one_recorded_outside(merged, tmp_path):
    import shutil
    import subprocess
    import sys

    from hub_server import HubServer

    folder = shutil.copytree(merged, tmp_path / "model")
    inside = export_gguf(folder, "q8_0").path
    outside = export_gguf(folder, "f16", tmp_path / "shared.gguf").path
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    code = "import sys; from tui_merger.cli import main; sys.exit(main(sys.argv[1:]))"
    with HubServer() as hub:
        hub.add_token("hf_alice_write_5ecret", "alice", "write")
        env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
                   HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_alice_write_5ecret")
        run = subprocess.run([sys.executable, "-c", code, "upload", str(folder), "--repo-id", "alice/m"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        stored = hub.repos["alice/m"].files()
    assert stored[inside.name] == inside.read_bytes() and stored["shared.gguf"] == outside.read_bytes()
    assert f"Uploading the GGUF {outside} (recorded in merge_manifest.json) as shared.gguf" in run.stderr


def test_cli_writes_the_gguf_and_says_where(merged, tmp_path, capsys):
    import shutil

    from tui_merger.cli import main

    folder = shutil.copytree(merged, tmp_path / "model")
    assert main(["gguf", str(folder), "--type", "q8_0", "--plain"]) == 0
    out, err = capsys.readouterr()
    path = folder / "model-Q8_0.gguf"
    assert out.splitlines()[0] == f"GGUF written to {path}" and "qwen2, Q8_0" in out and "recorded in" in out
    assert "[gguf] Writing model-Q8_0.gguf: qwen2, Q8_0" in err and "100.0%" in err
    assert path.is_file()
    refused_by_cli(capsys, tmp_path, ["gguf", str(folder), "--type", "q8_0"], needles=["exists; choose another --out"])
    refused_by_cli(capsys, tmp_path, ["gguf", str(tmp_path / "missing")], needles=["does not exist"])


def test_one_default_type_in_the_command_and_the_docs():
    """Issue 38 item 13: the command's --type default is the one docs/command-line.md names and explains."""
    from tui_merger.cli import build_parser
    from tui_merger.core.ship.gguf import DEFAULT_TYPE

    gguf = build_parser()._subparsers._group_actions[0].choices["gguf"]  # noqa: SLF001
    assert gguf.get_default("gguf_type") == DEFAULT_TYPE == "f16"
    page = (Path(__file__).resolve().parents[1] / "docs" / "command-line.md").read_text()
    assert f"tui-merger gguf merged                          # merged/<name>-{DEFAULT_TYPE.upper()}.gguf" in page
    assert f"<name>-BF16.gguf" not in page and "The default, f16," in page


def test_cli_help_lists_the_command_fast():
    import subprocess
    import sys
    import time

    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "tui_merger", "gguf", "--help"], capture_output=True, text=True, check=True)
    assert "--type {f16,bf16,q8_0,q4_k_m,q5_k_m,q6_k,q4_k_s,q5_k_s,q3_k_m}" in run.stdout and time.perf_counter() - started < 5
    code = "import sys, tui_merger.cli.gguf, tui_merger.core.ship.gguf; print(sorted(m for m in sys.modules if m.split('.')[0] in ('gguf', 'numpy', 'torch')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"


# -- the assistant's Finish step -------------------------------------------------------------------------


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_finish_makes_a_gguf_with_progress_and_stop(tmp_path, monkeypatch):
    """After a verified merge in the assistant: Run it locally... asks type and file; Stop (the engine thread
    held at its first tensor until the test has pressed it) leaves nothing; made again, the notes say where."""
    from rich.text import Text
    from textual.widgets import Button, Input, ProgressBar, Select, Static

    from tui_merger.demo import build_demo
    from tui_merger.tui.app import MergeApp
    from tui_merger.core.record.manifest import read_manifest

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    build_demo(tmp_path / "ws")
    reached, release = threading.Event(), threading.Event()

    def hook(event):
        if isinstance(event, TensorProgress) and app.wizard.running == "gguf" and not reached.is_set():
            reached.set()
            release.wait(30)

    async def until(condition, what, tries=1200):
        for _ in range(tries):
            if condition():
                return
            await pilot.pause(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def notes() -> str:
        return str(app.screen.query_one("#finish-notes", Static).content)

    app = MergeApp(tmp_path / "ws", engine_hook=hook)
    out = tmp_path / "merged"
    async with app.run_test(size=(100, 30)) as pilot:
        wizard = app.wizard
        await until(lambda: wizard.candidate is not None, "a candidate")
        await pilot.press("ctrl+n")
        await until(lambda: wizard.plan is not None and wizard.running is None, "the plan")
        app.screen.query_one("#out", Input).value = str(out)
        app.screen.query_one("#out", Input).focus()
        await pilot.press("enter")
        await until(lambda: wizard.running is None and not wizard.plan_stale, "the new plan")
        await pilot.press("ctrl+n")
        await until(lambda: wizard.step == "verify" and wizard.running is None, "merge and verification")
        await pilot.press("ctrl+n", "ctrl+n")  # Try it (skipped), Finish
        assert wizard.step == "finish" and not app.screen.query_one("#gguf", Button).disabled

        await pilot.click("#gguf")
        await pilot.pause()
        assert type(app.screen).__name__ == "GgufDialog"
        # issue 40: "Run it locally" preselects Q4_K_M (the command's default stays f16) and shows size and time first
        assert app.screen.query_one("#gguf-type", Select).value == "q4_k_m"
        assert app.screen.query_one("#gguf-out", Input).value == str(out / "merged-Q4_K_M.gguf")
        estimate = str(app.screen.query_one("#gguf-estimate", Static).content)
        assert estimate.startswith("About ") and " to write (at the speed measured on a 2-core machine), then checked against the model" in estimate
        # issue 38 item 14: a path longer than the field shows its end (the file's name), not its start
        field = app.screen.query_one("#gguf-out", Input)
        assert len(field.value) > field.content_region.width and field.scroll_offset.x > 0
        app.screen.query_one("#gguf-type", Select).value = "q8_0"
        await pilot.pause()
        assert app.screen.query_one("#gguf-out", Input).value == str(out / "merged-Q8_0.gguf")  # follows the type
        await pilot.click("#make")
        await until(reached.is_set, "the GGUF to start")
        assert app.screen.query_one("#gguf-progress", ProgressBar).display
        assert str(app.screen.query_one("#gguf", Button).label) == "Stop the GGUF"
        assert app.screen.query_one("#upload", Button).disabled
        await pilot.click("#gguf")  # Stop
        release.set()
        await until(lambda: wizard.running is None, "the GGUF thread to stop")
        assert "Stopped." in notes() and "nothing was written" in notes()
        assert not [p for p in out.iterdir() if "gguf" in p.name.lower()]

        await pilot.click("#gguf")
        await pilot.pause()
        app.screen.query_one("#gguf-type", Select).value = "q8_0"
        await pilot.pause()
        await pilot.click("#make")
        await until(lambda: wizard.running is None and "GGUF written" in notes(), "the GGUF")
        assert "merged-Q8_0.gguf" in notes() and "Upload... includes it" in notes()
        # the file and the commands on lines of their own, whole (Textual folds them on screen; a newline
        # put into them was copied with them)
        lines = Text.from_markup(notes()).plain.splitlines()
        assert str(out / "merged-Q8_0.gguf") in lines
        assert any(line.startswith("Check PASSED: token ids equal on ") for line in lines), lines
        assert "Ollama Modelfile beside it: merged-Q8_0.Modelfile. Run it with:" in lines
        assert f"ollama create merged:q8_0 -f {out / 'merged-Q8_0.Modelfile'}" in lines
        assert f"llama-cli -m {out / 'merged-Q8_0.gguf'}" in lines
        assert not app.screen.query_one("#upload", Button).disabled
        assert str(app.screen.query_one("#gguf", Button).label) == "Run it locally..."
    assert [e["path"] for e in read_manifest(out)["gguf"]] == ["merged-Q8_0.gguf"]
    assert (out / "merged-Q8_0.gguf").stat().st_size > 100_000
