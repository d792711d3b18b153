"""Packed MoE experts with a LoRA on them (peft ``target_parameters``), as GPT-OSS ships them (MXFP4):
peak memory and time of the merge, side by side in one run, against ``cp -r`` and, with ``--code``,
another checkout of tui-merger (e.g. the commit before experts were merged a few at a time).

    python benchmarks/bench_experts.py                          # GPT-OSS-20B widths, 2 layers
    python benchmarks/bench_experts.py --code /path/to/old/checkout --repeats 2
    python benchmarks/bench_experts.py --clean                  # delete the cached model

The model: GPT-OSS-20B's widths (hidden 2880, 32 experts of intermediate 2880, 64 heads of 64, 8 KV
heads; vocabulary cut to 32000) with ``--layers`` decoder layers (default 2), random bf16 weights, the
experts written in MXFP4 (``*_blocks`` + ``*_scales``) as the release is; an r=16 alpha=32 adapter made
by peft on ``q_proj`` and ``target_parameters`` ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``
(its weights random). Each layer's ``gate_up_proj`` is 530M values: 1.06 GB in bf16, 2.1 GB in fp32.

Cases, each in its own child process with warm inputs, round robin: ``cp -r`` of the base; ``ours``:
``tui-merger merge --plain --no-verify`` (bf16 output); ``ours --keep-quantization`` (MXFP4 output);
and the same two with ``--code`` (run with that checkout on PYTHONPATH). Peak RSS is each child's own.
"""

from __future__ import annotations

import argparse
import json
import os
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
)

SPEC_VERSION = 1
SHAPE = dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
             num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=32000,
             max_position_embeddings=4096, sliding_window=128,
             rope_parameters={"rope_type": "default", "rope_theta": 150000.0})


def child_build(folder: str, layers: str) -> None:
    """The base (bf16 weights written tensor by tensor, experts as MXFP4) and the adapter (peft on the
    meta model, its LoRA weights materialized and filled)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from tui_merger.core.merge.requant_mxfp4 import quantize_mxfp4

    folder = Path(folder)
    base, adapter = folder / "base", folder / "adapter"
    base.mkdir(parents=True)
    config = transformers.GptOssConfig(num_hidden_layers=int(layers), **SHAPE)
    config.dtype = "bfloat16"
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, p in model.state_dict().items():
        w = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16) if p.dim() > 1 else torch.ones(p.shape, dtype=torch.bfloat16)
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(w, name)
        else:
            tensors[name] = w
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    cfg = config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj"],
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    peft_model = get_peft_model(model, lora)
    for name, p in list(peft_model.named_parameters()):
        if "lora_" in name:  # materialized on the CPU; the base stays on meta
            parent, leaf = name.rsplit(".", 1)
            value = (torch.randn(p.shape, generator=g) * 0.01).to(torch.bfloat16)
            peft_model.get_submodule(parent)._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    peft_model.save_pretrained(adapter)
    (folder / "SPEC").write_text(f"{SPEC_VERSION} {layers}\n")


def ensure_model(cache: Path, layers: int) -> Path:
    folder = cache / f"gpt-oss-20b-shapes-mxfp4-L{layers}"
    if (folder / "SPEC").exists() and (folder / "SPEC").read_text().split() == [str(SPEC_VERSION), str(layers)]:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    print(f"building the MXFP4 base and adapter in {folder} ...", flush=True)
    r = run_child([sys.executable, str(Path(__file__).resolve()), "_build", str(folder), str(layers)], capture=True)
    print(f"  built in {r['wall']:.1f} s, peak RSS {r['rss']:.0f} MiB", flush=True)
    return folder


CHILDREN = {"_build": lambda a: child_build(*a)}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, CHILDREN):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--code", type=Path, help="another checkout of tui-merger to run beside this one")
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--clean", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args(argv)
    cache = args.cache_dir.resolve()
    if args.clean:
        for folder in cache.glob("gpt-oss-20b-shapes-mxfp4-*"):
            shutil.rmtree(folder, ignore_errors=True)
        print(f"removed the MXFP4 models in {cache}")
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    print(f"measuring tui_merger at {code_state()}", flush=True)
    t0 = time.perf_counter()
    folder = ensure_model(cache, args.layers)
    base, adapter = folder / "base", folder / "adapter"

    def merge(code: Path | None, *extra):
        """The CLI merge with the package imported from ``code`` (a checkout; None: this one)."""
        where = str((code or Path(__file__).resolve().parent.parent).resolve())

        def argv(out):
            args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain",
                    "--no-verify", *extra]
            return [sys.executable, "-c", f"import sys; sys.path.insert(0, {where!r}); from tui_merger.cli import "
                    f"entry; sys.argv = ['tui-merger'] + {args!r}; entry()"]
        return argv

    cases = {"cp -r": lambda out: ["cp", "-r", str(base), str(out)],
             "ours (bf16 out)": merge(None), "ours --keep-quantization": merge(None, "--keep-quantization")}
    if args.code is not None:
        cases["other checkout (bf16 out)"] = merge(args.code)
        cases["other checkout --keep-quantization"] = merge(args.code, "--keep-quantization")
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    runner = Runner(tmp_root, sync=True, settle=args.settle, inputs=[base, adapter])
    load0 = loadavg()
    try:
        print(f"base: {dir_bytes(base) / 1e9:.2f} GB ({args.layers} layers, experts MXFP4)", flush=True)
        results = timed_rounds(runner, cases, args.repeats)
    except ChildFailed as err:
        print(f"\nA benchmark child failed:\n{err}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    wall, rss, rows = summarize(results)
    print()
    print(f"Results ({args.repeats} repeats, medians and spread; load average before/after: {load0} / {loadavg()})")
    print(fmt_table(RESULT_HEADERS, rows))
    for name in cases:
        if name.startswith("other"):
            ours = name.replace("other checkout", "ours")
            print(f"  {ours}: {rss[ours]:.0f} MiB vs {rss[name]:.0f} MiB with the other checkout "
                  f"({rss[ours] / rss[name]:.2f}x), wall {wall[ours]:.1f} s vs {wall[name]:.1f} s")
    print(f"total benchmark runtime: {time.perf_counter() - t0:.0f} s  (pid {os.getpid()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
