"""``tui-merger try MODEL [--prompt TEXT] [--against BASE_OR_ADAPTER]``: the merged model answers a prompt,
and then the model it was made from, greedy, streamed token by token (core/ship/trial.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def add_parser(sub) -> None:
    p = sub.add_parser(
        "try",
        help="ask the merged model a prompt and compare its answer with the base model's (or the unmerged adapter's)",
        description="Load the merged model and answer a prompt with greedy decoding, streamed token by token; "
        "then the same for the model it was made from (the base named by its merge_manifest.json, or "
        "--against), one model at a time, so that what the training changed can be read. The prompt goes "
        "through the chat template when the tokenizer has one. Without --prompt it is read from stdin "
        "(or asked for on a terminal).",
    )
    p.add_argument("model", type=Path, help="the merged model folder")
    p.add_argument("--prompt", help="the prompt (default: read from stdin, or asked for)")
    p.add_argument(
        "--against", type=Path, metavar="BASE_OR_ADAPTER",
        help="compare with this base model folder, or with this LoRA adapter folder applied unmerged through "
        "peft (default: the base recorded in the model's merge_manifest.json)",
    )
    p.add_argument("--max-new-tokens", "--max_new_tokens", dest="max_new_tokens", type=_positive_int, default=64,
                   help="longest answer, in tokens (default: %(default)s)")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_try)


def cmd_try(args) -> int:
    from tui_merger.console import TrialPrinter
    from tui_merger.core.ship.trial import STOPPED, agreement, plan_trial, run_trial

    try:
        plan = plan_trial(args.model, args.against)
        for note in plan.notes:
            print(note, file=sys.stderr, flush=True)
        prompt = args.prompt if args.prompt is not None else _read_prompt()
        answers = run_trial(plan, prompt, max_new_tokens=args.max_new_tokens, on_event=TrialPrinter(err=sys.stderr))
        said = agreement(answers)
        if said:
            print(f"\n{said}")
    except KeyboardInterrupt:  # Ctrl-C: the models are only read, so there is nothing to undo
        print(f"\n{STOPPED}", file=sys.stderr)
        return 130
    return 0


def _read_prompt() -> str:
    from tui_merger.core.errors import MergeError

    if not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        try:
            text = input("Prompt: ")
        except EOFError:
            text = ""
    if not text.strip():
        raise MergeError("No prompt was given; pass one with --prompt TEXT, or type it when asked.")
    return text.strip()
