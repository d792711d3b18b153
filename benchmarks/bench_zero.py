"""DeepSpeed ZeRO-3 checkpoint -> Hugging Face model: tui-merger (with verification) against DeepSpeed's own
zero_to_fp32 (``convert_zero_checkpoint_to_fp32_state_dict``, torch.save shards: with safetensors it stops on
tied embeddings) and ``cp`` of the rank files to /dev/null (reading them once);
wall time and each process's own peak RSS, in one run.

The checkpoint is written by a generator in DeepSpeed's exact layout: it runs in a venv with DeepSpeed (the
objects pickled are DeepSpeed's own: ``ZeroStageEnum``, ``LossScaler``), takes every key of a real Trainer
checkpoint (tests/fixtures/deepspeed/z3_bf16_llama_tied) as its template and fills in a Qwen2.5 shape (3B by
default, tied embeddings, bf16 config) with random fp32 masters partitioned as ZeRO-3 does, and Adam's
exp_avg / exp_avg_sq of the same size, as DeepSpeed saves them (neither tool reads them; ours hashes them, as every input file). ``--prove`` writes the
fixture's own model that way and compares every file's structure (keys, types, tensor dtypes and shapes) and
its zip members (order and sizes) with the real one.

    python benchmarks/bench_zero.py --prove                      # the generator against the real fixture
    nice python benchmarks/bench_zero.py --shape 3b --world 8    # the benchmark (~35 GB of rank files)

zero_to_fp32 writes fp32; ours runs twice, as a user runs it (the config's dtype, bf16) and with ``--dtype
fp32`` (the same bytes as zero_to_fp32). DeepSpeed runs from ``--ds-python`` (default /work/venvs/ds/bin/python); tui-merger never needs it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import CHILD_ENV, DEFAULT_CACHE, REPO, code_state, fmt_table, run_child  # noqa: E402

TEMPLATE = REPO / "tests" / "fixtures" / "deepspeed" / "z3_bf16_llama_tied"


# -- the generator (runs in the DeepSpeed venv) ------------------------------------------------------


def child_make(out: str, shape: str, world: str, moments: str) -> None:
    import copy
    import math
    from collections import OrderedDict

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    world, moments = int(world), moments == "1"
    tag = TEMPLATE / "checkpoint-3" / "global_step3"
    m_tmpl = [torch.load(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", weights_only=False) for r in (0, 1)]
    o_tmpl = torch.load(tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    if shape == "fixture":
        config = AutoConfig.from_pretrained(TEMPLATE / "checkpoint-3")
    else:
        from harness import qwen_config

        config = qwen_config(None, 151643, shape)
        config.tie_word_embeddings = True
        config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = OrderedDict((n, p.shape) for n, p in model.named_parameters())  # a tied lm_head is not listed
    per_rank = sum(math.ceil(s.numel() / world) for s in shapes.values())
    ckpt = Path(out) / "checkpoint-3"
    folder = ckpt / "global_step3"
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(ckpt)
    (ckpt / "latest").write_text("global_step3")
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(1 << 24, generator=g)  # the moments' values (see below)
    for r in range(world):
        m = copy.copy(m_tmpl[0 if r == 0 else 1])
        # the module's state dict, every entry a placeholder (a tied lm_head listed too)
        # (tied weights are one parameter: one placeholder, one storage, as in the real files)
        holders = {}
        m["module"] = OrderedDict((n, holders.setdefault(id(t), torch.empty(0, dtype=torch.bfloat16)))
                                  for n, t in model.state_dict(keep_vars=True).items())
        m["param_shapes"] = [shapes]
        m["shared_params"] = {"lm_head.weight": "model.embed_tokens.weight"} if r == 0 and config.tie_word_embeddings else {}
        m["dp_world_size"] = world
        torch.save(m, folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        flat = torch.empty(per_rank)
        for start in range(0, per_rank, 1 << 24):
            chunk = flat[start : start + (1 << 24)]
            chunk.copy_(torch.randn(chunk.numel(), generator=g) * 0.02)
        o = copy.deepcopy({k: v for k, v in o_tmpl.items() if k != "optimizer_state_dict"})
        osd = dict(o_tmpl["optimizer_state_dict"])
        osd["fp32_flat_groups"] = [flat]
        osd["partition_count"] = world
        inner = copy.copy(osd["optimizer_state_dict"])
        # Adam's moments as DeepSpeed saves them: one exp_avg and one exp_avg_sq per group, each the size of
        # the rank's fp32 partition, in storages of their own written before the masters (the real files'
        # order: --prove compares the zip members). Their values are never read by either tool, only
        # hashed by ours: random blocks repeated (an exp_avg_sq is >= 0)
        size = per_rank if moments else 0
        exp_avg, exp_avg_sq = torch.empty(size), torch.empty(size)
        for start in range(0, size, pool.numel()):
            n = min(pool.numel(), size - start)
            shift = (start // pool.numel() * 7919 + r * 104729) % (pool.numel() - n + 1)
            exp_avg[start : start + n].copy_(pool[shift : shift + n])
            exp_avg_sq[start : start + n].copy_(pool[shift : shift + n]).square_().mul_(1e-3)
        inner["state"] = {0: {"step": inner["state"][0]["step"].clone(), "exp_avg": exp_avg.mul_(1e-3),
                              "exp_avg_sq": exp_avg_sq}}
        osd["optimizer_state_dict"] = inner
        o["optimizer_state_dict"] = osd
        torch.save(o, folder / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        del flat, exp_avg, exp_avg_sq, o, osd, inner
    print(json.dumps({"params": len(shapes), "values": sum(s.numel() for s in shapes.values())}))


def child_structure(*files: str) -> None:
    """Each file's structure: dict keys, value types, tensor dtypes and shapes (no values)."""
    import torch

    def walk(x):
        if isinstance(x, torch.Tensor):
            return ["tensor", str(x.dtype), list(x.shape)]
        if isinstance(x, dict):
            return {"type": type(x).__name__, "items": {str(k): walk(v) for k, v in x.items()}}
        if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
            return [type(x).__name__, [walk(v) for v in x]]
        if isinstance(x, torch.Size):
            return ["Size", list(x)]
        return type(x).__module__ + "." + type(x).__qualname__

    print(json.dumps({Path(f).name: walk(torch.load(f, weights_only=False)) for f in files}))


# -- the parent (never imports torch) --------------------------------------------------------------


def _ds(args, *argv) -> list[str]:
    return [args.ds_python, str(Path(__file__).resolve()), *argv]


def _last_json(text: str):
    return json.loads(text.strip().splitlines()[-1])  # DeepSpeed prints its own lines first


def prove(args) -> int:
    """The generator writes the fixture's own model with the keys and structure of the real files."""
    out = args.cache / "zero-prove"
    shutil.rmtree(out, ignore_errors=True)
    run_child(_ds(args, "--child-make", str(out), "fixture", "2", "1"))
    real = TEMPLATE / "checkpoint-3" / "global_step3"
    made = out / "checkpoint-3" / "global_step3"
    names = sorted(p.name for p in real.glob("*.pt"))
    assert names == sorted(p.name for p in made.glob("*.pt")), (names, sorted(p.name for p in made.glob("*.pt")))
    a = _last_json(run_child(_ds(args, "--child-structure", *[str(real / n) for n in names]), capture=True)["stdout"])
    b = _last_json(run_child(_ds(args, "--child-structure", *[str(made / n) for n in names]), capture=True)["stdout"])
    for name in names:
        if a[name] != b[name]:
            print(f"{name}: the structure differs from the real file")
            return 1
        # the bytes' layout too: the same zip members (tensor storages, the pickle) in the same order and
        # sizes, so the same bytes are read, skipped and hashed (the moments before the masters)
        # (the pickle's own size differs by a few bytes of recorded strings, e.g. the ds_config)
        members = [[(m, i.file_size if m.startswith("data/") else None)
                    for i in zipfile.ZipFile(d / name).infolist() for m in [i.filename.split("/", 1)[1]]]
                   for d in (real, made)]
        if members[0] != members[1]:
            print(f"{name}: the zip members differ from the real file's:\n  {members[0]}\n  {members[1]}")
            return 1
    print(f"generator proved: {len(names)} files with the real checkpoint's keys, types, dtypes and shapes, "
          "and its zip members in the same order and sizes (Adam's moments included)")
    # and our reader gives what it gives on the real files
    from subprocess import run

    code = ("import sys; from tui_merger.core.formats.deepspeed_zero import ZeroSource, find_zero_checkpoint as f\n"
            f"a = ZeroSource(f({str(TEMPLATE / 'checkpoint-3')!r})); b = ZeroSource(f({str(out / 'checkpoint-3')!r}))\n"
            "assert {k: v.shape for k, v in a.tensors.items()} == {k: v.shape for k, v in b.tensors.items()}\n")
    run([sys.executable, "-c", code], check=True, cwd=REPO)
    shutil.rmtree(out, ignore_errors=True)
    return 0


def bench(args) -> int:
    root = args.cache / f"zero-{args.shape}-w{args.world}{'' if args.moments else '-nomoments'}"
    ckpt = root / "checkpoint-3"
    if not (ckpt / "latest").is_file():
        shutil.rmtree(root, ignore_errors=True)
        made = run_child(_ds(args, "--child-make", str(root), args.shape, str(args.world), "1" if args.moments else "0"))
        print(f"checkpoint written in {made['wall']:.0f} s", flush=True)
    ranks = sorted((ckpt / "global_step3").iterdir())
    size = sum(p.stat().st_size for p in ranks)
    out = root / "out"
    ours = [sys.executable, "-m", "tui_merger", "merge", str(ckpt), "--out", str(out), "--plain"]
    ours += [] if args.behaviour else ["--no-behaviour"]
    cases = {
        # reading every rank file once (what any tool that hashes its inputs must do at least); a copy
        # beside them would need their size again on disk (37 GB at 3B with the moments)
        "cp rank files > /dev/null": ["sh", "-c", 'for f in "$@"; do cp "$f" /dev/null; done', "cp", *map(str, ranks)],
        # torch.save shards, zero_to_fp32.py's default: with safe_serialization=True it stops on tied embeddings
        # ("Some tensors share memory"), the failure the issue reports
        "zero_to_fp32 (deepspeed), fp32": [args.ds_python, "-c",
                                           "import sys; from deepspeed.utils.zero_to_fp32 import "
                                           "convert_zero_checkpoint_to_fp32_state_dict as c; "
                                           f"c({str(ckpt)!r}, {str(out)!r})"],
        "tui-merger + verification, bf16 (default)": ours,
        "tui-merger + verification, --dtype fp32": ours + ["--dtype", "fp32"],
    }
    if args.only:
        cases = {k: v for k, v in cases.items() if any(o in k for o in args.only)}
    rows = []
    for name, argv in cases.items():
        shutil.rmtree(out, ignore_errors=True)
        with tempfile.TemporaryDirectory() as state:
            CHILD_ENV["XDG_STATE_HOME"] = state  # no hash remembered from an earlier case: every input is read
            r = run_child(argv, log=root / f"{name.split()[0]}-{len(rows)}.log")
        rows.append([name, f"{r['wall']:.1f}", f"{r['rss']:.0f}", f"{r['cpu']:.1f}"])
        print(rows[-1], flush=True)
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nZeRO-3, {args.world} ranks, Qwen2.5-{args.shape} shape: {size / 2**30:.1f} GiB of rank files "
          f"({'with' if args.moments else 'without'} Adam's moments); {code_state()}")
    print(fmt_table(["case", "wall s", "peak RSS MiB", "cpu s"], rows))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child-make":
        child_make(*argv[1:])
        return 0
    if argv and argv[0] == "--child-structure":
        child_structure(*argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prove", action="store_true", help="compare the generator's files with the real fixture's")
    ap.add_argument("--shape", default="3b", choices=["0.5b", "1.5b", "3b", "7b"], help="Qwen2.5 shape (default 3b)")
    ap.add_argument("--world", type=int, default=8, help="ZeRO ranks (default 8)")
    ap.add_argument("--no-moments", dest="moments", action="store_false",
                    help="save the Adam moments empty (a third of the disk; real checkpoints hold them)")
    ap.add_argument("--only", nargs="+", help="run only the cases whose name holds one of these words")
    ap.add_argument("--behaviour", action="store_true", help="also run the behaviour check (slow on few cores)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint for the next run")
    ap.add_argument("--ds-python", default="/work/venvs/ds/bin/python", help="a python with deepspeed installed")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the checkpoint is written")
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    return prove(args) if args.prove else bench(args)


if __name__ == "__main__":
    sys.exit(main())
