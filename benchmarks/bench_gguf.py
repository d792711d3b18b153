"""GGUF export against copying the model: `tui-merger gguf` (bf16, f16, q8_0) on a bf16 model with
Qwen2.5-0.5B shapes (0.99 GB, 2 shards, vocabulary 151936, tied), each case in its own process, round robin.

    python benchmarks/bench_gguf.py                 # cp -r vs the CLI for each type, medians of 3
    python benchmarks/bench_gguf.py --repeats 1
    python benchmarks/bench_gguf.py --scaling       # peak RSS at 12 and 24 layers (memory flat?)

The model is bench_merge.py's cached base (benchmarks/.cache), hard-linked into a folder that also gets a
small trained byte-level BPE tokenizer (Qwen2's split regex; the embedding's other rows are padding ids).
Each case reports wall time and its own peak RSS (ru_maxrss of that child); the in-process case times
export_gguf alone, after torch and transformers are imported (what the assistant pays).
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

from harness import DEFAULT_CACHE, Runner, dir_bytes, fmt_table, loadavg, med, run_child, run_child_command  # noqa: E402

TYPES = ("bf16", "f16", "q8_0")


def child_tokenizer(folder: str) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tui_merger.core.ship.gguf import _QWEN2_SPLIT

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    text = [Path(__file__).read_text()] * 4
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(folder)


def child_cli(src: str, type_: str, out: str) -> None:
    """The command a user runs, in this very process (exec: its peak RSS is this child's)."""
    os.makedirs(out)
    os.execv(sys.executable, [sys.executable, "-m", "tui_merger", "gguf", src, "--type", type_,
                              "--out", os.path.join(out, "m.gguf"), "--plain"])


def child_inproc(src: str, type_: str, out: str) -> None:
    import torch  # noqa: F401  (imported before the clock starts, as in the assistant)
    import transformers  # noqa: F401

    from tui_merger.core.ship.gguf import plan_gguf, write_gguf

    os.makedirs(out)
    t0 = time.perf_counter()
    plan = plan_gguf(Path(src), type_, Path(out) / "m.gguf")
    t1 = time.perf_counter()
    result = write_gguf(plan)
    t2 = time.perf_counter()
    print("BENCH_JSON " + json.dumps({"plan": t1 - t0, "write+hash": t2 - t1, "total": t2 - t0, "size": result.size}))


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def ensure_source(cache: Path, layers: int) -> Path:
    """bench_merge's cached base, hard-linked, plus a tokenizer."""
    from bench_merge import ensure_model

    base = ensure_model(cache, layers) / "base"
    src = cache / f"gguf-source-L{layers}"
    if not (src / "tokenizer.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        for f in base.iterdir():
            if f.is_file():
                os.link(f, src / f.name)
        run_child(py("_tokenizer", src))
    return src


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    children = {
        "_tokenizer": lambda a: child_tokenizer(*a),
        "_cli": lambda a: child_cli(*a),
        "_inproc": lambda a: child_inproc(*a),
    }
    if run_child_command(argv, children):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scaling", action="store_true", help="peak RSS of the q8_0 and bf16 exports at 12 and 24 layers")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args(argv)
    cache = args.cache_dir.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    sizes = (12, 24) if args.scaling else (24,)
    sources = {n: ensure_source(cache, n) for n in sizes}
    tmp_root = Path(tempfile.mkdtemp(prefix="run-", dir=cache))
    load0 = loadavg()
    try:
        if args.scaling:
            rows = []
            for n, src in sources.items():
                runner = Runner(tmp_root, sync=True, settle=0.5, inputs=[src])
                for type_ in ("bf16", "q8_0"):
                    rss = [runner.run(f"gguf-{type_}", lambda out, t=type_: py("_cli", src, t, out))[0]["rss"] for _ in range(args.repeats)]
                    rows.append([f"{n} layers ({dir_bytes(src) / 1e9:.2f} GB)", type_, f"{med(rss):.0f}"])
            print(fmt_table(["model", "type", "peak RSS MiB (median)"], rows))
            return 0
        src = sources[24]
        runner = Runner(tmp_root, sync=True, settle=0.5, inputs=[src])
        cases = {"cp -r": lambda out: ["cp", "-r", str(src), str(out)]}
        for type_ in TYPES:
            cases[f"tui-merger gguf --type {type_}"] = lambda out, t=type_: py("_cli", src, t, out)
            cases[f"export_gguf {type_} (in-process)"] = lambda out, t=type_: py("_inproc", src, t, out)
        print(f"model: {src} ({dir_bytes(src) / 1e9:.3f} GB); outputs in {tmp_root}", flush=True)
        for name, make in cases.items():  # warm-up, untimed
            r, _ = runner.run(name, make)
            print(f"  warm-up {name}: {r['wall']:.2f} s, {r['rss']:.0f} MiB", flush=True)
        results = {name: [] for name in cases}
        for rep in range(args.repeats):
            for name, make in cases.items():
                r, _ = runner.run(name, make)
                results[name].append(r)
                print(f"  [{rep + 1}/{args.repeats}] {name}: {r['wall']:.2f} s, {r['rss']:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    cp = med([r["wall"] for r in results["cp -r"]])
    rows = []
    for name, runs in results.items():
        wall = med([r["wall"] for r in runs])
        inner = [json.loads(line.split(" ", 1)[1]) for r in runs for line in r["stdout"].splitlines() if line.startswith("BENCH_JSON ")]
        detail = ""
        if inner:
            total = med([i["total"] for i in inner])
            detail = f"export_gguf {total:.2f} s ({total / cp:.1f}x cp), plan {med([i['plan'] for i in inner]):.2f} s, {inner[0]['size'] / 1e9:.2f} GB"
        rows.append([name, f"{wall:.2f}", f"{wall / cp:.1f}x", f"{med([r['rss'] for r in runs]):.0f}", detail])
    print()
    print(f"Results ({args.repeats} repeats, medians; inputs re-read into the page cache before each case; "
          f"load average before/after: {load0} / {loadavg()})")
    print(fmt_table(["case", "wall s", "/ cp", "peak RSS MiB", "in-process"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
