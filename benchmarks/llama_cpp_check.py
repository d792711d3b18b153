#!/usr/bin/env python
"""Does llama.cpp itself run what `tui-merger gguf` writes? Not part of CI (llama.cpp must be built).

    python -m venv --system-site-packages llvenv            # sees this project's torch and transformers
    llvenv/bin/pip install --no-deps llama-cpp-python        # compiles llama.cpp (~10 min on 2 cores)
    llvenv/bin/python benchmarks/llama_cpp_check.py

For a tiny random model of each family (tests/test_gguf.py's builder: a trained byte-level BPE tokenizer
with chat template, random weights and norms) and each GGUF type it exports the GGUF, loads it with
llama.cpp (llama-cpp-python's ``Llama``) and compares with transformers on the Hugging Face folder
(float32): the token ids of sample texts (ASCII, digits, Chinese, emoji, the chat template's special
tokens), the logits of a prompt, and 12 greedy tokens. One table row per family and type.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

NEW_TOKENS = 12


def main() -> int:
    import torch
    from llama_cpp import Llama, llama_cpp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_gguf import SAMPLES, make_model  # the tests' tiny models and texts
    from tui_merger.core.ship.gguf import export_gguf

    print(f"llama-cpp-python {llama_cpp.__version__ if hasattr(llama_cpp, '__version__') else ''}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = {
            "llama (llama3 rope)": make_model(root / "llama", "llama", rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
            "llama": make_model(root / "llama-plain", "llama", seed=2),
            "qwen2": make_model(root / "qwen2", "qwen2"),
            "qwen3": make_model(root / "qwen3", "qwen3", tie_word_embeddings=True),
            "qwen3_moe": make_model(root / "qwen3-moe", "qwen3_moe"),
        }
        for family, folder in folders.items():
            tok = AutoTokenizer.from_pretrained(folder)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            chat = tok.apply_chat_template([{"role": "user", "content": "2+2=? 中文 🤖"}], tokenize=False, add_generation_prompt=True)
            texts = SAMPLES + [chat]
            prompt = tok.encode(chat)
            with torch.no_grad():
                want_logits = hf(torch.tensor([prompt])).logits[0]
                want_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                          min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
            for type_ in ("f16", "q8_0"):
                path = export_gguf(folder, type_, root / f"{folder.name}-{type_}.gguf").path
                llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=2)
                same_ids = sum(llm.tokenize(t.encode("utf-8"), add_bos=tok.bos_token is not None, special=True)
                               == tok.encode(t) for t in texts)
                llm.reset()
                llm.eval(prompt)
                got_logits = torch.tensor(llm.scores[: len(prompt)])
                rel = ((got_logits - want_logits).abs().max() / want_logits.abs().max()).item()
                llm.reset()
                got_tokens = []
                for token in llm.generate(prompt, temp=0.0, top_k=1):
                    got_tokens.append(token)
                    if len(got_tokens) == NEW_TOKENS:
                        break
                same = sum(a == b for a, b in zip(got_tokens, want_tokens))
                rows.append((family, type_, f"{same_ids}/{len(texts)}", f"{rel:.2e}", f"{same}/{NEW_TOKENS}"))
                print("  " + " | ".join(rows[-1]), flush=True)
                del llm
    print()
    print("| family | type | token ids = transformers' | prompt logits, max rel. diff | greedy tokens = transformers' |")
    print("|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
