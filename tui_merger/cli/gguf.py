"""``tui-merger gguf MODEL_DIR [--type f16|bf16|q8_0|q4_k_m|...] [--out FILE.gguf]``: the model as one GGUF file for
llama.cpp, Ollama and LM Studio (core/ship/gguf.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tui_merger.cli.common import is_tty


def add_parser(sub) -> None:
    from tui_merger.core.ship.gguf import DEFAULT_TYPE, FAMILY_NAMES, TYPES  # names only: no heavy imports

    p = sub.add_parser(
        "gguf",
        help="write a model folder as one GGUF file for llama.cpp, Ollama and LM Studio",
        description=f"Write a Hugging Face model folder ({FAMILY_NAMES}) as one GGUF file with llama.cpp's own gguf "
        "library: weights streamed one tensor at a time, the tokenizer, chat template and model settings in the "
        "file's metadata. Written under a temporary name and renamed when complete; recorded (type, size, sha256) "
        "in the folder's merge_manifest.json, and uploaded with the folder by `tui-merger upload`. Then the file is "
        "checked against the model (--check) and an Ollama Modelfile is written beside it; the lines to run it "
        "with Ollama and llama.cpp are printed.",
    )
    p.add_argument("model", type=Path, help="the model folder (config.json, safetensors, tokenizer.json)")
    p.add_argument(
        "--type", dest="gguf_type", choices=TYPES, default=DEFAULT_TYPE,
        help="how the weights are stored: f16, bf16 (bf16 weights exactly as they are), q8_0 (8-bit, about half "
        "the size; llama.cpp's own near-lossless quantization), or a k-quant mix as llama.cpp's llama-quantize "
        "makes it, byte for byte: q4_k_m (what Ollama pulls by default), q5_k_m, q6_k, q4_k_s, q5_k_s, q3_k_m; "
        "norms and biases stay float32 (default: %(default)s)",
    )
    p.add_argument("--out", type=Path, metavar="FILE.gguf",
                   help="where to write it, a .gguf file or a folder (default: MODEL/<name>-<TYPE>.gguf, inside the model folder)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file (only once the new one is complete)")
    p.add_argument(
        "--check", choices=("auto", "llama.cpp", "transformers", "none"), default="auto",
        help="compare the written file with transformers on the folder (token ids, prompt logits within the type's "
        "limit, top tokens): with llama.cpp itself when llama-cpp-python is installed, else with transformers' GGUF "
        "reader where it knows the family; a vision-language model's mmproj file: llama.cpp's image embeddings against "
        "transformers' (llama.cpp only); the verdict goes to merge_manifest.json and the model card; none: skip "
        "it, the file is recorded as not checked (default: %(default)s)",
    )
    p.add_argument(
        "--adapter", type=Path, metavar="ADAPTER",
        help="also write this peft LoRA adapter of MODEL (the base) as a GGUF LoRA beside it (ADAPTER/<name>-LoRA-F32.gguf, "
        "as llama.cpp's convert_lora_to_gguf.py lays it out) and an Ollama Modelfile with FROM the base's GGUF and "
        "ADAPTER; the base's GGUF is written first unless it is already there; then llama.cpp runs the base's GGUF with the "
        "LoRA against peft on the base with the adapter (--check; only llama.cpp applies a GGUF LoRA: without "
        "llama-cpp-python the LoRA is recorded as not checked)",
    )
    p.add_argument(
        "--no-mmproj", dest="mmproj", action="store_false",
        help="for a vision-language model (Gemma 3, Gemma 4, Qwen2-VL, Qwen2.5-VL, Qwen3-VL), do not write its vision tower and "
        "projector as llama.cpp's mmproj file (mmproj-<name>-F16.gguf beside the GGUF; written by default, so llama.cpp "
        "and Ollama can read images)",
    )
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_gguf)


def cmd_gguf(args) -> int:
    from contextlib import nullcontext

    from tui_merger.console import PlainProgress, RichProgress
    from tui_merger.core.options import human_bytes
    from tui_merger.cli.common import VERIFY_FAILED
    from tui_merger.core.ship.run_locally import make_local

    progress = PlainProgress() if args.plain or not is_tty(sys.stderr) else RichProgress()
    if args.adapter is not None:
        return _cmd_gguf_lora(args, progress)
    with progress if isinstance(progress, RichProgress) else nullcontext():
        made = make_local(args.model, args.gguf_type, args.out, overwrite=args.overwrite, check=args.check, on_event=progress,
                          mmproj=args.mmproj)
    result, check, modelfile = made.result, made.check, made.modelfile
    print(f"GGUF written to {result.path}")
    print(f"  {result.arch}, {result.type.upper()}, {human_bytes(result.size)}, {result.tensors} tensors, {result.seconds:.1f} s")
    print(f"  sha256 {result.sha256}")
    if result.mmproj is not None:
        print(f"  vision tower (mmproj) {result.mmproj}, {human_bytes(Path(result.mmproj).stat().st_size)}")
    if result.recorded:
        print(f"  recorded in {Path(args.model) / 'merge_manifest.json'}")
    print(f"  check {check.line()}")
    if made.mmproj_check is not None:
        print(f"  mmproj check {made.mmproj_check.line()}")
    print(f"  Ollama Modelfile {modelfile.path}" + ("" if modelfile.template else " (no TEMPLATE: its comment says why)"))
    print("Run it:")
    for line in made.run_lines():
        print(f"  {line}")
    if check.status == "failed":
        print("The file does not behave like the model: do not share it (the check above says where it differs).", file=sys.stderr)
        return VERIFY_FAILED
    if made.mmproj_check is not None and made.mmproj_check.status == "failed":
        print("llama.cpp does not see images through the mmproj file as the model does: do not share it (the mmproj check "
              "above says how).", file=sys.stderr)
        return VERIFY_FAILED
    return 0


def _cmd_gguf_lora(args, progress) -> int:
    """--adapter: the LoRA as a GGUF adapter (first: it needs only the base's headers), the base's GGUF
    unless it is already there, and the Modelfile that applies one to the other."""
    from contextlib import nullcontext

    from tui_merger.console import RichProgress
    from tui_merger.core.options import human_bytes
    from tui_merger.core.ship.gguf import default_out
    from tui_merger.core.errors import MergeError
    from tui_merger.core.ship.gguf_lora import export_lora_gguf, quantization_of
    from tui_merger.core.ship.modelfile import write_modelfile
    from tui_merger.core.ship.run_locally import make_local

    base = default_out(args.model, args.gguf_type) if args.out is None else Path(args.out).expanduser().absolute()
    base = base / default_out(args.model, args.gguf_type).name if base.is_dir() else base
    quantized = quantization_of(args.model)
    if quantized and not base.is_file():  # before anything is written: its GGUF is not ours to make
        raise MergeError(
            f"{args.model} holds {quantized} weights: tui-merger writes the LoRA for it but not its GGUF; give the "
            f"base's GGUF made by llama.cpp (e.g. its {quantized} GGUF of the released model) with --out, which is used as it is."
        )
    lora = export_lora_gguf(args.model, args.adapter, overwrite=args.overwrite)
    print(f"GGUF LoRA written to {lora.path}")
    print(f"  {lora.arch}, F32, {human_bytes(lora.size)}, {lora.pairs} LoRA pairs (rank {', '.join(map(str, lora.ranks))}, "
          f"alpha {lora.alpha:g})" + (f", {lora.rescaled} with lora_b scaled to peft's scale" if lora.rescaled else ""))
    if base.is_file() and quantized:
        print(f"Base GGUF {base} is used as it is (llama.cpp's to make: {args.model} holds {quantized} weights).")
    elif base.is_file() and not args.overwrite:
        print(f"Base GGUF {base} is already there: used as it is (--overwrite writes it again).")
    else:
        with progress if isinstance(progress, RichProgress) else nullcontext():
            made = make_local(args.model, args.gguf_type, base, overwrite=args.overwrite, check=args.check, on_event=progress)
        base = made.result.path
        print(f"Base GGUF written to {base}")
        print(f"  check {made.check.line()}")
        if made.check.status == "failed":
            from tui_merger.cli.common import VERIFY_FAILED

            print("The base GGUF does not behave like the model: do not share it (the check above says where it differs).", file=sys.stderr)
            return VERIFY_FAILED
    # the chat template the adapter was trained with: its own tokenizer's when it saved one, else the base's
    chat_folder = args.adapter if (Path(args.adapter) / "tokenizer_config.json").is_file() else args.model
    from tui_merger.core.ship.gguf_check import gguf_type_of

    # the tag says the base GGUF's own type (one used as it is may not be --type's)
    modelfile = write_modelfile(chat_folder, base, gguf_type_of(base) or args.gguf_type, adapter=lora.path)
    check = check_lora(args, lora, base, modelfile.path, progress)
    print(f"  Ollama Modelfile {modelfile.path}" + ("" if modelfile.template else " (no TEMPLATE: its comment says why)"))
    print("Run it:")
    for line in modelfile.commands(base):
        print(f"  {line}")
    if check.status == "failed":
        from tui_merger.cli.common import VERIFY_FAILED

        print("llama.cpp with the LoRA does not behave like the base with the adapter: do not share it (the check above "
              "says where it differs).", file=sys.stderr)
        return VERIFY_FAILED
    return 0


def check_lora(args, lora, base: Path, modelfile: Path, progress):
    """The GGUF LoRA checked with llama.cpp on the base's GGUF (--check), the verdict printed and recorded in
    the base folder's merge_manifest.json where it has one."""
    from contextlib import nullcontext

    from tui_merger.console import RichProgress
    from tui_merger.core.ship.gguf_check import NOT_CHECKED, GgufCheck, check_lora_gguf
    from tui_merger.core.ship.gguf_lora import lora_record_path, record_lora_gguf, write_lora_record

    if args.check == "none":
        check = GgufCheck(NOT_CHECKED, None, "skipped (--check none).")
    else:
        with progress if isinstance(progress, RichProgress) else nullcontext():
            check = check_lora_gguf(args.model, args.adapter, base, lora.path, reader=args.check, on_event=progress)
    print(f"  LoRA check {check.line()}")
    manifest = Path(args.model) / "merge_manifest.json"
    try:
        recorded = record_lora_gguf(args.model, lora, base, check, modelfile)
    except OSError as err:  # a read-only base folder: the record goes beside the LoRA
        why = f"{manifest} could not be updated ({err.strerror or err})"
        try:
            print(f"  LoRA and its check recorded in {write_lora_record(args.model, lora, base, check, modelfile, why=why)} ({why})")
        except OSError as again:
            print(f"  not recorded: {why}, nor {lora_record_path(lora.path)} written ({again.strerror or again}).")
        return check
    if recorded:
        print(f"  LoRA and its check recorded in {manifest}")
    else:
        print(f"  LoRA and its check recorded in {lora_record_path(lora.path)} ({args.model} has no merge_manifest.json: "
              "it was not made by tui-merger, so neither it nor its model card is changed)")
    return check
