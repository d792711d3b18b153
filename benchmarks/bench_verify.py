#!/usr/bin/env python
"""The default merge (merge + manifest + verification, as a user runs it) against ``cp -r``, the merge
alone and peft, at real sizes, side by side in one run.

    python benchmarks/bench_verify.py                        # 0.5b, 1.5b and 3b shapes, 2 rounds each
    python benchmarks/bench_verify.py --shapes 3b --repeats 3
    python benchmarks/bench_verify.py --shapes 3b --dora        # also DoRA: our default merge and peft's
    python benchmarks/bench_verify.py --shapes 3b --repeats 3 --code /tmp/before --cases merge,peft
                                                             # A/B: also "merge" on another checkout's code
    python benchmarks/bench_merge.py --clean                 # delete benchmarks/.cache (the 3B model is 6 GB)

Models: Qwen2.5 shapes (0.5B: 24 layers, 1.5B: 28, 3B: 36; vocab 151936, tied), random bf16 weights,
with an r=16 alpha=32 adapter on all seven linear kinds, built once in benchmarks/.cache/ by
bench_merge.py's builder. Cases, each in its own child process with warm inputs, round robin:

- ``cp -r``: the base copied (the I/O floor of writing a model);
- ``merge --no-verify``: the CLI, merge and manifest only;
- ``merge``: the CLI as a user runs it (merge, manifest, verification: structure, every value recomputed,
  merged model and base+adapter through peft run layer by layer);
- ``merge, lora_alpha 24``: the same with the adapter's lora_alpha set to 24 (scale 1.5: the merge and
  the recompute cannot fold a power of two into one addmm);
- ``peft``: load bf16, ``PeftModel``, ``merge_and_unload``, ``save_pretrained`` (no verification at all);
- with ``--code DIR``: ``merge (DIR)``, the default merge on the tui_merger package under DIR (another
  checkout, e.g. ``git archive HEAD~1 tui_merger | tar -x -C DIR``), in the same rounds: on this shared
  machine the load swings within minutes, so a before/after comparison is only fair side by side.

Our cases import tui_merger from this checkout (or DIR), whatever the installed package points at.
``--cases`` keeps only the named cases (comma-separated names as in the table; ``merge`` also keeps
``merge (DIR)``), to spend a busy machine's time on the rows that matter.

Peak RSS is each child's own ru_maxrss. The phase times come from the manifest the default merge writes
(merge_s, hash_s, verify_s); the behaviour check's worst layer (its difference over its limit) too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import child_peft, ensure_model  # noqa: E402
from harness import DEFAULT_CACHE, REPO, Runner, dir_bytes, fmt_table, loadavg, med, summarize, timed_rounds  # noqa: E402


def child_cli(base: str, adapter: str, out: str, verify: str, code: str = "") -> None:
    """tui-merger merge as the console script runs it (its process settings, and no interpreter
    teardown at the end), then the manifest's timings and metrics. ``code``: the folder whose
    tui_merger package is measured (default: this checkout's)."""
    import os

    folder = code or str(REPO)
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, [os.environ.get("PYTHONPATH")])])
    from tui_merger.cli import console_defaults, leave, main

    assert Path(sys.modules["tui_merger"].__file__).resolve().is_relative_to(Path(folder).resolve()), "wrong tui_merger"

    console_defaults()
    args = ["merge", "--base", base, "--adapter", adapter, "--out", out, "--plain"]
    code = main(args + ([] if verify == "1" else ["--no-verify"]))
    manifest = json.loads((Path(out) / "merge_manifest.json").read_text())
    ver = manifest.get("verification") or {}
    checks = {c["name"]: c for c in ver.get("checks", [])}
    behaviour = checks.get("behaviour", {}).get("metrics", {})
    print("BENCH_JSON " + json.dumps({
        "code": code, "timings": manifest.get("timings", {}), "passed": ver.get("passed"),
        "worst_ratio": behaviour.get("worst_ratio"), "peak_live_values": behaviour.get("peak_live_values"),
        "layers": behaviour.get("layers"),
    }), flush=True)
    leave(code)


CHILDREN = {"_cli": child_cli, "_peft": child_peft}


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def bench_shape(shape: str, args) -> dict:
    folder = ensure_model(args.cache, None, shape=shape)
    base, adapter = folder / "base", folder / "adapter_all"
    adapter_a24 = scaled_copy(adapter, folder / "adapter_all_alpha24", 24)
    tmp_root = Path(tempfile.mkdtemp(prefix=f"verify-{shape}-", dir=args.cache))
    runner = Runner(tmp_root, sync=True, settle=1.0, inputs=[base, adapter], tag=lambda n: n.split()[0])
    cases = {
        "cp -r": lambda out: ["cp", "-r", str(base), str(out)],
        "merge --no-verify": lambda out: py("_cli", base, adapter, out, 0),
        "merge": lambda out: py("_cli", base, adapter, out, 1),
        "merge, lora_alpha 24": lambda out: py("_cli", base, adapter_a24, out, 1),
        "peft": lambda out: py("_peft", base, adapter, out),
    }
    if args.dora:  # DoRA on all linear kinds (exact_check.py's adapter, built with peft on first use)
        from exact_check import ensure_dora_adapter

        adapter_dora = folder / "adapter_dora"
        ensure_dora_adapter(base, adapter_dora)
        cases["merge, DoRA"] = lambda out: py("_cli", base, adapter_dora, out, 1)
        cases["peft, DoRA"] = lambda out: py("_peft", base, adapter_dora, out)
    if args.code is not None:  # right after "merge": the two run minutes apart in every round
        code = args.code.resolve()
        other = {"merge (" + str(args.code) + ")": lambda out: py("_cli", base, adapter, out, 1, code)}
        cases = {k: v for name, make in cases.items() for k, v in [(name, make), *(other.items() if name == "merge" else [])]}
    if args.skip_peft:
        del cases["peft"]
        cases.pop("peft, DoRA", None)
    if args.cases:
        keep = {c.strip() for c in args.cases.split(",")}
        cases = {k: v for k, v in cases.items() if k in keep or k.split(" (")[0] in keep}
    load0 = loadavg()
    try:
        results = timed_rounds(runner, cases, args.repeats)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    wall, rss, rows = summarize(results)
    inner = {}
    for name, runs in results.items():
        for r in runs:
            line = next((x for x in r["stdout"].splitlines() if x.startswith("BENCH_JSON ")), None)
            if line:
                inner.setdefault(name, []).append(json.loads(line[len("BENCH_JSON "):]))
    size = dir_bytes(base)
    print(f"\n== Qwen2.5-{shape} shapes: {size / 1e9:.2f} GB bf16; load average {load0} at the start, {loadavg()} at the end")
    print(fmt_table(["case", "wall median s", "min s", "max s", "cpu s", "peak RSS MiB", "peak RSS max MiB"], rows))
    nan = float("nan")
    cpu = {k: med([r["cpu"] for r in v]) for k, v in results.items()}
    default = inner.get("merge", [])
    phases = {k: med([d["timings"].get(k, nan) for d in default]) for k in ("merge_s", "hash_s", "verify_s")}
    worst = max((d.get("worst_ratio") or 0.0) for d in default) if default else nan
    assert all(d.get("passed") is not False for runs in inner.values() for d in runs), "a correct merge failed verification"
    fig = {
        "shape": shape, "gb": size / 1e9, "cp": wall.get("cp -r", nan), "no_verify": wall.get("merge --no-verify", nan),
        "default": wall.get("merge", nan), "peft": wall.get("peft", nan), "rss_default": rss.get("merge", nan),
        "rss_no_verify": rss.get("merge --no-verify", nan), "rss_peft": rss.get("peft", nan),
        "worst_ratio": worst, **phases,
    }
    for name in [n for n in results if n == "merge" or n.startswith("merge (")]:
        if "peft" not in results:
            break
        # each round's ratio (the two ran minutes apart, under about the same load): steadier than a ratio of medians
        paired = [p["wall"] / m["wall"] for m, p in zip(results[name], results["peft"])]
        cpu_paired = [p["cpu"] / m["cpu"] for m, p in zip(results[name], results["peft"])]
        print(f"  {name}: {wall['peft'] / wall[name]:.2f}x faster than peft (medians); per round "
              f"{', '.join(f'{x:.2f}' for x in paired)} (median {med(paired):.2f}); CPU time (user+sys) "
              f"{cpu['peft'] / cpu[name]:.2f}x less (per round {', '.join(f'{x:.2f}' for x in cpu_paired)})")
    if "cp -r" in wall and "merge" in wall:
        print(f"  default merge: {fig['default']:.1f} s = {fig['default'] / fig['cp']:.1f}x cp"
              + (f"; merge --no-verify {fig['no_verify'] / fig['cp']:.1f}x cp" if "merge --no-verify" in wall else ""))
    if default:
        print(f"  in the default merge: merge {phases['merge_s']:.1f} s, hashing {phases['hash_s']:.1f} s, "
              f"verification {phases['verify_s']:.1f} s = {phases['verify_s'] / phases['merge_s']:.2f}x the merge")
        print(f"  peak RSS: default {fig['rss_default']:.0f} MiB = {fig['rss_default'] / fig['rss_peft']:.0%} of peft's "
              f"{fig['rss_peft']:.0f} MiB; --no-verify {fig['rss_no_verify']:.0f} MiB")
        print(f"  behaviour check: the worst hidden state or logits at {worst:.1%} of its limit")
    if "merge, lora_alpha 24" in wall:
        print(f"  lora_alpha 24 (scale 1.5, no power of two): {wall['merge, lora_alpha 24']:.1f} s, "
              f"{rss['merge, lora_alpha 24']:.0f} MiB ({wall['merge, lora_alpha 24'] / fig['default']:.2f}x the alpha-32 merge)")
    if "merge, DoRA" in wall:
        line = f"  DoRA (all linear kinds): the default merge {wall['merge, DoRA']:.1f} s, {rss['merge, DoRA']:.0f} MiB"
        if "peft, DoRA" in wall:
            line += (f"; peft's merge alone {wall['peft, DoRA']:.1f} s, {rss['peft, DoRA']:.0f} MiB "
                     f"({wall['peft, DoRA'] / wall['merge, DoRA']:.2f}x)")
        print(line)
    return fig


def scaled_copy(adapter: Path, folder: Path, alpha: int) -> Path:
    """The same adapter with another lora_alpha (its tensors are the same; only the scale changes)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    if not (folder / "adapter_config.json").is_file() or json.loads((folder / "adapter_config.json").read_text()) != {**config, "lora_alpha": alpha}:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(adapter, folder)
        (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": alpha}, indent=2))
    return folder


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in CHILDREN:
        CHILDREN[sys.argv[1]](*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b,1.5b,3b")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-peft", action="store_true")
    parser.add_argument("--dora", action="store_true", help="also a DoRA adapter: our default merge and peft's")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--code", type=Path, help="also time the default merge on the tui_merger package in this folder (A/B)")
    parser.add_argument("--cases", help="only these cases, comma-separated names (e.g. 'merge,peft'; 'merge' keeps 'merge (DIR)' too)")
    args = parser.parse_args(argv)
    figs = [bench_shape(shape, args) for shape in args.shapes.split(",")]
    if len(figs) > 1:
        small, big = figs[0], figs[-1]
        print(f"\npeak RSS of the default merge, {big['shape']} vs {small['shape']}: "
              f"{big['rss_default'] / small['rss_default']:.2f}x for {big['gb'] / small['gb']:.1f}x the weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
