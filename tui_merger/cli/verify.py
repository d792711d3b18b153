"""``tui-merger verify OUT``: check a merged model against its inputs (also run after every merge)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tui_merger.cli.common import VERIFY_FAILED, print_report  # noqa: F401  (VERIFY_FAILED: the exit code)

def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="check a merged model against its inputs: files, recomputed tensors, logits",
        description="Check a merged model folder: every file reads, tensors equal a recomputation from the "
        "inputs, and its logits match the unmerged model. The inputs come from its merge_manifest.json "
        "unless given.",
    )
    p.add_argument("out", type=Path, help="the merged model folder")
    p.add_argument("--base", type=Path, help="base model folder (default: from the manifest)")
    p.add_argument("--adapter", type=Path, help="PEFT adapter folder (default: from the manifest)")
    p.add_argument("--against", type=Path, help="a verl checkpoint folder the model was made from")
    p.add_argument("--lora-alpha", "--lora_alpha", dest="lora_alpha", type=float, help="the lora_alpha the merge used (as merge --lora-alpha)")
    add_verify_options(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--rewrite-card", action="store_true", help="replace README.md with tui-merger's model card even if you wrote it")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_verify)


def add_verify_options(p) -> None:
    p.add_argument("--perplexity", type=Path, metavar="TEXT_FILE", help="also compare perplexity on this text file")
    p.add_argument("--no-behaviour", dest="behaviour", action="store_false", help="skip loading the models (files and tensors only)")


def cmd_verify(args) -> int:
    from tui_merger.console import PlainProgress
    from tui_merger.core.errors import MergeError
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.record.provenance import record_verification
    from tui_merger.core.verify.checks import options_from_manifest, verify_merge

    given = {"base": args.base, "adapter": args.adapter, "checkpoint": args.against}
    if any(given.values()):
        if args.against is None and (args.base is None or args.adapter is None):
            raise MergeError("Give both --base and --adapter (or --against CHECKPOINT), or neither to use the manifest.")
        saved = {}
        try:
            saved = options_from_manifest(args.out).to_dict()
        except MergeError:
            pass
        keep = {k: saved[k] for k in ("dtype", "is_value_model", "tie_word_embedding", "export_adapter", "tokenizer_from", "base_roundtrip", "output_quantization") if k in saved}
        options = MergeOptions(out=args.out, lora_alpha=args.lora_alpha, **{**keep, **given})
    else:
        options = options_from_manifest(args.out)
    progress = PlainProgress(stream=sys.stderr)
    report = verify_merge(args.out, options, behaviour=args.behaviour, perplexity_text=args.perplexity, on_event=progress)
    if record_verification(args.out, report.to_dict(), overwrite_card=args.rewrite_card) is None:
        print(f"note: {args.out} has no readable merge_manifest.json, so the result is not recorded in it.", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print_report(report)
    return 0 if report.passed else VERIFY_FAILED


