#!/usr/bin/env python
"""Does llama.cpp itself apply what `tui-merger gguf --adapter` writes as the merge would? Not part of CI
(llama.cpp must be installed; a prebuilt wheel is in ../shared/tools, see llama_cpp_check.py).

    /work/venvs/llama-sys/bin/python benchmarks/llama_cpp_lora_check.py [model_type ...] [--targets REGEX] [--no-experts] [--control]

For a tiny random model of each family (tests/test_gguf_families.py's builder and configs, float32) and
a random all-linear peft LoRA on it (r 8, alpha 16, A and B both random so every pair matters), it writes
the base's F16 GGUF and the LoRA's GGUF (ship/gguf_lora.py), and the F16 GGUF of peft's merge_and_unload
of the two; llama.cpp (llama-cpp-python's ``Llama(model_path=base, lora_path=lora)``, benchmarks/harness.py's
``llama_cpp_run``) runs the chat prompt and its logits are compared with llama.cpp's on the merged GGUF (max
difference relative to the largest logit; limit 1e-2, f16's) and with peft's in transformers (float32; the
judge where a MoE router picks other experts for the merged model's f16 weights); 12 greedy tokens against
the merged GGUF's. The last column is tui-merger's own check of the file (gguf_check.check_lora_gguf, what
`tui-merger gguf --adapter` records). A family whose LoRA cannot be a GGUF LoRA is listed with the sentence
that refuses it, then tried again with a LoRA on its attention only.

A mixture of experts gets a LoRA on its experts too: peft's ``target_parameters`` on each packed expert
parameter transformers keeps in memory (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: every
3-D parameter whose name has "experts") and on its router (a 2-D ``gate.weight`` with a row per expert),
which the GGUF stacks per layer (``ffn_*_exps.lora_a`` [experts, r, in]); ``--no-experts``: all-linear
alone, as before. ``--control``: once, the same LoRA with lora_B doubled is checked against the adapter,
which tui-merger's check must FAIL. Prints a Markdown table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

NEW_TOKENS, LIMIT = 12, 1e-2
# per-family config changes from tests/test_gguf_families.py's tiny cases. Qwen3.5: heads of 64 (as
# llama_cpp_check.py's table has them) and MRoPE sections that fit them: the released models' [11, 11, 10] are half
# of their 64 rotary dims (head_dim 256 x 0.25). On the tiny case's head_dim 16 that default (what the config leaves
# out, and llama.cpp's converter writes then) sums to 32 > 16, and llama.cpp's rope aborts the process
# (GGML_ASSERT(sect_dims <= ne0)) on the base alone; with sections [1, 1, 0] it runs, but llama.cpp's f16 Qwen3.5
# of heads of 16 is itself 0.013 from transformers on a merged model (its own GGUF check FAILS, no LoRA involved),
# where heads of 64 give 0.0019
OVERRIDES = {
    "qwen3_5_text": dict(head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                          "mrope_section": [3, 3, 2]}),
}


def main(argv: list[str]) -> int:
    import shutil

    import torch
    import llama_cpp
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness import llama_cpp_run
    from test_gguf_families import CASES, make_family
    from tui_merger.core.errors import MergeError
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import check_lora_gguf
    from tui_merger.core.ship.gguf_lora import export_lora_gguf

    targets = "all-linear"
    if "--targets" in argv:  # e.g. --targets '.*\.self_attn\.o_proj': a LoRA on these modules only
        i = argv.index("--targets")
        targets, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    experts = "--no-experts" not in argv and targets == "all-linear"
    control, controlled = "--control" in argv, False  # one control: a wrong LoRA that the check must fail
    argv = [a for a in argv if a not in ("--no-experts", "--control")]
    families = argv or list(CASES)
    print(f"llama-cpp-python {llama_cpp.__version__}, torch {torch.__version__}", flush=True)

    def run(path, prompt, lora_path=None):
        logits, tokens = llama_cpp_run(path, prompt, NEW_TOKENS, lora_path=lora_path)
        return torch.from_numpy(logits), tokens

    def expert_parameters(model) -> list[str]:
        """peft target_parameters for a MoE's packed experts and its router (none for a dense model)."""
        config = model.config
        n = next((getattr(config, k) for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                  if isinstance(getattr(config, k, None), int)), 0)
        params = set()
        for name, p in model.named_parameters():
            if p.dim() == 3 and ".experts." in name:
                params.add(".".join(name.split(".")[-2:]))
            elif n and p.dim() == 2 and name.endswith((".gate.weight", ".router.weight")) and p.shape[0] == n:
                params.add(".".join(name.split(".")[-2:]))  # the router (GPT-OSS's: mlp.router.weight)
        return sorted(params)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n, family in enumerate(families):
            started = time.perf_counter()
            base = make_family(root / f"base-{n}", family, dtype=torch.float32, **OVERRIDES.get(family, {}))
            tok = AutoTokenizer.from_pretrained(base)
            chat = tok.apply_chat_template([{"role": "user", "content": "2+2=? and a longer question"}],
                                           tokenize=False, add_generation_prompt=True)
            prompt = tok.encode(chat)

            def make_lora(name, targets, with_experts):
                """The adapter saved, peft's logits on the prompt, and the merged folder."""
                torch.manual_seed(n)
                model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
                params = expert_parameters(model) if with_experts else []
                peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, init_lora_weights=False,
                                                              target_parameters=params or None))
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
                return adapter, logits, merged, params

            # all-linear (with the experts); where refused, the attention with the experts; then the attention alone
            attention = r".*\.self_attn\.[qkvo]_proj"
            tries = [("lora", targets, experts)] + ([("attn-experts", attention, True)] if experts else []) + [("attn", attention, False)]
            lora, has_experts = None, None
            for name, modules, with_experts in tries:
                if name == "attn-experts" and not has_experts:  # a dense model: no experts to try
                    continue
                adapter, want, merged, params = make_lora(name, modules, with_experts)
                has_experts = bool(params) if has_experts is None else has_experts
                label = family + (", attention" if modules == attention else "") + (
                    f", experts ({', '.join(params)})" if params else (" only" if modules == attention else ""))
                try:
                    lora = export_lora_gguf(base, adapter, root / f"{name}-{n}.gguf")
                    break
                except MergeError as err:
                    rows.append((label, "refused: " + str(err).replace(str(adapter), "the adapter")[:170], "", "", "", "", "", "REFUSED"))
                    print("  " + " | ".join(rows[-1]), flush=True)
            if lora is None:
                continue
            try:
                base_gguf = export_gguf(base, "f16", root / f"base-{n}.gguf").path
                merged_gguf = export_gguf(merged, "f16", root / f"{merged.name}.gguf").path
            except MergeError as err:
                rows.append((label, "GGUF of the base not written: " + str(err)[:120], "", "", "", "", "", "FAIL"))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            pairs = f"{lora.pairs}" + (f" ({lora.experts} stacked)" if lora.experts else "")
            try:
                with_lora, lora_tokens = run(base_gguf, prompt, lora.path)
            except Exception as err:  # noqa: BLE001 - a row of the table
                rows.append((label, pairs, f"llama.cpp does not load it: {err}"[:150], "", "", "", "", "FAIL"))
                print("  " + " | ".join(rows[-1]), flush=True)
                continue
            plain, _ = run(base_gguf, prompt)
            ref, ref_tokens = run(merged_gguf, prompt)
            rel = ((with_lora - ref).abs().max() / ref.abs().max()).item()
            vs_peft = ((with_lora - want).abs().max() / want.abs().max()).item()
            moved = ((plain - ref).abs().max() / ref.abs().max()).item()  # what the LoRA changes at all
            greedy = sum(a == b for a, b in zip(lora_tokens, ref_tokens))
            check = check_lora_gguf(base, adapter, base_gguf, lora.path)  # what `tui-merger gguf --adapter` records
            checked = check.status.upper() + (f" ({check.details.get('logits_rel_median' if check.details.get('experts', 0) > 1 else 'logits_rel')}"
                                              f", limit {check.details.get('limit')})" if check.details else "")
            # a MoE router may pick another expert for f16-rounded merged weights than for base + F32 LoRA: then
            # llama.cpp with the LoRA is judged against peft itself (float32)
            ok = min(rel, vs_peft) < LIMIT and moved > 10 * min(rel, vs_peft) and check.status == "passed"
            rows.append((label, pairs, f"{rel:.1e}", f"{vs_peft:.1e}", f"{moved:.1e}", f"{greedy}/{NEW_TOKENS}", checked,
                         "PASS" if ok else "FAIL"))
            print("  " + " | ".join(rows[-1]) + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
            if check.status != "passed":
                print(f"    check: {check.line()}", flush=True)
            if family == "gpt_oss" and lora.experts:  # the experts as llama.cpp's own GPT-OSS files hold them: MXFP4
                rows.append(mxfp4_row(label, pairs, base_gguf, with_lora, lora.path, prompt, want, run))
                print("  " + " | ".join(rows[-1]), flush=True)
            if control and not controlled:  # the check can fail: the same LoRA with lora_B doubled, against this adapter
                from safetensors.torch import load_file, save_file

                wrong = root / f"control-{n}"
                shutil.copytree(adapter, wrong)
                weights = load_file(str(wrong / "adapter_model.safetensors"))
                save_file({k: v * 2 if "lora_B" in k else v for k, v in weights.items()}, str(wrong / "adapter_model.safetensors"))
                bad = export_lora_gguf(base, wrong, root / f"control-{n}.gguf")
                check = check_lora_gguf(base, adapter, base_gguf, bad.path)
                rows.append((f"{label}: control, lora_B doubled", f"{bad.pairs}", "", "", "", "",
                             check.status.upper() + f" ({check.details.get('logits_rel_median' if check.details.get('experts', 0) > 1 else 'logits_rel')}"
                             f", limit {check.details.get('limit')})",
                             "PASS (caught)" if check.status == "failed" else "FAIL (not caught)"))
                print("  " + " | ".join(rows[-1]), flush=True)
                controlled = True
    print()
    print("| family | LoRA pairs | logits vs merged GGUF (max rel.) | vs peft (float32) | base alone vs merged "
          "(what the LoRA moves) | greedy = merged GGUF's | tui-merger's check | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0 if all(r[-1] in ("PASS", "REFUSED", "PASS (caught)") for r in rows) else 1


def mxfp4_row(label, pairs, base_gguf, with_f16, lora_path, prompt, want, run):
    """GPT-OSS with its experts in MXFP4 (llama.cpp's ``llama_model_quantize`` to MOSTLY_MXFP4_MOE: the experts
    MXFP4, the rest as they were, as llama.cpp's own GPT-OSS files hold them): the same LoRA file on the MXFP4
    base. MXFP4 rounds the base's experts to 4 bits, so neither peft nor the F16 run is matched to f16's limit;
    what must hold is that llama.cpp adds the same LoRA to MXFP4 experts as to F16 ones: the LoRA's effect on
    the logits (with it minus without it) on the MXFP4 base equals its effect on the F16 base within 0.2 of
    its size (a LoRA dropped or doubled is 1.0 off), and llama.cpp with it stays within 3x the MXFP4 base's own
    rounding (MXFP4 base alone vs F16 base alone) of peft. Columns: the effect's difference; vs peft; the
    MXFP4 base alone vs peft."""
    import ctypes

    import gguf
    import llama_cpp

    out = base_gguf.with_name(base_gguf.stem + "-MXFP4.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    assert llama_cpp.llama_model_quantize(str(base_gguf).encode(), str(out).encode(), ctypes.byref(params)) == 0
    exps = [t for t in gguf.GGUFReader(out).tensors if "_exps.weight" in t.name]
    mx = sum(t.tensor_type == gguf.GGMLQuantizationType.MXFP4 for t in exps)
    with_lora, _ = run(out, prompt, lora_path)
    plain, _ = run(out, prompt)
    plain_f16, _ = run(base_gguf, prompt)
    scale = want.abs().max()
    effect, effect_f16 = with_lora - plain, with_f16 - plain_f16
    off = ((effect - effect_f16).abs().max() / effect_f16.abs().max()).item()
    vs_peft = ((with_lora - want).abs().max() / scale).item()
    moved = ((plain - want).abs().max() / scale).item()
    own = ((plain - plain_f16).abs().max() / plain_f16.abs().max()).item()  # MXFP4's own rounding, no LoRA
    ok = mx == len(exps) > 0 and off < 0.2 and vs_peft < 3 * own
    return (f"{label}, base experts MXFP4 ({mx}/{len(exps)} ffn_*_exps; MXFP4 base alone vs F16 base alone {own:.1e})", pairs,
            f"{off:.1e} (the LoRA's effect vs on the F16 base)", f"{vs_peft:.1e}", f"{moved:.1e}", "", "", "PASS" if ok else "FAIL")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
