#!/usr/bin/env python
"""Does llama.cpp itself run what `tui-merger gguf` writes, for every family and the types people use?
Not part of CI (llama.cpp must be built; a prebuilt wheel is in ../shared/tools).

    python -m venv --system-site-packages /work/venvs/llama-sys     # sees this project's torch and transformers
    /work/venvs/llama-sys/bin/pip install --no-deps ../shared/tools/llama_cpp_python-*.whl
    /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_check.py [model_type ...] [--types f16,q8_0,q4_k_m] [--seed 0]
    (vl:<case>, a case of tests/test_gguf_vl_text.py's VL_CASES: vl:gemma3 vl:gemma4 vl:qwen2_vl vl:qwen2_5_vl vl:qwen3_vl
    vl:qwen3_vl:tied vl:qwen3_vl_moe vl:llava vl:llava:mistral vl:llava:qwen2 vl:mistral3: a vision-language folder, its language model's
    GGUF judged against the VL model's own logits on text-only input; the in-app check's verdict is printed for each file)

For a tiny random model of each family (tests/test_gguf_families.py's builder and configs, widened to
hidden 256 so that k-quant rows are whole super-blocks; bf16 weights; a trained byte-level BPE
tokenizer with chat template; random weights, norms and biases) and each GGUF type, it exports the
GGUF with tui-merger, loads it with llama.cpp (llama-cpp-python's ``Llama``) and compares:
- every type: the token ids of sample texts (ASCII, digits, Chinese, emoji, the chat template's special
  tokens) with transformers' tokenizer, and 12 greedy tokens with transformers' (shown, not judged:
  random weights make near-ties);
- f16 and bf16: the chat prompt's logits with transformers on the folder (float32), largest difference
  relative to the largest logit, limit 1e-2 (bf16: 2e-2, gguf_check's LIMITS: llama.cpp rounds the
  activations to bf16 for a bf16 matrix);
- q8_0 and the k-quants: the logits with those of llama.cpp's own quantization of our BF16 file of the
  same folder (``llama_model_quantize``, what `llama-quantize` does); limit 1e-3 relative (q8_0: the
  converter quantizes from the weights, llama-quantize from the BF16 file, the same values here), and
  the logits' difference from transformers for scale.
A row passes when it loads, every id is equal and the logits are within the limit. Prints a Markdown table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

NEW_TOKENS = 12
LIMIT_F16, LIMIT_SAME = 1e-2, 1e-3
LIMIT_FLOAT = {"f16": LIMIT_F16, "bf16": 2e-2}  # bf16: gguf_check.LIMITS["bf16"], from bf16's rounding
FTYPES = {"q8_0": 7, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q4_k_s": 14, "q5_k_s": 16, "q3_k_m": 12}  # LLAMA_FTYPE_MOSTLY_*
WIDE = dict(hidden_size=256, intermediate_size=512)
WIDE_FAMILY = {  # per-family widths that follow hidden 256 (head sizes, expert widths)
    "qwen3": dict(head_dim=64), "qwen3_moe": dict(head_dim=64, moe_intermediate_size=256),
    "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=512),
    "gemma": dict(head_dim=64), "gemma2": dict(head_dim=64, query_pre_attn_scalar=64),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64), "ernie4_5": dict(head_dim=64), "seed_oss": dict(head_dim=64),
    "ernie4_5_moe": dict(head_dim=64, moe_intermediate_size=256),
    "qwen3_5_text": dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64),
    "qwen3_next": dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=256,
                       shared_expert_intermediate_size=512),
    "gemma4_text": dict(head_dim=64, global_head_dim=128, hidden_size_per_layer_input=64),
    "gemma4_text:moe": dict(head_dim=64, global_head_dim=128, moe_intermediate_size=256),
    # vision-language folders (vl:<case>): the language model's widths
    "vl:qwen3_vl": dict(head_dim=64), "vl:qwen3_vl_moe": dict(head_dim=64, moe_intermediate_size=256),
    "vl:mistral3": dict(head_dim=128),  # 4 heads of 128 in a 256-wide model, as Mistral Small 3.1's 32 of 128 in 5120
    "phi3:longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 50000.0, "long_factor": [1.0 + i / 4 for i in range(32)],
                                           "short_factor": [1.0 + i / 32 for i in range(32)]}),
}


def main(argv: list[str]) -> int:
    import ctypes

    import torch
    import llama_cpp
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from test_gguf import SAMPLES
    from test_gguf_families import CASES, make_family
    from test_gguf_vl_text import VL_CASES, make_vl
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import check_gguf

    types = ["f16", "q8_0", "q4_k_m"]
    if "--types" in argv:
        i = argv.index("--types")
        types = argv[i + 1].split(",")
        argv = argv[:i] + argv[i + 2:]
    seed = 0  # the random weights (another seed: another tiny model, e.g. past an MoE router's near-tie)
    if "--seed" in argv:
        i = argv.index("--seed")
        seed = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    families = argv or list(CASES)
    print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}, seed {seed}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n, family in enumerate(families):
            vl = family.startswith("vl:")  # a vision-language folder: its language model's GGUF, judged against the VL
            # model's own logits on text-only input, and the in-app check's verdict shown
            if vl:
                text_type = VL_CASES[family[3:]][1]
                widths = WIDE_FAMILY.get(family) or WIDE_FAMILY.get(text_type, {})
                folder = make_vl(root / f"tiny-{n}", family[3:], seed=seed, dtype=torch.bfloat16, **WIDE, **widths)
            else:
                folder = make_family(root / f"tiny-{n}", family, dtype=torch.bfloat16, seed=seed, **WIDE, **WIDE_FAMILY.get(family, {}))
            bf16 = export_gguf(folder, "bf16", root / f"{folder.name}-bf16.gguf").path
            tok = AutoTokenizer.from_pretrained(folder)
            hf = (AutoModelForImageTextToText if vl else AutoModelForCausalLM).from_pretrained(folder, dtype=torch.float32).eval()
            chat = tok.apply_chat_template([{"role": "user", "content": "2+2=? 中文 🤖 and a longer question"}],
                                           tokenize=False, add_generation_prompt=True)
            texts = SAMPLES + [chat]
            prompt = tok.encode(chat)
            with torch.no_grad():
                want_logits = hf(torch.tensor([prompt])).logits[0]
                ids = torch.tensor([prompt])  # the mask given: a prompt that starts with id 0 is not padding
                want_tokens = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                          min_new_tokens=NEW_TOKENS, pad_token_id=0)[0, len(prompt):].tolist()
            def scores(path):
                llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=2)
                llm.eval(prompt)
                got = torch.tensor(llm.scores[: len(prompt)])
                del llm
                return got

            for type_ in types:
                started = time.perf_counter()
                try:
                    # bf16: the BF16 file already written above (the input of llama.cpp's quantizations)
                    path = bf16 if type_ == "bf16" else export_gguf(folder, type_, root / f"{folder.name}-{type_}.gguf").path
                except Exception as err:  # noqa: BLE001 - a row of the table
                    rows.append((family, type_, f"not written: {err}"[:120], "", "", "", "FAIL"))
                    print("  " + " | ".join(rows[-1]), flush=True)
                    continue
                try:
                    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=2)
                except Exception as err:  # noqa: BLE001
                    rows.append((family, type_, f"no: {err}"[:120], "", "", "", "FAIL"))
                    print("  " + " | ".join(rows[-1]), flush=True)
                    continue
                same_ids = sum(llm.tokenize(t.encode("utf-8"), add_bos=tok.bos_token is not None, special=True)
                               == tok.encode(t) for t in texts)
                llm.reset()
                llm.eval(prompt)
                got_logits = torch.tensor(llm.scores[: len(prompt)])
                rel = ((got_logits - want_logits).abs().max() / want_logits.abs().max()).item()
                if type_ in FTYPES:  # against llama.cpp's own quantization of the BF16 file
                    ref = root / f"{folder.name}-{type_}-llama.gguf"
                    params = llama_cpp.llama_model_quantize_default_params()
                    params.ftype = FTYPES[type_]
                    assert llama_cpp.llama_model_quantize(str(bf16).encode(), str(ref).encode(), ctypes.byref(params)) == 0
                    theirs = scores(ref)
                    same = ((got_logits - theirs).abs().max() / theirs.abs().max()).item()
                llm.reset()
                got_tokens = []
                for token in llm.generate(prompt, temp=0.0, top_k=1):
                    got_tokens.append(token)
                    if len(got_tokens) == NEW_TOKENS:
                        break
                greedy = sum(a == b for a, b in zip(got_tokens, want_tokens))
                if type_ in FTYPES:
                    ok = same_ids == len(texts) and same < LIMIT_SAME
                    vs = f"{same:.1e} (transformers {rel:.1e})"
                else:
                    ok = same_ids == len(texts) and rel < LIMIT_FLOAT[type_]
                    vs = f"{rel:.1e}"
                rows.append((family, type_, "yes", f"{same_ids}/{len(texts)}", vs, f"{greedy}/{NEW_TOKENS}",
                             "PASS" if ok else "FAIL"))
                if vl:
                    del llm
                    verdict = check_gguf(folder, path, type_, reader="llama.cpp")
                    print(f"  {family} {type_}: the in-app check says {verdict.line()}", flush=True)
                    llm = None
                print("  " + " | ".join(rows[-1]) + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
                del llm
    print()
    print("| family | type | loads | token ids = transformers' | prompt logits, max rel. diff (f16: from transformers; "
          "quantized: from llama.cpp's own quantization) | greedy tokens = transformers' | verdict |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(r[-1] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
