#!/usr/bin/env python
"""The spreads behind gguf_check.LIMITS, and the llama.cpp path of `tui-merger gguf`'s check (outside CI).

    python -m venv --system-site-packages /work/venvs/llama-sys     # sees this project's torch and transformers
    /work/venvs/llama-sys/bin/pip install ../shared/tools/llama_cpp_python-0.3.36-*.whl
    PYTHONPATH=$PWD /work/venvs/llama-sys/bin/python benchmarks/gguf_check_spreads.py [--readers llama.cpp,transformers]

For a tiny random model of each family GGUF writes (tests/test_gguf.py's builder: a trained byte-level
BPE tokenizer with a chat template, random weights and norms) and each type, it writes the GGUF and runs
gguf_check.check_gguf with each reader: the verdict, token ids, the relative logit difference against the
limit, top tokens. One table row per family, type and reader. Random weights are the hard case for
quantization (no large values to set the scales, logits close together), so the limits hold with room
for real models.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
TYPES = ("f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q5_k_s", "q4_k_m", "q4_k_s", "q3_k_m")


def main() -> int:
    import torch

    from test_gguf import make_model
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import check_gguf, llama_cpp_version

    parser = argparse.ArgumentParser()
    parser.add_argument("--readers", default="llama.cpp,transformers")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--families", default="", help="comma-separated family labels (default: all)")
    args = parser.parse_args()
    readers = [r for r in args.readers.split(",") if r != "llama.cpp" or llama_cpp_version()]
    print(f"llama-cpp-python {llama_cpp_version()}; readers {readers}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "out").mkdir()
        folders = {
            "llama (llama3 rope)": make_model(root / "llama", "llama", torch.bfloat16, rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
            "qwen2": make_model(root / "qwen2", "qwen2", torch.bfloat16),
            "qwen3 tied": make_model(root / "qwen3", "qwen3", torch.bfloat16, tie_word_embeddings=True),
            "qwen3_moe": make_model(root / "qwen3-moe", "qwen3_moe", torch.bfloat16),
            # rows of 256 values: the k-quants proper (64-value rows fall back to Q5_0 / Q5_1 / Q8_0)
            "qwen2 256-wide": make_model(root / "qwen2-256", "qwen2", torch.bfloat16, hidden_size=256, intermediate_size=512),
            "qwen3_moe 256-wide": make_model(root / "qwen3-moe-256", "qwen3_moe", torch.bfloat16, hidden_size=256),
        }
        for family, folder in folders.items():
            if args.families and family not in args.families.split(","):
                continue
            for type_ in args.types.split(","):
                path = export_gguf(folder, type_, root / "out" / f"{folder.name}-{type_}.gguf").path
                for reader in readers:
                    c = check_gguf(folder, path, type_, reader=reader)
                    d = c.details
                    rows.append((family, type_, reader, c.status, f"{d.get('ids_equal')}/{d.get('texts')}",
                                 f"{d.get('logits_rel')}", f"{d.get('logits_rel_median')}", f"{d.get('limit')}",
                                 f"{d.get('top_equal')}/{d.get('positions')} (+{d.get('top_near_ties')} near ties)"))
                    print("  " + " | ".join(rows[-1]) + ("" if c.details else f"  {c.summary}"), flush=True)
                path.unlink()
    print()
    print("| family | type | reader | verdict | token ids equal | logits, max rel. diff | median over positions | limit | top token equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
