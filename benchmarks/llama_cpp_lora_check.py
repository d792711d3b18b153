#!/usr/bin/env python
"""Does llama.cpp itself apply what `tui-merger gguf --adapter` writes as the merge would? Not part of CI
(llama.cpp must be installed; a prebuilt wheel is in ../shared/tools, see llama_cpp_check.py).

    /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_lora_check.py [model_type ...] [--targets REGEX]

For a tiny random model of each family (tests/test_gguf_families.py's builder and configs, float32) and
a random all-linear peft LoRA on it (r 8, alpha 16, A and B both random so every pair matters), it writes
the base's F16 GGUF and the LoRA's GGUF (ship/gguf_lora.py), and the F16 GGUF of peft's merge_and_unload
of the two; llama.cpp (llama-cpp-python's ``Llama(model_path=base, lora_path=lora)``) runs the chat prompt
and its logits are compared with llama.cpp's on the merged GGUF (max difference relative to the largest
logit; limit 1e-2, f16's) and with peft's in transformers (float32; the judge where a MoE router picks
other experts for the merged model's f16 weights); 12 greedy tokens against
the merged GGUF's. A family whose LoRA cannot be a GGUF LoRA is listed with the sentence that refuses it,
then tried again with a LoRA on its attention only.
Prints a Markdown table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

NEW_TOKENS, LIMIT = 12, 1e-2


def main(argv: list[str]) -> int:
    import shutil

    import torch
    import llama_cpp
    from llama_cpp import Llama
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_gguf_families import CASES, make_family
    from tui_merger.core.errors import MergeError
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_lora import export_lora_gguf

    targets = "all-linear"
    if "--targets" in argv:  # e.g. --targets '.*\.self_attn\.o_proj': a LoRA on these modules only
        i = argv.index("--targets")
        targets, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    families = argv or list(CASES)
    print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n, family in enumerate(families):
            started = time.perf_counter()
            base = make_family(root / f"base-{n}", family, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(base)
            chat = tok.apply_chat_template([{"role": "user", "content": "2+2=? and a longer question"}],
                                           tokenize=False, add_generation_prompt=True)
            prompt = tok.encode(chat)

            def make_lora(name, targets):
                """The adapter saved, peft's logits on the prompt, and the merged folder."""
                torch.manual_seed(n)
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False))
                with torch.no_grad():  # B as random as A, but small enough that the model stays a model
                    for pname, p in peft_model.named_parameters():
                        if "lora_B" in pname or "lora_A" in pname:
                            p.mul_(0.25)
                adapter = root / f"{name}-{n}"
                peft_model.save_pretrained(adapter)
                with torch.no_grad():
                    logits = peft_model(torch.tensor([prompt])).logits[0]
                merged = root / f"merged-{name}-{n}"
                peft_model.merge_and_unload().save_pretrained(merged)
                for f in base.iterdir():
                    if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
                        shutil.copy(f, merged / f.name)
                return adapter, logits, merged

            adapter, want, merged = make_lora("lora", targets)
            try:
                lora = export_lora_gguf(base, adapter, root / f"lora-{n}.gguf")
            except MergeError as err:
                rows.append((family, "refused: " + str(err)[:150], "", "", "", "", "REFUSED"))
                print("  " + " | ".join(rows[-1]), flush=True)
                # the same family with a LoRA on its attention only (what a GGUF LoRA can carry there)
                family = f"{family}, attention only"
                adapter, want, merged = make_lora("attn", r".*\.self_attn\.[qkvo]_proj")
                try:
                    lora = export_lora_gguf(base, adapter, root / f"attn-{n}.gguf")
                except MergeError as err2:
                    rows.append((family, "refused: " + str(err2)[:150], "", "", "", "", "REFUSED"))
                    print("  " + " | ".join(rows[-1]), flush=True)
                    continue
            try:
                base_gguf = export_gguf(base, "f16", root / f"base-{n}.gguf").path
                merged_gguf = export_gguf(merged, "f16", root / f"{merged.name}.gguf").path
            except MergeError as err:
                rows.append((family, "GGUF of the base not written: " + str(err)[:120], "", "", "", "", "FAIL"))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue

            def run(path, lora_path=None):
                kw = {"lora_path": str(lora_path)} if lora_path else {}
                llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=2, **kw)
                llm.eval(prompt)
                scores = torch.tensor(llm.scores[: len(prompt)])
                llm.reset()
                tokens = []
                for token in llm.generate(prompt, temp=0.0, top_k=1):
                    tokens.append(token)
                    if len(tokens) == NEW_TOKENS:
                        break
                del llm
                return scores, tokens

            try:
                with_lora, lora_tokens = run(base_gguf, lora.path)
            except Exception as err:  # noqa: BLE001 - a row of the table
                rows.append((family, f"{lora.pairs}", f"llama.cpp does not load it: {err}"[:150], "", "", "", "FAIL"))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            plain, _ = run(base_gguf)
            ref, ref_tokens = run(merged_gguf)
            rel = ((with_lora - ref).abs().max() / ref.abs().max()).item()
            vs_peft = ((with_lora - want).abs().max() / want.abs().max()).item()
            moved = ((plain - ref).abs().max() / ref.abs().max()).item()  # what the LoRA changes at all
            greedy = sum(a == b for a, b in zip(lora_tokens, ref_tokens))
            # a MoE router may pick another expert for f16-rounded merged weights than for base + F32 LoRA: then
            # llama.cpp with the LoRA is judged against peft itself (float32)
            ok = min(rel, vs_peft) < LIMIT and moved > 10 * min(rel, vs_peft)
            rows.append((family, f"{lora.pairs}", f"{rel:.1e}", f"{vs_peft:.1e}", f"{moved:.1e}", f"{greedy}/{NEW_TOKENS}",
                         "PASS" if ok else "FAIL"))
            print("  " + " | ".join(rows[-1]) + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    print()
    print("| family | LoRA pairs | logits vs merged GGUF (max rel.) | vs peft (float32) | base alone vs merged "
          "(what the LoRA moves) | greedy = merged GGUF's | verdict |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(r[-1] in ("PASS", "REFUSED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
