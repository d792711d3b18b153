"""Command line: ``tui-merger merge ...``, ``tui-merger demo``.

Nothing heavy is imported here: torch loads only when a merge starts.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tui_merger.cli.common import preflight, print_result, report_verification, run_with_progress, terminal



class _VersionAction(argparse.Action):
    """``--version``: ours and each library's version with its declared range (metadata only: no torch)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from tui_merger.deps import version_report

        print(version_report())
        parser.exit()


def _finite_number(text: str) -> float:
    """argparse type: a finite number (float() alone takes 'nan' and 'inf', which would poison every weight)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    return value


def build_parser() -> argparse.ArgumentParser:
    from tui_merger.cli import cleanup as cli_cleanup  # each adds its command (cheap imports)
    from tui_merger.cli import convert as cli_convert
    from tui_merger.cli import gguf as cli_gguf
    from tui_merger.cli import inspect as cli_inspect
    from tui_merger.cli import jobs as cli_jobs
    from tui_merger.cli import trial as cli_trial
    from tui_merger.cli import upload as cli_upload
    from tui_merger.cli import verify as cli_verify

    parser = argparse.ArgumentParser(
        prog="tui-merger",
        description="Turn a training checkpoint (base model + LoRA adapter) into a plain Hugging Face model. "
        "`tui-merger [PATH]` (no command) opens the merge assistant on PATH; `--plain` asks plain questions instead.",
    )
    parser.add_argument("--version", action=_VersionAction, help="show the versions of tui-merger, Python and the libraries it uses (what a bug report needs), and exit")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks of unexpected errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    merge = sub.add_parser(
        "merge",
        help="merge a LoRA adapter into its base model, or turn a verl FSDP checkpoint into a model",
        description="Write a complete Hugging Face model folder from a base model + PEFT LoRA adapter "
        "(--base, --adapter) or from a verl FSDP checkpoint (CHECKPOINT or --local_dir; its LoRA, if any, "
        "is merged into the weights). verl's model_merger flags are accepted as users type them.",
    )
    _add_checkpoint_options(merge)
    merge.add_argument(
        "--adapter", action="append", metavar="ADAPTER[:WEIGHT]",
        help="PEFT adapter folder (adapter_config.json), or a kohya-style LoRA .safetensors file; repeat it with "
        "weights for a weighted merge: --adapter A:0.7 --adapter B:0.3 (W + 0.7*dA + 0.3*dB, exactly)",
    )
    merge.add_argument("--out", "--target_dir", dest="out", type=Path, help="output folder (created; must be empty)")
    merge.add_argument("--export-adapter", "--export_adapter", dest="export_adapter", action="store_true", help="write the base model plus a PEFT adapter folder (lora_adapter/) instead of merging")
    merge.add_argument(
        "--qlora-base", dest="base_roundtrip", metavar="QUANT",
        help="the adapter was trained with QLoRA on the 16-bit --base quantized as QUANT (nf4, or fp4): merge into "
        "dequant(quant(W)), the weights training saw, instead of W itself. Defaults are QLoRA's (blocksize 64, "
        "double quantization); change them like nf4:blocksize=64,double_quant=no,skip=mlp.gate. Without it the "
        "adapter goes into the 16-bit weights",
    )
    merge.add_argument(
        "--keep-quantization", dest="output_quantization", action="store_const", const="keep",
        help="a base released in FP8 blocks (DeepSeek-V3, Qwen3-FP8): write the output in that format again (tensors "
        "the adapter does not change copied with their scales, changed ones quantized again; about half the size of "
        "bf16). Without it the output is a plain bf16 model",
    )
    merge.add_argument(
        "--quantize", dest="output_quantization", choices=["fp8"],
        help="fp8: write the weights transformers' FP8 load quantizes as 128x128-block FP8 (DeepSeek/Qwen format, "
        "weight-only, no calibration data); what it leaves alone (the output embedding, tied weights), embeddings "
        "and norms stay 16-bit",
    )
    merge.add_argument("--hf_upload_path", "--hf-upload-path", dest="hf_upload_path", metavar="ORG/NAME", help="upload the verified model to this Hub repo (private unless --public)")
    merge.add_argument("--public", action="store_true", help="with --hf_upload_path: create the repo public")
    merge.add_argument("--private", action="store_true", help=argparse.SUPPRESS)  # verl's flag; private is our default
    merge.add_argument("--use_cpu_initialization", "--use-cpu-initialization", action="store_true", help=argparse.SUPPRESS)
    _add_write_options(merge)
    merge.add_argument("--no-verify", dest="verify", action="store_false", help="skip the verification after the merge")
    merge.add_argument("--dry-run", action="store_true", help="print the plan and every check; write nothing")
    merge.add_argument("--detach", action="store_true", help="check in the foreground, then merge in the background: it keeps running if you disconnect (tui-merger attach follows it)")
    cli_verify.add_verify_options(merge)
    merge.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    test = sub.add_parser(
        "test",
        help="compare what a checkpoint merges to with a reference model (verl's model_merger test)",
        description="Check that the model tui-merger makes from a checkpoint has the reference model's tensor "
        "names, shapes and dtypes, and close values. Writes nothing.",
    )
    _add_checkpoint_options(test)
    test.add_argument("--test_hf_dir", "--test-hf-dir", dest="test_hf_dir", type=Path, required=True, help="the reference Hugging Face model folder")
    test.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="dtype to compare in (default: the checkpoint config's)")
    test.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    demo = sub.add_parser(
        "demo",
        help="build a tiny model and adapter offline, then open the assistant on them (or merge them: --no-ui)",
        description="Build a tiny random Qwen2-style model, a LoRA adapter and a tokenizer in a workspace "
        "folder (offline, in seconds), then open the merge assistant on it (on a terminal) or merge them "
        "right away (no terminal, or --no-ui).",
    )
    demo.add_argument(
        "--workspace", type=Path, default=Path("tui-merger-demo"), help="folder for the demo files (default: %(default)s)"
    )
    demo.add_argument("--no-ui", action="store_true", help="merge right away instead of opening the assistant")
    demo.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    # commands that live in their own modules: each adds its parser and sets ``run``
    cli_verify.add_parser(sub)
    cli_upload.add_parser(sub)
    cli_cleanup.add_parser(sub)
    cli_inspect.add_parser(sub)
    cli_jobs.add_parser(sub)
    cli_convert.add_parser(sub)
    cli_trial.add_parser(sub)
    cli_gguf.add_parser(sub)
    return parser


def _add_checkpoint_options(p: argparse.ArgumentParser) -> None:
    """What says which model to read: a checkpoint (verl's flags as users type them) or a base."""
    from tui_merger.core.formats.registry import BACKENDS  # names and stat only: no heavy imports

    p.add_argument("checkpoint", nargs="?", type=Path, help="a verl checkpoint: run, global_step_N or actor folder")
    p.add_argument("--local_dir", type=Path, help="verl: the checkpoint folder (same as CHECKPOINT)")
    p.add_argument("--backend", choices=["auto", *BACKENDS], default="auto", help="checkpoint format")
    p.add_argument("--base", type=Path, help="base model folder (config.json + weights)")
    p.add_argument("--lora-alpha", "--lora_alpha", dest="lora_alpha", type=_finite_number, help="the lora_alpha training used: needed when the checkpoint does not record it; over a recorded one it is used instead, and said")
    p.add_argument("--is-value-model", "--is_value_model", dest="is_value_model", action="store_true", help="verl critic: a TokenClassification model")
    p.add_argument("--tie-word-embedding", "--tie_word_embedding", dest="tie_word_embedding", action="store_true", help="keep one embedding for input and output when they are equal")
    p.add_argument("--trust-remote-code", "--trust_remote_code", action="store_true", help="accepted for verl compatibility; tui-merger never runs model code")


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


def build_ui_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tui-merger",
        description="The merge assistant: finds checkpoints in PATH and walks you through merging, "
        "verifying, cleaning up and uploading. Run `tui-merger --help` for the other commands.",
    )
    p.add_argument("path", nargs="?", default=".", type=Path, help="folder to look in (default: the current one)")
    p.add_argument("--plain", action="store_true", help="plain questions instead of the full-screen app")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)  # noqa: SLF001 (argparse keeps them here)
    ui = not argv or (argv[0] not in commands and argv[0] not in ("-h", "--help", "--version"))
    args = build_ui_parser().parse_args(argv) if ui else parser.parse_args(argv)
    if not ui and args.command is None:
        parser.print_help(sys.stderr)
        return 0
    from tui_merger.core.errors import MergeCancelled, MergeError

    if not ui:
        _interrupt_on_signals()
    try:
        if ui:
            return launch(args.path, plain=args.plain)
        if getattr(args, "run", None) is not None:
            return args.run(args)
        if args.command == "merge":
            return cmd_merge(args)
        if args.command == "test":
            return cmd_test(args)
        if args.command == "demo":
            from tui_merger.demo import cmd_demo

            return cmd_demo(args, launch)
    except MergeCancelled as err:
        print(str(err), file=sys.stderr)
        return 130
    except MergeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(_left_behind(args), file=sys.stderr)
        return 130
    except Exception as err:  # an unexpected failure: a library outside its range, else a bug of ours
        if args.debug:
            raise
        from tui_merger.deps import explain_failure

        mismatch = explain_failure(err)
        if mismatch is not None:
            print(f"error: {mismatch}", file=sys.stderr)
            return 1
        print(
            f"error: unexpected {type(err).__name__}: {err}. This is a bug in tui-merger; "
            "run again with --debug for the traceback and report it.",
            file=sys.stderr,
        )
        return 3
    return 2  # pragma: no cover


def _left_behind(args) -> str:
    """After Ctrl-C: what is on disk now (a second Ctrl-C can stop the cleanup of the first, a stop
    during verification leaves a complete model), and that the inputs were only read."""
    out = getattr(args, "out", None) if getattr(args, "command", None) == "merge" else None
    if out is None:  # another command: it says what it keeps on its own way out, if anything
        return "interrupted."
    from tui_merger.core.merge.output import left_on_disk

    return f"interrupted: {left_on_disk(out)}; the inputs are untouched."


def _interrupt_on_signals() -> None:
    """SIGTERM and SIGHUP (a closed SSH session) stop a merge like Ctrl-C: between tensors, keeping the
    finished shards for a resume."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    said = []

    def ctrl_c(signum, frame):
        """Said at once (the merge stops after the tensor it is on; verification after its module)."""
        if not said:
            said.append(True)
            print("\nStopping...", file=sys.stderr, flush=True)
        raise KeyboardInterrupt

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        try:
            signal.signal(signal.SIGINT, ctrl_c)
        except (ValueError, OSError):  # not the main thread
            pass
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(sig, interrupt)
        except (ValueError, OSError):  # not the main thread
            pass


def launch(path: Path, plain: bool = False) -> int:
    """The interactive assistant on ``path``: the Textual app, or the plain question flow when the
    terminal cannot take it or --plain asks; with no terminal at all, say what to run instead."""
    from tui_merger.core.errors import MergeError

    path = Path(path).expanduser()
    if not path.exists():
        raise MergeError(f"{path} does not exist; give a folder that holds your training run or checkpoint.")
    interactive, dumb = terminal()
    if not interactive and not plain:
        from tui_merger.plain import explain_no_terminal

        print(explain_no_terminal(path), file=sys.stderr)
        return 2
    if plain or dumb or not interactive:
        from tui_merger.plain import run_plain

        return run_plain(path, dumb=dumb or not interactive)
    from tui_merger.tui.app import run_tui

    return run_tui(path)


def entry() -> None:
    """The console script: run, flush, and leave without the interpreter's teardown (``leave``)."""
    console_defaults()
    leave(main())


def console_defaults() -> None:
    """Process settings of the console script, made before torch loads (a user's own setting wins):
    OpenMP's threads sleep between torch's parallel regions instead of spinning. The merge, its
    writer and hashing threads and the verification share the cores, and idle spinning took 5 of 47
    CPU-seconds of a 3B merge."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def leave(code: int) -> None:
    """Flush and exit without the interpreter's teardown: once transformers and peft are loaded it
    walks and frees about a million objects, 1.1 s after a 3B merge (every file the merge wrote is
    closed and synced by then)."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def cmd_merge(args) -> int:
    from tui_merger.core.errors import MergeError
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.plan.preflight import import_ahead

    import_ahead(args.base)  # the plan's imports (transformers' model code) run while the inputs are read

    checkpoint = _checkpoint(args)
    if checkpoint is not None and args.backend == "auto" and (args.adapter is None or args.base is None):
        checkpoint = _adapter_given_as_checkpoint(args, checkpoint)
    if checkpoint is not None:
        if args.adapter is not None:
            raise MergeError("--adapter is for PEFT adapter folders; a checkpoint carries its LoRA itself.")
        _check_backend(checkpoint, args.backend)
    elif args.base is None and args.adapter:  # the base the (first) adapter names, as `merge ADAPTER` takes it
        args.base = _base_named_by(args)
    elif args.base is None or args.adapter is None:
        raise MergeError(
            "Say what to merge: --base MODEL --adapter ADAPTER, or a verl checkpoint folder (CHECKPOINT or --local_dir)."
        )
    if args.out is None and not args.dry_run:
        raise MergeError("Say where to write the merged model with --out (or --target_dir); --dry-run suggests a name.")
    if args.hf_upload_path and not args.dry_run:
        if args.public and args.private:
            raise MergeError("--public and --private contradict each other; give one.")
        if not args.verify:
            raise MergeError("--hf_upload_path uploads only a verified model; leave out --no-verify.")
        from tui_merger.core.ship.hub import check_token

        check_token(args.hf_upload_path)  # a bad token is found now, not after the merge
    options = MergeOptions(
        adapters=args.adapter or [],
        out=args.out,
        shard_size=args.shard_size,
        tokenizer_from=args.tokenizer_from or "auto",
        overwrite=args.overwrite,
        force_fp16_overflow=args.force,
        export_adapter=args.export_adapter,
        **_read_options(args),
    )
    if not preflight(options, args.dry_run):
        return 1
    if args.dry_run:
        return 0
    if args.detach:  # the checks passed here; the merge runs on in its own session (cli/jobs.py)
        from tui_merger.cli.jobs import detach

        return detach(args, options)
    result, report = run_with_progress(
        options, plain=args.plain, verify=args.verify, perplexity=args.perplexity, behaviour=args.behaviour
    )
    print_result(result)
    code = report_verification(report)
    if args.hf_upload_path:
        if code != 0:
            raise MergeError(f"Nothing was uploaded to {args.hf_upload_path}: the merged model failed verification.")
        from tui_merger.cli.common import upload_after_merge  # noqa: F811

        uploaded = upload_after_merge(result.out, args.hf_upload_path, private=not args.public, plain=args.plain)
        print(f"  uploaded: {uploaded.commit_url}")
    return code


def _adapter_given_as_checkpoint(args, path: Path) -> Path | None:
    """``tui-merger merge ./my-adapter``: an adapter is taken as --adapter (into --base, or the base it
    names when that is on this machine), ``tui-merger merge ./model --adapter A`` takes the model as
    --base (said on stderr); an adapter without a base, or a model without an adapter, is the sentence
    saying what to run. Returns the checkpoint that is left (None when the path was no checkpoint)."""
    from tui_merger.core.plan.choices import not_a_checkpoint

    taken = not_a_checkpoint(path, args.base, args.out, adapters=args.adapter is not None)
    if taken is None:
        return path
    adapter, base, said = taken
    print(f"note: {said}", file=sys.stderr)
    if adapter is not None:
        args.adapter = [str(adapter)]
    args.base, args.checkpoint, args.local_dir = base, None, None
    return None


def _base_named_by(args) -> Path:
    """``merge --adapter A --out O`` without --base: the base A names when it is on this machine (said on
    stderr, as for ``merge A``); else the sentence saying to give --base."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.options import parse_adapter_spec
    from tui_merger.core.plan.choices import not_a_checkpoint

    first = parse_adapter_spec(str(args.adapter[0]))[0]
    taken = not_a_checkpoint(first, None, args.out)
    if taken is None or taken[0] is None:
        raise MergeError(
            f"{first} names no base model that is on this machine; give the model it was trained on with --base MODEL."
        )
    _, base, said = taken
    print(f"note: {said}", file=sys.stderr)
    return base


def _checkpoint(args) -> Path | None:
    from tui_merger.core.errors import MergeError

    if args.checkpoint and args.local_dir and args.checkpoint != args.local_dir:
        raise MergeError("Give the checkpoint once: either as CHECKPOINT or with --local_dir.")
    return args.checkpoint or args.local_dir


def _read_options(args) -> dict:
    """MergeOptions fields that say what to read, shared by merge and test."""
    return dict(
        base=args.base,
        checkpoint=_checkpoint(args),
        dtype=args.dtype,
        lora_alpha=args.lora_alpha,
        is_value_model=args.is_value_model,
        tie_word_embedding=args.tie_word_embedding,
        base_roundtrip=getattr(args, "base_roundtrip", None),  # merge only: --qlora-base
        output_quantization=getattr(args, "output_quantization", None),  # merge only
    )


def _check_backend(checkpoint: Path, backend: str) -> None:
    """--backend fsdp on a Megatron folder (or the reverse) is said in one sentence; auto detects."""
    from tui_merger.core.formats.registry import check_backend

    check_backend(checkpoint, backend)


def cmd_test(args) -> int:
    from tui_merger.console import PlainProgress
    from tui_merger.core.verify.compare import compare_with_reference
    from tui_merger.core.errors import MergeError
    from tui_merger.core.options import MergeOptions

    if _checkpoint(args) is None:
        raise MergeError("Say which checkpoint to test: CHECKPOINT or --local_dir.")
    _check_backend(_checkpoint(args), args.backend)
    options = MergeOptions(**_read_options(args))
    report = compare_with_reference(options, args.test_hf_dir, PlainProgress())
    if report.problems:
        for line in report.problems[:20]:
            print(f"  {line}", file=sys.stderr)
        more = f" (and {len(report.problems) - 20} more)" if len(report.problems) > 20 else ""
        raise MergeError(
            f"{len(report.problems)} difference(s) from {args.test_hf_dir}{more}; the checkpoint does not "
            "reproduce the reference model."
        )
    print(
        f"The checkpoint matches {args.test_hf_dir}: {report.compared} tensors, same names, shapes and dtypes, "
        f"max abs diff {report.max_abs_diff:.3g}."
    )
    if report.behaviour is not None:
        print(f"  {report.behaviour.summary}")
    return 0
