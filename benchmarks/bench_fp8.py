#!/usr/bin/env python
"""Merging into a base released as FP8 blocks: tui-merger's merge vs ``cp -r`` and peft on the
dequantized model, in one run, with peak RSS.

    python benchmarks/bench_fp8.py                # 3 repeats, medians, peak RSS
    python benchmarks/bench_fp8.py --repeats 5 --layers 36
    python benchmarks/bench_fp8.py --clean        # delete the cached models and exit

The base is a Qwen3 model with Qwen2.5-3B widths (hidden 2048, intermediate 11008, 36 layers, 16 heads
of 128, 2 kv heads, vocab 151936, tied embeddings), random weights, written as Qwen3-*-FP8 releases are:
every Linear weight of the decoder layers float8_e4m3fn with an fp32 ``weight_scale_inv`` per 128x128
block (absmax / 448), embeddings and norms bf16, ``quantization_config: {quant_method: fp8, fmt: e4m3,
weight_block_size: [128, 128]}``. It is written tensor by tensor (one shard in memory at a time). The
adapter (r=16 on all 7 linear kinds) is made by peft on the dequantized model's structure.

Cases (each in its own child; peak RSS is that child's ru_maxrss):
- ``cp -r``: the I/O floor for reading the FP8 base (the output is twice its size: bf16).
- ``ours``: ``tui-merger merge --plain --no-verify`` (dequantize + merge + write bf16 + manifest).
- ``peft``: transformers' ``FineGrainedFP8Config(dequantize=True)`` load, ``PeftModel``,
  ``merge_and_unload``, ``save_pretrained`` (bf16) -- what one writes by hand today.

Untimed check: ours equals peft's output on a few merged tensors and an untouched one.
Models go to benchmarks/.cache (gitignored); ``--clean`` deletes them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    DEFAULT_CACHE,
    RESULT_HEADERS,
    ChildFailed,
    Runner,
    code_state,
    dir_bytes,
    fmt_table,
    loadavg,
    run_child,
    run_child_command,
    summarize,
    timed_rounds,
    warm_up,
)

SPEC_VERSION = 1
SHAPE = dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
             vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SHARD_BYTES = 2 << 30


def _quantize(w):
    """float8_e4m3fn values and fp32 scales per 128x128 block (absmax / 448), vectorized."""
    import torch

    rows, cols = w.shape
    blocks = w.float().reshape(rows // 128, 128, cols // 128, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(rows, cols)
    return q, scale


def child_build(folder: str, layers: str, seed: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    t0 = time.perf_counter()
    folder = Path(folder)
    base, adapter = folder / "base", folder / "adapter"
    base.mkdir(parents=True)
    config = Qwen3Config(**SHAPE, num_hidden_layers=int(layers), dtype="bfloat16")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(int(seed))
    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(base / name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if p.dim() == 1:
            t = {name: torch.ones(p.shape, dtype=torch.bfloat16)}
        else:
            w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g)
            if ".layers." in name and name.endswith("_proj.weight"):
                q, s = _quantize(w)
                t = {name: q, name[: -len("weight")] + "weight_scale_inv": s}
            else:
                t = {name: w.to(torch.bfloat16)}
        for k, v in t.items():
            current[k] = v
            size += v.numel() * v.element_size()
        if size > SHARD_BYTES:
            flush()
    flush()
    n = len(shards)
    for i, (name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (base / name).rename(base / final)
        weight_map.update({k: final for k in names})
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = config.to_dict()
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    t1 = time.perf_counter()
    lcfg = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False, task_type="CAUSAL_LM")
    pm = get_peft_model(model, lcfg, low_cpu_mem_usage=True)
    state = {}
    for name, p in pm.named_parameters():
        if ".lora_" in name:
            state[name.replace(".default.", ".")] = torch.empty(p.shape).normal_(0.0, 0.05, generator=g)
    adapter.mkdir()
    save_file(state, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    pm.peft_config["default"].base_model_name_or_path = str(base)
    pm.peft_config["default"].save_pretrained(str(adapter))
    print(f"built {layers} layers: FP8 base {dir_bytes(base) / 1e9:.2f} GB in {n} shards ({t1 - t0:.0f} s), "
          f"adapter {len(state) // 2} LoRA pairs ({time.perf_counter() - t1:.0f} s)", flush=True)


def child_peft(base: str, adapter: str, out: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=FineGrainedFP8Config(dequantize=True),
                                                 dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(out)


def child_check(ours: str, peft_out: str) -> None:
    """Not timed: ours vs peft's output on some merged tensors and an untouched one."""
    import torch
    from safetensors import safe_open

    def tensor(folder, name):
        index = Path(folder) / "model.safetensors.index.json"
        file = json.loads(index.read_text())["weight_map"][name] if index.is_file() else "model.safetensors"
        with safe_open(str(Path(folder) / file), "pt") as f:
            return f.get_tensor(name)

    ok = True
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                 "model.layers.1.mlp.gate_proj.weight", "model.layers.0.input_layernorm.weight"):
        a, b = tensor(ours, name), tensor(peft_out, name)
        # peft merges in bf16 (W + delta computed and added in bf16); ours adds in fp32 and rounds once
        d = (a.float() - b.float()).abs().max().item()
        rel = d / max(b.float().abs().max().item(), 1e-30)
        print(f"  {name}: dtype {a.dtype}/{b.dtype}, max |ours - peft| = {d:.3g} ({rel:.2%} of max |w|)")
        ok &= a.dtype == b.dtype == torch.bfloat16 and rel < 0.02
    cfg = json.loads((Path(ours) / "config.json").read_text())
    print(f"  ours config.json has quantization_config: {'quantization_config' in cfg}")
    ok &= "quantization_config" not in cfg
    print("CHECK_OK" if ok else "CHECK_FAILED", flush=True)


def child_keep_twice(base: str, adapter: str, out: str) -> None:
    """``--keep-quantization`` with nothing kept between a weight's values and its scales: each changed
    weight merged and quantized twice, as before requant.PairSource (the side-by-side baseline)."""
    from tui_merger.cli import main as cli
    from tui_merger.core.merge.requant import PairSource

    PairSource.KEPT_BYTES = 0
    raise SystemExit(cli(["merge", "--base", base, "--adapter", adapter, "--out", out, "--plain", "--no-verify",
                          "--keep-quantization"]))


CHILDREN = {"_build": lambda a: child_build(*a), "_peft": lambda a: child_peft(*a), "_check": lambda a: child_check(*a),
            "_keep_twice": lambda a: child_keep_twice(*a)}


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def ensure_model(cache: Path, layers: int, seed: int = 0) -> Path:
    folder = cache / f"qwen3-3b-shapes-fp8-L{layers}"
    marker = folder / "complete.json"
    spec = {"version": SPEC_VERSION, "layers": layers, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"building the FP8 base and adapter in {folder} ...", flush=True)
    r = run_child(py("_build", folder, layers, seed), capture=True)
    print("  " + r["stdout"].strip() + f"  [{r['wall']:.1f} s, peak RSS {r['rss']:.0f} MiB]", flush=True)
    marker.write_text(json.dumps(spec))
    return folder


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, CHILDREN):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=36, help="decoder layers (default 36: the 3B shape)")
    ap.add_argument("--skip-peft", action="store_true")
    ap.add_argument("--keep", action="store_true",
                    help="also --keep-quantization (FP8 out), and the same computing each changed weight twice")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--clean", action="store_true", help="delete the cached models and exit")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args(argv)
    cache = args.cache_dir.resolve()
    if args.clean:
        for folder in cache.glob("qwen3-3b-shapes-fp8-*"):
            shutil.rmtree(folder, ignore_errors=True)
        print(f"removed the FP8 models in {cache}")
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    print(f"measuring tui_merger at {code_state()}", flush=True)
    t0 = time.perf_counter()
    folder = ensure_model(cache, args.layers)
    base, adapter = folder / "base", folder / "adapter"
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    runner = Runner(tmp_root, sync=True, settle=args.settle, inputs=[base, adapter], tag=lambda n: n.split()[0])
    cases = {
        "cp -r": lambda out: ["cp", "-r", str(base), str(out)],
        "ours (CLI, fsync, no verify)": lambda out: [sys.executable, "-m", "tui_merger", "merge", "--base", str(base),
                                                     "--adapter", str(adapter), "--out", str(out), "--plain",
                                                     "--no-verify"],
        "peft (dequantize=True)": lambda out: py("_peft", base, adapter, out),
    }
    if args.skip_peft:
        del cases["peft (dequantize=True)"]
    if args.keep:
        cases["ours --keep-quantization"] = lambda out: [
            sys.executable, "-m", "tui_merger", "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out),
            "--plain", "--no-verify", "--keep-quantization"]
        cases["ours --keep-quantization, computed twice"] = lambda out: py("_keep_twice", base, adapter, out)
    load0 = loadavg()
    rc = 0
    try:
        print(f"base: {dir_bytes(base) / 1e9:.2f} GB FP8", flush=True)
        kept = warm_up(runner, cases, tuple(n for n in cases if n != "cp -r"))
        if "peft (dequantize=True)" in kept:
            r = run_child(py("_check", kept["ours (CLI, fsync, no verify)"], kept["peft (dequantize=True)"]), capture=True)
            print(r["stdout"].rstrip(), flush=True)
            rc = 0 if "CHECK_OK" in r["stdout"] else 1
        out_bytes = dir_bytes(kept["ours (CLI, fsync, no verify)"])
        for path in kept.values():
            shutil.rmtree(path, ignore_errors=True)
        results = timed_rounds(runner, cases, args.repeats)
    except ChildFailed as err:
        print(f"\nA benchmark child failed:\n{err}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    wall, rss, rows = summarize(results)
    print()
    print(f"Results ({args.repeats} repeats, medians and spread; output {out_bytes / 1e9:.2f} GB bf16; "
          f"load average before/after: {load0} / {loadavg()})")
    print(fmt_table(RESULT_HEADERS, rows))
    ours = "ours (CLI, fsync, no verify)"
    print(f"  ours / cp (wall): {wall[ours] / wall['cp -r']:.2f}")
    if "peft (dequantize=True)" in wall:
        print(f"  peft / ours (wall): {wall['peft (dequantize=True)'] / wall[ours]:.2f};  "
              f"ours-RSS / peft-RSS: {rss[ours] / rss['peft (dequantize=True)']:.3f}")
    print(f"total benchmark runtime: {time.perf_counter() - t0:.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
