""""Run it locally": a GGUF, checked, with its Ollama Modelfile and the lines to run it, in one call that
the command line (``tui-merger gguf``), the assistant's Finish step and the plain flow share.

``estimate`` says before anything is written how large the file will be (from the plan: headers only)
and about how long writing it takes; ``make_local`` writes the GGUF (ship/gguf.py), the Modelfile
(modelfile.py), checks the file (gguf_check.py) and records the check in merge_manifest.json and the
model card.

Q4_K_M is what "Run it locally" preselects: Ollama's default, what model pages publish first, about a
third of f16's size. The command's ``--type`` default stays f16 (gguf.DEFAULT_TYPE): a command run without
a type gets the file closest to the model, and a k-quant takes about 20 times longer to write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.events import CancelToken, EventSink, ignore_event

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
        size = plan.tensor_bytes + (side.plan.tensor_bytes if side is not None and side.plan is not None else 0)
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
    return Estimate(type_, size, source_bytes / rate, source_bytes)


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
    if result.mmproj is not None:  # its own check (llama.cpp's image embeddings) in its own manifest entry
        from tui_merger.core.ship.gguf_mmproj import check_mmproj

        mmproj_check = check_mmproj(folder, result.path, result.mmproj, reader=check, on_event=on_event, cancel=cancel)
        try:
            record_check(folder, result.mmproj, mmproj_check)
        except OSError:
            pass
    if check == "none":
        verdict = GgufCheck(NOT_CHECKED, None, "skipped (--check none).")
    else:
        verdict = check_gguf(folder, result.path, result.type, reader=check, on_event=on_event, cancel=cancel)
    try:
        record_check(folder, result.path, verdict, modelfile.path)
    except OSError:  # a read-only folder: export_gguf said so already; the file and its check stand
        pass
    return LocalModel(result, modelfile, verdict, mmproj_check)


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
