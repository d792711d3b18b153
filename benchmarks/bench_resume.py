#!/usr/bin/env python
"""What a resume costs: finishing a merge interrupted at 90% vs a fresh merge, side by side in one run.

    python benchmarks/bench_resume.py              # medians of 3
    python benchmarks/bench_resume.py --repeats 5

Model: bench_merge.py's Qwen2.5-0.5B-shaped bf16 base (0.99 GB) and r=16 all-linear adapter, written in
100 MB shards. Each case runs ``run_merge`` in its own child process (torch imported before
the clock starts, fsync on, as the CLI does):

- fresh: a merge from nothing;
- resume at 90%: a merge stopped (KeyboardInterrupt, as Ctrl-C / SIGTERM / SIGHUP raise it) once about
  90% of the bytes are in finished, journaled shards, then timed: the run that checks the kept shards
  against their sha256 and writes the rest.
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
from harness import DEFAULT_CACHE, med, run_child  # noqa: E402

SHARD = "100MB"


def child(base: str, adapter: str, out: str, stop_at: str) -> None:
    import torch  # noqa: F401  (imported before the clock, as in the other benchmarks)

    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import TensorProgress
    from tui_merger.core.options import MergeOptions

    options = MergeOptions(base=base, adapter=adapter, out=out, shard_size=SHARD)
    stop = float(stop_at)
    if stop:
        partial = Path(out).parent / f".{Path(out).name}.tui-merger-partial"

        def interrupt(event):
            if isinstance(event, TensorProgress) and event.bytes_done >= stop * event.bytes_total:
                journal = partial / ".tui-merger-journal.json"
                while True:  # the finished shards hashed and recorded: about 90% of the bytes
                    shards = json.loads(journal.read_text())["shards"]
                    if sum(e["size"] for e in shards.values()) >= 0.85 * event.bytes_total:
                        break
                    time.sleep(0.01)
                raise KeyboardInterrupt

        try:
            run_merge(options, interrupt)
        except MergeCancelled:
            pass
        else:
            raise SystemExit("the merge was not interrupted")
    t0 = time.perf_counter()
    run_merge(options)
    print("BENCH_JSON " + json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


def seconds(result: dict) -> float:
    line = next(x for x in result["stdout"].splitlines() if x.startswith("BENCH_JSON "))
    return json.loads(line[len("BENCH_JSON "):])["seconds"]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        child(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = ensure_model(DEFAULT_CACHE, 24)
    base, adapter = folder / "base", folder / "adapter_all"
    tmp = Path(tempfile.mkdtemp(prefix="resume-", dir=DEFAULT_CACHE))
    results = {"fresh": [], "resume at 90%": []}
    try:
        for rep in range(args.repeats):
            for name, stop in (("fresh", 0), ("resume at 90%", 0.92)):
                out = tmp / f"out-{rep}-{stop}"
                r = run_child([sys.executable, __file__, "_child", str(base), str(adapter), str(out), str(stop)], capture=True)
                results[name].append(seconds(r))
                print(f"  [{rep + 1}/{args.repeats}] {name}: {results[name][-1]:.2f} s", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    fresh, resumed = med(results["fresh"]), med(results["resume at 90%"])
    print(f"\nfresh merge {fresh:.2f} s; finishing a merge interrupted at 90% {resumed:.2f} s "
          f"= {resumed / fresh:.2f}x a fresh merge (medians of {args.repeats}; 0.99 GB in 100 MB shards)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
