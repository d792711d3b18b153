""""Run it locally": a GGUF, checked, with its Ollama Modelfile and the lines to run it, in one call that
the command line (``tui-merger gguf``), the assistant's Finish step and the plain flow share.

``estimate`` says before anything is written how large the file will be (from the plan: headers only)
and about how long writing it takes; ``make_local`` writes the GGUF (ship/gguf.py), the Modelfile
(modelfile.py), checks the file (gguf_check.py) and records the check in merge_manifest.json and the
model card.

A peft LoRA merge can also be run as its base's GGUF with the adapter as a GGUF LoRA (llama.cpp
``--lora``, Ollama ``ADAPTER``): ``lora_source`` says whether the merge had such an adapter, ``plan_lora``
where the files go and how large they are before anything is written, ``make_local_lora`` writes the
LoRA (ship/gguf_lora.py), the base's GGUF unless it is already there, the Modelfile that applies one to
the other, checks the pair with llama.cpp against peft and records it (the command's ``gguf --adapter``
does the same steps).

Q4_K_M is what "Run it locally" preselects: Ollama's default, what model pages publish first, about a
third of f16's size. The command's ``--type`` default stays f16 (gguf.DEFAULT_TYPE): a command run without
a type gets the file closest to the model, and a k-quant takes about 20 times longer to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import CancelToken, EventSink, PhaseStarted, ignore_event

RUN_LOCALLY_TYPE = "q4_k_m"
# bytes of the model folder written per second, by type, measured on this project's 2-core machine
# (docs/command-line.md: 0.5B f16 6.9 s, q8_0 8.0 s; 3B widths q4_k_m 6 layers in 163 s): the estimate
# is that rate, so a faster machine takes less
SOURCE_BYTES_PER_SECOND = {"f16": 150e6, "bf16": 150e6, "q8_0": 125e6}
K_QUANT_BYTES_PER_SECOND = 7.4e6  # numpy's k-quant loops
# numba's (core/ship/kquants_jit.py): 3B widths, 8 layers (1.86 GB) in 123-144 s at load average 14-28
K_QUANT_NUMBA_BYTES_PER_SECOND = 14e6


@dataclass(frozen=True)
class Estimate:
    type: str
    size: int  # bytes of the GGUF
    seconds: float  # about, at the measured rate
    source_bytes: int
    mmproj_size: int = 0  # bytes of a vision-language folder's mmproj file (included in ``size``); 0: none


@dataclass(frozen=True)
class LocalModel:
    result: object  # gguf.GgufResult
    modelfile: object  # modelfile.Modelfile
    check: object  # gguf_check.GgufCheck
    mmproj_check: object = None  # gguf_check.GgufCheck of the mmproj file beside it (gguf_mmproj.check_mmproj); None: none

    def run_lines(self) -> list[str]:
        import shlex

        from tui_merger.core.ship.modelfile import run_lines

        lines = run_lines(self.result.path, self.modelfile)
        mmproj = getattr(self.result, "mmproj", None)
        if mmproj is not None:  # llama.cpp's multimodal command line: the GGUF, its mmproj, an image, a prompt
            lines.append(f"llama-mtmd-cli -m {shlex.quote(str(Path(self.result.path).absolute()))} --mmproj "
                         f"{shlex.quote(str(Path(mmproj).absolute()))} --image IMAGE.jpg -p 'Describe this image.'")
        return lines


def estimate(folder: Path, type_: str) -> Estimate:
    """The GGUF's size (its plan: headers only, nothing written) and about how long it takes to write.
    Raises MergeError with the plan's sentence when the folder cannot be a GGUF."""
    import tempfile

    from tui_merger.core.io.sources import open_model
    from tui_merger.core.ship.gguf import plan_gguf

    from tui_merger.core.ship import gguf_mmproj

    with tempfile.TemporaryDirectory(prefix="tui-merger-estimate-") as tmp:  # a target that is surely free
        plan = plan_gguf(folder, type_, Path(tmp) / "estimate.gguf")
        side = gguf_mmproj.beside(plan, overwrite=False)  # a vision-language folder: its mmproj file too
        mmproj_size = side.plan.tensor_bytes if side is not None and side.plan is not None else 0
        size = plan.tensor_bytes + mmproj_size
        for held in (plan, getattr(side, "plan", None)):  # the plans hold the folder's files open
            closing = getattr(getattr(held, "_source", None), "close", None)
            if closing is not None:
                closing()
    source = open_model(Path(folder))
    try:
        source_bytes = sum(int(getattr(ref, "nbytes", 0) or 0) for ref in source.tensors.values())
    finally:
        source.close()
    rate = SOURCE_BYTES_PER_SECOND.get(type_) or _k_quant_rate()
    return Estimate(type_, size, source_bytes / rate, source_bytes, mmproj_size)


def _k_quant_rate() -> float:
    from importlib.util import find_spec

    return K_QUANT_NUMBA_BYTES_PER_SECOND if find_spec("numba") is not None else K_QUANT_BYTES_PER_SECOND


def make_local(
    folder: Path,
    type_: str,
    out: Path | None = None,
    overwrite: bool = False,
    check: str = "auto",
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
    mmproj: bool = True,
) -> LocalModel:
    """Write the GGUF (and a vision-language folder's mmproj file beside it, unless ``mmproj`` is False), its
    Modelfile, check the file and record the check. ``check``: auto, llama.cpp, transformers or none (recorded
    as not checked)."""
    from tui_merger.core.ship.gguf import export_gguf
    from tui_merger.core.ship.gguf_check import NOT_CHECKED, GgufCheck, check_gguf, record_check
    from tui_merger.core.ship.modelfile import write_modelfile

    from tui_merger.core.ship.gguf_mmproj import companion

    result = export_gguf(folder, type_, out, overwrite=overwrite, on_event=on_event, cancel=cancel,
                         companion=companion if mmproj else None)
    modelfile = write_modelfile(folder, result.path, result.type, projector=result.mmproj)
    mmproj_check = None

    def stopped(err: MergeCancelled) -> MergeCancelled:  # the files are complete: say so, not the merge's "nothing was written"
        if result.mmproj is not None and mmproj_check is None:  # stopped in the mmproj's check: neither is checked
            said = f"{result.path} and {result.mmproj} were written but are not checked."
        elif result.mmproj is not None:  # stopped in the GGUF's check, after the mmproj's: its verdict stands
            said = (f"{result.path} was written but is not checked ({Path(result.mmproj).name} beside it: mmproj check "
                    f"{mmproj_check.line().split(':')[0]}).")
        else:
            said = f"{result.path} was written but is not checked."
        new = MergeCancelled(f"Stopped during the check: {said}")
        new.interrupted = getattr(err, "interrupted", False)
        return new

    if result.mmproj is not None:  # its own check (llama.cpp's image embeddings) in its own manifest entry
        from tui_merger.core.ship.gguf_mmproj import check_mmproj
        from tui_merger.core.ship.llama_child import cancel_scope

        try:
            with cancel_scope(cancel):  # a Stop ends llama.cpp's child process of the image check too
                mmproj_check = check_mmproj(folder, result.path, result.mmproj, reader=check, on_event=on_event, cancel=cancel)
            if cancel is not None:
                cancel.raise_if_cancelled()
        except MergeCancelled as err:
            raise stopped(err) from None
        try:
            record_check(folder, result.mmproj, mmproj_check)
        except OSError:
            pass
    if check == "none":
        verdict = GgufCheck(NOT_CHECKED, None, "skipped (--check none).")
    else:
        try:
            verdict = check_gguf(folder, result.path, result.type, reader=check, on_event=on_event, cancel=cancel)
            if cancel is not None:  # (a stop inside the reference comes back as "cannot be run": not a verdict)
                cancel.raise_if_cancelled()
        except MergeCancelled as err:
            raise stopped(err) from None
    try:
        record_check(folder, result.path, verdict, modelfile.path)
    except OSError:  # a read-only folder: export_gguf said so already; the file and its check stand
        pass
    return LocalModel(result, modelfile, verdict, mmproj_check)


# -- the adapter as a GGUF LoRA on its base's GGUF ------------------------------------------------------

# bytes of LoRA factors written per second: taken as f16's rate above (the factors are only converted to F32
# and written, no quantization); not measured on its own: a LoRA is small beside its base's GGUF
LORA_BYTES_PER_SECOND = SOURCE_BYTES_PER_SECOND["f16"]


@dataclass(frozen=True)
class LoraPlan:
    """What "also the adapter as a GGUF LoRA" writes, said before anything is written."""

    base_folder: Path
    adapter: Path
    type: str  # the base GGUF's type
    lora_path: Path  # ADAPTER/<name>-LoRA-F32.gguf (replaced when there: it is made of the adapter alone)
    lora_size: int  # about: the adapter's LoRA factors as F32
    lora_exists: bool
    base_gguf: Path
    base: Estimate | None  # the base's GGUF to write; None: it is already there and used as it is
    seconds: float  # about, writing both (the checks come after)


@dataclass(frozen=True)
class LocalLora:
    lora: object  # gguf_lora.LoraGgufResult
    base_gguf: Path
    base: LocalModel | None  # the base's GGUF written now (with its check); None: it was there, used as it is
    modelfile: object | None  # modelfile.Modelfile (FROM the base GGUF, ADAPTER the LoRA); None: the base failed
    check: object | None  # gguf_check.GgufCheck of llama.cpp with the LoRA against peft; None: the base failed
    recorded: str | None  # the file the LoRA and its check went to (the base's manifest, or the JSON beside the LoRA)
    not_recorded: str = ""  # why not in the base's manifest (recorded beside it), or why not at all (recorded None)

    @property
    def base_failed(self) -> bool:
        return self.base is not None and self.base.check.status == "failed"

    def run_lines(self) -> list[str]:
        from tui_merger.core.ship.modelfile import run_lines

        return run_lines(self.base_gguf, self.modelfile) if self.modelfile is not None else []


def lora_source(options) -> tuple[Path, Path] | None:
    """(base folder, adapter folder) when the merge (MergeOptions) was one peft LoRA adapter, weight 1, on a
    base folder here: what a GGUF LoRA can be made of. None otherwise (a checkpoint, a weighted blend,
    an adapter that is not a peft folder)."""
    if options is None or getattr(options, "checkpoint", None) is not None:
        return None
    base, adapter = getattr(options, "base", None), getattr(options, "adapter", None)
    if base is None or adapter is None or options.weighted:
        return None
    base, adapter = Path(base).expanduser().absolute(), Path(adapter).expanduser().absolute()
    if not (base / "config.json").is_file() or not (adapter / "adapter_config.json").is_file():
        return None
    return base, adapter


def default_base_gguf(base_folder: Path, adapter_folder: Path, type_: str) -> Path:
    """Where the base's GGUF goes: inside the base folder, as ``tui-merger gguf BASE`` writes it, so the
    next adapter of that base finds it; beside the adapter when the base is a snapshot in the Hugging Face
    cache (a folder huggingface_hub manages), named after the Hub model."""
    from tui_merger.core.io.hf_refs import hub_cache
    from tui_merger.core.ship.gguf import default_out

    base_folder = Path(base_folder).absolute()
    try:
        cached = base_folder.resolve().is_relative_to(hub_cache().expanduser().resolve())
    except OSError:
        cached = False
    if not cached:
        return default_out(base_folder, type_)
    repo = next((p[len("models--"):].split("--")[-1] for p in base_folder.parts if p.startswith("models--")), base_folder.name)
    return Path(adapter_folder).absolute() / f"{repo}-{type_.upper()}.gguf"


def plan_lora(base_folder: Path, adapter_folder: Path, type_: str) -> LoraPlan:
    """The files, their sizes and about how long writing them takes; nothing written. Raises MergeError
    with the plan's sentence when the base cannot be a GGUF."""
    from tui_merger.core.formats.adapter import open_adapter
    from tui_merger.core.ship.gguf_lora import default_lora_out

    base_folder, adapter_folder = Path(base_folder).absolute(), Path(adapter_folder).absolute()
    lora_path = default_lora_out(adapter_folder)
    base_gguf = default_base_gguf(base_folder, adapter_folder, type_)
    base = None if base_gguf.is_file() else estimate(base_folder, type_)
    adapter = open_adapter(adapter_folder)
    try:
        tensors = getattr(adapter.source, "tensors", None) or {}
        size = sum(4 * _numel(ref) for name, ref in tensors.items() if "lora_" in name)
    finally:
        adapter.close()
    seconds = size / LORA_BYTES_PER_SECOND + (base.seconds if base is not None else 0.0)
    return LoraPlan(base_folder, adapter_folder, type_, lora_path, size, lora_path.is_file(), base_gguf, base, seconds)


def _numel(ref) -> int:
    import math

    return math.prod(int(d) for d in getattr(ref, "shape", ()) or ())


def make_local_lora(
    plan: LoraPlan,
    check: str = "auto",
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> LocalLora:
    """Write the plan: the GGUF LoRA first (it needs only the base's headers, so a refusal comes before the
    long part), the base's GGUF unless it is there (written and checked as ``make_local`` does; when that
    check FAILS nothing more is done), the Modelfile beside the LoRA (the adapter's chat template when it
    saved a tokenizer, else the base's), then llama.cpp runs the base GGUF with the LoRA against peft on the
    base with the adapter (``check`` as make_local's), recorded in the base folder's merge_manifest.json
    where it has one, else in the JSON beside the LoRA (gguf_lora.record_lora_gguf)."""
    from tui_merger.core.ship.gguf_check import NOT_CHECKED, GgufCheck, check_lora_gguf
    from tui_merger.core.ship.gguf_lora import export_lora_gguf, record_lora_gguf
    from tui_merger.core.ship.modelfile import write_modelfile

    written: list[Path] = []

    def stopped(err: MergeCancelled, during: str) -> MergeCancelled:
        done = ", ".join(str(p) for p in written)
        new = MergeCancelled(f"Stopped {during}: " + (f"{done} written; " if done else "") + "the rest was not made.")
        new.interrupted = getattr(err, "interrupted", False)
        return new

    def raise_if_cancelled(during: str) -> None:
        if cancel is not None and cancel.cancelled:
            raise stopped(MergeCancelled(), during)

    raise_if_cancelled("before the GGUF LoRA")
    on_event(PhaseStarted("lora", f"Writing {plan.adapter.name} as a GGUF LoRA"))
    try:
        lora = export_lora_gguf(plan.base_folder, plan.adapter, plan.lora_path, overwrite=True)
    except OSError as err:
        raise MergeError(f"{plan.lora_path} could not be written ({err.strerror or err}); the adapter folder must be writable.") from None
    written.append(lora.path)
    base = None
    if plan.base is not None or not plan.base_gguf.is_file():
        raise_if_cancelled("after the GGUF LoRA")
        try:
            base = make_local(plan.base_folder, plan.type, plan.base_gguf, check=check, on_event=on_event, cancel=cancel)
        except MergeCancelled as err:
            written.extend(p for p in [plan.base_gguf] if p.is_file())
            raise stopped(err, "while making the base's GGUF") from None
        written.append(base.result.path)
        if base.check.status == "failed":
            return LocalLora(lora, base.result.path, base, None, None, None, "the base's GGUF failed its check.")
    base_gguf = base.result.path if base is not None else plan.base_gguf
    chat = plan.adapter if (plan.adapter / "tokenizer_config.json").is_file() else plan.base_folder
    modelfile = write_modelfile(chat, base_gguf, plan.type, adapter=lora.path)
    written.append(modelfile.path)
    if check == "none":
        verdict = GgufCheck(NOT_CHECKED, None, "skipped (--check none).")
    else:
        try:
            raise_if_cancelled("before the LoRA's check")
            verdict = check_lora_gguf(plan.base_folder, plan.adapter, base_gguf, lora.path, reader=check,
                                      on_event=on_event, cancel=cancel)
            raise_if_cancelled("during the LoRA's check (not checked)")
        except MergeCancelled as err:
            raise stopped(err, "during the LoRA's check (not checked)") from None
    from tui_merger.core.ship.gguf_lora import lora_record_path

    manifest = plan.base_folder / "merge_manifest.json"
    beside = lora_record_path(lora.path)  # where the record goes when the base folder has no manifest
    try:
        in_manifest = record_lora_gguf(plan.base_folder, lora, base_gguf, verdict, modelfile.path)
    except OSError as err:  # a read-only folder: the files and the check stand
        return LocalLora(lora, base_gguf, base, modelfile, verdict, None,
                         f"{manifest if manifest.is_file() else beside} could not be written ({err.strerror or err}).")
    if in_manifest:
        return LocalLora(lora, base_gguf, base, modelfile, verdict, str(manifest))
    if beside.is_file():
        return LocalLora(lora, base_gguf, base, modelfile, verdict, str(beside),
                         f"{plan.base_folder.name} has no merge_manifest.json: tui-merger did not make it")
    return LocalLora(lora, base_gguf, base, modelfile, verdict, None,
                     f"{plan.base_folder.name} has no merge_manifest.json (tui-merger did not make it).")


def human_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def _local_type_words() -> list[tuple[str, str]]:
    """gguf.TYPE_WORDS as "Run it locally" offers them: Q4_K_M is its choice, f16 the command's default."""
    from tui_merger.core.ship.gguf import TYPE_WORDS

    words = []
    for text, type_ in TYPE_WORDS:
        text = text.replace(" (default)", "")
        if type_ == RUN_LOCALLY_TYPE:
            text = text.replace(type_ + ":", type_ + " (recommended):", 1)
        words.append((text, type_))
    return words


def __getattr__(name: str):
    if name == "LOCAL_TYPE_WORDS":  # built on first use: gguf's names only, no heavy imports
        return _local_type_words()
    raise AttributeError(name)
