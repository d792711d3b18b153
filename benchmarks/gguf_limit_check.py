#!/usr/bin/env python
"""The GGUF check's limit derived from the model's own rounding, against llama.cpp itself. Not part of CI.

    PYTHONPATH=$PWD /work/venvs/llama-sys/bin/python benchmarks/gguf_limit_check.py FAMILY:TYPE:SEED ... [--control]

For each tiny random model (llama_cpp_check.py's builder and widths, bf16 weights) it writes the GGUF of
the type and runs gguf_check.check_gguf with llama.cpp: the verdict, the measured spread, the model's own
rounding spread, the fixed LIMITS floor and the derived limit. ``--control=1.1``: also the GGUF of a copy of
the folder with one tensor (layer 0's mlp.gate_proj: not followed by a norm that undoes a scale, as o_proj is in Gemma; else the first 2-D one) scaled by that factor (repeat the option for more), checked against the
unchanged folder: it must FAIL. Prints a Markdown table.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]


def scaled_copy(folder: Path, dest: Path, factor: float = 1.01) -> str:
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    for f in sorted(dest.glob("*.safetensors")):
        state = load_file(f)
        name = next((n for n in state if "layers.0." in n and "mlp.gate_proj.weight" in n), None) or \
            next(n for n in state if state[n].dim() == 2 and "embed" not in n)
        state[name] = (state[name].float() * factor).to(state[name].dtype)
        save_file(state, f, metadata={"format": "pt"})
        return name
    raise SystemExit("no safetensors")


def main(argv: list[str]) -> int:
    import torch

    from llama_cpp_check import WIDE, WIDE_FAMILY
    from test_gguf_families import make_family
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import LIMITS, check_gguf

    factors = [float(a.split("=")[1]) for a in argv if a.startswith("--control=")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for n, spec in enumerate(a for a in argv if not a.startswith("--")):
            family, type_, seed = spec.split(":")
            folder = make_family(root / f"m{n}", family, dtype=torch.bfloat16, seed=int(seed), **WIDE, **WIDE_FAMILY.get(family, {}))
            cases = [("file", folder)]
            for k, factor in enumerate(factors):
                bad = root / f"bad{n}-{k}"
                cases.append((f"{scaled_copy(folder, bad, factor).split('.', 2)[-1]} x{factor:g}", bad))
            for what, src in cases:
                started = time.perf_counter()
                path = export_gguf(src, type_, root / f"{src.name}-{type_}.gguf").path
                c = check_gguf(folder, path, type_, reader="llama.cpp")
                d = c.details
                rows.append((family, type_, seed, what, f"{d.get('logits_rel')}", f"{d.get('logits_rel_median')}",
                             f"{d.get('own_rounding_rel')}", f"{LIMITS[type_]:g}", f"{d.get('limit')}", c.status.upper()))
                print("  " + " | ".join(rows[-1]) + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
                print("    " + c.summary, flush=True)
    print("| family | type | seed | file | max rel | median rel | own rounding | fixed limit | derived limit | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
