"""The tokenizer of a GGUF (``tokenizer.ggml.*``), written from a model folder's tokenizer files the way
llama.cpp's ``convert_hf_to_gguf.py`` writes it, so that llama.cpp splits text into the ids the folder's
tokenizer gives.

Two kinds, told apart by how the tokenizer behaves, never by the model's name:

- **byte-level BPE** (GPT-2, Qwen2, Llama 3, GPT-OSS, Mistral's tekken, DeepSeek LLM / V2 / V3): llama.cpp's
  ``"gpt2"`` model, the merges, and ``tokenizer.ggml.pre``, llama.cpp's name for how the text is split
  before BPE. llama.cpp recognises a pre-tokenizer by hashing the ids of a fixed text; here the
  tokenizer.json's own pre-tokenizer steps (the split regexes llama.cpp transcribed) name it.
- **SentencePiece BPE with byte fallback** (Llama 2, Mistral v0.1-0.3, Gemma 1-3, Phi-3): llama.cpp's
  ``"llama"`` model: every piece with its score and type (``<0xNN>`` as BYTE), ``add_space_prefix`` from
  how the tokenizer adds its leading "▁". Pieces, scores and types come from ``tokenizer.model`` (read
  here: it is a small protobuf, parsed without the ``sentencepiece`` package); a folder with only a
  fast ``tokenizer.json`` gets each token's score from the merge that makes it (llama.cpp merges the
  adjacent pair whose joined token scores highest, which is the merges' order), where llama.cpp's
  converter writes -1000 for every token and so merges left to right.

Added tokens are CONTROL when special, USER_DEFINED otherwise (matched whole in the text); ids the
embedding has and the tokenizer never produces are ``[PADn]``, UNUSED; the special token ids,
add_bos/add_eos and the chat template come from gguf's ``SpecialVocab``. Anything else is one sentence.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

from tui_merger.core.errors import MergeError

# -- byte-level BPE: the pre-tokenizers llama.cpp knows by name ---------------------------------------

# The split regexes as a Hugging Face tokenizer.json spells them (llama.cpp's llama-vocab.cpp keeps each
# "original regex from tokenizer.json" beside its own transcription).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K_SPLIT = (  # GPT-OSS (o200k_harmony), what llama.cpp calls gpt-4o
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral's tekken (Nemo, Small 3, Ministral): o200k's without the contractions, single digits
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER_SPLIT = (  # ByteDance Seed-Coder / Seed-OSS: single digits, no newline inside punctuation runs
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (  # DeepSeek-V3 / R1: digits in threes, CJK runs, then the words
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek LLM / V2's letters: the cased letters of these scripts (code points; several of them, such as the
# Kelvin and Ohm signs and Greek's oxia forms, change under Unicode normalization, so they are not spelled here)
_DEEPSEEK_LETTERS = "".join(chr(int(lo, 16)) + (f"-{chr(int(hi, 16))}" if hi else "") for lo, _, hi in (part.partition("-") for part in (
    "41-5A 61-7A B5 C0-D6 D8-F6 F8-1BA 1BC-1BF 1C4-293 295-2AF 370-373 376 377 37B-37D 37F 386 388-38A 38C 38E-3A1 "
    "3A3-3F5 3F7-481 48A-52F 531-556 10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A "
    "1E00-1F15 1F18-1F1D 1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 "
    "1FC6-1FCC 1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128 "
    "212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183 2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2 2CF3 A640-A66D "
    "A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A 10400-1044F 104B0-104D3 "
    "104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943").split()))
_DEEPSEEK_LLM_SPLITS = (  # DeepSeek LLM, DeepSeek-V2 and DeepSeek-Coder-V2 (then single digits): line breaks, a space
    # and letters, a space and ASCII / full-width punctuation, trailing spaces, CJK and Hangul runs
    r"[\r\n]",
    r"\s?[" + _DEEPSEEK_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
)
_BYTES = ("bytes",)  # the byte-level alphabet, without a regex of its own
_BYTES_GPT2 = ("bytes", "gpt-2 regex")  # GPT-2's ByteLevel with its built-in regex

# pre-tokenizer steps -> llama.cpp's name (tokenizer.ggml.pre); llama.cpp splits with the same regexes
PRE_TOKENIZERS: dict[tuple, str] = {
    (_BYTES_GPT2,): "gpt-2",
    (("split", _GPT2_SPLIT), _BYTES): "gpt-2",  # GPT-2's regex spelled out (llama.cpp's exaone4 splits with it too)
    (("split", _QWEN2_SPLIT), _BYTES): "qwen2",
    (("split", _LLAMA3_SPLIT), _BYTES): "llama-bpe",
    (("split", _O200K_SPLIT), _BYTES): "gpt-4o",
    (("split", _TEKKEN_SPLIT), _BYTES): "tekken",
    (("split", _SEED_CODER_SPLIT), _BYTES): "seed-coder",
    (*(("split", s) for s in _DEEPSEEK3_SPLITS), _BYTES): "deepseek-v3",
    (("digits",), _BYTES_GPT2): "starcoder",  # single digits, then GPT-2's (StarCoder 2, Granite, Command-R)
    (*(("split", s) for s in _DEEPSEEK_LLM_SPLITS), ("digits",), _BYTES): "deepseek-llm",
}


_ADDS_BOS = {"tekken"}  # pre-tokenizer names llama.cpp turns add_bos on for (llama-vocab.cpp)


def add_tokenizer(writer, folder: Path, n_vocab: int, notices: list | None = None) -> int:
    """Write tokenizer.ggml.* for the folder's tokenizer into ``writer``; returns the vocabulary size.
    What llama.cpp will split differently from the folder's tokenizer, in a way a GGUF cannot say, is
    appended to ``notices``."""
    notices = notices if notices is not None else []
    path, spm_model = folder / "tokenizer.json", folder / "tokenizer.model"
    if not path.is_file():
        if spm_model.is_file():
            return _sentencepiece(writer, folder, n_vocab, None, spm_model, notices)
        raise MergeError(
            f"{folder} has no tokenizer (no tokenizer.json or tokenizer.model); a GGUF carries the tokenizer, "
            "so copy the tokenizer files of the original model into the folder."
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data["model"]
        if not isinstance(model, dict):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise MergeError(f"{path} is not a valid tokenizer.json; copy it again from the original model.") from None
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        return _sentencepiece(writer, folder, n_vocab, data, spm_model if spm_model.is_file() else None, notices)
    return _byte_level(writer, folder, n_vocab, path, data)


def spaces_at_start_only(folder: Path) -> bool:
    """Whether the folder's tokenizer is a SentencePiece-style BPE (byte fallback) whose tokenizer.json puts
    "▁" only in front of the whole text (Metaspace, prepend_scheme "first"), where llama.cpp puts it in
    front of every text fragment after a special token too (the notice of the export)."""
    data = _json_or_none(Path(folder) / "tokenizer.json")
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        return False
    model, pre = data["model"], data.get("pre_tokenizer")
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        return False
    if not (isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first"):
        return False
    try:
        return _space_prefix(Path(folder) / "tokenizer.json", data)
    except MergeError:
        return False


# -- byte-level BPE ----------------------------------------------------------------------------------


def _byte_level(writer, folder: Path, n_vocab: int, path: Path, data: dict) -> int:
    import gguf

    pre = _pre_tokenizer(path, data)
    vocab = data["model"].get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise MergeError(f"{path} has no token vocabulary; copy it again from the original model.")
    by_id: dict[int, str] = {i: tok for tok, i in vocab.items()}
    types: dict[int, int] = {}
    for i, text, special in _added_tokens(path, data):
        by_id[i] = text
        types[i] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    _fits(folder, by_id, n_vocab)
    tokens, kinds = [], []
    for i in range(n_vocab):
        if i in by_id:
            tokens.append(by_id[i])
            kinds.append(int(types.get(i, gguf.TokenType.NORMAL)))
        else:  # ids the embedding has and the tokenizer never produces (vocabularies padded to a multiple)
            tokens.append(f"[PAD{i}]")
            kinds.append(int(gguf.TokenType.UNUSED))
    special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab)
    if not special.merges:
        raise MergeError(f"{path} has no BPE merges; a byte-level BPE tokenizer needs them.")
    if pre in _ADDS_BOS:  # llama.cpp adds a BOS for this name unless the file says otherwise
        special.add_special_token.setdefault("bos", False)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    special.add_to_gguf(writer, quiet=True)
    return n_vocab


def _pre_tokenizer(path: Path, data: dict) -> str:
    """llama.cpp's name for how the tokenizer splits text before BPE (tokenizer.ggml.pre)."""
    model, pre, norm, dec = data.get("model") or {}, data.get("pre_tokenizer"), data.get("normalizer"), data.get("decoder")
    what = f"The tokenizer in {path}"
    kinds = "byte-level BPE tokenizers and SentencePiece BPE ones with byte fallback"
    if model.get("type") != "BPE":
        raise MergeError(f"{what} is a {model.get('type')} tokenizer; GGUF export writes {kinds}.")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise MergeError(f"{what} uses subword prefixes or suffixes, which llama.cpp's byte-level BPE does not.")
    if not (isinstance(dec, dict) and dec.get("type") == "ByteLevel"):
        raise MergeError(f"{what} does not decode byte-level tokens (its decoder is {(dec or {}).get('type')}); GGUF export writes {kinds}.")
    if norm is not None and not (isinstance(norm, dict) and norm.get("type") == "NFC"):
        raise MergeError(f"{what} normalizes text ({(norm or {}).get('type')}) in a way llama.cpp does not.")
    steps = _steps(pre)
    if steps in PRE_TOKENIZERS:
        return PRE_TOKENIZERS[steps]
    raise MergeError(
        f"{what} splits text with a pre-tokenizer llama.cpp does not know by name (GGUF export recognises "
        "GPT-2's, Qwen2's, Llama 3's, GPT-OSS's, Mistral tekken's, DeepSeek LLM / V2's, DeepSeek-V3's, Seed-Coder's and "
        "StarCoder's); a GGUF of it "
        "would tokenize differently."
    )


def _steps(pre) -> tuple | None:
    """The pre-tokenizer as a tuple of steps that PRE_TOKENIZERS is keyed by (None: a step it has none of)."""
    parts = pre.get("pretokenizers") if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    out = []
    for step in parts if isinstance(parts, list) else [None]:
        if not isinstance(step, dict):
            return None
        kind = step.get("type")
        if kind == "ByteLevel" and not step.get("add_prefix_space"):
            out.append(_BYTES_GPT2 if step.get("use_regex", True) else _BYTES)
        elif kind == "Split" and str(step.get("behavior", "")).lower() == "isolated" and not step.get("invert"):
            pattern = step.get("pattern")
            regex = pattern.get("Regex") if isinstance(pattern, dict) else None
            if not isinstance(regex, str):
                return None
            # a tokenizer.json may hold CR/LF as characters or as \r \n escapes; the regex is the same
            out.append(("split", regex.replace("\r", r"\r").replace("\n", r"\n")))
        elif kind == "Digits" and step.get("individual_digits"):
            out.append(("digits",))
        else:
            return None
    return tuple(out)


# -- SentencePiece BPE -------------------------------------------------------------------------------

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPACE = "\u2581"  # SentencePiece's visible space
_ACROSS = re.compile("[^\u2581]\u2581")  # a "▁" after another character: a token across a word start


def _sentencepiece(writer, folder: Path, n_vocab: int, data: dict | None, spm_model: Path | None, notices: list) -> int:
    import gguf

    T = gguf.TokenType
    where = folder / ("tokenizer.json" if data is not None else "tokenizer.model")
    space_prefix = _space_prefix(where, data) if data is not None else None
    pre = (data or {}).get("pre_tokenizer")
    if space_prefix and isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("prepend_scheme") == "first":
        notices.append(
            f"The tokenizer of {folder.name} puts \u2581 only in front of the whole text and not in front of text that "
            "already begins with a space (Metaspace, prepend_scheme \"first\"); llama.cpp's SentencePiece tokenizer puts "
            "it there too and after every special token, so such text splits into other ids in llama.cpp."
        )
    if spm_model is not None:
        pieces, kind, dummy_prefix = read_sentencepiece_model(spm_model)
        if kind != 2:
            raise MergeError(
                f"{spm_model} is a SentencePiece {_SPM_KINDS.get(kind, 'unknown')} model; llama.cpp's SentencePiece "
                "tokenizer merges pairs as BPE does, so GGUF export writes SentencePiece BPE models only."
            )
        if data is not None:
            vocab = data["model"].get("vocab")
            if isinstance(vocab, dict) and any(vocab.get(p) not in (None, i) for i, (p, _, _) in enumerate(pieces)):
                raise MergeError(
                    f"{spm_model} and tokenizer.json in {folder} give the same piece different ids; they come from "
                    "different tokenizers, so copy both again from the original model."
                )
        if space_prefix is None:
            space_prefix = dummy_prefix
        # llama.cpp's converter keeps unknown, control, unused and byte pieces; the rest are NORMAL
        tokens = {i: (p, s, t if t in (T.UNKNOWN, T.CONTROL, T.UNUSED, T.BYTE) else T.NORMAL)
                  for i, (p, s, t) in enumerate(pieces)}
    else:
        tokens = _pieces_from_merges(where, data)
    if isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("split", True):
        # the folder's tokenizer cuts the text before every "▁"; llama.cpp's never does, so a token that
        # runs across a "▁" (learnt without the cut) is one llama.cpp makes where the folder never does
        across = next((t for t, _, k in tokens.values() if k == T.NORMAL and _ACROSS.search(t)), None)
        if across is not None:
            raise MergeError(
                f"The tokenizer in {where} splits text at every \u2581 (Metaspace split) yet has tokens that run across "
                f"one ({across!r}); llama.cpp's SentencePiece tokenizer does not split, so it would make those tokens "
                "where this tokenizer never does."
            )
    for i, text, special in _added_tokens(where, data) + _added_tokens_json(folder):
        _, score, kind = tokens.get(i, (None, -1000.0, T.UNUSED))
        if kind in (T.UNKNOWN, T.CONTROL, T.BYTE):
            tokens[i] = (text, score, kind)
        elif special:
            tokens[i] = (text, -1000.0, T.CONTROL)
        else:  # llama.cpp matches user-defined tokens in the raw text, before spaces become "▁"
            tokens[i] = (text.replace(_SPACE, " "), -1000.0, T.USER_DEFINED)
    _fits(folder, tokens, n_vocab)
    names, scores, kinds = [], [], []
    for i in range(n_vocab):
        text, score, kind = tokens.get(i, (f"[PAD{i}]", -1000.0, T.UNUSED))
        names.append(text)
        scores.append(float(score))
        kinds.append(int(kind))
    special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=n_vocab)
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise; say what the folder does
    special.add_special_token.setdefault("bos", False)
    special.add_special_token.setdefault("eos", False)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(names)
    writer.add_token_scores(scores)
    writer.add_token_types(kinds)
    writer.add_add_space_prefix(bool(space_prefix))
    special.add_to_gguf(writer, quiet=True)
    return n_vocab


def _space_prefix(path: Path, data: dict) -> bool:
    """Whether the tokenizer.json puts "▁" in front of the text (SentencePiece's dummy prefix), as
    llama.cpp's add_space_prefix; anything that splits or normalizes text otherwise is refused."""
    norm, pre = data.get("normalizer"), data.get("pre_tokenizer")
    norms = norm.get("normalizers") if isinstance(norm, dict) and norm.get("type") == "Sequence" else ([norm] if norm else [])
    prepend, replaces = False, False
    for n in norms if isinstance(norms, list) else [None]:
        kind = n.get("type") if isinstance(n, dict) else None
        if kind == "Prepend" and n.get("prepend") == _SPACE:  # before or after the Replace: the same text
            prepend = True
        elif kind == "Replace" and _string(n.get("pattern")) == " " and n.get("content") == _SPACE:
            replaces = True
        else:
            raise MergeError(f"The tokenizer in {path} normalizes text ({kind}) in a way llama.cpp's SentencePiece tokenizer does not.")
    if isinstance(pre, dict) and pre.get("type") == "Metaspace" and pre.get("replacement") == _SPACE and not replaces:
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        return scheme != "never"
    if replaces and (pre is None or (isinstance(pre, dict) and pre.get("type") == "Split"
                                     and _string(pre.get("pattern")) == " "
                                     and pre.get("behavior") == "MergedWithPrevious" and not pre.get("invert"))):
        return prepend  # (Gemma's split at " " comes after every space became "▁": it splits nothing)
    raise MergeError(
        f"The tokenizer in {path} splits text before its byte-fallback BPE in a way llama.cpp's SentencePiece "
        "tokenizer does not (it replaces spaces with \u2581 and merges pairs, nothing else)."
    )


def _string(pattern) -> str | None:
    """A tokenizers pattern's plain string ({"String": " "}), None for a regex or anything else."""
    return pattern.get("String") if isinstance(pattern, dict) else None


def _pieces_from_merges(path: Path, data: dict) -> dict:
    """A fast-only byte-fallback BPE as SentencePiece pieces: each token's score is minus the rank of the
    first merge that makes it (llama.cpp then merges in the merges' order); the unknown token and the
    ``<0xNN>`` tokens typed as llama.cpp types them."""
    import gguf

    T = gguf.TokenType
    model = data["model"]
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()) or not isinstance(merges, list):
        raise MergeError(f"{path} has no token vocabulary or merges; copy it again from the original model.")
    rank: dict[str, int] = {}
    for r, m in enumerate(merges):
        pair = m.split(" ", 1) if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise MergeError(f"{path} has a merge that is not a pair of tokens; copy it again from the original model.")
        rank.setdefault(pair[0] + pair[1], r)
    unk = model.get("unk_token")
    tokens = {}
    for text, i in vocab.items():
        if _BYTE_TOKEN.fullmatch(text):
            kind = T.BYTE
        elif text == unk:
            kind = T.UNKNOWN
        else:
            kind = T.NORMAL
        # a token no merge makes (a character, a byte, a special token) scores below every merged one
        tokens[i] = (text, -float(rank[text]) if text in rank else -1e6, kind)
    return tokens


def _added_tokens(path: Path, data: dict | None) -> list[tuple[int, str, bool]]:
    """(id, text, special) of the tokenizer.json's added tokens, or of tokenizer_config.json's
    added_tokens_decoder when there is no tokenizer.json."""
    if data is not None:
        entries = [(a.get("id"), a.get("content"), bool(a.get("special"))) for a in data.get("added_tokens") or []
                   if isinstance(a, dict)]
    else:
        config = _json_or_none(path.parent / "tokenizer_config.json") or {}
        decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
        entries = []
        for key, a in (decoder or {}).items() if isinstance(decoder, dict) else ():
            if not isinstance(a, dict) or not str(key).isdigit():
                raise MergeError(f"{path.parent / 'tokenizer_config.json'} has an added token without an id; copy it again from the original model.")
            entries.append((int(key), a.get("content"), bool(a.get("special"))))
    for i, text, _ in entries:
        if not isinstance(i, int) or not isinstance(text, str):
            raise MergeError(f"{path} has an added token without an id or text; copy it again from the original model.")
    return entries


def _added_tokens_json(folder: Path) -> list[tuple[int, str, bool]]:
    """added_tokens.json (older slow tokenizers save their added tokens there): user-defined tokens."""
    data = _json_or_none(folder / "added_tokens.json")
    if data is None:
        return []
    if not isinstance(data, dict) or not all(isinstance(i, int) for i in data.values()):
        raise MergeError(f"{folder / 'added_tokens.json'} is not a map of tokens to ids; copy it again from the original model.")
    return [(i, text, False) for text, i in data.items()]


def _json_or_none(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        raise MergeError(f"{path} is not valid JSON; copy it again from the original model.") from None


def _fits(folder: Path, by_id: dict, n_vocab: int) -> None:
    top = max(by_id, default=-1)
    if top >= n_vocab:
        raise MergeError(
            f"The tokenizer of {folder} has token id {top}, beyond the model's {n_vocab} embedding rows "
            "(config.json vocab_size); the tokenizer does not belong to these weights."
        )


# -- tokenizer.model: SentencePiece's ModelProto -----------------------------------------------------

_SPM_KINDS = {1: "Unigram", 2: "BPE", 3: "word", 4: "character"}


def read_sentencepiece_model(path: Path) -> tuple[list[tuple[str, float, int]], int, bool]:
    """(pieces as (text, score, type), the model type (1 Unigram, 2 BPE...), add_dummy_prefix) from a
    SentencePiece ``tokenizer.model``: a protobuf ModelProto (sentencepiece_model.proto: field 1 the
    pieces {1 piece, 2 score, 3 type}, 2 the trainer spec {3 model_type}, 3 the normalizer spec
    {3 add_dummy_prefix}); the types are gguf's TokenType values (NORMAL 1 ... BYTE 6)."""
    try:
        raw = path.read_bytes()
        pieces, kind, dummy = [], 1, True  # the proto's defaults
        for field, value in _fields(raw):
            if field == 1:
                text, score, typ = None, 0.0, 1
                for f, v in _fields(value):
                    if f == 1:
                        text = v.decode("utf-8")
                    elif f == 2:
                        score = v
                    elif f == 3:
                        typ = v
                if text is None or not 1 <= typ <= 6:
                    raise ValueError
                pieces.append((text, score, typ))
            elif field == 2:
                kind = next((v for f, v in _fields(value) if f == 3), 1)
            elif field == 3:
                dummy = bool(next((v for f, v in _fields(value) if f == 3), 1))
        if not pieces:
            raise ValueError
    except (OSError, ValueError, UnicodeDecodeError, IndexError, struct.error, TypeError):
        raise MergeError(f"{path} is not a SentencePiece model; copy it again from the original model.") from None
    return pieces, kind, dummy


def _fields(buf: bytes):
    """(field number, value) of a protobuf message: varints as int, 32-bit values as float, length-
    delimited ones as bytes (64-bit fields skipped)."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
            if pos > end:
                raise ValueError
        elif wire == 5:
            value, pos = struct.unpack_from("<f", buf, pos)[0], pos + 4
        else:
            raise ValueError
        yield field, value


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError
