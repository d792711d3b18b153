#!/usr/bin/env python
"""Does llama.cpp itself split text into the ids of the folder's tokenizer, for each kind of tokenizer
`tui-merger gguf` writes beyond the byte-level BPE of benchmarks/llama_cpp_check.py? Not part of CI.

    /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_vocab_check.py     # see llama_cpp_check.py for the venv

For each tokenizer of tests/test_gguf_vocab.py (the SentencePiece fixtures: Llama 2, Phi-3 and Gemma
shaped tokenizer.model + tokenizer.json, a fast-only byte-fallback tokenizer.json; byte-level BPE with
the tekken, DeepSeek-V3, Seed-Coder, StarCoder and spelled-out GPT-2 splits; the Gemma one on a Gemma 4 model) on a
tiny model, it exports an F16 GGUF,
loads it in llama.cpp (llama-cpp-python, vocab only) and compares llama.cpp's ids with transformers'
tokenizer on the folder: the samples, the chat template rendered, each special token alone. Prints a
Markdown table; the first differing text of a row is printed below it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]


# Gemma 4's tokenizer is Gemma's (transformers builds it as GemmaTokenizer); llama.cpp turns add_bos on for its arch
ON_ARCH = {"gemma on gemma4": ("gemma", "gemma4_text")}


def main() -> int:
    import llama_cpp
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from test_gguf_families import make_family
    from test_gguf_vocab import CHAT, FIXTURES, PRE, SENTENCEPIECE, TEXTS, byte_level_model, fields, sentencepiece_model, with_tokenizer
    from tui_merger.core.ship.gguf import export_gguf

    print(f"llama-cpp-python {llama_cpp.__version__}", flush=True)
    rows, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for kind in list(SENTENCEPIECE) + list(PRE) + list(ON_ARCH):
            if kind in ON_ARCH:  # a tokenizer fixture on another family's model: llama.cpp's vocabulary rules per arch
                fixture, family = ON_ARCH[kind]
                folder = with_tokenizer(make_family(root / f"tiny-{kind}", family, vocab_size=448), FIXTURES / fixture)
            else:
                folder = sentencepiece_model(root, kind) if kind in SENTENCEPIECE else byte_level_model(root, kind)
            path = export_gguf(folder, "f16", root / f"{kind}.gguf").path
            f = fields(path)
            tok = AutoTokenizer.from_pretrained(folder)
            try:
                llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
            except ValueError as err:
                rows.append((kind, f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"], f"does not load: {err}"[:80], "FAIL"))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            chat = tok.apply_chat_template(CHAT, tokenize=False)
            texts = TEXTS + [chat] + list(tok.all_special_tokens)
            same = 0
            for text in texts:
                want = tok.encode(text)
                got = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
                if got == want:
                    same += 1
                elif len(notes) < 40:
                    notes.append(f"{kind}: {text!r}: transformers {want[:16]}, llama.cpp {got[:16]}")
            rows.append((kind, f["tokenizer.ggml.model"], f["tokenizer.ggml.pre"], f"{same}/{len(texts)}",
                         "PASS" if same == len(texts) else "FAIL"))
            print("  " + " | ".join(rows[-1]), flush=True)
            del llm
    print()
    print("| tokenizer | tokenizer.ggml.model | tokenizer.ggml.pre | token ids = transformers' | verdict |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for note in notes:
        print(note)
    return 0 if all(r[-1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
