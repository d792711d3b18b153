#!/usr/bin/env python
"""Benchmark tui-merger on a verl FSDP2 checkpoint against ``cp``, one plain read of the rank files (the
I/O floor) and verl's load-everything merge.

    python benchmarks/bench_fsdp.py                  # cp / read once / ours / load-everything, medians + peak RSS
    python benchmarks/bench_fsdp.py --repeats 5
    python benchmarks/bench_fsdp.py --scaling        # 6, 12, 24 layers: our peak RSS stays flat
    python benchmarks/bench_fsdp.py --profile        # cProfile of one run_merge (fsync=False)
    python benchmarks/bench_fsdp.py --cold           # evict the rank files from the page cache before each case
    python benchmarks/bench_fsdp.py --clean          # delete this benchmark's checkpoints and exit

The checkpoint has Qwen2.5-0.5B shapes (hidden 896, intermediate 4864, 24 layers, 14 heads, 2 kv heads,
vocab 151936, tied embeddings) with fp32 master weights, written the way verl's FSDPCheckpointManager
writes one: 8 processes (``RANK`` 0..7, gloo on 127.0.0.1, CPU) each build the model on the meta device,
shard it with FSDP2 ``fully_shard`` (decoder layers, then the root; tied embeddings stay with the root,
as verl's apply_fsdp2 does) on an 8-rank DeviceMesh, materialise only their own shards
(``to_empty(device="cpu")``, then random values seeded per parameter and rank) and ``torch.save`` their
``model.state_dict()`` (DTensors) as ``global_step_1/actor/model_world_size_8_rank_R.pt``; rank 0 adds
``fsdp_config.json`` and ``huggingface/config.json`` (``"dtype": "bfloat16"``, so the merge writes bf16,
as verl's merger does). No optimizer or extra_state files are written: they are not read by a merge and
would only make ``cp -r`` slower. Built once per size and cached in ``benchmarks/.cache/fsdp-*``.

Cases, each in its own child process, round-robin over ``--repeats``:

* ``cp -r`` of the actor folder;
* read once: a plain Python child that reads every rank file start to end in 8 MiB ``readinto`` calls
  (the floor a merge that reads its input once cannot beat); ``cat > /dev/null`` for context;
* ours: the CLI (``python -m tui_merger merge --backend fsdp --local_dir ACTOR --target_dir OUT --plain``,
  which fsyncs; ``--no-verify``: verification is measured by bench_verify.py, the manifest's sha256
  pass is included), and ``run_merge(MergeOptions(checkpoint=ACTOR, out=OUT), fsync=False)`` in a child that
  has already imported torch, timed around ``run_merge`` alone;
* verl's steps: the same, ending as verl's ``save_hf_model_and_tokenizer`` does (the model class from
  the config under ``init_empty_weights``, ``to_empty``, ``save_pretrained(target, state_dict=...)``):
  what a user of ``python -m verl.model_merger merge --backend fsdp`` waits for, transformers' import
  included;
* load-everything: a small reference script (here, not in the product) doing what verl's
  ``model_merger`` does: ``torch.load`` every rank file (thread pool, weights_only=False), per key the
  ranks' ``_local_tensor`` cast to bf16 and concatenated along the placement's dim, lm_head dropped when
  tied and equal to the embedding (save_pretrained does that), shards of at most 5 GB written with
  ``safetensors.torch.save_file``.

Our output is checked once (untimed) against the load-everything output: same key set, every tensor
``torch.equal``, bf16, only ``model.embed_tokens.weight`` written and ``tie_word_embeddings`` true.

Peak RSS is the ``ru_maxrss`` that ``os.wait4`` reports for each child; this parent never imports torch
(see bench_merge.py for why). ``sync`` + ``--settle`` seconds run between cases (untimed), then the rank
files are re-read into the page cache (or, with ``--cold``, evicted from it with
``posix_fadvise(DONTNEED)``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: run as `python benchmarks/bench_fsdp.py`

from harness import (  # noqa: E402
    free_port,
    CHILD_ENV,
    DEFAULT_CACHE,
    REPO,
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
    source_fingerprint,
    summarize,
    timed_rounds,
    warm_up,
)

SPEC_VERSION = 1
WORLD = 8
STEP = 1
SHARD_SIZE = 5_000_000_000  # "5GB" as transformers counts it
READ_CHUNK = 8 << 20
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

CHILD_ENV["TRANSFORMERS_VERBOSITY"] = "error"  # harness.run_child starts every child with CHILD_ENV

# ----------------------------------------------------------------------------------------------
# Children (run as `python bench_fsdp.py _<name> ...`; these are the only places torch is imported)
# ----------------------------------------------------------------------------------------------


def child_rank(actor: str, layers: str, seed: str) -> None:
    """One FSDP2 rank (RANK / WORLD_SIZE / MASTER_* in the environment): shard, fill, torch.save."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from transformers import Qwen2ForCausalLM

    actor, layers, seed = Path(actor), int(layers), int(seed)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=900))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        cfg = qwen_config(layers, eos_token_id=151645)
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
        assert model.lm_head.weight is model.model.embed_tokens.weight, "embeddings not tied"
        # verl's apply_fsdp2: every decoder layer, then the root (tied embeddings stay with the root)
        kwargs = dict(mesh=mesh, reshard_after_forward=True,
                      mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                     cast_forward_inputs=True))
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu")  # only this rank's shards get memory
        assert model.lm_head.weight is model.model.embed_tokens.weight, "to_empty untied the embeddings"
        with torch.no_grad():
            for i, (name, p) in enumerate(model.named_parameters()):
                assert isinstance(p, DTensor) and p.dtype == torch.float32, (name, type(p), p.dtype)
                torch.manual_seed(seed * 1_000_003 + i * 1009 + rank)
                local = p.to_local()
                if "norm" in name:
                    local.normal_(1.0, 0.02)
                else:
                    local.normal_(0.0, 0.02)
        sd = model.state_dict()
        for key, v in sd.items():  # what a verl FSDP2 rank file holds: DTensors sharded on dim 0
            assert isinstance(v, DTensor), (key, type(v))
            assert tuple(v.placements) == (Shard(0),), (key, v.placements)
            local = v._local_tensor
            expect = list(torch.empty(v.shape, device="meta").chunk(world, dim=0))
            want = tuple(expect[rank].shape) if rank < len(expect) else (0, *v.shape[1:])
            assert tuple(local.shape) == want, (key, tuple(local.shape), want)
            assert local.untyped_storage().nbytes() == local.numel() * 4, (key, "padded storage")
        # tied: two DTensors (state_dict detaches) over one storage, which torch.save writes once
        head, emb = sd[HEAD]._local_tensor, sd[EMBED]._local_tensor
        assert head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr(), "lm_head not tied"
        torch.save(sd, actor / f"model_world_size_{world}_rank_{rank}.pt")
        dist.barrier()
        if rank == 0:
            (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
            model.config.dtype = torch.bfloat16  # verl's actor config says bf16: the merged model is bf16
            model.config.save_pretrained(actor / "huggingface")
            (actor.parent.parent / "latest_checkpointed_iteration.txt").write_text(str(STEP))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank}: {len(sd)} keys in {time.perf_counter() - t0:.1f} s", flush=True)


def child_read(*files: str) -> None:
    """Read every file once, start to end, in 8 MiB readinto calls (no torch)."""
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


def child_ours(actor: str, out: str, fsync: str) -> None:
    """run_merge in-process (lets us pass fsync=False) and report where the time went, by phase."""
    t0 = time.perf_counter()
    import tui_merger.core.merge.engine as engine
    from tui_merger.core.events import PhaseStarted
    from tui_merger.core.options import MergeOptions

    t1 = time.perf_counter()
    import torch  # noqa: F401  (imported here so that its cost shows as its own phase)

    marks = [("import tui_merger", t0), ("import torch", t1)]
    opened = {}
    real_open = engine.open_inputs

    def timed_open(options):  # splits "plan" into unpickling the rank files (+ tie check) and the rest
        s = time.perf_counter()
        try:
            return real_open(options)
        finally:
            opened["open inputs"] = time.perf_counter() - s

    engine.open_inputs = timed_open

    def on_event(ev):
        if isinstance(ev, PhaseStarted):
            marks.append((ev.phase, time.perf_counter()))

    result = engine.run_merge(MergeOptions(checkpoint=actor, out=out), on_event, fsync=fsync == "1")
    marks.append(("end", time.perf_counter()))
    phases = {marks[i][0]: marks[i + 1][1] - marks[i][1] for i in range(len(marks) - 1)}
    if "open inputs" in opened and "plan" in phases:
        phases = {"import tui_merger": phases.pop("import tui_merger"), "import torch": phases.pop("import torch"),
                  "open inputs": opened["open inputs"], "plan (rest)": phases.pop("plan") - opened["open inputs"],
                  **phases}
    phases["run_merge total"] = marks[-1][1] - marks[2][1]
    phases["tensors_total"] = result.tensors_total
    print("BENCH_JSON " + json.dumps(phases), flush=True)


def child_reference(actor: str, out: str, how: str = "safetensors") -> None:
    """Load everything, concatenate, save: what verl's model_merger (FSDP backend) does. ``how``:
    "safetensors" writes the state dict with save_file (the lean floor of that approach);
    "save_pretrained" ends as verl's ``save_hf_model_and_tokenizer`` does: the model class built
    from the config under accelerate's ``init_empty_weights``, ``to_empty``, its generation config
    read, and ``save_pretrained(target, state_dict=...)``."""
    from concurrent.futures import ThreadPoolExecutor

    t = [time.perf_counter()]
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    t.append(time.perf_counter())
    actor, out = Path(actor), Path(out)
    world = json.loads((actor / "fsdp_config.json").read_text())["world_size"]
    files = [actor / f"model_world_size_{world}_rank_{r}.pt" for r in range(world)]
    shards: list = [None] * world

    def load(rank):
        shards[rank] = torch.load(files[rank], map_location="cpu", weights_only=False)

    with ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1)) as pool:
        list(pool.map(load, range(world)))
    t.append(time.perf_counter())

    state_dict, placements = {}, {}
    for key in list(shards[0]):
        parts = []
        for sd in shards:  # in rank order
            v = sd.pop(key)
            if isinstance(v, DTensor):
                parts.append(v._local_tensor.bfloat16())
                placements.setdefault(key, tuple(v.placements))
            else:
                parts.append(v.bfloat16())
        state_dict[key] = parts
    del shards
    for key in list(state_dict):
        parts = state_dict[key]
        pl = placements.get(key)
        if pl is None:
            state_dict[key] = torch.cat(parts, dim=0)
        elif len(pl) != 1:
            raise SystemExit(f"{key}: {pl}: the reference handles a 1-D mesh only")
        elif pl[0].is_replicate():
            state_dict[key] = parts[0]
        elif pl[0].is_shard():
            state_dict[key] = torch.cat(parts, dim=pl[0].dim).contiguous()
        else:
            raise SystemExit(f"{key}: unsupported placement {pl[0]}")
        del parts
    t.append(time.perf_counter())

    if how == "save_pretrained":
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        hf_dir = actor / "huggingface"
        model_config = AutoConfig.from_pretrained(hf_dir)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(model_config, torch_dtype=torch.bfloat16)
        model.to_empty(device="cpu")
        try:
            model.generation_config = GenerationConfig.from_pretrained(hf_dir)
        except OSError:
            pass
        model.save_pretrained(out, state_dict=state_dict)
        t.append(time.perf_counter())
        phases = ["import", "torch.load all ranks", "concat + bf16", "build + save_pretrained"]
        print("BENCH_JSON " + json.dumps({k: t[i + 1] - t[i] for i, k in enumerate(phases)}), flush=True)
        return
    config = json.loads((actor / "huggingface" / "config.json").read_text())
    if config.get("tie_word_embeddings") and HEAD in state_dict and EMBED in state_dict \
            and torch.equal(state_dict[HEAD], state_dict[EMBED]):
        del state_dict[HEAD]  # save_pretrained keeps one copy of tied weights
    groups: list[dict] = [{}]
    size = 0
    for key, v in state_dict.items():  # greedy, in order, like transformers' shard_checkpoint
        n = v.numel() * v.element_size()
        if groups[-1] and size + n > SHARD_SIZE:
            groups.append({})
            size = 0
        groups[-1][key] = v
        size += n
    out.mkdir(parents=True)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    for name, group in zip(names, groups):
        save_file(group, str(out / name), metadata={"format": "pt"})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state_dict.values())},
                 "weight_map": {k: n for n, g in zip(names, groups) for k in g}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    t.append(time.perf_counter())
    phases = ["import", "torch.load all ranks", "concat + bf16", "save"]
    print("BENCH_JSON " + json.dumps({k: t[i + 1] - t[i] for i, k in enumerate(phases)}), flush=True)


def child_profile(actor: str, out: str, top: str) -> None:
    from tui_merger.core.options import MergeOptions

    import torch  # noqa: F401  (import cost is not what we profile)

    profile_run_merge(MergeOptions(checkpoint=actor, out=out), top)


def child_verify(ours: str, ref: str, layers: str) -> None:
    """Not timed: our output == the load-everything output, tensor for tensor."""
    import torch

    o, r = load_tensors(ours), load_tensors(ref)
    ok = True
    common = sorted(set(o) & set(r))
    diff = [k for k in common if o[k].dtype != r[k].dtype or not torch.equal(o[k], r[k])]
    print(f"  ours vs load-everything: {len(common) - len(diff)}/{len(common)} tensors torch.equal; "
          f"only in ours: {sorted(set(o) - set(r))[:3]}, only in load-everything: {sorted(set(r) - set(o))[:3]}")
    for k in diff[:5]:
        print(f"    differs: {k} {o[k].dtype}/{r[k].dtype} shape {list(o[k].shape)}/{list(r[k].shape)}")
    extra = set(r) - set(o)
    if extra == {HEAD} and EMBED in o and torch.equal(r[HEAD], o[EMBED]):  # save_pretrained(state_dict=...)
        print(f"  the reference also wrote {HEAD}, a copy of the tied embedding ({r[HEAD].numel() * 2 / 1e6:.0f} MB more)")
        extra = set()
    ok &= not diff and not extra and set(o) <= set(r)
    dtypes = sorted({str(v.dtype) for v in o.values()})
    expected = 2 + 12 * int(layers)  # embed + final norm + 12 per Qwen2 layer
    print(f"  ours: {len(o)} tensors (expected {expected}), dtypes {dtypes}, "
          f"{EMBED} {list(o[EMBED].shape) if EMBED in o else 'MISSING'}, {HEAD} present: {HEAD in o}")
    ok &= len(o) == expected and dtypes == ["torch.bfloat16"] and EMBED in o and HEAD not in o
    ok &= tuple(o[EMBED].shape) == (151936, 896)
    oc = json.loads((Path(ours) / "config.json").read_text())
    print(f"  ours config.json: tie_word_embeddings {oc.get('tie_word_embeddings')}, dtype {oc.get('dtype')}")
    ok &= oc.get("tie_word_embeddings") is True and oc.get("dtype") == "bfloat16"
    print("VERIFY_OK" if ok else "VERIFY_FAILED", flush=True)


CHILDREN = {
    "_rank": lambda a: child_rank(*a),
    "_read": lambda a: child_read(*a),
    "_ours": lambda a: child_ours(*a),
    "_reference": lambda a: child_reference(*a),
    "_profile": lambda a: child_profile(*a),
    "_verify": lambda a: child_verify(*a),
}

# ----------------------------------------------------------------------------------------------
# Parent (no torch here)
# ----------------------------------------------------------------------------------------------


def py(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *map(str, args)]


def ours_cli(actor, out) -> list[str]:
    return [sys.executable, "-m", "tui_merger", "merge", "--backend", "fsdp", "--local_dir", str(actor),
            "--target_dir", str(out), "--plain", "--no-verify"]


def rank_files(actor: Path) -> list[Path]:
    return [actor / f"model_world_size_{WORLD}_rank_{r}.pt" for r in range(WORLD)]


def _build_ranks(actor: Path, layers: int, seed: int, logdir: Path) -> tuple[float, list[float]]:
    """Start WORLD rank processes, wait for all; on the first failure stop the others (their pids only)."""
    port = free_port()
    procs = {}
    t0 = time.perf_counter()
    for rank in range(WORLD):
        env = dict(CHILD_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
        log = open(logdir / f"rank_{rank}.log", "wb")
        p = subprocess.Popen(py("_rank", actor, layers, seed), stdout=log, stderr=subprocess.STDOUT, env=env,
                             cwd=REPO)
        log.close()
        procs[p.pid] = (rank, p)
    rss = [0.0] * WORLD
    failed = None
    deadline = time.monotonic() + 1200
    while procs:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline and failed is None:
                failed = "timed out"
            if failed is not None:
                for _rank, p in procs.values():
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
            continue
        if pid not in procs:
            continue
        rank, p = procs.pop(pid)
        p.returncode = os.waitstatus_to_exitcode(status)
        rss[rank] = usage.ru_maxrss / 1024
        if p.returncode != 0 and failed is None:
            failed = f"rank {rank} exited {p.returncode}"
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n" + (logdir / f"rank_{r}.log").read_text(errors="replace")[-3000:]
                         for r in range(WORLD))
        raise ChildFailed(f"building the FSDP checkpoint failed ({failed}):\n{logs}")
    return time.perf_counter() - t0, rss


def ensure_checkpoint(cache: Path, layers: int, seed: int = 0) -> Path:
    """The actor folder of a cached 8-rank FSDP2 checkpoint with `layers` layers (built when missing)."""
    folder = cache / f"fsdp-qwen2.5-0.5b-shapes-L{layers}-w{WORLD}"
    actor = folder / f"global_step_{STEP}" / "actor"
    marker = folder / "complete.json"
    spec = {"version": SPEC_VERSION, "layers": layers, "seed": seed, "world_size": WORLD}
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return actor
    shutil.rmtree(folder, ignore_errors=True)
    actor.mkdir(parents=True)
    logdir = folder / "build-logs"
    logdir.mkdir()
    print(f"building the {layers}-layer {WORLD}-rank FSDP2 checkpoint in {folder} ...", flush=True)
    for attempt in range(3):
        try:
            wall, rss = _build_ranks(actor, layers, seed, logdir)
            break
        except ChildFailed as err:
            if attempt == 2 or "address already in use" not in str(err).lower():
                raise
            for f in actor.glob("model_world_size_*"):
                f.unlink()
    shutil.rmtree(logdir, ignore_errors=True)
    print(f"  built: {dir_bytes(actor) / 1e9:.3f} GB in {WORLD} rank files, {wall:.1f} s; peak RSS per rank "
          f"{min(rss):.0f}-{max(rss):.0f} MiB ({sum(rss):.0f} MiB together)", flush=True)
    marker.write_text(json.dumps(spec))
    return actor


CP = "cp -r actor/"
READ = "read once (8 MiB reads)"
CAT = "cat rank files > /dev/null"
CLI = "ours (CLI, fsync)"
DEFAULT = "ours (CLI, verified: as a user runs it)"
INPROC = "ours (run_merge fsync=False)"
REF = "load-everything (verl-style)"
VERL = "verl's steps (save_pretrained)"


def make_cases(actor: Path, with_cat: bool = True) -> dict:
    files = rank_files(actor)
    cases = {
        CP: lambda out: ["cp", "-r", str(actor), str(out)],
        READ: lambda out: py("_read", *files),
        CAT: lambda out: ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files)],
        CLI: lambda out: ours_cli(actor, out),
        DEFAULT: lambda out: [a for a in ours_cli(actor, out) if a != "--no-verify"],
        INPROC: lambda out: py("_ours", actor, out, 0),
        REF: lambda out: py("_reference", actor, out),
        VERL: lambda out: py("_reference", actor, out, "save_pretrained"),
    }
    if not with_cat:
        del cases[CAT]
    return cases


def main_bench(args, cache: Path) -> int:
    layers = 24
    actor = ensure_checkpoint(cache, layers)
    tmp_root = Path(tempfile.mkdtemp(prefix="fsdp-run-", dir=cache))
    runner = Runner(tmp_root, sync=not args.no_sync, settle=args.settle, inputs=[actor], cold=args.cold)
    cases = make_cases(actor)
    if args.skip_reference:
        del cases[REF], cases[VERL]
    load0 = loadavg()
    in_bytes = sum(f.stat().st_size for f in rank_files(actor))
    out_bytes = None
    try:
        print(f"checkpoint: {actor} ({in_bytes / 1e9:.3f} GB in {WORLD} rank files, fp32); outputs in {tmp_root}",
              flush=True)
        floor = rss_floor({
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "python -c 'import tui_merger.core.merge.engine, torch'": [sys.executable, "-c",
                                                                   "import tui_merger.core.merge.engine, torch"],
        })

        kept = warm_up(runner, cases, (INPROC, REF, VERL))
        out_bytes = dir_bytes(kept[INPROC])
        verify_ok = True
        if not args.skip_verify and REF in kept:
            print(" verify (untimed):", flush=True)
            for ref in (REF, VERL):
                if ref in kept:
                    r = run_child(py("_verify", kept[INPROC], kept[ref], layers), capture=True)
                    print(f"  against {ref}:\n" + r["stdout"].rstrip(), flush=True)
                    verify_ok = verify_ok and "VERIFY_OK" in r["stdout"]
        remove_kept(kept)

        results = timed_rounds(runner, cases, args.repeats)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    wall, rss, rows = summarize(results)
    print()
    print(f"Results: {layers} layers, {in_bytes / 1e9:.3f} GB fp32 in {WORLD} FSDP2 rank files -> "
          f"{(out_bytes or 0) / 1e9:.3f} GB bf16 ({args.repeats} repeats, medians; sync + {args.settle:g} s settle + "
          f"inputs {'evicted from' if args.cold else 're-read into'} the page cache before each case; "
          f"load average before/after: {load0} / {loadavg()})")
    print(fmt_table(RESULT_HEADERS, rows))
    print()
    print_rss_floor(floor)

    inner = {}
    for name in (READ, INPROC, REF, VERL):
        if name in results:
            phases = [p for p in (bench_json(r["stdout"]) for r in results[name]) if p]
            if not phases:
                continue
            keys = [k for k in phases[0] if k not in ("tensors_total", "bytes")]
            inner[name] = {k: med([p[k] for p in phases]) for k in keys}
            if name == READ:
                continue
            summed = sum(v for k, v in inner[name].items() if k != "run_merge total")
            print(f"phases of {name} (medians, s): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in inner[name].items())
                  + f"; interpreter start-up + exit ~{wall[name] - summed:.2f}")

    def ratio(label, val, target, better_low=True):
        ok = val <= target if better_low else val >= target
        print(f"  {label:<58} {val:6.2f}   target {'<=' if better_low else '>='} {target:<5} "
              f"{'OK' if ok else 'MISSED'}")

    def plain(label, val):
        print(f"  {label:<58} {val:6.2f}")

    print()
    for variant in (CLI, INPROC):
        print(f"Ratios, ours = {variant} (whole child process):")
        ratio("ours / read once (wall)", wall[variant] / wall[READ], 2.0)
        plain("ours / cp -r (wall)", wall[variant] / wall[CP])
        if REF in wall:
            plain("load-everything / ours (wall)", wall[REF] / wall[variant])
            ratio("ours-RSS / load-everything-RSS", rss[variant] / rss[REF], 0.25)
    if DEFAULT in wall:
        print("The default merge (verified) against verl's way, which verifies nothing:")
        for ref in (REF, VERL):
            if ref in wall:
                plain(f"{ref} / ours verified (wall)", wall[ref] / wall[DEFAULT])
                plain(f"ours verified RSS / {ref} RSS", rss[DEFAULT] / rss[ref])
    if INPROC in inner and READ in inner:
        a = inner[INPROC]["run_merge total"]
        rd = inner[READ]["read"]
        print("Ratios, ours = run_merge(fsync=False) alone (torch already imported; no interpreter start-up):")
        plain("run_merge seconds", a)
        ratio(f"run_merge / read once ({rd:.2f} s, reading alone)", a / rd, 2.0)
        plain("run_merge / cp -r (wall)", a / wall[CP])
        if REF in inner:
            ref_inner = sum(v for k, v in inner[REF].items() if k != "import")
            plain(f"load-everything without import ({ref_inner:.2f} s) / run_merge", ref_inner / a)
    if not args.skip_verify and REF in results:
        print()
        print("verification: " + ("ours == load-everything and == verl's steps (same keys, every tensor "
                                  "torch.equal, bf16, lm_head tied to the embedding)" if verify_ok else "FAILED (see above)"))
    return 0 if verify_ok else 1


def main_scaling(args, cache: Path) -> int:
    sizes = [int(x) for x in args.layers.split(",")]
    actors = {n: ensure_checkpoint(cache, n) for n in sizes}
    tmp_root = Path(tempfile.mkdtemp(prefix="fsdp-run-", dir=cache))
    runner = Runner(tmp_root, sync=not args.no_sync, settle=args.settle, inputs=[], cold=args.cold)
    rows = []
    try:
        for n in sizes:
            actor = actors[n]
            runner.inputs = [actor]
            all_cases = make_cases(actor)
            cases = {k: all_cases[k] for k in (READ, CLI, INPROC, REF) if k != REF or not args.skip_reference}
            for name, make in cases.items():  # warm-up
                runner.run(name, make)
            res = {k: [] for k in cases}
            for _ in range(args.repeats):
                for name, make in cases.items():
                    res[name].append(runner.run(name, make)[0])
            w = {k: med([r["wall"] for r in v]) for k, v in res.items()}
            m = {k: med([r["rss"] for r in v]) for k, v in res.items()}
            rm = med([bench_json(r["stdout"])["run_merge total"] for r in res[INPROC]])
            rd = med([bench_json(r["stdout"])["read"] for r in res[READ]])
            size = sum(f.stat().st_size for f in rank_files(actor))
            row = [n, f"{size / 1e9:.3f}", f"{w[READ]:.2f}", f"{w[CLI]:.2f}", f"{rm:.2f}", f"{rm / rd:.2f}",
                   f"{m[CLI]:.0f}", f"{m[INPROC]:.0f}"]
            if REF in w:
                row += [f"{w[REF]:.2f}", f"{m[REF]:.0f}", f"{m[CLI] / m[REF]:.2f}"]
            rows.append(row)
            print(f"  {n} layers done: {row}", flush=True)
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print()
    print(f"Scaling (Qwen2.5-0.5B widths, {WORLD}-rank FSDP2, fp32 -> bf16; {args.repeats} repeats, medians; "
          f"settle {args.settle:g} s; page cache {'cold' if args.cold else 'warm'})")
    headers = ["layers", "rank files GB", "read once s", "ours CLI s", "run_merge s", "run_merge/read",
               "ours CLI peak RSS MiB", "ours in-proc peak RSS MiB"]
    if not args.skip_reference:
        headers += ["load-everything s", "load-everything peak RSS MiB", "ours CLI RSS / load-everything RSS"]
    print(fmt_table(headers, rows))
    return 0


def main_profile(args, cache: Path) -> int:
    actor = ensure_checkpoint(cache, 24)
    tmp_root = Path(tempfile.mkdtemp(prefix="fsdp-run-", dir=cache))
    try:
        runner = Runner(tmp_root, True, 0, [actor], cold=args.cold)
        r, _ = runner.run("profile", lambda out: py("_profile", actor, out, args.top))
        print(r["stdout"])
        print(f"profiled child: peak RSS {r['rss']:.0f} MiB")
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    return 0


def clean(cache: Path) -> None:
    """Only this benchmark's folders: bench_merge.py keeps its models in the same cache."""
    removed = []
    for p in list(cache.glob("fsdp-*")) if cache.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p.name)
    print(f"removed {', '.join(removed) if removed else 'nothing'} from {cache}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if run_child_command(argv, CHILDREN):
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per case (default 3)")
    ap.add_argument("--world", type=int, default=8, help="FSDP ranks of the checkpoint (default 8)")
    ap.add_argument("--scaling", action="store_true", help="time and peak RSS across model sizes")
    ap.add_argument("--layers", default="6,12,24", help="layer counts for --scaling (default 6,12,24)")
    ap.add_argument("--profile", action="store_true", help="cProfile one run_merge(fsync=False)")
    ap.add_argument("--top", type=int, default=25, help="rows of the profile to print")
    ap.add_argument("--skip-reference", action="store_true", help="leave out the load-everything case")
    ap.add_argument("--skip-verify", action="store_true", help="leave out the ours-vs-load-everything check")
    ap.add_argument("--cold", action="store_true",
                    help="evict the rank files from the page cache (posix_fadvise DONTNEED) before each case "
                    "instead of re-reading them into it")
    ap.add_argument("--no-sync", action="store_true", help="do not run sync between cases")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait (untimed) before each case, after deleting the previous output and "
                    "sync (default 3; see bench_merge.py: freshly freed memory is cheap to reuse on this VM "
                    "for ~1 s only)")
    ap.add_argument("--clean", action="store_true", help="delete this benchmark's cached checkpoints and exit")
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="default: benchmarks/.cache")
    args = ap.parse_args(argv)
    global WORLD
    WORLD = args.world
    cache = args.cache_dir.resolve()
    if args.clean:
        clean(cache)
        return 0
    cache.mkdir(parents=True, exist_ok=True)
    for stale in cache.glob("fsdp-run-*"):  # temp folders of an interrupted run
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    fingerprint = source_fingerprint()
    print(f"measuring tui_merger at {code_state()}, sources {fingerprint}", flush=True)
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
    after = source_fingerprint()
    if after != fingerprint:
        print(f"\nWARNING: tui_merger/ changed while this ran (sources {fingerprint} -> {after}, now "
              f"{code_state()}); the figures may mix two versions: run again.")
    print(f"\ntotal benchmark runtime: {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
