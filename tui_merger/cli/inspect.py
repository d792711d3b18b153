"""``tui-merger inspect [PATH]``: list the checkpoints under a folder and what each one is."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tui_merger.cli.common import next_step

MAX_TARGETS = 8


def add_parser(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="list the checkpoints under a folder: kind, step, dtype, size, base model, LoRA settings",
        description="Scan PATH (default: the current folder) for PEFT adapters, trainer checkpoint-N folders, "
        "verl FSDP and Megatron checkpoints, Hugging Face models and kohya LoRA files, and say what each is. "
        "Reads file names and headers only, never tensor data.",
    )
    p.add_argument("path", metavar="PATH", nargs="?", default=".", help="folder to scan, or a kohya LoRA .safetensors file")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--depth", type=int, default=4, metavar="N", help="folder levels below PATH to look into (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_inspect)


def cmd_inspect(args) -> int:
    from tui_merger.cli.common import is_tty
    from tui_merger.core.formats.scan import scan

    result = scan(args.path, max_depth=args.depth)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    lines = render(result, args.path)
    if is_tty(sys.stdout):
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False)
        for text, style in lines:
            console.print(Text(text, style=style or ""), soft_wrap=True)
    else:
        for text, _ in lines:
            print(text)
    return 0


def render(result, given: str) -> list[tuple[str, str | None]]:
    """(line, rich style) pairs: one block per candidate, the problems, then what to run next."""
    from tui_merger.core.formats.scan import shown
    from tui_merger.core.options import human_bytes

    def where(path: str) -> str:
        """A path as the user can type it: PATH as they gave it, joined with the part below it."""
        rel = os.path.relpath(path, result.root)
        return shown(os.path.normpath(os.path.join(given, rel)))

    out: list[tuple[str, str | None]] = []
    n, p = len(result.candidates), len(result.problems)
    out.append((
        f"{shown(result.root)}: {n} checkpoint{'s' * (n != 1)}, {p} problem{'s' * (p != 1)} ({result.seconds:.2f} s)",
        "bold",
    ))
    for c in result.candidates:
        out.append(("", None))
        head = f"{c.kind:<18} {where(c.path)}"
        if c.step is not None:
            head += f"  step {c.step}" + ("  (latest)" if c.latest else "") + ("  (best)" if c.best else "")
        out.append((head, "bold green" if c.latest else "bold"))
        rows = []
        backend = [b for b in (c.backend, c.world_size and f"world size {c.world_size}", c.role) if b]
        if backend:
            rows.append(("backend", ", ".join(backend)))
        rows.append(("dtype", c.dtype or "unknown"))
        rows.append(("size", human_bytes(c.size_bytes)))
        if c.base_model:
            place = {"path": "local folder", "hf-cache": "in the HF cache", "missing": "not on this machine"}
            same = c.base_path and os.path.normpath(c.base_model) == c.base_path
            found = f": {shown(c.base_path)}" if c.base_path and not same else ""
            rows.append(("base", f"{c.base_model} ({place.get(c.base_resolves, 'unknown')}{found})"))
        elif c.needs_base:
            rows.append(("base", "unknown: pass --base"))
        rows.append(("tokenizer", "yes" if c.tokenizer else "no"))
        if c.lora is not None:
            rows.append(("LoRA", _lora_line(c.lora)))
        for label, value in rows:
            out.append((f"  {label:<10} {value}", None))
        for note in c.notes:
            out.append((f"  note       {note}", "yellow"))
    if not result.candidates:
        out.append((f"No checkpoints found under {shown(result.root)}.", None))
    if result.too_deep:
        out.append(("", None))
        out.append((
            f"{result.too_deep} folder(s) deeper than {result.max_depth} levels were not looked into; "
            "raise --depth to include them.",
            "yellow",
        ))
    if result.problems:
        out.append(("", None))
        out.append(("Problems (the scan went on):", "bold red"))
        for prob in result.problems:
            out.append((f"  {where(prob.path)}: {prob.message}", "red"))
    hint = next_step(result, where)
    if hint:
        out.append(("", None))
        out.append((f"Next: {hint}", "bold cyan"))
    return out


def _lora_line(lora: dict) -> str:
    alpha = lora["alpha"]
    head = f"r {lora['r'] if lora['r'] is not None else '?'}, " + ("alpha not recorded" if alpha is None else f"alpha {alpha}")
    parts = [head + "".join(f", {name}" for key, name in (("rslora", "rsLoRA"), ("dora", "DoRA")) if lora[key])]
    targets = lora["target_modules"]
    if isinstance(targets, list):
        kinds = sorted({t.rsplit(".", 1)[-1] for t in targets})
        more = f" +{len(kinds) - MAX_TARGETS}" if len(kinds) > MAX_TARGETS else ""
        targets = ", ".join(kinds[:MAX_TARGETS]) + more
    if targets:
        parts.append(f"targets {targets}")
    if lora.get("target_parameters"):
        parts.append(f"parameters {', '.join(lora['target_parameters'])} "
                     "(peft target_parameters: LoRA on packed experts, rank r per expert, and on routers)")
    if lora["n_modules"] is not None:
        parts.append(f"{lora['n_modules']} modules")
    for key, label in (("rank_pattern", "r"), ("alpha_pattern", "alpha")):
        pattern = lora[key]
        if pattern:
            listed = ", ".join(f"{k}={v}" for k, v in list(pattern.items())[:4]) + (" ..." if len(pattern) > 4 else "")
            parts.append(f"{label} per module: {listed}")
    if lora["modules_to_save"]:
        parts.append(f"modules_to_save {', '.join(map(str, lora['modules_to_save']))}")
    return "; ".join(parts)


