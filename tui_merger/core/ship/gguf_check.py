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
- the logits of that chat prompt: max |difference| / max |reference logit| within ``LIMITS[type]``, or a
  multiple of the model's own spread under the type's rounding where larger (f16/bf16: 3x under the type's own
  rounding, ROUNDED, OWN_FACTOR; quantized types: the checker's own block rounding with as many bits,
  QUANT_BITS, 2.2x at the largest position, QUANT_FACTOR, 1.4-1.6x at the median, QUANT_MEDIAN_FACTOR; a
  limit at the largest logit or beyond: "not checked", BLIND);
- the top token at every prompt position: equal, or where not, the reference's own margin between its
  top token and the GGUF's is within the same limit (a near tie that rounding can flip).

A mixture of experts is judged at its median position (``MOE_CEILING``): rounding can turn a near-tied
router choice, and a position that runs other experts moves by far more than the rounding. A position
where a router's k-th and (k+1)-th experts are within the rounding's reach of each other (NEAR_TIE) is held
to that median rule alone.

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
# The quantized types: the checker rounds the reference's weights itself, with a rounding of its own as
# coarse as the type and written here (plain b-bit min-max rounding of each block of QUANT_BLOCK values of
# a row; ggml's k-quants and gguf.quants, which write the file, are not used), and every linear layer's input
# to 8 bits per block of QUANT_INPUT_BLOCK values (llama.cpp's CPU converts it so: Q8_0 / Q8_K). The file's
# own rounding is another one, so its spread is not this one's: the limits are QUANT_FACTOR and
# QUANT_MEDIAN_FACTOR times it, measured against llama.cpp (benchmarks/gguf_limit_check.py, docs/formats.md), and no position is
# compared with this rounded reference. A tensor whose rows are not whole blocks stays as it is (ggml
# cannot quantize it either).
QUANT_BITS = {"q8_0": 8, "q6_k": 6, "q5_k_m": 5, "q5_k_s": 5, "q4_k_m": 4, "q4_k_s": 4, "q3_k_m": 3}
QUANT_BLOCK = 32
QUANT_INPUT_BLOCK = {"q8_0": 32}  # Q8_0's blocks; the k-quants' Q8_K: 256 (32 where a row is not a multiple)
# QUANT_FACTOR: a dense model's largest position. llama.cpp's largest position is 0.34-1.29 times this rounding's
# on the 279 correct files measured, 1.94 on one (the tiny Gemma 3 at q8_0, seed 0); 3 let through wrong files
# the fixed limits had caught (Llama q4_k_m with a norm +1 at 2.55x, Qwen3 q4_k_m with q/k reversed at 2.51x,
# Qwen3 and Phi-3 q8_0 with a projection x1.1 where the fixed 0.05 bound), 2.2 catches them and leaves that
# Gemma 3 file 13% below its limit.
QUANT_FACTOR = 2.2
# ... at the median position (a dense model's median rule, and a mixture of experts' limit), where the spread
# is steadier than at the largest position: llama.cpp's median is 0.34-1.22 times this rounding's median on the
# 259 files measured (q8_0, where the roundings this one leaves out weigh most: up to 1.22; the k-quants: up to
# 1.08), its largest position up to 1.94 times. 3 there let wrong files through that the fixed limits had caught
# (Qwen3-Next q4_k_m with q/k reversed, a norm +1 or an expert zeroed: 1.5-1.9x this rounding's median, the
# correct files 0.95-1.05x), so about 1.3x the largest measured ratio.
QUANT_MEDIAN_FACTOR = {"q8_0": 1.6}
QUANT_MEDIAN_FACTOR_K = 1.4  # the k-quants
# A derived limit this large (the logits may move by the largest logit, and every top token that differs is
# within it) is not a check of the logits: a file within it is "not checked", said why, never PASSED; one
# beyond it, or with other token ids, still FAILS. Met on tiny random Gemma 3 and EXAONE 4 models at q3_k_m
# (Gemma 3's q/k norms make attention so sharp that 3-bit rounding moves the logits by about the largest).
BLIND = 1.0
# A mixture of experts: a position where some layer's router has its k-th and (k+1)-th expert closer than
# NEAR_TIE times the largest move the type's rounding gives that router's scores (the rounded reference
# against the plain one, over every position and expert) may run other experts in the file than in the
# reference for a correct file. Such a position is left out of the MOE_CEILING rule (counted and said
# where that mattered); the median position rule holds over every position, and a position over the limit
# has its top token left uncompared as before. 2 x OWN_FACTOR: both experts' scores move.
NEAR_TIE = 2 * OWN_FACTOR
# A file past the ceiling at near-tied positions only must be as close as the rounding alone makes it at the
# median: within this times the model's own median (f16/bf16; quantized types: their QUANT_MEDIAN_FACTOR), not
# the floor. llama.cpp's median is 1.03-1.13x the rounded reference's on the MoE files measured in bf16; a
# Qwen3-Next bf16 file with in_proj_ba x1.05, which turns a near-tied router, sits at 1.72x.
NEAR_TIE_MEDIAN = 1.6
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
    quirk = _llama_cpp_quirk(gguf_path) if use_llama else None
    try:
        ref = _reference(folder, cancel, type_=type_, config_edit=quirk[0] if quirk else None)
    except MergeError as err:
        return GgufCheck(NOT_CHECKED, None, f"the model folder cannot be run as the reference ({str(err).rstrip('.')}).")
    if cancel is not None:
        cancel.raise_if_cancelled()
    if use_llama:
        got, name = _with_llama_cpp(gguf_path, ref, cancel=cancel)
        if quirk and not isinstance(got, str):
            name = f"{name}; {quirk[1]}"
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
    got, name = _with_llama_cpp(base_gguf, ref, lora=lora_gguf, cancel=cancel)
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
    # (ROUNDED), or by the checker's own rounding as coarse as a quantized type (QUANT_BITS): how far this
    # model's own logits move under that rounding; None for other types
    rounded: object = None
    # a mixture of experts: per position, whether some router's k-th and (k+1)-th experts are within
    # NEAR_TIE times that router's own move under the rounding (bool tensor [positions]); None: no routers seen
    near_tie: object = None


def _reference(folder: Path, cancel, adapter: Path | None = None, type_: str | None = None,
               config_edit: dict | None = None) -> _Reference:
    """transformers on the folder; with ``adapter``, peft's LoRA applied to it unmerged (the reference of a
    GGUF LoRA). For a float ``type_`` (ROUNDED) the forward runs a second time rounded to that type.
    ``config_edit``: values set on the (text) config before the model is built (``_llama_cpp_quirk``)."""
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
    logits, routers = _streamed_logits(folder, cls, prompt, cancel, adapter, config_edit=config_edit)
    rounded = near_tie = None
    if type_ in ROUNDED or type_ in QUANT_BITS:
        rounded, moved = _streamed_logits(folder, cls, prompt, cancel, adapter, round_to=type_, config_edit=config_edit)
        rounded = rounded.to(torch.float32)
        near_tie = _near_ties(routers, moved)
    llama_ids = None
    from tui_merger.core.ship.gguf_vocab import spaces_at_start_only

    if spaces_at_start_only(folder):
        llama_ids = [_as_llama_cpp_splits(tok, text, with_bos=special and add_bos) for text, special in zip(texts, special)]
    return _Reference(texts, ids, special, prompt, logits.to(torch.float32), add_bos, llama_ids, rounded, near_tie)


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
                     round_to: str | None = None, config_edit: dict | None = None):
    """transformers' own forward of the folder's model, float32, one module's weights in memory at a time;
    with ``adapter``, peft's forward of the model with that LoRA (behaviour.streamer_with_adapter).
    Returns (logits [positions, vocab], the selection scores of every router [(scores [positions, experts],
    k)], in the order they ran; routers as transformers' own ``_can_record_outputs["router_logits"]`` names them).

    ``round_to`` ("f16", "bf16"): every floating weight of the files goes through that type as it is read
    (the GGUF stores it so), and the input of every linear layer too, as llama.cpp's CPU matrix product
    converts its float32 input to the matrix's f16/bf16 type (ggml's vec_dot_type); the adapter's own
    weights stay float32 as a GGUF LoRA keeps them. A quantized type (QUANT_BITS): the checker's own
    b-bit block rounding of every matrix whose rows are whole blocks, and 8-bit blocks for the inputs."""
    import torch
    from transformers import AutoConfig

    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour as bh

    source = open_model(folder)
    tensors = source.tensors
    weight_fn = input_fn = None
    if round_to in ROUNDED:
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[round_to]
        weight_fn = lambda v: v.to(dtype)  # noqa: E731
        input_fn = lambda x, _width: x.to(dtype).to(x.dtype)  # noqa: E731
    elif round_to is not None:
        bits, in_block = QUANT_BITS[round_to], QUANT_INPUT_BLOCK.get(round_to, 256)
        weight_fn = lambda v: _block_rounded(v, bits, QUANT_BLOCK)  # noqa: E731
        input_fn = lambda x, width: (_absmax_rounded(x, 8, in_block if width % in_block == 0 else QUANT_BLOCK)  # noqa: E731
                                     if width % QUANT_BLOCK == 0 else x)
    if weight_fn is not None:
        tensors = {name: _RoundedRef(ref, weight_fn) for name, ref in tensors.items()}
    try:
        try:
            config = AutoConfig.from_pretrained(folder)
            for key, value in (config_edit or {}).items():
                setattr(config.get_text_config(), key, value)
            if adapter is None:
                streamer, missing = bh.streamer_for_files(cls, config, tensors, "merged model", cancel=cancel)
            else:
                streamer, missing = bh.streamer_with_adapter(cls, config, tensors, [(Path(adapter), None)],
                                                             "base model with the adapter", cancel=cancel)
        except bh.NoReference as err:
            raise MergeError(str(err)) from None
        if missing:
            raise MergeError(f"it lacks {len(missing)} weight(s) ({', '.join(missing[:3])})")
        if input_fn is not None:
            _round_linear_inputs(streamer.model, input_fn)
        routers = _record_routers(streamer.model, config)
        try:
            return streamer(torch.tensor([prompt])).logits[0].detach().clone(), routers
        finally:
            streamer.close()
    finally:
        source.close()


def _block_rounded(value, bits: int, block: int):
    """``value`` (float32) with every run of ``block`` values along its rows rounded to 2**bits levels
    evenly between the run's smallest and largest value; a tensor of one dimension, or whose rows are not
    whole blocks, as it is. The checker's own rounding, not ggml's: plain min-max, no search for scales."""
    import torch

    if not value.is_floating_point() or value.dim() < 2 or value.shape[-1] % block:
        return value
    w = value.to(torch.float32, copy=True).reshape(-1, block)
    low, high = torch.aminmax(w, dim=-1, keepdim=True)
    step = (high - low) / (2**bits - 1)
    step[step == 0] = 1
    return w.sub_(low).div_(step).round_().mul_(step).add_(low).reshape(value.shape)


def _absmax_rounded(x, bits: int, block: int):
    """``x`` rounded per run of ``block`` values to signed ``bits``-bit multiples of the run's largest |value|
    (as ggml's Q8_0 / Q8_K hold a matrix product's input)."""
    import torch

    w = x.reshape(-1, block)
    step = w.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
    step = torch.where(step == 0, torch.ones_like(step), step)
    return (torch.round(w / step) * step).reshape(x.shape).to(x.dtype)


class _RoundedRef:
    """A file tensor (io.sources.TensorRef) read through a rounding: what the GGUF stores, or as coarse."""

    def __init__(self, ref, fn) -> None:
        self._ref, self._fn = ref, fn

    def __getattr__(self, name):
        return getattr(self._ref, name)

    def load(self):
        value = self._ref.load()
        if not value.is_floating_point() or value.element_size() < 2:
            return value  # integers, fp8 with its scales: a converter's business
        return self._fn(value)

    def load_into(self, out) -> None:
        out.copy_(self.load())


def _round_linear_inputs(model, fn) -> None:
    """Round the input of every linear layer with ``fn(input, in_features)`` (peft's lora_A/lora_B excepted:
    a GGUF LoRA is F32, llama.cpp multiplies it in float32)."""
    import torch

    def pre_hook(module, args):
        if args and torch.is_tensor(args[0]) and args[0].is_floating_point():
            return (fn(args[0], module.in_features), *args[1:])
        return None

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "lora_" not in name:
            module.register_forward_pre_hook(pre_hook)


def _record_routers(model, config) -> list:
    """Hooks that append each router's selection scores to the returned list as the forward runs: the
    router modules and the output that holds their logits as transformers' own output recording names them
    (``_can_record_outputs["router_logits"]``); the scores are the logits (softmax keeps their order), or
    sigmoid(logits) + the router's ``e_score_correction_bias`` where it has one (DeepSeek-V3's selection);
    k from the router's ``top_k``, else the config's ``num_experts_per_tok``."""
    import torch

    recorder = None
    for klass in type(model).__mro__:
        recorder = (getattr(klass, "_can_record_outputs", None) or {}).get("router_logits") or recorder
        if recorder is not None:
            break
    target = getattr(recorder, "target_class", recorder)
    index = getattr(recorder, "index", 0)
    found: list = []
    if not isinstance(target, type):
        return found

    def hook(module, args, output):
        logits = output[index] if isinstance(output, (tuple, list)) else output
        k = getattr(module, "top_k", None) or getattr(config, "num_experts_per_tok", None)
        if not torch.is_tensor(logits) or not isinstance(k, int) or logits.shape[-1] <= k:
            return
        scores = logits.detach().float().reshape(-1, logits.shape[-1])
        bias = getattr(module, "e_score_correction_bias", None)
        if torch.is_tensor(bias) and bias.numel() == scores.shape[-1]:
            scores = scores.sigmoid() + bias.detach().float()
        found.append((scores.clone(), k))

    for module in model.modules():
        if isinstance(module, target):
            module.register_forward_hook(hook)
    return found


def _near_ties(plain: list, rounded: list):
    """Per position: does some router choose between two experts (its k-th and (k+1)-th best) whose
    scores are closer than NEAR_TIE times the most the rounding moved that router's scores (any position,
    any expert)? None when no router was recorded, or the two forwards saw different routers."""
    import torch

    if not plain or len(plain) != len(rounded):
        return None
    tie = None
    for (scores, k), (moved, _k) in zip(plain, rounded):
        if scores.shape != moved.shape:
            return None
        top = scores.topk(k + 1, dim=-1).values
        margin = top[:, k - 1] - top[:, k]
        here = margin < NEAR_TIE * float((moved - scores).abs().max())
        tie = here if tie is None else tie | here
    return tie


# -- the readers -------------------------------------------------------------------------------------


@dataclass
class _Read:
    ids: list[list[int]]
    logits: object  # torch tensor [positions, vocab]


def _with_llama_cpp(path: Path, ref: _Reference, lora: Path | None = None, cancel: CancelToken | None = None):
    """The GGUF at ``path`` (with the GGUF LoRA ``lora`` applied, llama.cpp's --lora) as llama.cpp reads it, in a
    child process (llama_child): a failed assert in llama.cpp aborts that process, not tui-merger."""
    import torch

    from tui_merger.core.ship.llama_child import LlamaStopped, run

    name = f"llama.cpp (llama-cpp-python {llama_cpp_version()})"
    task = {"kind": "text", "model": str(path), "lora": str(lora) if lora else None, "n_ctx": max(256, len(ref.prompt) + 8),
            "threads": max(1, min(4, os.cpu_count() or 1)), "texts": list(ref.texts), "special": list(ref.special),
            "prompt": [int(i) for i in ref.prompt]}
    try:
        out, arrays = run(task, cancel=cancel)  # a Stop ends the child: MergeCancelled
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


# llama.cpp versions whose qwen2vl graph runs its RMS norms with epsilon 0: their loader
# (src/models/qwen2vl.cpp, load_arch_hparams) reads the M-RoPE sections only, never
# attention.layer_norm_rms_epsilon, which the file holds as the converter writes it (the qwen2 loader reads it)
_QWEN2VL_WITHOUT_EPS = {"0.3.36"}


def _llama_cpp_quirk(path: Path) -> tuple[dict, str] | None:
    """Where the installed llama.cpp computes a file's architecture otherwise than the file says, by a known
    fault of its own: the reference's config values that do as it does, and the sentence that says so."""
    import gguf

    if llama_cpp_version() not in _QWEN2VL_WITHOUT_EPS:
        return None
    try:
        field = gguf.GGUFReader(path).fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode() if field is not None and field.data else None
    except Exception:  # noqa: BLE001 - an unreadable file: its loading says what
        return None
    if arch != "qwen2vl":
        return None
    return ({"rms_norm_eps": 0.0}, "reference run with the norms' epsilon 0, as this llama.cpp's qwen2vl runs them "
            "(it does not read the file's attention.layer_norm_rms_epsilon)")


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
    bits = QUANT_BITS.get(type_)
    factor, median_factor = (OWN_FACTOR, OWN_FACTOR) if bits is None else (
        QUANT_FACTOR, QUANT_MEDIAN_FACTOR.get(type_, QUANT_MEDIAN_FACTOR_K))
    own_median = None
    if ref.rounded is not None and tuple(ref.rounded.shape) == tuple(want.shape):
        own_position = (ref.rounded - want).abs().max(-1).values / scale  # the model's own rounding, as measured
        own_median = float(own_position.median())
        own = own_median if experts > 1 else float(own_position.max())
        if experts > 1:
            factor = median_factor
        limit = max(floor, factor * own)
        median_limit = max(floor, median_factor * own_median)
        if experts > 1 and bits is None:  # where the type's rounding itself turns an expert choice, the file is
            # held to the reference rounded the same way: both must have turned it (and agree there). Not for a
            # quantized type: the checker's rounding is not the file's, it turns other choices.
            where = own_position > limit
            turned = int(where.sum())
            want = torch.where(where[:, None], ref.rounded, want)
    per_position = (have - want).abs().max(-1).values / scale
    rel = float(per_position.max())
    median = float(per_position.median())
    positions = len(ref.prompt)
    near = torch.zeros(positions, dtype=torch.bool)
    if experts > 1 and ref.near_tie is not None and tuple(ref.near_tie.shape) == (positions,):
        near = ref.near_tie
    if bits is None:
        limit_words = (f"limit {limit:.2g} from this model's own {type_} rounding, {OWN_FACTOR} x {own:.2g}" if limit > floor
                       else f"limit {limit:g} for {type_}" + (f"; its own {type_} rounding moves them {own:.2g}" if own is not None else ""))
    else:
        limit_words = (f"limit {limit:.2g}: {factor:g} x this model's own movement under {bits}-bit rounding ({own:.2g})"
                       if limit > floor else f"limit {limit:g} for {type_}" +
                       (f"; {bits}-bit rounding moves this model {own:.2g}" if own is not None else ""))
    top_want, top_have = want.argmax(-1), have.argmax(-1)
    margin = (want.max(-1).values - want.gather(-1, top_have[:, None])[:, 0]) / scale  # the reference's own gap
    within = per_position <= limit
    compared = within if experts > 1 else torch.ones_like(within)  # MoE: where no expert choice turned
    top_equal = int((top_want == top_have).sum())
    near_ties = int(((top_want != top_have) & (margin <= limit) & compared).sum())
    unexplained = int(((top_want != top_have) & (margin > limit) & compared).sum())
    rerouted = int(((top_want != top_have) & ~compared).sum())
    details = {
        "texts": len(ref.texts), "ids_equal": sum(same), "logits_rel": float(f"{rel:.3g}"),
        "logits_rel_median": float(f"{median:.3g}"), "limit": float(f"{limit:.3g}"), "limit_floor": floor,
        "own_rounding_rel": None if own is None else float(f"{own:.3g}"), "experts": experts,
        "top_equal": top_equal, "top_near_ties": near_ties, "top_rerouted": rerouted, "positions": positions,
    }
    if bits is not None and own is not None:
        details["own_rounding"] = f"{bits}-bit blocks of {QUANT_BLOCK}"
    if experts > 1:
        over = positions - int(within.sum())
        tied = int(near.sum())
        judged = per_position[~near]
        rest = float(judged.max()) if judged.numel() else 0.0
        logits_ok = median <= limit and rest <= MOE_CEILING * limit
        excused = rel > MOE_CEILING * limit and logits_ok  # only a near tie's position is past the ceiling
        if excused:  # then the file must be as close as the rounding alone makes it, at the median, not the floor:
            # a wrong expert that turns a near-tied router elsewhere moves the median too (Mixtral bf16, an
            # expert's w1 x1.1: 0.019 at the median, under the floor 0.02, 7.6x the model's own)
            excuse = median_factor if bits is not None else NEAR_TIE_MEDIAN
            logits_ok = own_median is not None and median <= excuse * own_median
        logit_words = (f"prompt logits within {median:.2g} of transformers' at the median position and {rel:.2g} at "
                       f"most ({limit_words}; {MOE_CEILING}x that at {over} position{'s' if over != 1 else ''} "
                       "where a mixture of experts may route differently)")
        details["positions_over_limit"] = over
        details["positions_turned_by_own_rounding"] = turned
        details["positions_near_tied_routers"] = tied
        if turned:
            logit_words += (f", at {turned} position{'s' if turned != 1 else ''} where this model's own {type_} rounding "
                            f"turns an expert choice compared with transformers' rounded to {type_}")
        if tied and rest < rel:  # the ceiling was not held where a router's choice is within the rounding's reach
            logit_words += (f"; {tied} position{'s' if tied != 1 else ''} where a router chooses between experts within "
                            f"{NEAR_TIE}x the rounding's move of each other, held to the median rule only"
                            + (f" ({rest:.2g} at most elsewhere)" if tied < positions else "")
                            + (f", with the median within {excuse:g}x this model's own ({own_median:.2g})"
                               if excused and own_median is not None else ""))
    else:
        logits_ok = rel <= limit and median <= median_limit
        logit_words = f"prompt logits within {rel:.2g} of transformers' ({limit_words})"
        if median_limit < limit:  # the largest position is allowed the model's largest own spread, the median its median
            logit_words += f" and {median:.2g} at the median position (limit {median_limit:.2g}" + (
                f": {median_factor:g} x its median {own_median:.2g})" if bits is not None and median_limit > floor else ")")
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
    if ok and (limit if experts > 1 else min(limit, median_limit)) >= BLIND:  # within limits no wrong tensor has to
        # cross (a dense model's median position is held to its own, smaller, limit): not a check of the logits
        details["logits_judged"] = False
        return GgufCheck(NOT_CHECKED, None, (
            f"token ids equal on {sum(same)}/{len(same)} texts, but the logits cannot judge this file: this model's own "
            f"movement under the type's rounding puts their limit at {limit:.2g} of the largest logit, so a wrong "
            f"tensor would pass as well (the file's: {rel:.2g}); read by {reader}."), details)
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

