#!/usr/bin/env python
"""Does llama.cpp itself run the k-quant GGUFs `tui-merger gguf` writes? Not part of CI.

    python -m venv --system-site-packages /work/venvs/llama-sys      # sees this project's torch and transformers
    /work/venvs/llama-sys/bin/pip install --no-deps ../shared/tools/llama_cpp_python-*.whl
    /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_kquant_check.py

For each tiny model of tests/kquant_factory.py (hidden 256, so that rows are k-quant super-blocks;
Llama, Qwen3 tied, Qwen3-MoE) it writes the F16 GGUF and our Q4_K_M, Q5_K_M and Q6_K files, loads each
in llama.cpp (llama-cpp-python's ``Llama``) and compares with the F16 file in llama.cpp: the prompt's
logits (largest difference relative to the largest F16 logit) and 16 greedy tokens. It also quantizes
the F16 file with llama.cpp's own ``llama_model_quantize`` and checks that llama.cpp's Q4_K_M gives the
same logits as ours, bit for bit. The weights are random: a greedy token can differ where two logits
are nearly tied, which the logit column shows.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

NEW_TOKENS = 16
TYPES = ("q4_k_m", "q5_k_m", "q6_k")


def main() -> int:
    import numpy as np
    import llama_cpp
    from llama_cpp import Llama

    from harness import llama_cpp_run
    from kquant_factory import MODELS, make_kquant_model
    from tui_merger.core.ship.gguf import export_gguf

    print(f"llama-cpp-python {llama_cpp.__version__}", flush=True)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in MODELS:
            folder = make_kquant_model(root / name, name)
            f16 = export_gguf(folder, "f16", root / f"{name}-F16.gguf").path
            llm = Llama(model_path=str(f16), n_ctx=256, verbose=False)
            prompt = llm.tokenize("<|im_start|>user\nthe merged model runs locally<|im_end|>\n<|im_start|>assistant\n".encode(),
                                  add_bos=False, special=True)
            del llm
            want_logits, want_tokens = llama_cpp_run(f16, prompt, NEW_TOKENS)
            ref = root / f"{name}-llama-Q4_K_M.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
            assert llama_cpp.llama_model_quantize(str(f16).encode(), str(ref).encode(), ctypes.byref(params)) == 0
            ref_logits, _ = llama_cpp_run(ref, prompt, NEW_TOKENS)
            for type_ in TYPES:
                path = export_gguf(folder, type_, root / f"{name}-{type_}.gguf").path
                logits, tokens = llama_cpp_run(path, prompt, NEW_TOKENS)
                rel = float(np.abs(logits - want_logits).max() / np.abs(want_logits).max())
                same = sum(a == b for a, b in zip(tokens, want_tokens))
                vs_llama = "bit for bit" if type_ != "q4_k_m" else (
                    "yes, bit for bit" if np.array_equal(logits, ref_logits) else "NO")
                rows.append((name, type_.upper(), "yes", f"{rel:.2e}", f"{same}/{NEW_TOKENS}",
                             vs_llama if type_ == "q4_k_m" else ""))
                print("  " + " | ".join(rows[-1]), flush=True)
    print()
    print("| model | type | loads in llama.cpp | prompt logits vs the F16 file, max rel. diff | greedy tokens = the F16 file's |"
          " same logits as llama.cpp's own Q4_K_M |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
