"""Try it: the merged model answers a prompt, and beside it the model it was made from (the base, or the
base with the adapter applied by peft, unmerged), with the same greedy settings, so that what the training
changed can be read.

``plan_trial`` checks the folders and says how much memory one model takes (the sides run one after the
other, never both loaded at once); ``run_trial`` loads each side with transformers, generates with
``model.generate`` (greedy, a streamer reporting every token as a ``TrialToken``) and hands the memory
back before the next side. Every side is loaded in the merged model's dtype (config.json's; float32 when
it records none), so both answer in the same arithmetic. A model that does not fit in the available
memory runs layer by layer from its files instead (the verification's streamed model: one module's
weights in memory at a time, in float32), and the plan says so: every token then reads the whole model,
so it is slow. (accelerate's disk offload is not used: under peft it writes into the offloaded model's
own files.)

The prompt becomes tokens with the merged model's tokenizer, for every side: as one user message through
the chat template when the tokenizer has one (``add_generation_prompt=True``), as plain text otherwise.
"""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.io.system import available_memory
from tui_merger.core.events import CancelToken, EventSink, TrialFinished, TrialStarted, TrialToken, ignore_event
from tui_merger.core.io.files import has_tokenizer, json_object_or_none, read_json_object
from tui_merger.core.io.safetensors_io import FLOAT_DTYPES, SafetensorsFile, itemsize
from tui_merger.core.io.sources import find_weight_files
from tui_merger.core.options import human_bytes
from tui_merger.core.record.manifest import read_manifest

MERGED, BASE, ADAPTER = "merged model", "base model", "unmerged adapter"
ADAPTER_CONFIG = "adapter_config.json"
CONTEXT_TOKENS = 2048  # room planned for the prompt and the answer (the KV cache)
STOPPED = "Try it stopped at your request; nothing was changed."


@dataclass
class TrialSide:
    """One model that answers."""

    label: str  # MERGED, BASE or ADAPTER
    path: Path  # the model folder (the adapter folder for ADAPTER)
    base: Path | None = None  # ADAPTER: the base model folder peft applies the adapter to
    memory_bytes: int = 0  # this side loaded (weights in the trial dtype, plus the KV cache)


@dataclass
class TrialPlan:
    sides: list[TrialSide]  # [merged] or [merged, base or unmerged adapter]
    chat_template: bool  # the prompt goes in as one user message through the tokenizer's chat template
    memory_bytes: int  # the largest side loaded: the peak, since one side runs at a time
    fits: bool  # memory_bytes <= available memory (MemAvailable; unknown counts as fitting); else layer by layer
    notes: list[str]  # sentences for the user: the memory statement first
    model_dir: Path = Path()  # the merged model: tokenizer and generation settings come from here
    dtype: str = "float32"  # every side is loaded in this dtype (the merged model's)
    available_bytes: int | None = None
    rounding_note: str = ""  # the note (also in notes) that bf16 rounding may part the answers: a screen that
    # says where the answers part (``agreement``) can leave it out


@dataclass
class TrialAnswer:
    label: str
    text: str  # decoded, special tokens left out
    token_ids: list[int]  # the generated tokens (the prompt's left out)
    seconds: float  # generation, loading left out
    tokens_per_s: float
    load_seconds: float = 0.0


# -- the plan ------------------------------------------------------------------------------------


def plan_trial(model_dir: Path, against: Path | None = None, *, available: int | None = None) -> TrialPlan:
    """What will answer, in which dtype, with how much memory. ``against``: a base model folder, or a LoRA
    adapter folder (applied to the merge's base through peft, unmerged); by default the base recorded in
    the model's merge_manifest.json. ``available``: bytes of memory to plan with (default MemAvailable).
    Bad input raises MergeError with one sentence."""
    model_dir = Path(model_dir).expanduser()
    config = _model_config(model_dir, "the merged model")
    if not has_tokenizer(model_dir):
        raise MergeError(
            f"{model_dir} has no tokenizer (tokenizer.json, tokenizer_config.json or tokenizer.model), so a "
            "prompt cannot be turned into tokens; copy the tokenizer files of the model it was made from into it."
        )
    tokenizer = load_tokenizer(model_dir)
    dtype = _trial_dtype(config)
    notes: list[str] = []
    manifest = read_manifest(model_dir)
    recorded_base = _recorded(manifest, "base")
    merged = TrialSide(MERGED, model_dir)
    sides = [merged]
    if against is not None:
        against = Path(against).expanduser()
        if not against.exists():
            raise MergeError(
                f"{against} does not exist; give a base model folder or a LoRA adapter folder to compare with."
            )
        if not against.is_dir():
            raise MergeError(
                f"{against} is a file; give the base model folder or the LoRA adapter folder to compare with."
            )
        if (against / ADAPTER_CONFIG).is_file() and not (against / "config.json").is_file():
            sides.append(_adapter_side(against, recorded_base))
            if manifest is not None and _merged_several_or_weighted(manifest):
                notes.append(
                    "This model was merged from several or weighted adapters; the unmerged side applies only "
                    f"{against.name}, at weight 1, so the answers may differ for that reason."
                )
        else:
            _model_config(against, "the model to compare with")
            sides.append(TrialSide(BASE, against))
    elif recorded_base is not None:
        if not recorded_base.is_dir():
            raise MergeError(
                f"The base this model was merged from, {recorded_base}, is no longer there; "
                "say which model to compare with (--against BASE_OR_ADAPTER)."
            )
        _model_config(recorded_base, "the base model")
        sides.append(TrialSide(BASE, recorded_base))
    else:
        why = (
            "it has no merge_manifest.json naming the base it was made from"
            if manifest is None else "it was not merged into a base model folder (a checkpoint conversion)"
        )
        notes.append(
            f"Only the merged model answers: {why}; give a base model or an adapter to compare with "
            "(--against BASE_OR_ADAPTER)."
        )
    rounding = ""
    if len(sides) > 1 and sides[1].label == ADAPTER and dtype in ("bfloat16", "float16"):
        rounding = (
            f"In {dtype} the merged weights are rounded, so a long answer may part from the unmerged one where "
            "the model hesitates between two tokens; that is rounding, not a bad merge."
        )
        notes.append(rounding)
    for side in sides:
        side.memory_bytes = _side_memory(side, dtype)
        note = _quantized_note(side, dtype)
        if note:
            notes.append(note)
    memory = max(s.memory_bytes for s in sides)
    if available is None:
        available = available_memory()
    fits = available is None or memory <= available
    one_at_a_time = " (one model at a time)" if len(sides) > 1 else ""
    if available is None:
        statement = f"Needs about {human_bytes(memory)} of memory{one_at_a_time}, in {dtype}; the available memory is unknown."
    else:
        statement = (
            f"Needs about {human_bytes(memory)} of memory{one_at_a_time}, in {dtype}; "
            f"{human_bytes(available)} is available."
        )
    notes.insert(0, statement)
    if not fits:
        notes.insert(1, _does_not_fit(memory, available))
    return TrialPlan(
        sides=sides,
        chat_template=bool(getattr(tokenizer, "chat_template", None)),
        memory_bytes=memory,
        fits=fits,
        notes=notes,
        model_dir=model_dir,
        dtype=dtype,
        available_bytes=available,
        rounding_note=rounding,
    )


def _does_not_fit(memory: int, available: int) -> str:
    return (
        f"It does not fit: {human_bytes(memory)} is more than the {human_bytes(available)} available, so each "
        "model runs layer by layer from its files, in float32: every token reads the whole model, which is "
        "slow (seconds to minutes per token for billions of weights); free memory for a faster answer."
    )


def _model_config(folder: Path, what: str) -> dict:
    """config.json of a model folder that transformers can load and generate with."""
    if not folder.exists():
        raise MergeError(f"{folder} does not exist; check the path of {what}.")
    if not folder.is_dir():
        raise MergeError(f"{folder} is a file; give the folder of {what} that holds it ({folder.parent}).")
    if (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file():
        raise MergeError(
            f"{folder} is a LoRA adapter, not a model; try the model merged from it (the adapter can be what "
            "it is compared with)."
        )
    if not (folder / "config.json").is_file():
        raise MergeError(f"{folder} has no config.json, so it is not a Hugging Face model folder.")
    config = read_json_object(folder / "config.json", "copy it again from the original model")
    if not find_weight_files(folder):
        raise MergeError(f"{folder} has no model weights (*.safetensors or pytorch_model.bin).")
    generator_class(config, folder)
    return config


def generator_class(config: dict, folder: Path):
    """The transformers class named by the config, when it is one that generates text."""
    from tui_merger.core.formats.hf_names import model_class

    archs = config.get("architectures") or [str(config.get("model_type"))]
    cls = model_class(config)
    if cls is None:
        raise MergeError(
            f"{folder} is a {archs[0]}, which is not a transformers class (custom code), and tui-merger never "
            "runs model code; try it with transformers directly."
        )
    if not (hasattr(cls, "can_generate") and cls.can_generate()):
        raise MergeError(f"{folder} is a {cls.__name__}, which does not generate text, so it cannot answer a prompt.")
    return cls


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    with quiet_libraries():
        try:
            return AutoTokenizer.from_pretrained(folder)
        except Exception as err:  # noqa: BLE001 - a damaged tokenizer can make transformers raise anything
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise MergeError(f"The tokenizer in {folder} does not load ({first[:200]}).") from None


def _trial_dtype(config: dict) -> str:
    from tui_merger.core.io.files import config_dtype

    dtype = config_dtype(config)
    return dtype if dtype in FLOAT_DTYPES else "float32"


def _recorded(manifest: dict | None, role: str) -> Path | None:
    if manifest is None:
        return None
    for item in manifest.get("inputs", []):
        if isinstance(item, dict) and item.get("role") == role and isinstance(item.get("path"), str):
            return Path(item["path"])
    return None


def _merged_several_or_weighted(manifest: dict) -> bool:
    adapters = (manifest.get("options") or {}).get("adapters") or []
    roles = [i.get("role") for i in manifest.get("inputs", []) if isinstance(i, dict)]
    weights = [a[1] for a in adapters if isinstance(a, list) and len(a) == 2]
    return roles.count("adapter") > 1 or any(w != 1 for w in weights)


def _adapter_side(adapter: Path, recorded_base: Path | None) -> TrialSide:
    """The adapter applied, unmerged, to the merge's base (the manifest's), else to the base its
    adapter_config.json names."""
    cfg = read_json_object(adapter / ADAPTER_CONFIG, "re-save the adapter")
    if recorded_base is not None and recorded_base.is_dir():
        base = recorded_base
    else:
        named = cfg.get("base_model_name_or_path")
        base = Path(named).expanduser() if isinstance(named, str) and named else None
        if base is None or not base.is_dir():
            raise MergeError(
                f"The adapter in {adapter} names its base as {named!r}, which is not a folder here; try the "
                "model merged from it, whose merge_manifest.json says which base it was merged into."
            )
    _model_config(base, "the adapter's base model")
    if not any((adapter / name).is_file() for name in ("adapter_model.safetensors", "adapter_model.bin")):
        raise MergeError(f"{adapter} has no adapter_model.safetensors, so there is no adapter to apply.")
    return TrialSide(ADAPTER, adapter, base=base)


def _weights_bytes(folder: Path, files: list[str], dtype: str, float_size: int | None = None) -> int:
    """Bytes of these weight files loaded with floating-point tensors in ``dtype`` (``float_size``:
    bytes per floating-point element instead)."""
    size = float_size or itemsize(dtype)
    total = 0
    for name in files:
        path = folder / name
        if name.endswith(".safetensors"):
            for info in SafetensorsFile(path).tensors.values():
                numel = 1
                for d in info.shape:
                    numel *= d
                if info.dtype in FLOAT_DTYPES or info.dtype.startswith("float8"):  # FP8 runs dequantized
                    total += numel * size
                elif _is_mxfp4_blocks(info, numel):  # two 4-bit values a byte, run dequantized
                    total += 2 * numel * size
                else:
                    total += numel * itemsize(info.dtype)
        else:
            try:
                total += path.stat().st_size
            except OSError:
                pass
    return total


def _is_mxfp4_blocks(info, numel: int) -> bool:
    """MXFP4 values (GPT-OSS's ``*_blocks``: uint8, 16 bytes a group of 32)."""
    return info.dtype == "uint8" and len(info.shape) == 4 and info.shape[-1] == 16 and numel > 0


def _quantized_note(side: TrialSide, dtype: str) -> str | None:
    """What Try it says of a side stored quantized (an FP8 release, an output kept in FP8): it runs
    dequantized, as transformers' dequantizing load gives it, so it needs the 16-bit size."""
    from tui_merger.core.formats.dequant import scheme_of

    folder = side.base if side.label == ADAPTER else side.path
    try:
        scheme = scheme_of(json_object_or_none(folder / "config.json"))
    except MergeError:
        return None
    if scheme is None:
        return None
    return (f"The {side.label} is stored as {scheme.label}; it runs dequantized to {dtype}, as transformers' "
            f"{scheme.loader} loads it, so it needs the {dtype} size in memory, not its size on disk.")


def _kv_cache_bytes(config: dict, dtype: str) -> int:
    cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    try:
        layers = int(cfg.get("num_hidden_layers") or 0)
        heads = int(cfg.get("num_attention_heads") or 0)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // max(heads, 1)))
    except (TypeError, ValueError):
        return 0
    return 2 * layers * kv_heads * head_dim * CONTEXT_TOKENS * itemsize(dtype)


def _side_memory(side: TrialSide, dtype: str) -> int:
    folder = side.base if side.label == ADAPTER else side.path
    config = json_object_or_none(folder / "config.json") or {}
    total = _weights_bytes(folder, find_weight_files(folder), dtype) + _kv_cache_bytes(config, dtype)
    if side.label == ADAPTER:
        files = [n for n in ("adapter_model.safetensors", "adapter_model.bin") if (side.path / n).is_file()][:1]
        total += _weights_bytes(side.path, files, dtype, float_size=4)  # peft keeps 16-bit adapters in float32
    return total + total // 10  # what loading and running add (buffers, activations)


# -- the run -------------------------------------------------------------------------------------


def agreement(answers: list[TrialAnswer]) -> str | None:
    """Where the two answers part, token by token, and why, in one sentence (None: one side only). Random
    or small models answer in characters a person cannot compare by eye (the demo's do)."""
    if len(answers) < 2:
        return None
    ours, other = answers[0].token_ids, answers[1].token_ids
    same = next((i for i, (a, b) in enumerate(zip(ours, other)) if a != b), min(len(ours), len(other)))
    if same == len(ours) == len(other):
        return f"The two answers are the same, token for token ({same} tokens)."
    if answers[1].label == ADAPTER:
        why = "where the model hesitates between two tokens, rounding decides (not a bad merge)"
    else:
        why = f"the adapter changed what the {BASE} says (that is the training)"
    if not same:
        return f"The two answers differ from the first token: {why}."
    return f"The two answers are the same for {same} token{'s' * (same != 1)}, then part: {why}."


def run_trial(
    plan: TrialPlan,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> list[TrialAnswer]:
    """Each side answers ``prompt`` in turn (greedy, the merged model's generation settings), reporting
    ``TrialStarted``, a ``TrialToken`` per token and ``TrialFinished``. ``cancel`` is checked between
    tokens: a cancelled trial raises MergeCancelled."""
    if not prompt or not prompt.strip():
        raise MergeError("The prompt is empty; type what the models should answer.")
    if max_new_tokens < 1:
        raise MergeError(f"max_new_tokens must be at least 1, not {max_new_tokens}.")
    _check(cancel)
    import torch

    with quiet_libraries():
        tokenizer = load_tokenizer(plan.model_dir)
        inputs = encode_prompt(tokenizer, prompt, plan.chat_template)
        if inputs["input_ids"].shape[-1] == 0:  # generate() would fail on it deep in the model's attention
            raise MergeError(
                f"The tokenizer of {plan.model_dir} turns this prompt into no tokens (none of its characters are "
                "in its vocabulary, and it has no chat template to add any); type a prompt in the language and "
                "script the model was trained on."
            )
        settings = generation_settings(plan.model_dir, tokenizer, max_new_tokens)
        answers = []
        for side in plan.sides:
            _check(cancel)
            where = f"{side.path} on {side.base}" if side.base is not None else str(side.path)
            how = plan.dtype if plan.fits else "layer by layer from its files, float32"
            on_event(TrialStarted(side.label, f"Loading the {side.label} from {where} ({how}) ..."))
            started = time.monotonic()
            model, close = _load(side, getattr(torch, plan.dtype)) if plan.fits else _streamed(side)
            load_seconds = time.monotonic() - started
            try:
                _check(cancel)
                answers.append(_generate(model, tokenizer, side.label, inputs, settings, on_event, cancel, load_seconds))
            finally:
                close()
                del model
                gc.collect()
    return answers


def encode_prompt(tokenizer, prompt: str, chat_template: bool) -> dict:
    """input_ids and attention_mask of one prompt: one user message through the chat template, or the
    text as it is."""
    if chat_template:
        messages = [{"role": "user", "content": prompt}]
        encoded = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def generation_settings(model_dir: Path, tokenizer, max_new_tokens: int):
    """The merged model's generation config, greedy: used for every side."""
    from transformers import AutoConfig, GenerationConfig

    if (model_dir / "generation_config.json").is_file():
        try:
            settings = GenerationConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as err:
            raise MergeError(f"{model_dir / 'generation_config.json'} does not load ({err}).") from None
    else:
        settings = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_dir))
    settings.do_sample = False
    settings.num_beams = 1
    settings.max_new_tokens = max_new_tokens
    for key in ("temperature", "top_p", "top_k", "min_p", "typical_p"):  # sampling only: unset, no warnings
        if hasattr(settings, key):
            setattr(settings, key, None)
    if settings.pad_token_id is None:
        settings.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else settings.eos_token_id
    return settings


def _load(side: TrialSide, dtype):
    folder = side.base if side.label == ADAPTER else side.path
    config = read_json_object(folder / "config.json", "copy it again from the original model")
    cls = generator_class(config, folder)
    try:
        model = cls.from_pretrained(folder, dtype=dtype)
    except MergeError:
        raise
    except Exception as err:  # noqa: BLE001 - damaged or mismatched weights: one sentence, not a traceback
        raise MergeError(f"The {side.label} in {folder} does not load ({_first_line(err)}).") from None
    if side.label == ADAPTER:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, side.path)
        except Exception as err:  # noqa: BLE001
            raise MergeError(
                f"peft could not apply the adapter in {side.path} to {folder} ({_first_line(err)})."
            ) from None
    model.eval()
    return model, lambda: None


def _dequantized_source(source, folder: Path):
    """A folder stored quantized (FP8 blocks, compressed-tensors FP8, MXFP4) read as transformers'
    dequantizing load reads it; a plain one as it is."""
    from tui_merger.core.formats.dequant import DequantSource, scheme_of

    config = json_object_or_none(folder / "config.json") or {}
    scheme = scheme_of(config)
    if scheme is None:
        return source
    view = DequantSource(source, scheme, config)
    view.close = source.close
    return view


def _streamed(side: TrialSide):
    """(model, close) of a side that does not fit: built on the meta device, each module's weights read
    from the files when it runs (``verify/streaming.py``), the adapter applied by peft unmerged."""
    import torch
    from transformers import AutoConfig

    from tui_merger.core.io.sources import open_model
    from tui_merger.core.verify import behaviour as bh

    folder = side.base if side.label == ADAPTER else side.path
    cls = generator_class(read_json_object(folder / "config.json", "copy it again from the original model"), folder)
    source = _dequantized_source(open_model(folder), folder)
    try:
        config = AutoConfig.from_pretrained(folder)
        if side.label == ADAPTER:
            streamer, missing = bh.streamer_with_adapter(cls, config, source.tensors, [(side.path, None)], side.label)
        else:
            streamer, missing = bh.streamer_for_files(cls, config, source.tensors, side.label)
    except (MergeError, bh.NoReference) as err:
        source.close()
        raise MergeError(f"The {side.label} in {folder} cannot run layer by layer ({err}).") from None
    if missing:
        source.close()
        raise MergeError(f"The {side.label} in {folder} lacks {len(missing)} weight(s) ({', '.join(missing[:3])}).")
    model = streamer.model
    # its weights live on the meta device between layers; generate() asks the model where to put its tensors
    model.__class__ = type(type(model).__name__, (type(model),), {"device": property(lambda self: torch.device("cpu"))})

    def close() -> None:
        streamer.close()
        source.close()

    return model, close


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def _generate(model, tokenizer, label, inputs, settings, on_event, cancel, load_seconds) -> TrialAnswer:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList
    from transformers.generation.streamers import BaseStreamer

    class Stream(BaseStreamer):
        """Every new token: the answer so far, decoded, as a TrialToken (the prompt, put first, is skipped)."""

        def __init__(self) -> None:
            self.ids: list[int] = []
            self.text = ""
            self.prompt_seen = False

        def put(self, value) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            if cancel is not None and cancel.cancelled:  # a token made before generate saw the stop
                return
            self.ids.extend(int(i) for i in value.reshape(-1).tolist())
            text = tokenizer.decode(self.ids, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # half of a character's bytes: wait for the rest
                self.text = text
            elapsed = max(time.monotonic() - started, 1e-9)
            on_event(TrialToken(label, self.text, len(self.ids), len(self.ids) / elapsed))

        def end(self) -> None:
            pass

    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stop = cancel is not None and cancel.cancelled
            return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

    stream = Stream()
    started = time.monotonic()
    try:
        with torch.inference_mode():
            output = model.generate(
                **inputs, generation_config=settings, streamer=stream, stopping_criteria=StoppingCriteriaList([Cancelled()])
            )
    except (IndexError, RuntimeError, ValueError) as err:  # e.g. a prompt token beyond this model's vocabulary
        raise MergeError(f"The {label} could not answer ({_first_line(err)}).") from None
    seconds = time.monotonic() - started
    _check(cancel)
    ids = output[0, inputs["input_ids"].shape[1]:].tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    rate = len(ids) / max(seconds, 1e-9)
    on_event(TrialFinished(label, text, tuple(ids), seconds, rate))
    return TrialAnswer(label, text, ids, seconds, rate, load_seconds)


def _check(cancel: CancelToken | None) -> None:
    if cancel is not None and cancel.cancelled:
        raise MergeCancelled(STOPPED)


@contextmanager
def quiet_libraries():
    """transformers' loading bars and log lines, and the libraries' deprecation warnings, kept off the
    terminal (the front ends say what happens); the settings are restored after."""
    import warnings

    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    bars = logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
