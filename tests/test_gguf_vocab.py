"""The tokenizer in a GGUF (core/ship/gguf_vocab.py) beyond byte-level BPE with the splits of GPT-2,
Qwen2, Llama 3 and GPT-OSS: SentencePiece BPE with byte fallback (a tokenizer.model as Llama 2, Phi-3
and Gemma ship it, and a fast-only tokenizer.json), and the byte-level pre-tokenizers of Mistral's
tekken, DeepSeek LLM / V2 (llama.cpp's deepseek-llm), DeepSeek-V3, Seed-Coder, StarCoder and GPT-2's regex
spelled out (llama.cpp's exaone4 split).

The tokenizers are made by the real tools: the SentencePiece fixtures by the ``sentencepiece`` trainer
and transformers' LlamaTokenizer / GemmaTokenizer (tests/fixtures/gguf_vocab/make_vocab_fixtures.py),
the byte-level ones by ``tokenizers``' trainer here. The reference is transformers: its tokenizer on the
folder against the tokenizer its own GGUF reader rebuilds from the file's metadata (ids equal on the
samples, the chat template and the special tokens). llama.cpp itself: benchmarks/llama_cpp_vocab_check.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_gguf import SAMPLES, TRAINING_TEXT, alone, files_in
from test_gguf_families import make_family
from tui_merger.core.errors import MergeError
from tui_merger.core.ship.gguf import export_gguf
from tui_merger.core.ship.gguf_vocab import (
    _DEEPSEEK3_SPLITS,
    _DEEPSEEK_LLM_SPLITS,
    _GPT2_SPLIT,
    _SEED_CODER_SPLIT,
    _TEKKEN_SPLIT,
    read_sentencepiece_model,
)

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_vocab"
# fixture -> (family whose GGUF transformers' reader loads, the embedding rows)
SENTENCEPIECE = {"llama2": ("llama", 448), "phi3": ("phi3", 448), "gemma": ("gemma2", 448), "fast_only": ("mistral", 520)}
# byte-level pre-tokenizers -> (their steps, llama.cpp's name)
PRE = {
    "tekken": ([("split", _TEKKEN_SPLIT)], "tekken"),
    "deepseek-v3": ([("split", s) for s in _DEEPSEEK3_SPLITS], "deepseek-v3"),
    "gpt2-split": ([("split", _GPT2_SPLIT)], "gpt-2"),
    "seed-coder": ([("split", _SEED_CODER_SPLIT)], "seed-coder"),
    "starcoder": ([("digits",)], "starcoder"),
    "deepseek-llm": ([("split", s) for s in _DEEPSEEK_LLM_SPLITS] + [("digits",)], "deepseek-llm"),  # DeepSeek-V2's
}
TEXTS = SAMPLES + ["<think> x", " lead", "a  b", "Ünïcödé ÀÉ isn't CamelCase 12345"]
CHAT = [{"role": "user", "content": "2+2=? 中文 🤖"}, {"role": "assistant", "content": "4 ok"}, {"role": "user", "content": " again"}]


def with_tokenizer(folder: Path, source: Path) -> Path:
    """The model folder with its tokenizer files replaced by those in ``source``."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tokenizer.model", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".py"):
            shutil.copy(f, folder / f.name)
    return folder


def sentencepiece_model(root: Path, fixture: str) -> Path:
    family, rows = SENTENCEPIECE[fixture]
    return with_tokenizer(make_family(root / f"tiny-{fixture}", family, vocab_size=rows), FIXTURES / fixture)


def byte_level_with(steps: list[tuple]):
    """A byte-level BPE trained by ``tokenizers`` on the samples, its text split by ``steps`` (Split
    regexes or single digits) before the byte alphabet, ChatML special tokens and template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from test_gguf import QWEN_TEMPLATE

    parts = [pre_tokenizers.Split(Regex(s[1]), behavior="isolated") if s[0] == "split" else pre_tokenizers.Digits(individual_digits=True)
             for s in steps]
    digits = steps == [("digits",)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(parts + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=digits)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer)
    tok.add_tokens(["<think>", "</think>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE)


def byte_level_model(root: Path, kind: str) -> Path:
    # a Mistral: transformers 5 loads its tokenizer.json as saved (for a qwen2 folder AutoTokenizer builds
    # Qwen2Tokenizer, which replaces the pre-tokenizer with Qwen2's own split)
    folder = make_family(root / f"tiny-{kind}", "mistral")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).unlink(missing_ok=True)
    byte_level_with(PRE[kind][0]).save_pretrained(folder)
    return folder


def fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    return {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """kind -> (folder, F16 GGUF in a folder of its own), each made once."""
    root = tmp_path_factory.mktemp("vocab")
    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            folder = sentencepiece_model(root, kind) if kind in SENTENCEPIECE else byte_level_model(root, kind)
            out = root / "gguf" / kind
            out.mkdir(parents=True)
            cache[kind] = (folder, export_gguf(folder, "f16", out / "model.gguf").path)
        return cache[kind]

    return get


def _same_ids(folder: Path, gguf_path: Path) -> None:
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(folder)
    got = AutoTokenizer.from_pretrained(alone(gguf_path), gguf_file=gguf_path.name)
    chat = want.apply_chat_template(CHAT, tokenize=False)
    # a token that drops the whitespace after it (rstrip: Phi-3's turn markers) has no GGUF key; llama.cpp
    # strips after them for a model named Phi-3, transformers' reader never (llama_cpp_vocab_check.py: 18/18)
    rstrip = [a["content"] for a in json.loads((folder / "tokenizer.json").read_text())["added_tokens"] if a.get("rstrip")]
    for text in TEXTS + [chat]:
        if any(t + c in text for t in rstrip for c in " \n"):
            continue
        ids = want.encode(text)
        assert got.encode(text) == ids, text
        assert got.decode(ids) == want.decode(ids), text
    specials = want.all_special_tokens
    assert len(specials) >= 2 and all(got.convert_tokens_to_ids(t) == want.convert_tokens_to_ids(t) for t in specials)
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    assert got.chat_template == want.chat_template


@pytest.mark.parametrize("kind", list(SENTENCEPIECE))
def test_sentencepiece_tokenizers_read_back_to_the_folders_ids(exported, kind):
    _same_ids(*exported(kind))


@pytest.mark.parametrize("kind", list(PRE))
def test_byte_level_pre_tokenizers_get_llama_cpps_name(exported, kind):
    folder, path = exported(kind)
    assert fields(path)["tokenizer.ggml.pre"] == PRE[kind][1]
    if kind == "tekken":  # the one of these transformers' reader splits by name (llama.cpp checks all: benchmarks/llama_cpp_vocab_check.py)
        _same_ids(folder, path)


def test_the_pieces_scores_and_types_are_the_tokenizer_models(exported):
    """What llama.cpp's converter writes from sentencepiece: the model's pieces with their scores, <0xNN>
    as BYTE, <unk> UNKNOWN, <s> </s> CONTROL; added tokens past them CONTROL when special, USER_DEFINED
    otherwise; [PADn] up to the embedding rows; add_space_prefix as the tokenizer prepends "▁"."""
    import gguf

    T = gguf.TokenType
    _, path = exported("phi3")
    f = fields(path)
    pieces, kind, dummy = read_sentencepiece_model(FIXTURES / "phi3" / "tokenizer.model")
    added = {a["id"]: a for a in json.loads((FIXTURES / "phi3" / "tokenizer.json").read_text())["added_tokens"]}
    assert f["tokenizer.ggml.model"] == "llama" and f["tokenizer.ggml.pre"] == "default" and kind == 2
    tokens, scores, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.scores"], f["tokenizer.ggml.token_type"]
    assert len(tokens) == len(scores) == len(types) == 448
    for i, (text, score, _) in enumerate(pieces):
        assert tokens[i] == text and scores[i] == pytest.approx(score)
    assert types[0] == T.UNKNOWN and types[1] == types[2] == T.CONTROL
    byte_ids = [i for i, (p, _, _) in enumerate(pieces) if p.startswith("<0x")]
    assert len(byte_ids) == 256 and all(types[i] == T.BYTE for i in byte_ids)
    for i in range(len(pieces), 426):
        assert tokens[i] == added[i]["content"] and types[i] == (T.CONTROL if added[i]["special"] else T.USER_DEFINED)
    assert tokens[426:] == [f"[PAD{i}]" for i in range(426, 448)] and set(types[426:]) == {T.UNUSED}
    assert f["tokenizer.ggml.add_space_prefix"] is True and dummy is True
    assert f["tokenizer.ggml.add_bos_token"] is False  # the folder adds none; llama.cpp would by default
    assert fields(exported("gemma")[1])["tokenizer.ggml.add_space_prefix"] is False
    assert fields(exported("llama2")[1])["tokenizer.ggml.add_bos_token"] is True


def test_a_fast_only_tokenizer_scores_each_token_by_the_merge_that_makes_it(exported):
    import gguf

    _, path = exported("fast_only")
    f = fields(path)
    model = json.loads((FIXTURES / "fast_only" / "tokenizer.json").read_text())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    first = {}
    for r, m in enumerate(merges):
        first.setdefault(m.replace(" ", ""), r)
    tokens, scores, types = f["tokenizer.ggml.tokens"], f["tokenizer.ggml.scores"], f["tokenizer.ggml.token_type"]
    made = [i for i, t in enumerate(tokens[:len(model["vocab"])]) if t in first]
    assert len(made) == len(first) > 100
    assert all(scores[i] == -first[tokens[i]] for i in made)
    assert sum(t == gguf.TokenType.BYTE for t in types) == 256 and types[model["vocab"]["<unk>"]] == gguf.TokenType.UNKNOWN


def _edit(folder: Path, name: str, edit) -> None:
    path = folder / name
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _truncate(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer.model").write_bytes((FIXTURES / "llama2" / "tokenizer.model").read_bytes()[:-7])


def _unigram(folder: Path) -> None:
    raw = bytearray((FIXTURES / "llama2" / "tokenizer.model").read_bytes())
    at = raw.rindex(bytes([0x18, 0x02]))  # trainer_spec.model_type = BPE (field 3, varint 2; after the pieces) -> 1, Unigram
    raw[at + 1] = 1
    (folder / "tokenizer.model").write_bytes(bytes(raw))
    (folder / "tokenizer.json").unlink()


BAD = {
    "spm and json disagree": ("give the same piece different ids", lambda f: _edit(
        f, "tokenizer.json", lambda d: d["model"]["vocab"].update({"\u2581He": 7}))),
    "truncated model": ("is not a SentencePiece model", _truncate),
    "unigram": ("is a SentencePiece Unigram model", _unigram),
    "nfkc": ("normalizes text (NFKC) in a way llama.cpp's SentencePiece tokenizer does not", lambda f: _edit(
        f, "tokenizer.json", lambda d: d.update(normalizer={"type": "NFKC"}))),
    "whitespace split": ("splits text before its byte-fallback BPE", lambda f: _edit(
        f, "tokenizer.json", lambda d: d.update(pre_tokenizer={"type": "Whitespace"}))),
    "too many tokens": ("has token id 460, beyond the model's 448 embedding rows", lambda f: _edit(
        f, "tokenizer.json", lambda d: d["added_tokens"].append({"id": 460, "content": "<|x|>", "special": True}))),
    "no tokenizer": ("has no tokenizer (no tokenizer.json or tokenizer.model)",
                     lambda f: [(f / "tokenizer.json").unlink(), (f / "tokenizer.model").unlink()]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_tokenizer_llama_cpp_would_split_differently_is_one_sentence(tmp_path, case):
    says, edit = BAD[case]
    folder = sentencepiece_model(tmp_path, "llama2")
    edit(folder)
    before = files_in(tmp_path)
    with pytest.raises(MergeError) as err:
        export_gguf(folder, "f16")
    message = str(err.value)
    assert says in message and "\n" not in message and message.endswith("."), message
    assert files_in(tmp_path) == before


def test_a_pre_tokenizer_llama_cpp_has_no_name_for_is_refused(tmp_path):
    folder = byte_level_model(tmp_path, "tekken")
    _edit(folder, "tokenizer.json", lambda d: d["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\p{L}+|\s+"))
    with pytest.raises(MergeError, match="pre-tokenizer llama.cpp does not know by name"):
        export_gguf(folder, "f16")


def test_the_tokenizer_model_reader_agrees_with_transformers_conversion():
    """Our protobuf reading of tokenizer.model against the tokenizer.json transformers converted from it."""
    for fixture in ("llama2", "phi3", "gemma"):
        pieces, kind, dummy = read_sentencepiece_model(FIXTURES / fixture / "tokenizer.model")
        vocab = json.loads((FIXTURES / fixture / "tokenizer.json").read_text())["model"]["vocab"]
        assert kind == 2 and dummy == (fixture != "gemma")
        assert {p: i for i, (p, _, _) in enumerate(pieces)} == vocab


def test_a_prefix_llama_cpp_puts_elsewhere_is_said(tmp_path):
    """Metaspace with prepend_scheme "first" (transformers 5's LlamaTokenizer, the fast-only fixture):
    llama.cpp also puts "▁" before a leading space and after special tokens (benchmarks/
    llama_cpp_vocab_check.py: 10/13 texts, the other 3 exactly those); the legacy normalizer (Phi-3's) not."""
    from tui_merger.core.ship.gguf import plan_gguf

    for fixture, said in (("llama2", True), ("fast_only", True), ("phi3", False), ("gemma", False)):
        plan = plan_gguf(sentencepiece_model(tmp_path / fixture, fixture), "f16")
        try:
            assert any('prepend_scheme "first"' in n for n in plan.notices) == said, fixture
        finally:
            plan._source.close()


def test_a_tokenizer_model_alone_gives_the_same_vocabulary(exported, tmp_path):
    """A folder with the tokenizer.model and no tokenizer.json (what llama.cpp's converter reads first)."""
    full = fields(exported("llama2")[1])
    folder = sentencepiece_model(tmp_path, "llama2")
    (folder / "tokenizer.json").unlink()
    alone_ = fields(export_gguf(folder, "f16", tmp_path / "alone.gguf").path)
    for key in ("model", "pre", "tokens", "scores", "token_type", "add_space_prefix"):
        assert alone_[f"tokenizer.ggml.{key}"] == full[f"tokenizer.ggml.{key}"], key


def test_a_metaspace_split_with_tokens_across_it_is_refused(tmp_path):
    """Metaspace with split: the folder's tokenizer never makes a token across a "▁"; llama.cpp would. The
    fast-only fixture was trained without the split (it has such tokens); Llama 2's pieces never cross one."""
    bad = sentencepiece_model(tmp_path / "bad", "fast_only")
    _edit(bad, "tokenizer.json", lambda d: d["pre_tokenizer"].update(split=True))
    with pytest.raises(MergeError, match="splits text at every \u2581 \\(Metaspace split\\) yet has tokens that run across one"):
        export_gguf(bad, "f16")
    good = sentencepiece_model(tmp_path / "good", "llama2")
    _edit(good, "tokenizer.json", lambda d: d["pre_tokenizer"].update(split=True))
    assert export_gguf(good, "f16").path.is_file()


@pytest.mark.parametrize("fixture", ["llama2", "fast_only"])
def test_the_check_splits_as_llama_cpp_where_the_tokenizer_json_differs_by_rule(fixture, tmp_path):
    """A Metaspace "first" tokenizer.json puts "▁" only at the very start; llama.cpp's SentencePiece
    tokenizer also puts one after every special token and before a leading space. The GGUF check compares
    llama.cpp's ids with the folder tokenizer's ids made fragment by fragment as llama.cpp does: those equal
    the ids llama.cpp itself gave (recorded by make_llama_cpp_ids.py), where transformers' own differ."""
    import torch
    from transformers import AutoTokenizer

    from tui_merger.core.ship.gguf_check import PASSED, FAILED, _as_llama_cpp_splits, _Read, _Reference, _verdict
    from tui_merger.core.ship.gguf_vocab import spaces_at_start_only

    recorded = json.loads((FIXTURES / "llama_cpp_ids.json").read_text())[fixture]
    folder = sentencepiece_model(tmp_path, fixture)
    assert spaces_at_start_only(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ours = [_as_llama_cpp_splits(tok, r["text"], with_bos=r["bos"]) for r in recorded]
    theirs = [list(tok(r["text"], add_special_tokens=r["bos"])["input_ids"]) for r in recorded]
    assert ours == [r["ids"] for r in recorded]
    assert sum(a != b for a, b in zip(theirs, ours)) == 2  # the leading spaces and the chat
    logits = torch.zeros(3, 8)
    ref = _Reference([r["text"] for r in recorded], theirs, [r["bos"] for r in recorded], [1, 2, 3], logits, True, ours)
    check = _verdict(ref, _Read([r["ids"] for r in recorded], logits), 0.01, "f16", "llama.cpp", expected=ref.llama_ids)
    assert check.status == PASSED and "transformers' own ids differ on 2 of them" in check.summary
    wrong = [r["ids"] for r in recorded]
    wrong[0] = wrong[0][:-1]
    assert _verdict(ref, _Read(wrong, logits), 0.01, "f16", "llama.cpp", expected=ref.llama_ids).status == FAILED
    for other in ("phi3", "gemma"):
        assert not spaces_at_start_only(sentencepiece_model(tmp_path / other, other))


def test_deepseek_v2s_pre_tokenizer_is_llama_cpps_deepseek_llm_with_its_ids(tmp_path):
    """DeepSeek LLM / V2 / Coder-V2 split text with five regexes and single digits before the byte alphabet;
    llama.cpp calls that split deepseek-llm. On a tokenizer of that shape (deepseek_llm/, trained by
    ``tokenizers``), the GGUF names it so, and transformers' ids on the texts equal the ids llama.cpp gave
    for a GGUF of it (recorded by make_llama_cpp_ids.py with llama-cpp-python 0.3.36)."""
    from transformers import AutoTokenizer

    recorded = json.loads((FIXTURES / "llama_cpp_ids.json").read_text())["deepseek_llm"]
    folder = with_tokenizer(make_family(tmp_path / "m", "mistral"), FIXTURES / "deepseek_llm")
    path = export_gguf(folder, "f16", tmp_path / "m.gguf").path
    assert fields(path)["tokenizer.ggml.pre"] == "deepseek-llm"
    tok = AutoTokenizer.from_pretrained(folder)
    assert [r["text"] for r in recorded] == TEXTS + [tok.apply_chat_template(CHAT, tokenize=False)]
    assert [tok.encode(r["text"]) for r in recorded] == [r["ids"] for r in recorded]
    digits = tok.encode("1234567890")  # the step that tells it from llama.cpp's other DeepSeek splits: one id a digit
    assert len(digits) == 10


def test_the_modelfile_reads_add_bos_as_ggufs_own_reader_does(exported):
    """The Modelfile's template choice needs tokenizer.ggml.add_bos_token; it is read by walking the
    header's keys (gguf's GGUFReader parses every array first: seconds and hundreds of MB at 150k tokens).
    Both give the same flag, true (SentencePiece, tekken) and false (other byte-level files)."""
    import gguf

    from tui_merger.core.ship.modelfile import _gguf_adds_bos

    seen = set()
    for kind in ("llama2", "gemma", "tekken", "deepseek-v3"):
        _, path = exported(kind)
        field = gguf.GGUFReader(path).fields.get("tokenizer.ggml.add_bos_token")
        want = bool(field is not None and field.parts[field.data[0]][0])
        assert _gguf_adds_bos(path) == want, kind
        seen.add(want)
    assert seen == {True, False}
