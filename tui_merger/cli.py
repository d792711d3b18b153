"""Command line: ``tui-merger merge ...``, ``tui-merger demo``.

Nothing heavy is imported here: torch loads only when a merge starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tui_merger import __version__


def _is_tty(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") not in ("", "dumb")
    except (AttributeError, ValueError):
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tui-merger",
        description="Turn a training checkpoint (base model + LoRA adapter) into a plain Hugging Face model.",
    )
    parser.add_argument("--version", action="version", version=f"tui-merger {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks of unexpected errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    merge = sub.add_parser(
        "merge",
        help="merge a PEFT LoRA adapter into its base model",
        description="Merge a PEFT LoRA adapter into its base model and write a complete Hugging Face model folder.",
    )
    merge.add_argument("--base", required=True, type=Path, help="base model folder (config.json + weights)")
    merge.add_argument("--adapter", required=True, type=Path, help="PEFT adapter folder (adapter_config.json)")
    merge.add_argument("--out", required=True, type=Path, help="output folder (created; must be empty)")
    _add_write_options(merge)
    merge.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    demo = sub.add_parser(
        "demo",
        help="build a tiny model and adapter offline and merge them",
        description="Build a tiny random Qwen2-style model, a LoRA adapter and a tokenizer in a workspace "
        "folder (offline, in seconds), then merge them.",
    )
    demo.add_argument(
        "--workspace", type=Path, default=Path("tui-merger-demo"), help="folder for the demo files (default: %(default)s)"
    )
    demo.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return parser


def _add_write_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="output dtype (default: the base's)")
    p.add_argument("--shard-size", default="5GB", help="largest output shard, e.g. 5GB, 2GiB (default: 5GB)")
    p.add_argument(
        "--tokenizer-from",
        choices=["base", "adapter"],
        default=None,
        help="where the tokenizer comes from (default: the adapter folder when it has one, else the base)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--force", action="store_true", help="clamp values that overflow float16 instead of refusing")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 0
    from tui_merger.core.errors import MergeCancelled, MergeError

    try:
        if args.command == "merge":
            return cmd_merge(args)
        if args.command == "demo":
            from tui_merger.demo import cmd_demo

            return cmd_demo(args)
    except MergeCancelled as err:
        print(f"cancelled: {err}", file=sys.stderr)
        return 130
    except MergeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the partial output was removed; the inputs are untouched.", file=sys.stderr)
        return 130
    except Exception as err:  # an unexpected failure: a bug of ours, say so plainly
        if args.debug:
            raise
        print(
            f"error: unexpected {type(err).__name__}: {err}. This is a bug in tui-merger; "
            "run again with --debug for the traceback and report it.",
            file=sys.stderr,
        )
        return 3
    return 2  # pragma: no cover


def entry() -> None:
    """The console script: run, flush, and leave without the interpreter's teardown, which takes
    ~0.35 s once torch is loaded (every file the merge wrote is closed and synced by then)."""
    code = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run_with_progress(options, plain: bool = False):
    """Run a merge with the right progress display; returns the MergeResult."""
    from tui_merger.console import PlainProgress, RichProgress
    from tui_merger.core.engine import run_merge

    if plain or not _is_tty(sys.stderr):
        return run_merge(options, PlainProgress())
    with RichProgress() as progress:
        return run_merge(options, progress)


def print_result(result, stream=None) -> None:
    from tui_merger.core.options import human_bytes

    stream = stream or sys.stdout
    print(f"Merged model written to {result.out}", file=stream)
    print(
        f"  {result.tensors_total} tensors ({result.tensors_merged} changed by the adapter), "
        f"{human_bytes(result.bytes_written)} in {len(result.shards)} shard(s), {result.seconds:.1f} s",
        file=stream,
    )
    tok = {"adapter": "from the adapter folder", "base": "from the base model", None: "none found"}
    print(f"  tokenizer: {tok[result.tokenizer_source]}", file=stream)
    for key, value in result.config_changes.items():
        print(f"  config.json: {key} set to {value}", file=stream)


def cmd_merge(args) -> int:
    from tui_merger.core.options import MergeOptions

    options = MergeOptions(
        base=args.base,
        adapter=args.adapter,
        out=args.out,
        dtype=args.dtype,
        shard_size=args.shard_size,
        tokenizer_from=args.tokenizer_from or "auto",
        overwrite=args.overwrite,
        force_fp16_overflow=args.force,
    )
    result = run_with_progress(options, plain=args.plain)
    print_result(result)
    return 0
