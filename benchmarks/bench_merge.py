#!/usr/bin/env python
"""Benchmark tui-merger's merge against ``cp -r`` (the I/O floor) and peft's merge_and_unload.

    python benchmarks/bench_merge.py                 # cp / ours / peft / ours(q,v), medians + peak RSS
    python benchmarks/bench_merge.py --repeats 5
    python benchmarks/bench_merge.py --scaling       # our peak RSS for 6, 12, 24, 48 layers
    python benchmarks/bench_merge.py --profile       # cProfile of one run_merge (fsync=False)
    python benchmarks/bench_merge.py --clean         # delete benchmarks/.cache and exit

The base model has Qwen2.5-0.5B shapes (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 kv heads,
vocab 151936, tied embeddings), random bf16 weights, saved by transformers' save_pretrained in exactly
2 shards. Adapters: r=16, alpha=32 on all 7 linear kinds, and one on q_proj/v_proj only, both saved by
peft with non-zero random lora_B. Everything is built once and cached in benchmarks/.cache/.

The CLI cases run ``tui-merger merge ... --no-verify`` (verification is measured by bench_verify.py;
the manifest's sha256 pass over inputs and outputs is included). Every timed case runs in its own child process; its peak RSS is the ru_maxrss that ``os.wait4``
reports for that child alone. This parent process never imports torch, so that the children's
ru_maxrss is not inflated by the parent's memory (exec records the pre-exec mm's high-water mark,
and with vfork that mm is the parent's). Outputs go to a temporary folder inside the cache (same
disk as the inputs) and are deleted after every run; ``sync`` runs between cases (untimed) so that
no case pays for the previous case's write-back, followed by ``--settle`` seconds of waiting: on a VM
with virtio-balloon free-page reporting, freshly freed memory is cheap to reuse for ~1 s and then costs
a host page fault per 4 KiB page on first touch (writing 715 MB into the page cache: 0.15 s vs 1.2 s),
which otherwise favours whichever case starts writing soonest after the previous output was deleted.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: run as `python benchmarks/bench_merge.py`

from harness import (  # noqa: E402
    DEFAULT_CACHE,
    RESULT_HEADERS,
    ChildFailed,
    Runner,
    bench_json,
    code_state,
    dir_bytes,
    fmt_table,
    load_tensors,
    loadavg,
    med,
    print_rss_floor,
    profile_run_merge,
    qwen_config,
    remove_kept,
    rss_floor,
    run_child,
    run_child_command,
    summarize,
    timed_rounds,
    warm_up,
)

SPEC_VERSION = 1
LORA_R, LORA_ALPHA = 16, 32
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QV_TARGETS = ["q_proj", "v_proj"]
MIB = 1024 * 1024

# ----------------------------------------------------------------------------------------------
# Children (run as `python bench_merge.py _<name> ...`; these are the only places torch is imported)
# ----------------------------------------------------------------------------------------------


def child_build(folder: str, layers: int, seed: int, shape: str = "0.5b") -> None:
    """Base (bf16, 2 shards, random) + two peft adapters, in `folder`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    t0 = time.perf_counter()
    folder = Path(folder)
    base_dir, ad_all, ad_qv = folder / "base", folder / "adapter_all", folder / "adapter_qv"
    torch.manual_seed(seed)
    cfg = qwen_config(layers, eos_token_id=151643, shape=shape)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    model.config.dtype = torch.bfloat16
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    shard = int(total * 0.55)  # greedy sharding: first shard <= 55%, the rest (< 55%) in the second
    model.save_pretrained(base_dir, max_shard_size=shard)
    shards = sorted(p.name for p in base_dir.glob("*.safetensors"))
    index = json.loads((base_dir / "model.safetensors.index.json").read_text())
    assert len(shards) == 2, f"expected 2 shards, got {shards}"
    assert "lm_head.weight" not in index["weight_map"], "lm_head saved although tied"
    t1 = time.perf_counter()

    def make_adapter(targets, out):
        lcfg = LoraConfig(
            r=LORA_R,
            lora_alpha=LORA_ALPHA,
            target_modules=list(targets),
            lora_dropout=0.0,
            init_lora_weights=False,
            task_type="CAUSAL_LM",
        )
        pm = get_peft_model(model, lcfg)
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if ".lora_A." in name or ".lora_B." in name:
                    p.normal_(0.0, 0.05)  # delta ~ 2 * 16 * 0.05^2 ~ comparable to the 0.02 weights
        pm.save_pretrained(out)
        n_b = sum(1 for n, _ in pm.named_parameters() if ".lora_B." in n)
        return pm.unload(), n_b

    model, n_all = make_adapter(ALL_TARGETS, ad_all)
    model, n_qv = make_adapter(QV_TARGETS, ad_qv)
    t2 = time.perf_counter()
    print(
        f"built {layers} layers: base {total / 1e9:.3f} GB in {shards} ({t1 - t0:.1f} s), "
        f"adapters with {n_all} and {n_qv} LoRA pairs ({t2 - t1:.1f} s)",
        flush=True,
    )


def child_peft(base: str, adapter: str, out: str) -> None:
    """The peft reference path: load bf16, PeftModel, merge_and_unload, save_pretrained."""
    t = [time.perf_counter()]
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t.append(time.perf_counter())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    t.append(time.perf_counter())
    model = PeftModel.from_pretrained(model, adapter)
    t.append(time.perf_counter())
    model = model.merge_and_unload()
    t.append(time.perf_counter())
    model.save_pretrained(out)
    t.append(time.perf_counter())
    phases = ["import", "load base", "load adapter", "merge", "save"]
    print("BENCH_JSON " + json.dumps({k: t[i + 1] - t[i] for i, k in enumerate(phases)}), flush=True)


def child_ours(base: str, adapter: str, out: str, fsync: str) -> None:
    """run_merge in-process (lets us pass fsync=False) and report where the time went, by phase."""
    t0 = time.perf_counter()
    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.events import PhaseStarted
    from tui_merger.core.options import MergeOptions

    t1 = time.perf_counter()
    import torch  # noqa: F401  (imported here so that its cost shows as its own phase)

    marks = [("import tui_merger", t0), ("import torch", t1)]

    def on_event(ev):
        if isinstance(ev, PhaseStarted):
            marks.append((ev.phase, time.perf_counter()))

    result = run_merge(MergeOptions(base=base, adapter=adapter, out=out), on_event, fsync=fsync == "1")
    marks.append(("end", time.perf_counter()))
    phases = {marks[i][0]: marks[i + 1][1] - marks[i][1] for i in range(len(marks) - 1)}
    phases["run_merge total"] = marks[-1][1] - marks[2][1]
    phases["tensors_merged"] = result.tensors_merged
    print("BENCH_JSON " + json.dumps(phases), flush=True)


def child_profile(base: str, adapter: str, out: str, top: str) -> None:
    from tui_merger.core.options import MergeOptions

    import torch  # noqa: F401  (import cost is not what we profile)

    profile_run_merge(MergeOptions(base=base, adapter=adapter, out=out), top)


def child_verify(base: str, adapter: str, ours: str, peft_out: str, targets: str) -> None:
    """Not timed: our output == peft's output, and both differ from the base where the adapter acts."""
    import torch
    from safetensors import safe_open

    ok = True
    b = load_tensors(base)
    o = load_tensors(ours)
    ad = {}
    with safe_open(str(Path(adapter) / "adapter_model.safetensors"), framework="pt") as h:
        for k in h.keys():
            ad[k] = h.get_tensor(k)
    acfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    scale = acfg["lora_alpha"] / acfg["r"]
    targets = targets.split(",")

    # 1. the named tensors against an independent fp32 round-once computation
    checks = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight"]
    if "down_proj" in targets:
        checks.append("model.layers.0.mlp.down_proj.weight")
    for name in checks:
        mod = name.removesuffix(".weight")
        A = ad[f"base_model.model.{mod}.lora_A.weight"].float()
        B = ad[f"base_model.model.{mod}.lora_B.weight"].float()
        expected = (b[name].float() + scale * (B @ A)).to(b[name].dtype)
        eq = torch.equal(o[name], expected)
        changed = not torch.equal(o[name], b[name])
        print(f"  ours {name}: equal to W + s*B@A (fp32, rounded once): {eq}; differs from base: {changed}")
        ok &= eq and changed

    # 2. untouched tensors are byte-identical to the base
    touched = [k for k in b if any(f".{t}.weight" in k for t in targets)]
    untouched = [k for k in b if k not in touched]
    same = sum(o[k].dtype == b[k].dtype and torch.equal(o[k], b[k]) for k in untouched)
    print(f"  ours: {same}/{len(untouched)} untouched tensors byte-identical to the base; "
          f"{len(touched)} adapted; tensors in ours {len(o)} vs base {len(b)}")
    ok &= same == len(untouched) and set(o) == set(b)

    # 3. against peft's merged output, every tensor
    if peft_out != "-":
        p = load_tensors(peft_out)
        common = sorted(set(o) & set(p))
        diff = [k for k in common if not torch.equal(o[k], p[k])]
        print(f"  ours vs peft: {len(common) - len(diff)}/{len(common)} tensors torch.equal; "
              f"only in ours: {sorted(set(o) - set(p))[:3]}, only in peft: {sorted(set(p) - set(o))[:3]}")
        for k in diff[:5]:
            d = (o[k].float() - p[k].float()).abs()
            print(f"    differs: {k} max|d|={d.max().item():.3g} n={int((d > 0).sum())}")
        q0 = "model.layers.0.self_attn.q_proj.weight"
        print(f"  torch.equal(ours[{q0}], peft[{q0}]) = {torch.equal(o[q0], p[q0])}")
        ok &= not diff and set(o) == set(p)
        oc = json.loads((Path(ours) / "config.json").read_text())
        pc = json.loads((Path(peft_out) / "config.json").read_text())
        print(f"  config tie_word_embeddings: ours {oc.get('tie_word_embeddings')}, "
              f"peft {pc.get('tie_word_embeddings')}")
    print("VERIFY_OK" if ok else "VERIFY_FAILED", flush=True)


CHILDREN = {
    "_build": lambda a: child_build(a[0], int(a[1]), int(a[2]), *a[3:]),
    "_peft": lambda a: child_peft(*a),
    "_ours": lambda a: child_ours(*a),
    "_profile": lambda a: child_profile(*a),
    "_verify": lambda a: child_verify(*a),
}

# ----------------------------------------------------------------------------------------------
# Parent (no torch here)
# ----------------------------------------------------------------------------------------------


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def ours_cli(base, adapter, out) -> list[str]:
    return [sys.executable, "-m", "tui_merger", "merge", "--base", str(base), "--adapter", str(adapter),
            "--out", str(out), "--plain", "--no-verify"]


def ensure_model(cache: Path, layers: int | None = 24, seed: int = 0, shape: str = "0.5b") -> Path:
    """The cached base + adapters of Qwen2.5 `shape` (0.5b, 1.5b, 3b) with `layers` layers (None: the
    real count). 0.5B with 24 layers keeps its old folder name."""
    from harness import QWEN_SHAPES

    layers = QWEN_SHAPES[shape][2] if layers is None else layers
    folder = cache / f"qwen2.5-{shape}-shapes-L{layers}"
    marker = folder / "complete.json"
    spec = {"version": SPEC_VERSION, "layers": layers, "seed": seed, "r": LORA_R, "alpha": LORA_ALPHA}
    if shape != "0.5b":
        spec["shape"] = shape
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    print(f"building the {shape} {layers}-layer base model and adapters in {folder} ...", flush=True)
    r = run_child(py("_build", folder, layers, seed, shape), capture=True)
    print("  " + r["stdout"].strip() + f"  [{r['wall']:.1f} s, peak RSS {r['rss']:.0f} MiB]", flush=True)
    marker.write_text(json.dumps(spec))
    return folder


def main_bench(args, cache: Path) -> int:
    folder = ensure_model(cache, 24)
    base, ad_all, ad_qv = folder / "base", folder / "adapter_all", folder / "adapter_qv"
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    runner = Runner(tmp_root, sync=not args.no_sync, settle=args.settle, inputs=[base, ad_all, ad_qv],
                    tag=lambda name: name.split()[0])
    cases = {
        "cp -r": lambda out: ["cp", "-r", str(base), str(out)],
        "ours (CLI, fsync)": lambda out: ours_cli(base, ad_all, out),
        "ours (run_merge fsync=False)": lambda out: py("_ours", base, ad_all, out, 0),
        "peft": lambda out: py("_peft", base, ad_all, out),
        "ours q,v (CLI, fsync)": lambda out: ours_cli(base, ad_qv, out),
        "ours q,v (run_merge fsync=False)": lambda out: py("_ours", base, ad_qv, out, 0),
    }
    if args.skip_peft:
        del cases["peft"]
    load0 = loadavg()
    try:
        print(f"base: {base} ({dir_bytes(base) / 1e9:.3f} GB, "
              f"{len(list(base.glob('*.safetensors')))} shards); outputs in {tmp_root}", flush=True)
        # context: what a bare process and a bare `import torch` cost in RSS
        floor = rss_floor({
            "true": ["true"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python -c 'import tui_merger.core.merge.engine, torch'": [sys.executable, "-c",
                                                                   "import tui_merger.core.merge.engine, torch"],
        })

        kept = warm_up(runner, cases, ("ours (run_merge fsync=False)", "peft", "ours q,v (run_merge fsync=False)"))
        verify_ok = True
        if not args.skip_verify:
            peft_out = kept.get("peft", "-")
            for label, ad, ours_out, targets in (
                ("all 7 kinds", ad_all, kept["ours (run_merge fsync=False)"], ALL_TARGETS),
                ("q,v only", ad_qv, kept["ours q,v (run_merge fsync=False)"], QV_TARGETS),
            ):
                print(f" verify ({label}):", flush=True)
                r = run_child(py("_verify", base, ad, ours_out, peft_out if ad is ad_all else "-",
                                 ",".join(targets)), capture=True)
                print(r["stdout"].rstrip(), flush=True)
                verify_ok &= "VERIFY_OK" in r["stdout"]
        remove_kept(kept)

        results = timed_rounds(runner, cases, args.repeats)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    wall, rss, rows = summarize(results)
    print()
    print(f"Results ({args.repeats} repeats, medians; sync + {args.settle:g} s settle + "
          f"inputs re-read into the page cache before each case; load average before/after: {load0} / {loadavg()})")
    print(fmt_table(RESULT_HEADERS, rows))
    print()
    print_rss_floor(floor)

    # where the time goes inside the children that report it
    for name in ("ours (run_merge fsync=False)", "ours q,v (run_merge fsync=False)", "peft"):
        if name in results:
            phases = [bench_json(r["stdout"]) for r in results[name]]
            phases = [p for p in phases if p]
            if phases:
                keys = [k for k in phases[0] if k != "tensors_merged"]
                total = med([r["wall"] for r in results[name]])
                inner = sum(med([p[k] for p in phases]) for k in keys if k != "run_merge total")
                print(f"phases of {name} (medians, s): "
                      + ", ".join(f"{k} {med([p[k] for p in phases]):.2f}" for k in keys)
                      + f"; interpreter start-up + exit ~{total - inner:.2f}")

    # ours without process start-up and imports: the part a long-running front end (the TUI) pays
    inproc = {}
    for name in ("ours (run_merge fsync=False)", "ours q,v (run_merge fsync=False)"):
        if name in results:
            vals = [bench_json(r["stdout"]) for r in results[name]]
            inproc[name] = med([v["run_merge total"] for v in vals if v])

    def ratio_line(label, num, den, target, better_low=True):
        if num not in wall or den not in wall:
            return
        val = (rss if label.startswith("ours-RSS") else wall)[num] / (rss if label.startswith("ours-RSS") else wall)[den]
        ok = val <= target if better_low else val >= target
        print(f"  {label:<44} {val:6.2f}   target {'<=' if better_low else '>='} {target:<5} "
              f"{'OK' if ok else 'MISSED'}")

    print()
    for variant, ours, ours_qv in (
        ("CLI, fsync", "ours (CLI, fsync)", "ours q,v (CLI, fsync)"),
        ("run_merge fsync=False", "ours (run_merge fsync=False)", "ours q,v (run_merge fsync=False)"),
    ):
        print(f"Ratios, ours = {variant}:")
        ratio_line("ours / cp (wall)", ours, "cp -r", 3.0)
        ratio_line("peft / ours (wall)", "peft", ours, 5.0, better_low=False)
        ratio_line("ours-RSS / peft-RSS", ours, "peft", 0.40)
        ratio_line("ours(q,v) / cp (wall)", ours_qv, "cp -r", 1.5)
    if inproc:
        print("Ratios, ours = run_merge(fsync=False) alone, in-process (no interpreter start-up, torch already "
              "imported):")
        a, q = inproc.get("ours (run_merge fsync=False)"), inproc.get("ours q,v (run_merge fsync=False)")
        if a:
            print(f"  run_merge all 7 kinds: {a:.2f} s;  / cp {a / wall['cp -r']:.2f} (target <= 3.0);  "
                  + (f"peft / it {wall['peft'] / a:.2f} (target >= 5.0)" if "peft" in wall else ""))
        if q:
            print(f"  run_merge q,v only:    {q:.2f} s;  / cp {q / wall['cp -r']:.2f} (target <= 1.5)")
    if not args.skip_verify:
        print()
        print("verification: " + ("ours == peft (all tensors torch.equal) and == fp32 round-once math"
                                  if verify_ok else "FAILED (see above)"))
    return 0 if verify_ok else 1


def main_scaling(args, cache: Path) -> int:
    sizes = [int(x) for x in args.layers.split(",")]
    folders = {n: ensure_model(cache, n) for n in sizes}
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    runner = Runner(tmp_root, sync=not args.no_sync, settle=args.settle, inputs=[],
                    tag=lambda name: name.split()[0])
    rows = []
    try:
        for n in sizes:
            base, ad = folders[n] / "base", folders[n] / "adapter_all"
            runner.inputs = [base, ad]
            cases = {
                "cp": lambda out: ["cp", "-r", str(base), str(out)],
                "cli": lambda out: ours_cli(base, ad, out),
                "nofsync": lambda out: py("_ours", base, ad, out, 0),
            }
            for name, make in cases.items():  # warm-up
                runner.run(name, make)
            res = {k: [] for k in cases}
            for _ in range(args.repeats):
                for name, make in cases.items():
                    res[name].append(runner.run(name, make)[0])
            w = {k: med([r["wall"] for r in v]) for k, v in res.items()}
            m = {k: med([r["rss"] for r in v]) for k, v in res.items()}
            size = dir_bytes(base)
            rows.append([n, f"{size / 1e9:.3f}", f"{w['cp']:.2f}", f"{w['cli']:.2f}", f"{w['nofsync']:.2f}",
                         f"{w['nofsync'] / w['cp']:.2f}", f"{m['cli']:.0f}", f"{m['nofsync']:.0f}"])
            print(f"  {n} layers done: {rows[-1]}", flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print()
    print(f"Scaling (Qwen2.5-0.5B widths, LoRA r=16 on all 7 kinds; {args.repeats} repeats, medians; "
          f"settle {args.settle:g} s)")
    print(fmt_table(["layers", "base GB", "cp s", "ours CLI s", "ours nofsync s", "nofsync/cp",
                     "ours CLI peak RSS MiB", "ours nofsync peak RSS MiB"], rows))
    return 0


def main_profile(args, cache: Path) -> int:
    folder = ensure_model(cache, 24)
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    try:
        out = tmp_root / "profiled"
        Runner(tmp_root, True, 0, []).preread([folder / "base", folder / "adapter_all"])
        r = run_child(py("_profile", folder / "base", folder / "adapter_all", out, args.top), capture=True)
        print(r["stdout"])
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, CHILDREN):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (default 3)")
    ap.add_argument("--scaling", action="store_true", help="peak RSS of our merge across model sizes")
    ap.add_argument("--layers", default="6,12,24,48", help="layer counts for --scaling (default 6,12,24,48)")
    ap.add_argument("--profile", action="store_true", help="cProfile one run_merge(fsync=False)")
    ap.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    ap.add_argument("--skip-peft", action="store_true", help="leave out the peft case")
    ap.add_argument("--skip-verify", action="store_true", help="leave out the ours-vs-peft check")
    ap.add_argument("--no-sync", action="store_true", help="do not run sync between cases")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait (untimed) before each case, after deleting the previous output and "
                    "sync (default 3). On VMs with free-page reporting (virtio-balloon), memory freed a moment "
                    "ago is fast to reuse while memory freed >2 s ago costs a host page fault per page on "
                    "first touch; the wait gives every case the same starting state. 0 favours cases that "
                    "start writing at once (cp)."),
    ap.add_argument("--keep-cache", action=argparse.BooleanOptionalAction, default=True,
                    help="keep the generated models in the cache after the run (default: keep)")
    ap.add_argument("--clean", action="store_true", help="delete the cache and exit")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="default: benchmarks/.cache")
    args = ap.parse_args(argv)
    cache = args.cache_dir.resolve()
    if args.clean:
        shutil.rmtree(cache, ignore_errors=True)
        print(f"removed {cache}")
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob("run-*"):  # temp folders of an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    print(f"measuring tui_merger at {code_state()}", flush=True)
    try:
        if args.profile:
            rc = main_profile(args, cache)
        elif args.scaling:
            rc = main_scaling(args, cache)
        else:
            rc = main_bench(args, cache)
    except ChildFailed as err:
        print(f"\nA benchmark child failed:\n{err}", file=sys.stderr)
        rc = 2
    finally:
        if not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    print(f"\ntotal benchmark runtime: {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
