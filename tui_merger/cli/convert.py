"""``tui-merger convert-kohya FILE --base B --out DIR``: a kohya-style LoRA file as a PEFT adapter folder."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert-kohya",
        help="turn a kohya-style LoRA .safetensors file into a PEFT adapter folder (no merge)",
        description="Map a kohya-style LoRA file's flattened names onto the base model's modules and write "
        "them as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) that peft, "
        "tui-merger and other tools load. Only the adapter is written; the base is read for its names.",
    )
    p.add_argument("file", type=Path, help="the kohya-style LoRA .safetensors file")
    p.add_argument("--base", type=Path, required=True, help="the base model folder the LoRA was trained on")
    p.add_argument("--out", type=Path, required=True, help="the new PEFT adapter folder")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_convert_kohya)


def cmd_convert_kohya(args) -> int:
    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.kohya import file_kind, kohya_to_peft
    from tui_merger.core.io.sources import open_model

    if not args.file.is_file():
        raise MergeError(f"{args.file} is not a file; give the kohya-style LoRA .safetensors file.")
    if not args.file.name.endswith(".safetensors") or file_kind(args.file) != "kohya":
        raise MergeError(f"{args.file} is not a kohya-style LoRA file (no lora_down / lora_up tensors).")
    base = open_model(args.base)
    try:
        names = list(base.tensors)
    finally:
        base.close()
    from tui_merger.core.io.files import json_object_or_none

    config = json_object_or_none(args.base / "config.json")  # which tensor is the output head: transformers says
    kohya_to_peft(args.file, names, args.out, base_model=str(args.base), config=config)
    print(f"PEFT adapter written to {args.out}; merge it with: tui-merger merge --base {args.base} --adapter {args.out} --out OUT")
    return 0
