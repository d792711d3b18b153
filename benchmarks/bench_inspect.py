#!/usr/bin/env python
"""How fast ``tui-merger inspect`` lists a folder of 20 checkpoints of a 7B model. Target: under 1 s.

    python benchmarks/bench_inspect.py                # builds the folder once, then medians of 5
    python benchmarks/bench_inspect.py --repeats 9 --no-cold

The folder (benchmarks/.cache/inspect-7b/, built once, about 50 MB on disk) holds sparse files of the
real sizes (apparent size 1.2 TB):

- ``verl/global_step_{100..1000}/actor/``: 8 ``model_world_size_8_rank_R.pt`` files of Qwen2.5-7B fp32
  master weights each (a small valid zip with the key list at the end of each: inspect reads rank 0's
  key list), optimizer and extra-state rank files, fsdp_config.json, huggingface/ config and tokenizer;
  latest_checkpointed_iteration.txt;
- ``sft/checkpoint-{100..1000}/``: the 7B model in bf16 as 4 safetensors shards with real headers
  (Qwen2.5-7B tensor names, shapes and offsets), the index, config, tokenizer files, trainer state and a
  sparse optimizer.pt;
- ``logs/``, ``wandb/`` and ``.git/``: 4,200 small unrelated files.

Timed: ``scan()`` in this process (warm page cache; cold too when the caches can be dropped, which needs
root), and ``python -m tui_merger inspect DIR --json`` end to end (interpreter start included).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import struct
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import DEFAULT_CACHE, code_state, fmt_table, loadavg, med, run_child  # noqa: E402

LAYOUT_VERSION = 1
STEPS = list(range(100, 1001, 100))
WORLD = 8
QWEN25_7B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
    max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
)


def tensors_7b() -> list[tuple[str, tuple[int, ...]]]:
    """Qwen2.5-7B's parameters in the order transformers saves them."""
    h, inter, vocab = QWEN25_7B["hidden_size"], QWEN25_7B["intermediate_size"], QWEN25_7B["vocab_size"]
    kv = QWEN25_7B["num_key_value_heads"] * h // QWEN25_7B["num_attention_heads"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(QWEN25_7B["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def sparse(path: Path, size: int, tail: bytes = b"") -> None:
    """A file of ``size`` bytes that takes no disk space but for ``tail``, written at its end."""
    with open(path, "wb") as f:
        f.truncate(size - len(tail))
        f.seek(size - len(tail))
        f.write(tail)


def write_safetensors_shards(folder: Path, n_shards: int) -> None:
    """The 7B model in bf16 as real-header safetensors shards (data left sparse) plus the index."""
    tensors = tensors_7b()
    total = sum(numel(s) * 2 for _, s in tensors)
    per_shard = total / n_shards
    shards: list[list] = [[]]
    filled = 0
    for name, shape in tensors:
        if filled >= per_shard * len(shards) and len(shards) < n_shards:
            shards.append([])
        shards[-1].append((name, shape))
        filled += numel(shape) * 2
    weight_map = {}
    for i, entries in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in entries:
            n = numel(shape) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        with open(folder / fname, "wb") as f:
            f.write(head)
            f.truncate(len(head) + offset)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def rank_file_tail(rank: int) -> bytes:
    """A torch.save-style zip holding a data.pkl with the keys and about the metadata size of a real
    FSDP2 rank file of this model (its tensor storages are left out: inspect never reads them)."""
    spec = "DTensorSpec(mesh=DeviceMesh('cuda', [0..7], mesh_dim_names=('fsdp',)), placements=(Shard(dim=0),))" * 6
    keys = {name: (list(shape), spec) for name, shape in tensors_7b()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        stem = f"model_world_size_{WORLD}_rank_{rank}"
        z.writestr(f"{stem}/data.pkl", pickle.dumps(keys, protocol=2))
        z.writestr(f"{stem}/byteorder", "little")
        z.writestr(f"{stem}/.format_version", "1")
    return buf.getvalue()


def build(folder: Path) -> None:
    marker = folder / "complete.json"
    if marker.is_file() and json.loads(marker.read_text()).get("version") == LAYOUT_VERSION:
        return
    import shutil

    if folder.exists():
        shutil.rmtree(folder)
    t0 = time.perf_counter()
    params = sum(numel(s) for _, s in tensors_7b())
    tokenizer = {"tokenizer.json": "{}", "tokenizer_config.json": '{"model_max_length": 32768}',
                 "vocab.json": "{}", "merges.txt": "#version: 0.2\n"}
    config = json.dumps(QWEN25_7B, indent=2)

    run = folder / "verl"
    tails = [rank_file_tail(r) for r in range(WORLD)]
    for step in STEPS:
        actor = run / f"global_step_{step}" / "actor"
        (actor / "huggingface").mkdir(parents=True)
        for r in range(WORLD):
            sparse(actor / f"model_world_size_{WORLD}_rank_{r}.pt", params * 4 // WORLD, tails[r])
            sparse(actor / f"optim_world_size_{WORLD}_rank_{r}.pt", params * 8 // WORLD)
            sparse(actor / f"extra_state_world_size_{WORLD}_rank_{r}.pt", 15_000)
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}))
        (actor / "huggingface" / "config.json").write_text(config.replace("bfloat16", "float32"))
        for name, text in tokenizer.items():
            (actor / "huggingface" / name).write_text(text)
        sparse(actor.parent / "data.pt", 1_500)
    (run / "latest_checkpointed_iteration.txt").write_text(str(STEPS[-1]))

    for step in STEPS:
        ckpt = folder / "sft" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        write_safetensors_shards(ckpt, 4)
        (ckpt / "config.json").write_text(config)
        for name, text in tokenizer.items():
            (ckpt / name).write_text(text)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [{"loss": 1.0}] * step}))
        sparse(ckpt / "optimizer.pt", params * 8)
        sparse(ckpt / "scheduler.pt", 1_000)
        sparse(ckpt / "rng_state.pth", 14_000)

    for i in range(3000):
        (folder / "logs").mkdir(exist_ok=True)
        (folder / "logs" / f"step_{i:05d}.log").write_text(f"step {i} loss 1.0\n" * 5)
    for k in range(10):
        files = folder / "wandb" / f"run-2024{k:04d}" / "files"
        files.mkdir(parents=True)
        for i in range(100):
            (files / f"media_{i}.json").write_text("{}")
    for i in range(200):
        obj = folder / ".git" / "objects" / f"{i:02x}"
        obj.mkdir(parents=True, exist_ok=True)
        (obj / ("0" * 38)).write_bytes(b"x" * 100)
    marker.write_text(json.dumps({"version": LAYOUT_VERSION}))
    print(f"built {folder} in {time.perf_counter() - t0:.1f} s")


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def check(result) -> None:
    """The benchmark measures a correct answer, not just a fast one."""
    cands = result.candidates
    assert len(cands) == 20, [c.path for c in cands]
    assert not result.problems, result.problems
    fsdp = [c for c in cands if c.kind == "verl-fsdp"]
    sft = [c for c in cands if c.kind == "trainer-checkpoint"]
    assert [c.step for c in fsdp] == STEPS[::-1] and [c.step for c in sft] == STEPS[::-1]
    assert [c.latest for c in fsdp] == [True] + [False] * 9 and [c.latest for c in sft] == [True] + [False] * 9
    assert {(c.backend, c.world_size, c.dtype) for c in fsdp} == {("fsdp2", WORLD, "float32")}
    assert {c.dtype for c in sft} == {"bfloat16"} and all(c.tokenizer for c in cands)
    shards = sum(p.stat().st_size for p in Path(sft[0].path).glob("*.safetensors"))
    assert 15e9 < shards < 15.5e9, shards  # the real Qwen2.5-7B bf16 size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-cold", dest="cold", action="store_false", help="skip the cold page cache runs")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE / "inspect-7b")
    args = ap.parse_args()

    build(args.cache)
    from tui_merger.core.formats.scan import scan
    from tui_merger.core.options import human_bytes

    result = scan(args.cache)
    check(result)
    n_files = sum(len(files) for _, _, files in os.walk(args.cache))
    apparent = sum(c.size_bytes for c in result.candidates)
    print(f"{code_state()}; load average {loadavg()}")
    print(f"folder: {args.cache}: {n_files} files, 20 checkpoints of a 7B model ({human_bytes(apparent)} apparent)")

    def timed_scan(cold: bool) -> float:
        if cold:
            drop_caches()
        t0 = time.perf_counter()
        scan(args.cache)
        return time.perf_counter() - t0

    cli = [sys.executable, "-m", "tui_merger", "inspect", str(args.cache), "--json"]

    def timed_cli(cold: bool) -> float:
        if cold:
            drop_caches()
        out = run_child(cli, capture=True)
        assert len(json.loads(out["stdout"])["candidates"]) == 20
        return out["wall"]

    can_drop = args.cold and drop_caches()
    rows = []
    for name, fn in (("scan() in-process", timed_scan), ("python -m tui_merger inspect --json", timed_cli)):
        for cold in (False, True) if can_drop else (False,):
            if not cold:
                fn(False)  # warm the page cache (and, for the CLI, the interpreter's .pyc files)
            times = [fn(cold) for _ in range(args.repeats)]
            verdict = "ok" if med(times) < 1.0 else "TOO SLOW"
            rows.append((name, "cold" if cold else "warm", f"{med(times):.3f}", f"{min(times):.3f}", f"{max(times):.3f}", verdict))
    print(fmt_table(["what", "page cache", f"median s (of {args.repeats})", "min s", "max s", "target < 1 s"], rows))
    if args.cold and not can_drop:
        print("cold runs skipped: /proc/sys/vm/drop_caches is not writable here (needs root).")


if __name__ == "__main__":
    main()
