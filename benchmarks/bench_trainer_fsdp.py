"""HF Trainer + accelerate FSDP checkpoint (SHARDED_STATE_DICT) -> Hugging Face model: tui-merger's default
merge (with its verification) against what users have, ``accelerate merge-weights`` (one fp32
``model.safetensors``, no config) followed by transformers' ``save_pretrained`` in the config's dtype, and
``cp`` of the DCP folder; wall time and each process's own peak RSS, in one run.

The checkpoint is written by a generator with torch's own DCP writer (``FileSystemWriter``: the same
``__R_0.distcp`` files of back-to-back ``torch.save`` archives and the same pickled ``Metadata`` that
accelerate's ``save_fsdp_model`` gets from ``dist_cp.save``), one rank after another in one process: each
rank's plan holds FSDP's dim-0 shards (``torch.chunk``: ``ceil(rows/world)`` rows per rank) of every entry of
``{"model": state_dict}``, fp32 masters as FSDP keeps them under bf16 mixed precision, for a Qwen2.5 shape
(3B widths, tied embeddings stored under both names, bf16 config). ``--prove`` writes the models of two real
Trainer fixtures (tests/fixtures/trainer: FSDP2 untied Llama, FSDP1 tied Qwen2) that way and compares
``.metadata`` (every key, dtype, shape, chunk, planner entry, storage file, offset and length) and the file
names and sizes with the real ones.

    python benchmarks/bench_trainer_fsdp.py --prove
    nice python benchmarks/bench_trainer_fsdp.py --layers 2:8 8:8:ours 2:2:ours    # LAYERS:RANKS, one run

The optimizer's DCP folder (``optimizer_0/``, which no tool here reads) is not written.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import DEFAULT_CACHE, REPO, fmt_table, loadavg, run_child  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "trainer"
PROVE = {"fsdp2_bf16mp": 2, "fsdp1_fp32_tied": 2}


# -- the generator (a child: the only place torch is imported) ---------------------------------------


def child_make(out: str, source: str, layers: str, world: str) -> None:
    """checkpoint-3/pytorch_model_fsdp_0 of the model of ``source`` (a config folder, or a Qwen2.5 shape
    name with ``layers`` layers), sharded over ``world`` ranks."""
    import dataclasses
    import math
    import pickle
    import zlib
    from collections import ChainMap

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
    from transformers import AutoConfig, AutoModelForCausalLM

    world = int(world)
    if Path(source).is_dir():
        config = AutoConfig.from_pretrained(source)
    else:
        from harness import qwen_config

        config = qwen_config(int(layers), 151643, source)
        config.dtype = torch.bfloat16
    base = Path(out) / "base_model"
    config.save_pretrained(base)  # before from_config, which sets config.dtype to the model's
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    entries = {"model." + n: tuple(t.shape) for n, t in model.state_dict().items()}  # a tied head: both names
    ckpt = Path(out) / "checkpoint-3"
    folder = ckpt / "pytorch_model_fsdp_0"
    folder.mkdir(parents=True, exist_ok=True)

    def shard(shape, r):  # FSDP's dim-0 chunk of rank r
        rows = math.ceil(shape[0] / world)
        lo = min(shape[0], r * rows)
        return lo, min(shape[0], lo + rows) - lo

    plans = []
    for r in range(world):
        items = []
        for key, shape in entries.items():
            lo, n = shard(shape, r)
            if n == 0:
                continue
            offsets, sizes = torch.Size((lo,) + (0,) * (len(shape) - 1)), torch.Size((n,) + shape[1:])
            items.append(WriteItem(MetadataIndex(key, offsets), WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes),
                                                               TensorProperties(dtype=torch.float32),
                                                               torch.Size(shape))))
        mapping = {k: ("model", k[len("model."):]) for k in entries}
        plans.append(pickle.loads(pickle.dumps(SavePlan(items, planner_data=mapping))))  # as gathered
    # what DefaultSavePlanner.create_global_plan does with the gathered plans
    plans, metadata = create_default_global_save_plan(plans)
    metadata = dataclasses.replace(metadata, planner_data=dict(ChainMap(*[p.planner_data for p in plans])))
    writer = FileSystemWriter(str(folder), sync_files=False)
    writer.set_up_storage_writer(True)
    plans = writer.prepare_global_plan(plans)
    # a tied head holds the embedding's values (FSDP saves the one parameter under both names)
    tied = {"model.lm_head.weight": "model.model.embed_tokens.weight"} if config.tie_word_embeddings else {}
    buffers: dict = {}

    class Planner:  # random values, one reused buffer per shape (the writer keeps every tensor it wrote)
        def resolve_data(self, item):
            sizes = tuple(item.tensor_data.chunk.sizes)
            buf = buffers.get(sizes)
            if buf is None:
                buf = buffers[sizes] = torch.empty(sizes)
            key = tied.get(item.index.fqn, item.index.fqn)
            g = torch.Generator().manual_seed(zlib.crc32(f"{key} {list(item.index.offset)}".encode()))
            return buf.normal_(0, 0.02, generator=g)

    results = []
    for plan in pickle.loads(pickle.dumps(plans)):  # as scattered to each rank
        writer.prepare_local_plan(plan)
        results.append(pickle.loads(pickle.dumps(writer.write_data(plan, Planner()).wait())))
    writer.finish(metadata, results)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3, "best_model_checkpoint": None}))
    print(json.dumps({"values": sum(math.prod(s) for s in entries.values()), "keys": len(entries)}))


def child_structure(folder: str) -> None:
    """A DCP folder's .metadata as plain data (every key, dtype, shape, chunk, planner entry and storage
    location; the run's ids left out) and its files' names and sizes."""
    import hashlib

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(folder).read_metadata()
    raw = (Path(folder) / ".metadata").read_bytes()
    out = {
        "type": type(md).__qualname__,
        "fields": sorted(vars(md)),
        "version": md.version,
        "storage_meta": sorted(vars(md.storage_meta)),
        "keys": {k: [type(v).__qualname__, str(v.properties), list(v.size),
                     [[list(c.offsets), list(c.sizes)] for c in v.chunks]] for k, v in md.state_dict_metadata.items()},
        "planner": {k: list(v) for k, v in md.planner_data.items()},
        "storage": sorted([i.fqn, list(i.offset), i.index, s.relative_path, s.offset, s.length,
                           s.transform_descriptors] for i, s in md.storage_data.items()),
        "files": sorted((p.name, p.stat().st_size) for p in Path(folder).iterdir() if p.name != ".metadata"),
        # the pickle itself, byte for byte, up to the run's own StorageMeta (its path and ids)
        "metadata_bytes": hashlib.sha1(raw[11:raw.index(b"storage_meta")]).hexdigest(),
    }
    print(json.dumps(out))


def child_reference(merged: str, config_dir: str, out: str) -> None:
    """What a user does after ``accelerate merge-weights``: the model of the config, the merged state dict
    loaded into it, written by save_pretrained in the config's dtype."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.float32)
    state = load_file(Path(merged) / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    del state
    model.save_pretrained(out)


def child_same(ours: str, ref: str) -> None:
    """Every tensor of the two model folders equal (names, dtypes, values), one tensor at a time."""
    import torch
    from safetensors import safe_open

    def index(folder):
        return {k: f for f in sorted(Path(folder).glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}

    a, b = index(ours), index(ref)
    differ = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        with safe_open(str(a[k]), "pt") as fa, safe_open(str(b[k]), "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if x.dtype != y.dtype or not torch.equal(x, y):
                differ.append(f"{k} ({x.dtype}, {y.dtype})")
    print(json.dumps({"tensors": len(a), "differ": differ[:5], "n_differ": len(differ)}))


# -- the parent (never imports torch) ------------------------------------------------------------------


def _child(*argv) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), *argv]


def _json(text: str):
    return json.loads(text.strip().splitlines()[-1])


def prove(args) -> int:
    for run, world in PROVE.items():
        out = args.cache / f"fsdp-prove-{run}"
        shutil.rmtree(out, ignore_errors=True)
        run_child(_child("--child-make", str(out), str(FIXTURES / run / "base_model"), "0", str(world)))
        real = _json(run_child(_child("--child-structure", str(FIXTURES / run / "checkpoint-3" / "pytorch_model_fsdp_0")),
                               capture=True)["stdout"])
        made = _json(run_child(_child("--child-structure", str(out / "checkpoint-3" / "pytorch_model_fsdp_0")),
                               capture=True)["stdout"])
        for part in real:
            if real[part] != made[part]:
                print(f"{run}: {part} differs from the real checkpoint's\n  real {str(real[part])[:600]}\n  made {str(made[part])[:600]}")
                return 1
        # and our reader sees the same tensors in both
        code = ("import sys; from tui_merger.core.io.dcp import DcpStore\n"
                "a, b = (DcpStore(p, lambda k: False) for p in sys.argv[1:])\n"
                "assert {k: (t.dtype, t.shape, [(c.offsets, c.sizes, c.file, c.start, c.length) for c in t.chunks])"
                " for k, t in a.tensors.items()} == {k: (t.dtype, t.shape, [(c.offsets, c.sizes, c.file, c.start, "
                "c.length) for c in t.chunks]) for k, t in b.tensors.items()}\n")
        subprocess.run([sys.executable, "-c", code, str(FIXTURES / run / "checkpoint-3" / "pytorch_model_fsdp_0"),
                        str(out / "checkpoint-3" / "pytorch_model_fsdp_0")], check=True, cwd=REPO)
        print(f"generator proved on {run}: .metadata ({len(real['keys'])} keys, {len(real['storage'])} chunks with "
              f"their files, offsets and lengths; the pickle byte for byte up to the run's path and ids) and the "
              "files' names and sizes equal the real checkpoint's")
        shutil.rmtree(out, ignore_errors=True)
    return 0


def _free_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def bench(args) -> int:
    rows = []
    for spec in args.layers:
        layers, world, *only = spec.split(":")
        layers, world, reference = int(layers), int(world), not args.no_reference and only != ["ours"]
        root = args.cache / f"fsdp-{args.shape}-l{layers}-w{world}"
        ckpt, base = root / "checkpoint-3", root / "base_model"
        dcp = ckpt / "pytorch_model_fsdp_0"
        for out in ("ours", "merged", "ref", "copy"):
            shutil.rmtree(root / out, ignore_errors=True)
        if not (dcp / ".metadata").is_file():  # a checkpoint kept by --keep is used again
            shutil.rmtree(root, ignore_errors=True)
            made = run_child(_child("--child-make", str(root), args.shape, str(layers), str(world)), capture=True)
            print(f"written in {made['wall']:.0f} s ({_json(made['stdout'])['values'] / 1e9:.2f} B values)", flush=True)
        size = sum(p.stat().st_size for p in dcp.iterdir())
        what = f"{layers} layers, {world} ranks, {size / 2**30:.1f} GiB"
        ours, merged, ref = root / "ours", root / "merged", root / "ref"
        cases = [
            ("cp (the DCP folder)", ["cp", "-r", str(dcp), str(root / "copy")]),
            ("tui-merger (default, verified)", [sys.executable, "-m", "tui_merger", "merge", str(ckpt), "--base",
                                                str(base), "--out", str(ours), "--plain"]),
        ]
        if reference:
            cases += [
                ("accelerate merge-weights", [str(Path(args.ref_python).with_name("accelerate")), "merge-weights",
                                              str(dcp), str(merged)]),
                ("  + save_pretrained (bf16)", _child("--child-reference", str(merged), str(base), str(ref))),
            ]
        total = None
        for name, argv in cases:
            if name.startswith(("accelerate", "  +")) and _free_gib() < size / 2**30 + 2:
                rows.append([what, name, "skipped", f"{_free_gib():.0f} GiB free", "", loadavg()])
                continue
            r = run_child(argv, log=root / f"{name.split()[0].strip('+')}.log")
            rows.append([what, name, f"{r['wall']:.1f}", f"{r['rss']:,.0f}", f"{r['cpu']:.1f}", loadavg()])
            print(rows[-1], flush=True)
            if name.startswith("accelerate"):
                total = r
            elif name.startswith("  +") and total:
                rows.append([what, "accelerate, both steps", f"{total['wall'] + r['wall']:.1f}",
                             f"{max(total['rss'], r['rss']):,.0f}", f"{total['cpu'] + r['cpu']:.1f}", ""])
                shutil.rmtree(merged, ignore_errors=True)
            shutil.rmtree(root / "copy", ignore_errors=True)
        if (ref / "config.json").exists() and (ours / "config.json").exists():
            same = _json(run_child(_child("--child-same", str(ours), str(ref)), capture=True)["stdout"])
            said = "equal" if not same["n_differ"] else f"{same['n_differ']} differ: {same['differ']}"
            print(f"{what}: ours against accelerate + save_pretrained, {same['tensors']} tensors: {said}", flush=True)
            rows.append([what, f"ours vs the reference: {same['tensors']} tensors, {said}", "", "", "", ""])
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nQwen2.5-{args.shape} widths, fp32 masters in DCP, output bf16 (the config's dtype)")
    print(fmt_table(["checkpoint", "case", "wall s", "peak RSS MiB", "cpu s", "load"], rows))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    children = {"--child-make": child_make, "--child-structure": child_structure,
                "--child-reference": child_reference, "--child-same": child_same}
    if argv and argv[0] in children:
        children[argv[0]](*argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prove", action="store_true", help="compare the generator's files with the real fixtures'")
    ap.add_argument("--shape", default="3b", choices=["0.5b", "1.5b", "3b", "7b"], help="Qwen2.5 widths (default 3b)")
    ap.add_argument("--layers", nargs="+", default=["2:8", "8:8:ours", "2:2:ours"], help="LAYERS:RANKS[:ours] checkpoints, in order (:ours leaves out accelerate)")
    ap.add_argument("--no-reference", action="store_true", help="leave out accelerate merge-weights")
    ap.add_argument("--ref-python", default=sys.executable, help="a python whose bin/ has accelerate")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and outputs")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the checkpoints are written")
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    return prove(args) if args.prove else bench(args)


if __name__ == "__main__":
    sys.exit(main())
