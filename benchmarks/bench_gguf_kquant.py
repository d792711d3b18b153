"""Q4_K_M from a bf16 model with Qwen2.5-3B widths (hidden 2048, intermediate 11008, vocabulary 151936,
tied): `tui-merger gguf --type q4_k_m` against llama.cpp's way, a BF16 GGUF then `llama_model_quantize`
(llama-cpp-python's wheel, all cores), side by side in one run: rounds of both ways, interleaved (the
order alternates between rounds, so that a change of load falls on both), each step in its own
process. Per step: wall time, CPU time, peak RSS, median and spread over the rounds; per round the
ratio of our wall time to llama.cpp's two steps (a paired comparison, the robust one on a shared
machine); the load average before each step; and whether the two files hold the same tensors byte
for byte (first round).

    python benchmarks/bench_gguf_kquant.py --llama-python /work/venvs/llama/bin/python --layers 8 --repeats 3
    python benchmarks/bench_gguf_kquant.py --llama-python /work/venvs/llama/bin/python --model DIR --repeats 1

Ours uses numba's compiled k-quant loops when the Python running this has numba (core/ship/kquants_jit.py;
compiled once per machine, so run it once before measuring), numpy's with --kquants numpy or without numba.

llama.cpp's wheel has no convert_hf_to_gguf.py, so the first step of its way is our own BF16 export
(bf16 weights copied as they are, what `convert_hf_to_gguf.py --outtype bf16` writes for them); its
quantizer then reads that file. Neither way checks its file here (`--check none`: llama.cpp's two steps
check nothing; --check auto measures ours with its check). --layers N keeps the widths and N of the 36
decoder layers (the random model is made once, in benchmarks/.cache); --model DIR takes an existing
bf16 Qwen2 folder (linked, never written; a tokenizer is added beside the links when it has none).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
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


def child_tok(folder: str) -> None:
    from bench_gguf import child_tokenizer

    child_tokenizer(folder)


def child_cli(src: str, type_: str, out: str, check: str, kquants: str = "auto") -> None:
    os.environ["TUI_MERGER_KQUANTS"] = kquants  # core/ship/kquants.py: auto (numba when installed), numpy, numba
    os.execv(sys.executable, [sys.executable, "-m", "tui_merger", "gguf", src, "--type", type_, "--out", out,
                              "--plain", "--check", check])


def digests(path: Path) -> dict:
    from gguf import GGUFReader

    return {t.name: (t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()) for t in GGUFReader(path).tensors}


def linked(model: Path, cache: Path, me: list) -> Path:
    """A folder of links to ``model``'s files (never written to), with a tokenizer if it has none."""
    dst = cache / f"kquant-{model.name if model.name != 'base' else model.parent.name}"
    if not (dst / "tokenizer.json").is_file():
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for f in model.iterdir():
            if f.is_file():
                (dst / f.name).symlink_to(f.resolve())
        if not (dst / "tokenizer.json").is_file():
            run_child([*me, "_tok", str(dst)])
    return dst


def _numba() -> str:
    from importlib import metadata

    try:
        return f"numba {metadata.version('numba')} installed (llvmlite {metadata.version('llvmlite')})"
    except metadata.PackageNotFoundError:
        return "numba not installed (numpy's loops)"


def spread(xs: list[float]) -> str:
    med = statistics.median(xs)
    return f"{med:.1f}" if len(xs) == 1 else f"{med:.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    children = {"_build": lambda a: child_build(*a), "_cli": lambda a: child_cli(*a), "_tok": lambda a: child_tok(*a)}
    if run_child_command(argv, children):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="a Python with llama-cpp-python (the shared wheel)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the random model (3B has 36)")
    ap.add_argument("--model", type=Path, help="an existing bf16 Qwen2 folder instead of the random model")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both ways")
    ap.add_argument("--check", default="none", choices=("none", "auto"), help="tui-merger's check of its file")
    ap.add_argument("--kquants", default="auto", choices=("auto", "numpy", "numba"),
                    help="our k-quant loops: numba's when installed (auto), or numpy's")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args(argv)
    me = [sys.executable, str(Path(__file__).resolve())]
    cache = args.cache_dir.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    if args.model:
        src = linked(args.model.resolve(), cache, me)
    else:
        src = cache / f"kquant-qwen2.5-3b-shapes-L{args.layers}"
        if not (src / "tokenizer.json").is_file():
            shutil.rmtree(src, ignore_errors=True)
            src.mkdir(parents=True)
            r = run_child([*me, "_build", str(src), str(args.layers)])
            print(f"built {src} in {r['wall']:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cases = {"ours": [], "bf16": [], "quant": []}
    ratios, cpu_ratios, loads = [], [], []
    same = compared = None
    tmp = Path(tempfile.mkdtemp(prefix="kquant-", dir=cache))

    def step(name: str, argv: list) -> dict:
        load = loadavg()
        loads.append(float(load.split()[0]))
        r = run_child(argv)
        r["load"] = load
        cases[name].append(r)
        print(f"  {name}: {r['wall']:.1f} s wall, {r['cpu']:.1f} s cpu, {r['rss']:.0f} MiB (load {load})", flush=True)
        return r

    try:
        for rnd in range(args.repeats):
            print(f"round {rnd + 1}/{args.repeats}", flush=True)
            got = {}
            for way in (("ours", "llama") if rnd % 2 == 0 else ("llama", "ours")):
                if way == "ours":
                    got["ours"] = step("ours", [*me, "_cli", str(src), "q4_k_m", str(tmp / "ours.gguf"), args.check, args.kquants])
                else:
                    got["bf16"] = step("bf16", [*me, "_cli", str(src), "bf16", str(tmp / "bf16.gguf"), args.check])
                    got["quant"] = step("quant", [args.llama_python, "-c", QUANTIZE, str(tmp / "bf16.gguf"), str(tmp / "llama.gguf")])
                    (tmp / "bf16.gguf").unlink()
            llama = got["bf16"]["wall"] + got["quant"]["wall"]
            ratios.append(got["ours"]["wall"] / llama)
            cpu_ratios.append(got["ours"]["cpu"] / (got["bf16"]["cpu"] + got["quant"]["cpu"]))
            print(f"  ours / llama.cpp's two steps: {ratios[-1]:.2f} wall, {cpu_ratios[-1]:.2f} cpu", flush=True)
            if same is None:
                a, b = digests(tmp / "ours.gguf"), digests(tmp / "llama.gguf")
                same, compared = sum(a[k] == b.get(k) for k in a), (len(a), len(b))
                sizes = (tmp / "ours.gguf").stat().st_size, (tmp / "llama.gguf").stat().st_size
            for f in tmp.iterdir():
                f.unlink()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cores = len(os.sched_getaffinity(0))
    both = [b["wall"] + q["wall"] for b, q in zip(cases["bf16"], cases["quant"])]
    both_cpu = [b["cpu"] + q["cpu"] for b, q in zip(cases["bf16"], cases["quant"])]
    print()
    print(f"k-quants: {args.kquants}; {_numba()}")
    print(f"{src.name}: {size / 1e9:.2f} GB bf16; {cores} cores; {args.repeats} round(s), interleaved; "
          f"--check {args.check}; load average (1 min) before the steps: {min(loads):.1f}-{max(loads):.1f}")
    col = lambda k, key: spread([r[key] for r in cases[k]])  # noqa: E731
    rss = lambda k: f"{max(r['rss'] for r in cases[k]):.0f}"  # noqa: E731
    rows = [
        ["tui-merger gguf --type q4_k_m", col("ours", "wall"), col("ours", "cpu"), rss("ours"), f"{sizes[0] / 1e9:.3f} GB"],
        ["llama.cpp: BF16 GGUF (tui-merger)", col("bf16", "wall"), col("bf16", "cpu"), rss("bf16"), ""],
        ["llama.cpp: llama_model_quantize Q4_K_M", col("quant", "wall"), col("quant", "cpu"), rss("quant"), f"{sizes[1] / 1e9:.3f} GB"],
        ["llama.cpp's way, both steps", spread(both), spread(both_cpu), str(max(int(rss("bf16")), int(rss("quant")))), ""],
    ]
    print(fmt_table(["case", "wall s, median (min-max)", "cpu s", "peak RSS MiB", "file"], rows))
    print(f"ours / llama.cpp's two steps, per round: wall {', '.join(f'{r:.2f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.2f}); cpu {', '.join(f'{r:.2f}' for r in cpu_ratios)} "
          f"(median {statistics.median(cpu_ratios):.2f})")
    print(f"tensors with the same type and bytes in both files: {same}/{compared[0]} (llama.cpp's file has {compared[1]})")
    return 0 if same == compared[0] == compared[1] else 1


if __name__ == "__main__":
    sys.exit(main())
