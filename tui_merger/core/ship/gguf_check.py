"""Does the GGUF say what the model folder says? ``tui-merger gguf`` checks the file it wrote.

The judge is llama.cpp itself when its Python binding (``llama_cpp``, llama-cpp-python; never a
dependency) is importable: it loads the file, tokenizes and runs it. Without it, transformers' own GGUF
reader (``from_pretrained(..., gguf_file=...)``, which dequantizes every tensor to float32) where it
knows the architecture. Else the file is "not checked", with the reason: a file is never called checked
that was not.

What is compared, against transformers on the model folder (float32, run layer by layer from the files
as the verification runs it, so memory stays flat in model size):

- token ids of sample texts (ASCII, digits, Chinese, emoji, whitespace) and of a chat rendered by the
  folder's chat template with its special tokens: the GGUF's tokenizer must give the very same ids;
- the logits of that chat prompt: max |difference| / max |reference logit| within ``LIMITS[type]``, for
  f16/bf16 or 3x the model's own spread under the type's rounding where larger (ROUNDED, OWN_FACTOR);
- the top token at every prompt position: equal, or where not, the reference's own margin between its
  top token and the GGUF's is within the same limit (a near tie that rounding can flip).

A mixture of experts is judged at its median position (``MOE_CEILING``): rounding can turn a near-tied
router choice, and a position that runs other experts moves by far more than the rounding.

``LIMITS``: the relative logit differences llama.cpp 0.3.36 and transformers' reader give on tiny
dense models of each family (random weights, a hard case for quantization: flat logits) times about 3; measured with ``benchmarks/gguf_check_spreads.py`` and listed in
docs/formats.md. One tensor changed in a file (a wrong layout, a wrong scale) lands far above them.

The verdict is recorded in the folder's merge_manifest.json (the GGUF's entry, ``check``) and shown in
the model card. torch, transformers and llama_cpp are imported inside functions only.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.events import CancelToken, EventSink, PhaseStarted, ignore_event

PASSED, FAILED, NOT_CHECKED = "passed", "failed", "not checked"

# max |logit difference| / max |reference logit| over the check's chat prompt, per GGUF type: the largest
# spread measured on tiny random dense models with either reader (benchmarks/gguf_check_spreads.py, the
# table in docs/formats.md), times about 3
LIMITS = {
    "f16": 1e-2,  # llama.cpp 5.3e-4; transformers' reader 4.6e-3 where it leaves out llama3's rope factors
    "bf16": 2e-2,  # llama.cpp 4.6e-3 (it rounds the activations to bf16 for a bf16 matrix)
    "q8_0": 5e-2,  # 1.8e-2
    "q6_k": 0.15,  # 4.9e-2
    "q5_k_m": 0.25,  # 7.9e-2 (q5_k_s)
    "q5_k_s": 0.25,
    "q4_k_m": 0.45,  # 0.156
    "q4_k_s": 0.45,
    "q3_k_m": 0.6,  # 0.196
}
# A mixture of experts: where rounding turns a near-tied router choice, a position runs other experts and
# its logits move by far more than the rounding (measured: up to 12 times the median position). There
# the limit holds for the median position, every position stays within MOE_CEILING times it, and the top
# token is compared at the positions within the limit.
MOE_CEILING = 6
# The float types whose rounding the check measures on the model at hand: the reference runs a second
# time with its weights and matrix-product inputs rounded to the type (_streamed_logits' round_to), and
# the limit is the larger of LIMITS[type] and OWN_FACTOR times that own spread (same measure, same
# positions). A dense model is held to it at its largest position and, with the model's median own spread,
# at its median position: rounding moves a few sharp positions far, a wrong tensor moves every position.
# A model whose attention is sharp (Gemma 3's q/k norms) moves its logits more under the same rounding; a
# fixed limit measured on plain models called such correct files FAILED. OWN_FACTOR: llama.cpp's own
# difference is 0.67-1.5x the model's own spread on the files measured (benchmarks/gguf_limit_check.py,
# docs/formats.md), so 3 leaves 2x; the same factor as LIMITS over their measurements.
ROUNDED = ("f16", "bf16")
OWN_FACTOR = 3
SAMPLE_TEXTS = (
    "Hello, world! The merge is done.",
    "Numbers: 3.14159, 2026-12-01, 1234567890 and 42.",
    "中文文本：模型合并完成了。",
    "emoji 🤖🚀 and accents: café, naïve",
    "  leading spaces\nand\ttabs\n\n",
)
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2+2? 中文 🤖"},
]
_MEMORY_SHARE = 0.6  # of MemAvailable that transformers' reader (the whole model in float32) may take


@dataclass(frozen=True)
class GgufCheck:
    status: str  # PASSED, FAILED or NOT_CHECKED
    reader: str | None  # "llama.cpp (llama-cpp-python 0.3.36)", "transformers 5.25.0's GGUF reader"; None: not checked
    summary: str  # one sentence: what was compared and found, or why it was not checked
    details: dict = field(default_factory=dict)  # texts, ids_equal, logits_rel, limit, top_equal, positions

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    def record(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        return f"{self.status.upper() if self.status != NOT_CHECKED else 'not checked'}: {self.summary}"


def check_gguf(
    folder: Path,
    gguf_path: Path,
    type_: str,
    reader: str = "auto",
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> GgufCheck:
    """Compare the GGUF at ``gguf_path`` with the model folder it was made from.

    ``reader``: "auto" (llama.cpp when importable, else transformers' reader), "llama.cpp" or
    "transformers". Never raises for a file that differs (that is FAILED); a folder that cannot be
    run as a reference, or a reader that cannot read this family, is NOT_CHECKED with the reason."""
    folder, gguf_path = Path(folder).absolute(), Path(gguf_path).absolute()
    if reader not in ("auto", "llama.cpp", "transformers"):
        raise MergeError(f"{reader!r} is not a GGUF reader tui-merger checks with; choose auto, llama.cpp or transformers.")
    use_llama = reader == "llama.cpp" or (reader == "auto" and llama_cpp_version() is not None)
    if reader == "llama.cpp" and llama_cpp_version() is None:
        return GgufCheck(NOT_CHECKED, None, "llama.cpp's Python binding (llama_cpp) is not installed here.")
    on_event(PhaseStarted("check", f"Checking {gguf_path.name} with {'llama.cpp' if use_llama else 'transformers’ GGUF reader'}"))
    limit = LIMITS.get(type_)
    if limit is None:
        return GgufCheck(NOT_CHECKED, None, f"tui-merger has no measured logit limit for {type_} files.")
    if not use_llama:
        why = _transformers_cannot_read(gguf_path)
        if why:
            return GgufCheck(NOT_CHECKED, None, why + " Install llama-cpp-python to check it with llama.cpp itself.")
    try:
        ref = _reference(folder, cancel, type_=type_)
    except MergeError as err:
        return GgufCheck(NOT_CHECKED, None, f"the model folder cannot be run as the reference ({str(err).rstrip('.')}).")
    if cancel is not None:
        cancel.raise_if_cancelled()
    if use_llama:
        got, name = _with_llama_cpp(gguf_path, ref)
        if ref.llama_ids is not None and not isinstance(got, str):
            return _verdict(ref, got, limit, type_, name, _experts(gguf_path), expected=ref.llama_ids)
    else:
        got, name = _with_transformers(gguf_path, ref)
    if isinstance(got, str):  # the reader could not read the file
        status = FAILED if got.startswith("!") else NOT_CHECKED
        return GgufCheck(status, name if status == FAILED else None, got.lstrip("!"))
    return _verdict(ref, got, limit, type_, name, _experts(gguf_path))


def check_lora_gguf(
    base_folder: Path,
    adapter_folder: Path,
    base_gguf: Path,
    lora_gguf: Path,
    reader: str = "auto",
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> GgufCheck:
    """Compare llama.cpp running the base's GGUF with the GGUF LoRA applied (``--lora``) with transformers
    on the base folder with the peft adapter applied by peft, unmerged (the independent reference): token
    ids, prompt logits within the base GGUF type's limit (the LoRA itself is F32), top tokens, as
    ``check_gguf`` judges a GGUF. Only llama.cpp applies a GGUF LoRA: without llama_cpp (or with
    ``reader`` "transformers") the file is NOT_CHECKED, said so; never raises for a file that differs."""
    base_folder, adapter_folder = Path(base_folder).absolute(), Path(adapter_folder).absolute()
    base_gguf, lora_gguf = Path(base_gguf).absolute(), Path(lora_gguf).absolute()
    if reader not in ("auto", "llama.cpp", "transformers"):
        raise MergeError(f"{reader!r} is not a GGUF reader tui-merger checks with; choose auto, llama.cpp or transformers.")
    if reader == "transformers":
        return GgufCheck(NOT_CHECKED, None, "transformers' GGUF reader cannot apply a GGUF LoRA; only llama.cpp can check it.")
    if llama_cpp_version() is None:
        return GgufCheck(NOT_CHECKED, None, "llama.cpp's Python binding (llama_cpp) is not installed here, and only llama.cpp "
                         "applies a GGUF LoRA; install llama-cpp-python to check it.")
    type_ = gguf_type_of(base_gguf)
    limit = LIMITS.get(type_) if type_ else None
    if limit is None:
        return GgufCheck(NOT_CHECKED, None, f"tui-merger has no measured logit limit for the base GGUF's type ({type_ or 'unknown'}).")
    on_event(PhaseStarted("check", f"Checking {lora_gguf.name} on {base_gguf.name} with llama.cpp"))
    try:
        ref = _reference(base_folder, cancel, adapter=adapter_folder, type_=type_)
    except MergeError as err:
        return GgufCheck(NOT_CHECKED, None, f"the base with the adapter cannot be run as the reference ({str(err).rstrip('.')}).")
    if cancel is not None:
        cancel.raise_if_cancelled()
    got, name = _with_llama_cpp(base_gguf, ref, lora=lora_gguf)
    if isinstance(got, str):
        status = FAILED if got.startswith("!") else NOT_CHECKED
        return GgufCheck(status, name if status == FAILED else None, got.lstrip("!"))
    verdict = _verdict(ref, got, limit, type_, name, _experts(base_gguf), expected=ref.llama_ids)
    summary = verdict.summary.replace("of transformers'", "of peft's on the base with the adapter unmerged").replace(
        f"; read by {name}.", f"; {lora_gguf.name} applied to {base_gguf.name} by {name}.")
    return GgufCheck(verdict.status, verdict.reader, summary, {**verdict.details, "reference": "peft, unmerged"})


def gguf_type_of(path: Path) -> str | None:
    """The type name (f16, q4_k_m...) of a GGUF's ``general.file_type``, by gguf's own LlamaFileType
    (MOSTLY_Q4_K_M -> q4_k_m); None where the header says none."""
    import gguf

    try:
        field = gguf.GGUFReader(path).fields.get("general.file_type")
    except Exception:  # noqa: BLE001 - an unreadable file: its loading says what
        return None
    if field is None or not field.data:
        return None
    try:
        kind = gguf.LlamaFileType(int(field.parts[field.data[0]][0]))
    except ValueError:
        return None
    return kind.name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def llama_cpp_version() -> str | None:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        return None
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


# -- the reference: transformers on the folder -----------------------------------------------------


@dataclass
class _Reference:
    texts: list[str]
    ids: list[list[int]]  # per text, as the folder's tokenizer gives them
    special: list[bool]  # per text: ids include the tokenizer's own specials (plain text) or not (a rendered chat)
    prompt: list[int]
    logits: object  # torch tensor [positions, vocab], float32
    add_bos: bool
    # per text, the ids llama.cpp's SentencePiece tokenizer makes of it where they differ by rule from the
    # folder's tokenizer (None: the same rule), built from the folder's tokenizer
    llama_ids: list[list[int]] | None = None
    # the same forward with the weights, and every matrix product's input, rounded to the GGUF's float type
    # (ROUNDED): how far this model's own logits move under that type's rounding; None for other types
    rounded: object = None


def _reference(folder: Path, cancel, adapter: Path | None = None, type_: str | None = None) -> _Reference:
    """transformers on the folder; with ``adapter``, peft's LoRA applied to it unmerged (the reference of a
    GGUF LoRA). For a float ``type_`` (ROUNDED) the forward runs a second time rounded to that type."""
    import torch

    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.ship.trial import generator_class, load_tokenizer

    config = json_object_or_none(folder / "config.json")
    if config is None:
        raise MergeError(f"{folder} has no readable config.json")
    cls = generator_class(config, folder)
    tok = load_tokenizer(folder)
    texts, ids, special = [], [], []
    for text in SAMPLE_TEXTS:
        texts.append(text)
        ids.append(list(tok(text)["input_ids"]))
        special.append(True)
    chat = _chat_text(tok)
    if chat is not None:
        texts.append(chat)
        ids.append(list(tok(chat, add_special_tokens=False)["input_ids"]))
        special.append(False)
    prompt = ids[-1]
    probe = list(tok("x")["input_ids"])
    add_bos = tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id]
    logits = _streamed_logits(folder, cls, prompt, cancel, adapter)
    rounded = None
    if type_ in ROUNDED:
        rounded = _streamed_logits(folder, cls, prompt, cancel, adapter, round_to=type_).to(torch.float32)
    llama_ids = None
    from tui_merger.core.ship.gguf_vocab import spaces_at_start_only

    if spaces_at_start_only(folder):
        llama_ids = [_as_llama_cpp_splits(tok, text, with_bos=special and add_bos) for text, special in zip(texts, special)]
    return _Reference(texts, ids, special, prompt, logits.to(torch.float32), add_bos, llama_ids, rounded)


def _as_llama_cpp_splits(tok, text: str, with_bos: bool) -> list[int]:
    """The ids llama.cpp's SentencePiece tokenizer gives ``text`` (llama-vocab.cpp: the text is cut at every
    added token; each fragment between them gets a space in front, "▁" after the escape, also a fragment
    that already begins with one), made with the folder's own tokenizer fragment by fragment: a fragment
    that begins with a space gets no second "▁" from a tokenizer.json whose Metaspace prepends "first"."""
    import re

    added = sorted({t.content for t in tok.added_tokens_decoder.values() if t.content}, key=len, reverse=True)
    ids = [tok.bos_token_id] if with_bos else []
    pieces = re.split("(" + "|".join(map(re.escape, added)) + ")", text) if added else [text]
    for i, piece in enumerate(pieces):
        if i % 2:  # an added token, by its own id
            ids.append(tok.convert_tokens_to_ids(piece))
        elif piece:
            ids.extend(tok(" " + piece, add_special_tokens=False)["input_ids"])
    return ids


def _chat_text(tok) -> str | None:
    if not getattr(tok, "chat_template", None):
        return None
    for messages in (CHAT, CHAT[1:]):  # some templates refuse a system message
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001, S112 - a template may raise anything for a role it does not take
            continue
    return None


def _streamed_logits(folder: Path, cls, prompt: list[int], cancel, adapter: Path | None = None,
                     round_to: str | None = None):
    """transformers' own forward of the folder's model, float32, one module's weights in memory at a time;
    with ``adapter``, peft's forward of the model with that LoRA (behaviour.streamer_with_adapter).

    ``round_to`` ("f16", "bf16"): every floating weight of the files goes through that type as it is read
    (the GGUF stores it so), and the input of every linear layer too, as llama.cpp's CPU matrix product
    converts its float32 input to the matrix's f16/bf16 type (ggml's vec_dot_type); the adapter's own
    weights stay float32 as a GGUF LoRA keeps them."""
    import torch
    from transformers import AutoConfig

    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour as bh

    source = open_model(folder)
    tensors = source.tensors
    dtype = None
    if round_to is not None:
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[round_to]
        tensors = {name: _RoundedRef(ref, dtype) for name, ref in tensors.items()}
    try:
        try:
            config = AutoConfig.from_pretrained(folder)
            if adapter is None:
                streamer, missing = bh.streamer_for_files(cls, config, tensors, "merged model", cancel=cancel)
            else:
                streamer, missing = bh.streamer_with_adapter(cls, config, tensors, [(Path(adapter), None)],
                                                             "base model with the adapter", cancel=cancel)
        except bh.NoReference as err:
            raise MergeError(str(err)) from None
        if missing:
            raise MergeError(f"it lacks {len(missing)} weight(s) ({', '.join(missing[:3])})")
        if dtype is not None:
            _round_linear_inputs(streamer.model, dtype)
        try:
            return streamer(torch.tensor([prompt])).logits[0].detach().clone()
        finally:
            streamer.close()
    finally:
        source.close()


class _RoundedRef:
    """A file tensor (io.sources.TensorRef) read through another float type: what the GGUF stores."""

    def __init__(self, ref, dtype) -> None:
        self._ref, self._dtype = ref, dtype

    def __getattr__(self, name):
        return getattr(self._ref, name)

    def load(self):
        value = self._ref.load()
        if not value.is_floating_point() or value.dtype == self._dtype or value.element_size() < 2:
            return value  # integers, fp8 with its scales: a converter's business; already the type
        return value.to(self._dtype)

    def load_into(self, out) -> None:
        out.copy_(self.load())


def _round_linear_inputs(model, dtype) -> None:
    """Round the input of every linear layer to ``dtype`` (peft's lora_A/lora_B excepted: a GGUF LoRA is
    F32, llama.cpp multiplies it in float32)."""
    import torch

    def pre_hook(module, args):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            return (args[0].to(dtype).to(args[0].dtype), *args[1:])
        return None

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            module.register_forward_pre_hook(pre_hook)


# -- the readers -------------------------------------------------------------------------------------


@dataclass
class _Read:
    ids: list[list[int]]
    logits: object  # torch tensor [positions, vocab]


def _with_llama_cpp(path: Path, ref: _Reference, lora: Path | None = None):
    """The GGUF at ``path`` (with the GGUF LoRA ``lora`` applied, llama.cpp's --lora) as llama.cpp reads it, in a
    child process (llama_child): a failed assert in llama.cpp aborts that process, not tui-merger."""
    import torch

    from tui_merger.core.ship.llama_child import LlamaStopped, run

    name = f"llama.cpp (llama-cpp-python {llama_cpp_version()})"
    task = {"kind": "text", "model": str(path), "lora": str(lora) if lora else None, "n_ctx": max(256, len(ref.prompt) + 8),
            "threads": max(1, min(4, os.cpu_count() or 1)), "texts": list(ref.texts), "special": list(ref.special),
            "prompt": [int(i) for i in ref.prompt]}
    try:
        out, arrays = run(task)
    except LlamaStopped as stop:
        said = stop.sentence(f"running {Path(lora).name} on {Path(path).name}" if lora else f"running {Path(path).name}")
        return ("!" + said, name) if stop.crashed else (said, None)
    if out.get("error") == "import":
        return f"llama_cpp is installed but does not import ({out['message']}).", None
    if out.get("error"):
        if lora is not None:
            return (f"!{name} did not load the LoRA {Path(lora).name} with {Path(path).name} ({out['message']}).", name)
        return (f"!{name} did not load the file ({out['message']}); a llama.cpp older than the file's "
                "architecture refuses it too: with a current llama-cpp-python, make the GGUF again."), name
    return _Read(out["ids"], torch.from_numpy(arrays["logits"])), name


def _gemma3_misread(reader) -> bool:
    """transformers' reader maps neither gemma3's rope scaling (Gemma 3 4B+: linear, factor 8) nor its attention scale
    (query_pre_attn_scalar, default 256; llama.cpp scales by the head size): measured wrong on such files (gemvl)."""

    def value(key):
        field = reader.fields.get(key)
        if field is None or not field.data:
            return None
        part = field.parts[field.data[0]]
        return bytes(part).decode() if field.types and field.types[0].name == "STRING" else part[0]

    scaling = value("gemma3.rope.scaling.type")
    return value("gemma3.attention.key_length") != 256 or scaling not in (None, "none")


def _transformers_cannot_read(path: Path) -> str | None:
    """Why transformers' GGUF reader cannot check this file (None: it can try), from the header alone."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from tui_merger.core.io.system import available_memory

    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # noqa: BLE001 - a damaged file: the reader says what
        return f"the file does not read as a GGUF ({_first_line(err)})."
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
    # transformers' own spelling of the llama.cpp names it maps (load_gguf_checkpoint)
    known = {a.replace("_", "") for a in GGUF_SUPPORTED_ARCHITECTURES} | set(GGUF_SUPPORTED_ARCHITECTURES)
    if arch not in known and arch.replace("-", "") not in known:
        import transformers

        return (f"transformers {transformers.__version__}'s GGUF reader does not know the {arch} architecture, "
                "and llama.cpp's Python binding (llama_cpp) is not installed here.")
    if arch == "gemma4":  # its reader maps gemma4's common keys only (integrations/ggml.py), none of these
        import transformers

        return (f"transformers {transformers.__version__}'s GGUF reader builds Gemma 4 without the file's sliding-layer head "
                "size, per-layer embedding size, layer pattern, shared KV layers, rope bases and soft-capping, so it would "
                "compare another model.")
    if arch == "gemma3" and _gemma3_misread(reader):
        import transformers

        return (f"transformers {transformers.__version__}'s GGUF reader builds Gemma 3 with attention scale 1/16 "
                "(query_pre_attn_scalar 256) and without rope scaling, not as this file says, so it would compare "
                "another model.")
    if any(t.name == "rope_factors_long.weight" for t in reader.tensors):  # Phi-3's longrope
        import transformers

        return (f"transformers {transformers.__version__}'s GGUF reader builds the model without its longrope factors "
                "(rope_factors_long, rope_factors_short), so it would compare another model.")
    values = sum(int(t.n_elements) for t in reader.tensors)
    available = available_memory()
    if available is not None and values * 4 > available * _MEMORY_SHARE:
        from tui_merger.core.options import human_bytes

        return (f"transformers' GGUF reader holds the whole model in float32 ({human_bytes(values * 4)}), more than "
                f"this machine can spare ({human_bytes(available)} available).")
    return None


def _with_transformers(path: Path, ref: _Reference):
    """The model and tokenizer as transformers builds them from the GGUF alone (the file linked into an
    empty folder, so that nothing of the model folder is read)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tui_merger.core.ship.trial import quiet_libraries

    name = f"transformers {transformers.__version__}'s GGUF reader"
    with tempfile.TemporaryDirectory(prefix="tui-merger-gguf-check-") as tmp:
        alone = Path(tmp) / path.name
        try:
            alone.symlink_to(path)
        except OSError:
            return "the file could not be linked into a folder of its own for transformers' reader.", None
        with quiet_libraries():
            try:
                tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
            except Exception as err:  # noqa: BLE001 - the reader refuses what it does not map in many ways
                return f"{name} could not build the model from it ({_first_line(err)}).", None
    ids = []
    for text, special in zip(ref.texts, ref.special):
        ids.append(list(tok(text, add_special_tokens=special)["input_ids"]))
    with torch.no_grad():
        logits = model(torch.tensor([ref.prompt])).logits[0].float()
    del model
    return _Read(ids, logits), name


# -- the verdict -------------------------------------------------------------------------------------


def _experts(path: Path) -> int:
    """The experts per layer the GGUF declares (``<arch>.expert_count``; 0: a dense model)."""
    import gguf

    try:
        fields = gguf.GGUFReader(path).fields
    except Exception:  # noqa: BLE001 - the readers said what is wrong with the file already
        return 0
    for name, f in fields.items():
        if name.endswith(".expert_count") and f.data:
            return int(f.parts[f.data[0]][0])
    return 0


def _verdict(ref: _Reference, got: _Read, limit: float, type_: str, reader: str, experts: int = 0,
             expected: list[list[int]] | None = None) -> GgufCheck:
    """``expected``: the ids to compare with where the reader splits text by another rule than the
    folder's tokenizer (llama.cpp and a Metaspace "first" tokenizer.json); default the folder's."""
    import torch

    same = [a == b for a, b in zip(expected or ref.ids, got.ids)]
    want, have = ref.logits, got.logits
    if tuple(have.shape) != tuple(want.shape):
        return GgufCheck(FAILED, reader, f"the file's logits have shape {list(have.shape)}, the model's {list(want.shape)}.",
                         {"texts": len(ref.texts), "ids_equal": sum(same)})
    scale = float(want.abs().max()) or 1.0
    floor, own, turned = limit, None, 0
    median_limit = limit  # a dense model: the median position too (a wrong tensor moves every position)
    if ref.rounded is not None and tuple(ref.rounded.shape) == tuple(want.shape):
        own_position = (ref.rounded - want).abs().max(-1).values / scale  # the model's own rounding, as measured
        own = float(own_position.median() if experts > 1 else own_position.max())
        limit = max(floor, OWN_FACTOR * own)
        median_limit = max(floor, OWN_FACTOR * float(own_position.median()))
        if experts > 1:  # where the type's rounding itself turns an expert choice, the file is held to the
            # reference rounded the same way: both must have turned it (and agree there)
            where = own_position > limit
            turned = int(where.sum())
            want = torch.where(where[:, None], ref.rounded, want)
    per_position = (have - want).abs().max(-1).values / scale
    rel = float(per_position.max())
    median = float(per_position.median())
    limit_words = (f"limit {limit:.2g} from this model's own {type_} rounding, {OWN_FACTOR} x {own:.2g}" if limit > floor
                   else f"limit {limit:g} for {type_}" + (f"; its own {type_} rounding moves them {own:.2g}" if own is not None else ""))
    top_want, top_have = want.argmax(-1), have.argmax(-1)
    margin = (want.max(-1).values - want.gather(-1, top_have[:, None])[:, 0]) / scale  # the reference's own gap
    within = per_position <= limit
    compared = within if experts > 1 else torch.ones_like(within)  # MoE: where no expert choice turned
    top_equal = int((top_want == top_have).sum())
    near_ties = int(((top_want != top_have) & (margin <= limit) & compared).sum())
    unexplained = int(((top_want != top_have) & (margin > limit) & compared).sum())
    rerouted = int(((top_want != top_have) & ~compared).sum())
    positions = len(ref.prompt)
    details = {
        "texts": len(ref.texts), "ids_equal": sum(same), "logits_rel": float(f"{rel:.3g}"),
        "logits_rel_median": float(f"{median:.3g}"), "limit": float(f"{limit:.3g}"), "limit_floor": floor,
        "own_rounding_rel": None if own is None else float(f"{own:.3g}"), "experts": experts,
        "top_equal": top_equal, "top_near_ties": near_ties, "top_rerouted": rerouted, "positions": positions,
    }
    if experts > 1:
        over = positions - int(within.sum())
        logits_ok = median <= limit and rel <= MOE_CEILING * limit
        logit_words = (f"prompt logits within {median:.2g} of transformers' at the median position and {rel:.2g} at "
                       f"most ({limit_words}; {MOE_CEILING}x that at {over} position{'s' if over != 1 else ''} "
                       "where a mixture of experts may route differently)")
        details["positions_over_limit"] = over
        details["positions_turned_by_own_rounding"] = turned
        if turned:
            logit_words += (f", at {turned} position{'s' if turned != 1 else ''} where this model's own {type_} rounding "
                            f"turns an expert choice compared with transformers' rounded to {type_}")
    else:
        logits_ok = rel <= limit and median <= median_limit
        logit_words = f"prompt logits within {rel:.2g} of transformers' ({limit_words})"
        if median_limit < limit:  # the largest position is allowed the model's largest own spread, the median its median
            logit_words += f" and {median:.2g} at the median position (limit {median_limit:.2g})"
            details["limit_median"] = float(f"{median_limit:.3g}")
    what = f"token ids equal on {sum(same)}/{len(same)} texts"
    if expected is not None:
        differ = sum(a != b for a, b in zip(expected, ref.ids))
        what += (f" as llama.cpp splits SentencePiece text (a \u2581 in front of the text and of every text after a "
                 "special token, also one that begins with a space; this tokenizer.json puts one only at the start, "
                 f"and not before a space: transformers' own ids differ on {differ} of them)")
        details["ids_rule"] = "llama.cpp-sentencepiece"
    what += f", {logit_words}, top token equal at {top_equal}/{positions} positions"
    what += f" ({near_ties} near tie{'s' if near_ties != 1 else ''} within the limit)" if near_ties else ""
    what += f" ({rerouted} more where experts may route differently)" if rerouted else ""
    ok = all(same) and logits_ok and unexplained == 0 and bool(torch.isfinite(have).all())
    return GgufCheck(PASSED if ok else FAILED, reader, f"{what}; read by {reader}.", details)


# -- recording ---------------------------------------------------------------------------------------


def record_check(folder: Path, gguf_path: Path, check: GgufCheck, modelfile: Path | None = None) -> bool:
    """Put the check (and the Modelfile written beside the GGUF) into the GGUF's entry of the folder's
    merge_manifest.json, and the model card when tui-merger wrote it; False when there is no entry."""
    from tui_merger.core.record.card import is_ours, write_model_card
    from tui_merger.core.record.manifest import read_manifest, write_manifest

    folder = Path(folder).absolute()
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    path = Path(gguf_path).absolute()
    shown = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else str(path)
    entry = next((e for e in manifest.get("gguf") or [] if isinstance(e, dict) and e.get("path") == shown), None)
    if entry is None:
        return False
    entry["check"] = check.record()
    if modelfile is not None:
        mf = Path(modelfile).absolute()
        entry["modelfile"] = mf.relative_to(folder).as_posix() if mf.is_relative_to(folder) else str(mf)
    write_manifest(folder, manifest)
    card = folder / "README.md"
    if not card.exists() or is_ours(card):
        write_model_card(folder, manifest, overwrite=False)
    return True


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]

