"""Q4_K_M from a bf16 model with Qwen2.5-3B widths (hidden 2048, intermediate 11008, vocabulary 151936,
tied): `tui-merger gguf --type q4_k_m` against llama.cpp's way, a BF16 GGUF then `llama_model_quantize`
(llama-cpp-python's wheel, all cores), each step in its own process, one run; wall time and peak RSS of
each, and whether the two files hold the same tensors byte for byte.

    python benchmarks/bench_gguf_kquant.py --llama-python /work/venvs/llama/bin/python
    python benchmarks/bench_gguf_kquant.py --llama-python /work/venvs/llama/bin/python --layers 4

llama.cpp's wheel has no convert_hf_to_gguf.py, so the first step of its way is our own BF16 export
(bf16 weights copied as they are, what `convert_hf_to_gguf.py --outtype bf16` writes for them); its
quantizer then reads that file. --layers N keeps the widths and N of the 36 decoder layers (the random
model is made once, in benchmarks/.cache).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import DEFAULT_CACHE, fmt_table, loadavg, run_child, run_child_command  # noqa: E402

QUANTIZE = r"""
import ctypes, os, sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
p.nthread = len(os.sched_getaffinity(0))
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def child_build(folder: str, layers: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from bench_gguf import child_tokenizer
    from harness import qwen_config

    torch.manual_seed(0)
    config = qwen_config(int(layers), eos_token_id=151645, shape="3b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied head its own storage
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.05 * torch.randn_like(p) if p.ndim == 1 else 0.02 * torch.randn_like(p))
    model.save_pretrained(folder)
    child_tokenizer(folder)


def child_cli(src: str, type_: str, out: str) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "tui_merger", "gguf", src, "--type", type_, "--out", out, "--plain"])


def digests(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()) for t in GGUFReader(path).tensors}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, {"_build": lambda a: child_build(*a), "_cli": lambda a: child_cli(*a)}):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python (the shared wheel)")
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (3B has 36)")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args(argv)
    me = [sys.executable, str(Path(__file__).resolve())]
    src = args.cache_dir.resolve() / f"kquant-qwen2.5-3b-shapes-L{args.layers}"
    if not (src / "tokenizer.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        r = run_child([*me, "_build", str(src), str(args.layers)])
        print(f"built {src} in {r['wall']:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    tmp = Path(tempfile.mkdtemp(prefix="kquant-", dir=args.cache_dir.resolve()))
    load0 = loadavg()
    try:
        ours = run_child([*me, "_cli", str(src), "q4_k_m", str(tmp / "ours.gguf")])
        print(f"  ours: {ours['wall']:.1f} s, {ours['rss']:.0f} MiB", flush=True)
        bf16 = run_child([*me, "_cli", str(src), "bf16", str(tmp / "bf16.gguf")])
        print(f"  BF16 GGUF: {bf16['wall']:.1f} s, {bf16['rss']:.0f} MiB", flush=True)
        quant = run_child([args.llama_python, "-c", QUANTIZE, str(tmp / "bf16.gguf"), str(tmp / "llama.gguf")])
        print(f"  llama_model_quantize: {quant['wall']:.1f} s, {quant['rss']:.0f} MiB", flush=True)
        a, b = digests(tmp / "ours.gguf"), digests(tmp / "llama.gguf")
        same = sum(a[k] == b.get(k) for k in a)
        sizes = (tmp / "ours.gguf").stat().st_size, (tmp / "llama.gguf").stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cores = len(os.sched_getaffinity(0))
    print()
    print(f"Qwen2.5-3B widths, {args.layers} layers, {size / 1e9:.2f} GB bf16; {cores} cores; one run; "
          f"load average before/after: {load0} / {loadavg()}")
    rows = [
        ["tui-merger gguf --type q4_k_m", f"{ours['wall']:.1f}", f"{ours['rss']:.0f}", f"{sizes[0] / 1e9:.3f} GB"],
        ["llama.cpp: BF16 GGUF (tui-merger)", f"{bf16['wall']:.1f}", f"{bf16['rss']:.0f}", ""],
        ["llama.cpp: llama_model_quantize Q4_K_M", f"{quant['wall']:.1f}", f"{quant['rss']:.0f}", f"{sizes[1] / 1e9:.3f} GB"],
        ["llama.cpp's way, both steps", f"{bf16['wall'] + quant['wall']:.1f}", f"{max(bf16['rss'], quant['rss']):.0f}", ""],
    ]
    print(fmt_table(["case", "wall s", "peak RSS MiB", "file"], rows))
    print(f"tensors with the same type and bytes in both files: {same}/{len(a)} (llama.cpp's file has {len(b)})")
    return 0 if same == len(a) == len(b) else 1


if __name__ == "__main__":
    sys.exit(main())
