#!/usr/bin/env python
"""Is our merge bit for bit peft's at a real size? The unit tests prove it on tiny models; block
boundaries, BLAS kernels and threads only show their differences at real widths.

    python benchmarks/exact_check.py --shape 3b                    # the cached 3B-shaped model
    python benchmarks/exact_check.py --shape 3b --code /tmp/old    # also an older checkout's merge
    python benchmarks/exact_check.py --shape 3b --adapter adapter_dora   # DoRA (built on first use)

peft (load bf16, ``PeftModel``, ``merge_and_unload``, ``save_pretrained``) and ``tui-merger merge
--no-verify`` (each checkout given) merge the cached base and adapter (benchmarks/.cache, built by
bench_merge.py's builder); then every tensor is compared, and the values that differ are counted and
shown per tensor. Exit status 1 when any differs. Correctness, not speed: nothing is timed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_merge import ensure_model  # noqa: E402
from harness import CHILD_ENV, DEFAULT_CACHE, REPO  # noqa: E402


def merge_with(code: Path, base: Path, adapter: Path, out: Path) -> None:
    """``tui-merger merge --no-verify`` with the package imported from ``code`` (a checkout)."""
    args = ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", "--no-verify"]
    script = (f"import sys; sys.path.insert(0, {str(code)!r}); from tui_merger.cli import entry; "
              f"sys.argv = ['tui-merger'] + {args!r}; entry()")
    _run(script)


def _run(script: str) -> None:
    done = subprocess.run([sys.executable, "-c", script], env=CHILD_ENV, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"a merge failed:\n{done.stderr[-3000:]}")


def merge_with_peft(base: Path, adapter: Path, out: Path) -> None:
    script = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from bench_merge import child_peft; " \
             f"child_peft({str(base)!r}, {str(adapter)!r}, {str(out)!r})"
    _run(script)


def ensure_dora_adapter(base: Path, out: Path) -> None:
    """A DoRA adapter (r=16, alpha=32, all linear kinds) for the cached base, built with peft: random
    A and B as bench_merge's adapters, and magnitudes peft's own (the base rows' norms) times a
    random factor around 1, so that merging changes every row's length as well as its direction."""
    if (out / "adapter_config.json").is_file():
        return
    script = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from bench_merge import ALL_TARGETS, LORA_ALPHA, LORA_R
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
torch.manual_seed(7)
model = AutoModelForCausalLM.from_pretrained({str(base)!r}, dtype=torch.bfloat16)
config = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=list(ALL_TARGETS), lora_dropout=0.0,
                    init_lora_weights=False, use_dora=True, task_type="CAUSAL_LM")
pm = get_peft_model(model, config)
with torch.no_grad():
    for name, p in pm.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            p.normal_(0.0, 0.05)
        elif "lora_magnitude_vector" in name:
            p.mul_(1 + 0.1 * torch.randn_like(p))
pm.save_pretrained({str(out)!r})
"""
    _run(script)


def compare(reference: Path, ours: Path) -> list[tuple[str, int, int]]:
    """[(tensor, values that differ, values)] for every tensor of ``reference`` that ``ours`` does not
    hold bit for bit (a missing tensor counts all its values)."""
    import torch
    from safetensors import safe_open

    def tensors(folder: Path) -> dict:
        found = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                found.update({name: (path, name) for name in f.keys()})
        return found

    want, got = tensors(reference), tensors(ours)
    differ = []
    for name, (path, _) in sorted(want.items()):
        with safe_open(path, "pt") as f:
            a = f.get_tensor(name)
        if name not in got:
            differ.append((name, a.numel(), a.numel()))
            continue
        with safe_open(got[name][0], "pt") as f:
            b = f.get_tensor(name)
        if a.dtype != b.dtype or a.shape != b.shape:
            differ.append((name, a.numel(), a.numel()))
        elif not torch.equal(a.view(torch.uint8) if a.dtype.is_floating_point else a,
                             b.view(torch.uint8) if b.dtype.is_floating_point else b):
            differ.append((name, int((a != b).sum()), a.numel()))
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="3b", help="0.5b, 1.5b, 3b or 7b (default 3b)")
    ap.add_argument("--adapter", default="adapter_all", help="adapter folder of the cached model (default adapter_all)")
    ap.add_argument("--code", type=Path, action="append", default=[],
                    help="another checkout whose merge is compared too (may repeat)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    folder = ensure_model(args.cache, None, shape=args.shape)
    base, adapter = folder / "base", folder / args.adapter
    if args.adapter == "adapter_dora":
        ensure_dora_adapter(base, adapter)
    tmp = Path(tempfile.mkdtemp(prefix="exact-", dir=args.cache))
    status = 0
    try:
        merge_with_peft(base, adapter, tmp / "peft")
        for code in [REPO, *args.code]:
            out = tmp / "ours"
            merge_with(code, base, adapter, out)
            differ = compare(tmp / "peft", out)
            print(f"{code}: {'bit for bit peft' if not differ else f'{len(differ)} tensors differ from peft'}")
            for name, n, total in differ:
                print(f"  {name}: {n} of {total} values")
            status |= bool(differ)
            shutil.rmtree(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
