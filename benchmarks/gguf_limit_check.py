#!/usr/bin/env python
"""The GGUF check's limits derived from the model's own rounding, against llama.cpp itself. Not part of CI.

    PYTHONPATH=$PWD /work/venvs/llama-sys/bin/python benchmarks/gguf_limit_check.py FAMILY:TYPES:SEEDS ... \
        [--controls gate1.1,gate1.05,qk,norm,expert] [--old REV]

FAMILY: a key of tests/test_gguf_families.py's CASES, or vl:gemma3 / vl:gemma4 (a vision-language folder, as
llama_cpp_check.py builds it); TYPES and SEEDS comma-separated (q4_k_m,bf16 and 0,1). For each tiny random
model (llama_cpp_check.py's builder and widths, bf16 weights) it writes the GGUF of each type and runs
gguf_check.check_gguf with llama.cpp: the verdict, the measured spread (largest and median position), the
model's own spread under the type's rounding (f16/bf16: the type's own rounding; quantized types: the
checker's b-bit block rounding), the fixed LIMITS floor, the derived limit, and llama.cpp's spread over the
own spread (the ratio the factor must cover). ``--old REV``: also the verdict of gguf_check.py as it is at
that git revision (the column "old").

Controls, each a copy of the folder with one thing broken, exported and checked against the unchanged
folder (every one must FAIL):
- ``gate1.1``, ``gate1.05``: the first mlp.gate_proj scaled (not followed by a norm that undoes a scale, as
  o_proj is in Gemma; else the first 2-D tensor of layer 0);
- ``qk``: the first q_proj and k_proj swapped where their shapes are equal, else their rows reversed per head
  (what a converter that permutes q/k for the wrong rope layout gives);
- ``norm``: the first input norm + 1 (a norm stored "+1" where the family does not add it, or twice);
- ``expert``: expert 0 of the first layer with experts zeroed (a mixture of experts only).
Prints a Markdown table.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]


def _edit(folder: Path, dest: Path, change) -> str:
    """A copy of ``folder`` whose safetensors state goes through ``change(state) -> what`` (None: nothing to change)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    files = sorted(dest.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update({n: (f, t) for n, t in load_file(f).items()})
    plain = {n: t for n, (f, t) in state.items()}
    what = change(plain)
    if what is None:
        return None
    for f in files:
        save_file({n: plain[n] for n, (g, _) in state.items() if g == f}, f, metadata={"format": "pt"})
    return what


def _layer0(state, suffix):
    """The tensor of the first layer that has one ending with ``suffix`` (layer 0 where it has one)."""
    names = [n for n in state if ".layers." in n and n.endswith(suffix)]
    names = [n for n in names if "language_model" in n] or names  # a VL folder: not the vision tower's
    return min(names, key=lambda n: int(n.split(".layers.")[1].split(".")[0]), default=None)


def control(kind: str, config: dict):
    """``change(state)`` for a control kind."""
    import torch

    def gate(factor):
        def change(state):
            name = _layer0(state, ".mlp.gate_proj.weight") or next(
                n for n in state if ".layers.0." in n and state[n].dim() == 2 and "embed" not in n)
            state[name] = (state[name].float() * factor).to(state[name].dtype)
            return f"{name.split('layers.')[-1]} x{factor:g}"
        return change

    def qk(state):
        q, k = _layer0(state, "q_proj.weight"), _layer0(state, "k_proj.weight")
        if q is None or k is None:
            return None
        if state[q].shape == state[k].shape:
            state[q], state[k] = state[k], state[q]
            return f"layer {q.split('.layers.')[1].split('.')[0]} q/k swapped"
        text = config.get("text_config", config)
        head = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        for n in (q, k):
            w = state[n]
            state[n] = w.reshape(-1, head, w.shape[-1]).flip(1).reshape(w.shape).contiguous()
        return f"layer {q.split('.layers.')[1].split('.')[0]} q/k rows reversed per head"

    def norm(state):
        name = _layer0(state, "input_layernorm.weight") or next(
            (n for n in state if ".layers.0." in n and "norm" in n and state[n].dim() == 1), None)
        if name is None:
            return None
        state[name] = (state[name].float() + 1).to(state[name].dtype)
        return f"{name.split('layers.')[-1]} +1"

    def expert(state):
        names = [n for n in state if ".experts." in n and "shared" not in n and "vision" not in n]
        if not names:
            return None
        layer = min(int(n.split(".layers.")[1].split(".")[0]) for n in names)
        hit = []
        for n in names:
            if f".layers.{layer}." not in n:
                continue
            if ".experts.0." in n:
                state[n] = torch.zeros_like(state[n])
                hit.append(n)
            elif state[n].dim() == 3 and ".experts." in n and n.split(".experts.")[1].count(".") <= 1:
                w = state[n].clone()
                w[0] = 0
                state[n] = w
                hit.append(n)
        return f"layer {layer} expert 0 zeroed" if hit else None

    return {"gate1.1": gate(1.1), "gate1.05": gate(1.05), "qk": qk, "norm": norm, "expert": expert}[kind]


def old_module(rev: str):
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:tui_merger/core/ship/gguf_check.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "gguf_check_old.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("gguf_check_old", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    import json

    import torch

    from llama_cpp_check import WIDE, WIDE_FAMILY
    from test_gguf_families import make_family
    from test_gguf_vl_text import make_vl
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import LIMITS, check_gguf

    kinds = []
    old = None
    args = []
    it = iter(argv)
    for a in it:
        if a.startswith("--controls"):
            kinds = (a.split("=", 1)[1] if "=" in a else next(it)).split(",")
        elif a.startswith("--old"):
            old = old_module(a.split("=", 1)[1] if "=" in a else next(it))
        else:
            args.append(a)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n, spec in enumerate(args):
            family, types, seeds = spec.rsplit(":", 2)
            for seed in map(int, seeds.split(",")):
                base = root / f"m{n}-{seed}"
                if family.startswith("vl:"):
                    folder = make_vl(base, family[3:], seed=seed, dtype=torch.bfloat16, **WIDE,
                                     **WIDE_FAMILY.get(f"{family[3:]}_text", {}))
                else:
                    folder = make_family(base, family, dtype=torch.bfloat16, seed=seed, **WIDE, **WIDE_FAMILY.get(family, {}))
                config = json.loads((folder / "config.json").read_text())
                cases = [("file", folder)]
                for k, kind in enumerate(kinds):
                    bad = root / f"bad{n}-{seed}-{k}"
                    what = _edit(folder, bad, control(kind, config))
                    if what is not None:
                        cases.append((what, bad))
                for type_ in types.split(","):
                    for what, src in cases:
                        started = time.perf_counter()
                        path = export_gguf(src, type_, root / f"{src.name}-{type_}.gguf").path
                        c = check_gguf(folder, path, type_, reader="llama.cpp")
                        took = time.perf_counter() - started
                        was = old.check_gguf(folder, path, type_, reader="llama.cpp").status.upper() if old else ""
                        d = c.details
                        moe = (d.get("experts") or 0) > 1
                        own = d.get("own_rounding_rel")
                        got = d.get("logits_rel_median") if moe else d.get("logits_rel")
                        ratio = f"{got / own:.2f}" if own and got is not None else ""
                        rows.append((family, type_, str(seed), what, was, c.status.upper(), f"{d.get('logits_rel')}",
                                     f"{d.get('logits_rel_median')}", f"{own}", ratio, f"{LIMITS[type_]:g}", f"{d.get('limit')}",
                                     f"{d.get('positions_near_tied_routers', '')}"))
                        print("  " + " | ".join(rows[-1]) + f"  ({took:.1f} s)", flush=True)
                        if what == "file" or c.status != "failed":
                            print("    " + c.summary, flush=True)
                        path.unlink()
                for _, src in cases[1:]:
                    shutil.rmtree(src)
    print()
    print("| family | type | seed | file | old | new | max rel | median rel | own rounding | llama.cpp / own "
          "| fixed limit | limit | near-tied positions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
