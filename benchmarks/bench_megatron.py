#!/usr/bin/env python
"""Benchmark tui-merger on a verl Megatron dist checkpoint (torch DCP) against reading its files once.

    python benchmarks/bench_megatron.py               # 12 and 24 layers side by side, medians + peak RSS
    python benchmarks/bench_megatron.py --repeats 5
    python benchmarks/bench_megatron.py --layers 24   # one size
    python benchmarks/bench_megatron.py --clean       # delete this benchmark's checkpoints and exit

The checkpoint has Qwen2.5-0.5B shapes (hidden 896, intermediate 4864, 14 heads, 2 KV heads, head_dim 64,
vocab 151936, tied embeddings, q/k/v biases) in bf16, with 12 and 24 layers, laid out the way Megatron-Core's
``torch_dist`` strategy writes a verl v2 checkpoint (``global_step_1/actor/model/dist_ckpt`` +
``model/huggingface/config.json`` + ``ckpt_contents.json``): megatron-core itself is not used, but the same
torch pieces are: 2 processes (tensor parallel 2; gloo on 127.0.0.1, CPU) each hold, per mcore key, a
``ShardedTensor`` with one local shard per layer (the stacked ``decoder.layers.*`` keys have a leading
``[num_layers]`` dim, every layer its own chunk), split by tensor parallelism the way Megatron splits it
(linear_qkv / linear_fc1 / embedding on dim 0 with fc1's gate and up halves apart, linear_proj /
linear_fc2 on dim 1, norms on rank 0 only), and ``torch.distributed.checkpoint.save`` writes them:
``.metadata`` plus one ``__{rank}_0.distcp`` per rank. Built once per size in ``benchmarks/.cache/megatron-*``.

Cases, each in its own child process, round-robin over ``--repeats``:

* read once: a plain Python child reading every ``.distcp`` file start to end in 8 MiB ``readinto`` calls
  (the floor for anything that reads its input once); ``cat > /dev/null`` and ``cp -r`` of the dist_ckpt
  folder for context;
* ours: the CLI (``python -m tui_merger merge --backend megatron --local_dir ACTOR --target_dir OUT --plain
  --no-verify``, which fsyncs) and ``run_merge(..., fsync=False)`` timed around ``run_merge`` alone in a child
  that has imported torch already;
* load-everything: ``torch.distributed.checkpoint.load(no_dist=True)`` of every model key into preallocated
  full tensors (what a merger that materialises the whole model does before writing anything).

Peak RSS is the ``ru_maxrss`` of each child (``os.wait4``); this parent never imports torch. Before each case:
``sync``, ``--settle`` seconds, and the ``.distcp`` files re-read into the page cache (untimed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: run as `python benchmarks/bench_megatron.py`

from harness import (  # noqa: E402
    free_port,
    CHILD_ENV,
    DEFAULT_CACHE,
    REPO,
    ChildFailed,
    Runner,
    bench_json,
    code_state,
    dir_bytes,
    fmt_table,
    loadavg,
    med,
    run_child,
    run_child_command,
    source_fingerprint,
)

SPEC_VERSION = 1
TP = 2
HIDDEN, FFN, HEADS, KV, HEAD_DIM, VOCAB = 896, 4864, 14, 2, 64, 151936
READ_CHUNK = 8 << 20

CHILD_ENV["TRANSFORMERS_VERBOSITY"] = "error"


# ----------------------------------------------------------------------------------------------
# Children (the only places torch is imported)
# ----------------------------------------------------------------------------------------------


def _hf_config(layers: int) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
        "intermediate_size": FFN, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV, "vocab_size": VOCAB, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    }


def child_rank(actor: str, layers: str) -> None:
    """One tensor-parallel rank: per mcore key a ShardedTensor with one local shard per layer, then DCP save."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards

    actor, layers = Path(actor), int(layers)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        gen = torch.Generator().manual_seed(1000 + rank)

        def fill(shape, norm=False):
            t = torch.empty(shape, dtype=torch.float32)
            t.normal_(1.0 if norm else 0.0, 0.02, generator=gen)
            return t.to(torch.bfloat16)

        def sharded(global_shape, pieces):
            """pieces: [(offsets, tensor)] held by this rank."""
            shards = [Shard(t, ShardMetadata(list(off), list(t.shape), f"rank:{rank}/cpu")) for off, t in pieces]
            return init_from_local_shards(shards, *global_shape)

        qkv_rows = (HEADS + 2 * KV) * HEAD_DIM
        sd = {}
        per = VOCAB // TP
        sd["embedding.word_embeddings.weight"] = sharded((VOCAB, HIDDEN), [((rank * per, 0), fill((per, HIDDEN)))])

        def stacked(name, param_shape, split_dim=None, glu=False, norm=False):
            pieces = []
            for i in range(layers):
                if split_dim is None:
                    if rank == 0:
                        pieces.append(((i,) + (0,) * len(param_shape), fill((1,) + param_shape, norm)))
                elif glu:  # [gate; up], each half split by TP
                    half = param_shape[0] // 2
                    n = half // TP
                    rest = param_shape[1:]
                    pieces.append(((i, rank * n) + (0,) * len(rest), fill((1, n) + rest)))
                    pieces.append(((i, half + rank * n) + (0,) * len(rest), fill((1, n) + rest)))
                else:
                    local = list(param_shape)
                    local[split_dim] //= TP
                    off = [0] * len(param_shape)
                    off[split_dim] = rank * local[split_dim]
                    pieces.append(((i, *off), fill((1, *local))))
            sd[f"decoder.layers.{name}"] = sharded((layers,) + param_shape, pieces)

        stacked("self_attention.linear_qkv.layer_norm_weight", (HIDDEN,), norm=True)
        stacked("self_attention.linear_qkv.weight", (qkv_rows, HIDDEN), 0)
        stacked("self_attention.linear_qkv.bias", (qkv_rows,), 0)
        stacked("self_attention.linear_proj.weight", (HIDDEN, HEADS * HEAD_DIM), 1)
        stacked("mlp.linear_fc1.layer_norm_weight", (HIDDEN,), norm=True)
        stacked("mlp.linear_fc1.weight", (2 * FFN, HIDDEN), 0, glu=True)
        stacked("mlp.linear_fc2.weight", (HIDDEN, FFN), 1)
        final = [((0,), fill((HIDDEN,), True))] if rank == 0 else []
        sd["decoder.final_layernorm.weight"] = sharded((HIDDEN,), final)
        dist_dir = actor / "model" / "dist_ckpt"
        dcp.save(sd, checkpoint_id=str(dist_dir))
        dist.barrier()
        if rank == 0:
            hf = actor / "model" / "huggingface"
            hf.mkdir(parents=True, exist_ok=True)
            (hf / "config.json").write_text(json.dumps(_hf_config(layers), indent=2))
            (dist_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                                "common_backend": "torch", "common_backend_version": 1}))
            (actor / "ckpt_contents.json").write_text(json.dumps({"schema_version": 2, "framework": "megatron",
                                                                  "role": "actor"}))
            (actor.parent.parent / "latest_checkpointed_iteration.txt").write_text("1")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def child_read(*files: str) -> None:
    t0 = time.perf_counter()
    buf = bytearray(READ_CHUNK)
    view = memoryview(buf)
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    print("BENCH_JSON " + json.dumps({"read": time.perf_counter() - t0, "bytes": total}), flush=True)


def child_ours(actor: str, out: str) -> None:
    import torch  # noqa: F401  (not part of the timing)

    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.options import MergeOptions

    t0 = time.perf_counter()
    result = run_merge(MergeOptions(checkpoint=actor, out=out), fsync=False)
    print("BENCH_JSON " + json.dumps({"run_merge": time.perf_counter() - t0, "tensors": result.tensors_total}),
          flush=True)


def child_load_all(dist_dir: str) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    md = dcp.FileSystemReader(dist_dir).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if hasattr(v, "chunks")}
    dcp.load(sd, checkpoint_id=dist_dir, no_dist=True)
    print("BENCH_JSON " + json.dumps({"load": time.perf_counter() - t0,
                                      "bytes": sum(t.numel() * t.element_size() for t in sd.values())}), flush=True)


def child_check(out: str, dist_dir: str, layers: str) -> None:
    """Untimed: our output equals the DCP tensors mapped by hand (DCP loaded with torch's own reader)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    warnings.simplefilter("ignore")
    ours = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        ours.update(load_file(str(f)))
    md = dcp.FileSystemReader(dist_dir).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=dist_dir, no_dist=True)
    ok = len(ours) == 2 + 12 * int(layers) and "lm_head.weight" not in ours
    per = HEADS // KV
    for i in range(int(layers)):
        qkv = sd["decoder.layers.self_attention.linear_qkv.weight"][i].view(KV, (per + 2) * HEAD_DIM, HIDDEN)
        q, k, v = qkv.split([per * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=1)
        gate, up = sd["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
        p = f"model.layers.{i}."
        for name, want in ((p + "self_attn.q_proj.weight", q.reshape(-1, HIDDEN)),
                           (p + "self_attn.k_proj.weight", k.reshape(-1, HIDDEN)),
                           (p + "self_attn.v_proj.weight", v.reshape(-1, HIDDEN)),
                           (p + "mlp.gate_proj.weight", gate), (p + "mlp.up_proj.weight", up),
                           (p + "mlp.down_proj.weight", sd["decoder.layers.mlp.linear_fc2.weight"][i])):
            ok &= torch.equal(ours[name], want)
    ok &= torch.equal(ours["model.embed_tokens.weight"], sd["embedding.word_embeddings.weight"])
    print("CHECK_OK" if ok else "CHECK_FAILED", flush=True)


CHILDREN = {
    "_rank": lambda a: child_rank(*a),
    "_read": lambda a: child_read(*a),
    "_ours": lambda a: child_ours(*a),
    "_load_all": lambda a: child_load_all(*a),
    "_check": lambda a: child_check(*a),
}

# ----------------------------------------------------------------------------------------------
# Parent (no torch here)
# ----------------------------------------------------------------------------------------------


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def ensure_checkpoint(cache: Path, layers: int) -> Path:
    folder = cache / f"megatron-qwen2.5-0.5b-shapes-L{layers}-tp{TP}"
    actor = folder / "global_step_1" / "actor"
    marker = folder / "complete.json"
    spec = {"version": SPEC_VERSION, "layers": layers, "tp": TP}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return actor
    shutil.rmtree(folder, ignore_errors=True)
    actor.mkdir(parents=True)
    print(f"building the {layers}-layer TP{TP} dist checkpoint in {folder} ...", flush=True)
    port = free_port()
    t0 = time.perf_counter()
    procs = []
    for rank in range(TP):
        env = dict(CHILD_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(TP),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(py("_rank", actor, layers), env=env, cwd=REPO))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise ChildFailed(f"building the checkpoint failed (exit codes {codes})")
    print(f"  built: {dir_bytes(actor) / 1e9:.3f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    marker.write_text(json.dumps(spec))
    return actor


def distcp_files(actor: Path) -> list[Path]:
    return sorted((actor / "model" / "dist_ckpt").glob("*.distcp"))


READ = "read once (8 MiB reads)"
CAT = "cat .distcp > /dev/null"
CP = "cp -r dist_ckpt/"
CLI = "ours (CLI, fsync)"
INPROC = "ours (run_merge fsync=False)"
LOAD = "load-everything (dcp.load)"


def make_cases(actor: Path) -> dict:
    files = distcp_files(actor)
    dist_dir = actor / "model" / "dist_ckpt"
    return {
        READ: lambda out: py("_read", *files),
        CAT: lambda out: ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files)],
        CP: lambda out: ["cp", "-r", str(dist_dir), str(out)],
        CLI: lambda out: [sys.executable, "-m", "tui_merger", "merge", "--backend", "megatron", "--local_dir",
                          str(actor), "--target_dir", str(out), "--plain", "--no-verify"],
        INPROC: lambda out: py("_ours", actor, out),
        LOAD: lambda out: py("_load_all", dist_dir),
    }


def main_bench(args, cache: Path) -> int:
    sizes = [int(x) for x in args.layers.split(",")]
    actors = {n: ensure_checkpoint(cache, n) for n in sizes}
    tmp_root = Path(tempfile.mkdtemp(prefix="megatron-run-", dir=cache))
    load0 = loadavg()
    results: dict = {}
    ok = True
    try:
        runner = Runner(tmp_root, sync=True, settle=args.settle, inputs=[])
        for n in sizes:  # untimed: warm-up and the output check
            runner.inputs = [actors[n] / "model" / "dist_ckpt"]
            _, out = runner.run(INPROC, make_cases(actors[n])[INPROC], keep=True)
            r = run_child(py("_check", out, actors[n] / "model" / "dist_ckpt", n), capture=True)
            print(f"  check {n} layers: {r['stdout'].strip()}", flush=True)
            ok &= "CHECK_OK" in r["stdout"]
            shutil.rmtree(out, ignore_errors=True)
        for rep in range(args.repeats):
            for n in sizes:
                runner.inputs = [actors[n] / "model" / "dist_ckpt"]
                for name, make in make_cases(actors[n]).items():
                    r, _ = runner.run(name, make)
                    results.setdefault((n, name), []).append(r)
                    print(f"  [{rep + 1}/{args.repeats}] {n} layers, {name}: {r['wall']:.2f} s, {r['rss']:.0f} MiB",
                          flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    wall = {k: med([r["wall"] for r in v]) for k, v in results.items()}
    rss = {k: med([r["rss"] for r in v]) for k, v in results.items()}
    inner = {}
    for (n, name), runs in results.items():
        values = [bench_json(r["stdout"]) for r in runs]
        if values and values[0]:
            key = {READ: "read", INPROC: "run_merge", LOAD: "load"}.get(name)
            if key:
                inner[(n, name)] = med([v[key] for v in values])
    print()
    print(f"Results ({args.repeats} repeats, medians; sync + {args.settle:g} s settle + inputs re-read into the "
          f"page cache before each case; load average before/after: {load0} / {loadavg()})")
    rows = []
    for n in sizes:
        size = sum(f.stat().st_size for f in distcp_files(actors[n]))
        for name in make_cases(actors[n]):
            k = (n, name)
            rows.append([n, f"{size / 1e9:.3f}", name, f"{wall[k]:.2f}",
                         f"{inner[k]:.2f}" if k in inner else "", f"{rss[k]:.0f}"])
    print(fmt_table(["layers", ".distcp GB", "case", "wall s", "inner s", "peak RSS MiB"], rows))
    print()
    print("Ratios (measured side by side in this run):")
    for n in sizes:
        rd = inner[(n, READ)]
        print(f"  {n} layers: run_merge / read once {inner[(n, INPROC)] / rd:.2f}; CLI / read-once child "
              f"{wall[(n, CLI)] / wall[(n, READ)]:.2f}; CLI / cp -r {wall[(n, CLI)] / wall[(n, CP)]:.2f}; "
              f"load-everything RSS / ours-in-process RSS {rss[(n, LOAD)] / rss[(n, INPROC)]:.2f}")
    if len(sizes) >= 2:
        a, b = sizes[0], sizes[-1]
        print(f"  peak RSS {b} vs {a} layers: ours in-process {rss[(b, INPROC)]:.0f} / {rss[(a, INPROC)]:.0f} MiB "
              f"(x{rss[(b, INPROC)] / rss[(a, INPROC)]:.2f}), ours CLI x{rss[(b, CLI)] / rss[(a, CLI)]:.2f}, "
              f"load-everything x{rss[(b, LOAD)] / rss[(a, LOAD)]:.2f}; input x"
              f"{sum(f.stat().st_size for f in distcp_files(actors[b])) / sum(f.stat().st_size for f in distcp_files(actors[a])):.2f}")
    print("output check: " + ("ours == the DCP tensors mapped by hand (q/k/v per KV group, gate/up halves)"
                              if ok else "FAILED (see above)"))
    return 0 if ok else 1


def clean(cache: Path) -> None:
    removed = []
    for p in list(cache.glob("megatron-*")) if cache.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    print(f"removed {', '.join(removed) if removed else 'nothing'} from {cache}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, CHILDREN):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (default 3)")
    ap.add_argument("--layers", default="12,24", help="layer counts, side by side (default 12,24)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait (untimed) before each case")
    ap.add_argument("--clean", action="store_true", help="delete this benchmark's cached checkpoints and exit")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="default: benchmarks/.cache")
    args = ap.parse_args(argv)
    cache = args.cache_dir.resolve()
    if args.clean:
        clean(cache)
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob("megatron-run-*"):
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    fingerprint = source_fingerprint()
    print(f"measuring tui_merger at {code_state()}, sources {fingerprint}", flush=True)
    try:
        rc = main_bench(args, cache)
    except ChildFailed as err:
        print(f"\nA benchmark child failed:\n{err}", file=sys.stderr)
        rc = 2
    if source_fingerprint() != fingerprint:
        print("\nWARNING: tui_merger/ changed while this ran; the figures may mix two versions: run again.")
    print(f"\ntotal benchmark runtime: {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
