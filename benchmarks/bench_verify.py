#!/usr/bin/env python
"""What verification and provenance cost next to the merge itself, measured side by side in one run.

    python benchmarks/bench_verify.py              # medians of 3 round-robin runs, peak RSS
    python benchmarks/bench_verify.py --repeats 5

Model: bench_merge.py's Qwen2.5-0.5B-shaped bf16 base (0.99 GB, 24 layers, tied) with the r=16 all-linear
adapter, built once in benchmarks/.cache/. Cases, each in its own child process with warm inputs:

- ``cp -r``: the base copied (the I/O floor of writing a model);
- ``merge``: ``run_merge`` (fsync) alone;
- ``hash``: sha256 of inputs and outputs into merge_manifest.json (``record_merge``);
- ``verify files+tensors``: structure + recomputation of every tensor (``--no-behaviour``);
- ``verify full``: + loading the merged model and base+adapter through peft, logits compared.

Peak RSS is each child's own ru_maxrss; the model's size is printed beside it, since verification loads
one model at a time (fp32 when it fits in 40 % of the available memory).
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

from bench_merge import ensure_model  # noqa: E402
from harness import DEFAULT_CACHE, Runner, dir_bytes, fmt_table, loadavg, run_child, summarize, timed_rounds  # noqa: E402


def child_merge(base: str, adapter: str, out: str) -> None:
    from tui_merger.core.engine import run_merge
    from tui_merger.core.options import MergeOptions

    t0 = time.perf_counter()
    run_merge(MergeOptions(base=base, adapter=adapter, out=out))
    print("BENCH_JSON " + json.dumps({"merge": time.perf_counter() - t0}), flush=True)


def child_hash(base: str, adapter: str, out: str) -> None:
    """A merge (untimed), then record_merge timed on its own."""
    from tui_merger.core.engine import run_merge
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.provenance import record_merge

    options = MergeOptions(base=base, adapter=adapter, out=out)
    result = run_merge(options, fsync=False)
    t0 = time.perf_counter()
    record_merge(options, result, fsync=False)
    print("BENCH_JSON " + json.dumps({"hash": time.perf_counter() - t0}), flush=True)


def child_verify(base: str, adapter: str, merged: str, behaviour: str) -> None:
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.verify import verify_merge

    t0 = time.perf_counter()
    report = verify_merge(Path(merged), MergeOptions(base=base, adapter=adapter, out=merged), behaviour=behaviour == "1")
    seconds = time.perf_counter() - t0
    assert report.passed, report.to_dict()
    metrics = {c.name: c.metrics for c in report.checks}
    print("BENCH_JSON " + json.dumps({"verify": seconds, "metrics": metrics}), flush=True)


CHILDREN = {"_merge": child_merge, "_hash": child_hash, "_verify": child_verify}


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in CHILDREN:
        CHILDREN[sys.argv[1]](*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)

    folder = ensure_model(args.cache, 24)
    base, adapter = folder / "base", folder / "adapter_all"
    tmp_root = Path(tempfile.mkdtemp(prefix="verify-", dir=args.cache))
    merged = tmp_root / "merged"
    run_child(py("_merge", base, adapter, merged))
    runner = Runner(tmp_root, sync=True, settle=1.0, inputs=[base, adapter, merged], tag=lambda n: n.split()[0])
    cases = {
        "cp -r": lambda out: ["cp", "-r", str(base), str(out)],
        "merge": lambda out: py("_merge", base, adapter, out),
        "hash (merge untimed)": lambda out: py("_hash", base, adapter, out),
        "verify files+tensors": lambda out: py("_verify", base, adapter, merged, 0),
        "verify full": lambda out: py("_verify", base, adapter, merged, 1),
    }
    load0 = loadavg()
    try:
        results = timed_rounds(runner, cases, args.repeats)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    inner = {}
    for name, runs in results.items():
        for r in runs:
            line = next((x for x in r["stdout"].splitlines() if x.startswith("BENCH_JSON ")), None)
            if line:
                inner.setdefault(name, []).append(json.loads(line[len("BENCH_JSON "):]))
    wall, rss, rows = summarize(results)
    size = dir_bytes(base)
    print(f"\nmodel {size / 1e9:.2f} GB bf16; load average before/after: {load0} / {loadavg()}")
    print(fmt_table(["case", "wall median s", "min s", "max s", "cpu s", "peak RSS MiB", "peak RSS max MiB"], rows))

    def inner_med(name, key):
        values = sorted(x[key] for x in inner.get(name, []) if key in x)
        return values[len(values) // 2] if values else float("nan")

    merge = inner_med("merge", "merge")
    print("\nin-process times (child start-up and imports excluded), medians:")
    for name, key in (("merge", "merge"), ("hash (merge untimed)", "hash"), ("verify files+tensors", "verify"), ("verify full", "verify")):
        t = inner_med(name, key)
        print(f"  {name:22} {t:6.2f} s  = {t / merge:4.1f}x the merge   (cp -r: {wall['cp -r']:.2f} s)")
    print(f"  peak RSS of verify full: {rss['verify full']:.0f} MiB = {rss['verify full'] * 2**20 / size:.1f}x the bf16 "
          f"model ({size * 2 / 2**20:.0f} MiB in fp32)")
    m = inner.get("verify full", [{}])[0].get("metrics", {}).get("behaviour", {})
    if m:
        print(f"  behaviour: KL {m.get('kl', float('nan')):.2e}, adapter effect KL {m.get('adapter_effect_kl', float('nan')):.2e}, "
              f"compute dtype {m.get('compute_dtype')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
