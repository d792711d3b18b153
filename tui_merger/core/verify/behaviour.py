"""The behaviour check: the merged model and its unmerged reference run on the same probe tokens,
one module's weights in memory at a time (``streaming``), and their hidden states are compared
after every layer, then their logits.

The reference is the base (as the merge read it: a Hugging Face folder, a checkpoint's reassembled
weights, a --qlora-base round trip) with the adapter applied by peft, unmerged. Both run in fp32, so
the only difference a correct merge leaves is the rounding of the weights the merge changed into the
output dtype. From that the limits follow (see ``limit``): each such weight is off by at most one
unit roundoff u of the output dtype, relatively; a matrix product with them is off by about u; n
independent roundings add up in quadrature, to about u * sqrt(n) after a depth that holds n rounded
tensors. The limit is SAFETY times that, so that rounding alone stays far below it; a fault (an
adapter not applied, a wrong base, a name transformers does not load) moves hidden states by the
adapter's whole effect and is named by the first layer where it shows.
"""

from __future__ import annotations

import math
import re
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

from tui_merger.core.events import TensorProgress

# float8_e4m3fn: 3 mantissa bits (the changed weights of an output written as FP8 blocks); mxfp4: e2m1's
# 1 mantissa bit (the changed experts of an output kept in MXFP4). For MXFP4 that bounds the error
# norm-wise, not per value: values under a quarter of their group's scale round to 0, but a group's
# error is about 10-15% of its norm for bell-shaped or heavy-tailed weights (0.115 Gaussian, 0.132
# Laplace, 0.151 Student-t(3), measured), below 2**-2. At that rounding the behaviour check only catches
# gross faults (a scale off by 16x); the recompute check compares the blocks and scales bit for bit
UNIT_ROUNDOFF = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11, "float8_e4m3fn": 2.0**-4,
                 "mxfp4": 2.0**-2}
# fp32 compute itself: the unmerged model sums base and adapter products in another order; a dot
# product of k terms rounds by up to about sqrt(k) units, k a few thousand
COMPUTE_ROUNDOFF = 2.0**-24 * 64
SAFETY = 8.0
_LAYER = re.compile(r"\.(\d+)\.")


# the verification's cost on one core of this project's 2-core benchmark machine (3B shapes)
RECOMPUTE_S_PER_VALUE = 2.2e-9  # every value read twice (input, output) and recomputed in cache-sized blocks
PASS_S_PER_VALUE = 1.1e-9  # one streamed pass: each weight block upcast in cache, 12 probe tokens
DORA_S_PER_VALUE = 6.5e-9  # the reference's DoRA layers (peft's forward: W + s * B @ A and its norm, whole)
BASE_MEMORY = 520 << 20  # python, torch, transformers and peft imported


def estimate(tplan, passes: int, adapter) -> tuple[float, int]:
    """(seconds, bytes of memory) the default verification of ``tplan`` takes, about: the recompute
    and the passes share two threads (parallel.py)."""
    values = sum(math.prod(t.shape) for t in tplan.tensors)
    changed = sum(math.prod(t.shape) for t in tplan.tensors if not t.raw_copy)
    seconds = 2.0 + (changed * RECOMPUTE_S_PER_VALUE + passes * values * PASS_S_PER_VALUE) / 2
    if passes > 1:  # a reference runs (3B, DoRA on all linear kinds: 29-32 s against 12 s for plain LoRA)
        seconds += DORA_S_PER_VALUE * sum(math.prod(t.shape) for t in tplan.tensors if _dora(t))
    from tui_merger.core.verify.streaming import BIG_VALUES, BLOCK_VALUES

    unit = max([math.prod(t.shape) for t in tplan.tensors if math.prod(t.shape) < BIG_VALUES] + [BLOCK_VALUES])
    held = sum(r.nbytes for m in adapter.lora.values() for r in (m.A, m.B, m.emb_A, m.emb_B, m.magnitude) if r is not None)
    held += sum(r.nbytes for r in adapter.replacements.values())
    return round(seconds, 1), max(BASE_MEMORY + 3 * unit * 4 + 2 * held, whole_unit_bytes(tplan)[1])


def whole_unit_bytes(tplan) -> tuple[str | None, int]:
    """(name, bytes) of the largest weight the behaviour check holds whole, with what that takes: the
    forward runs Linear and embedding weights a block of rows at a time, but a module of another kind
    (experts packed in one tensor: GPT-OSS's ``gate_up_proj``, 2.1G values at GPT-OSS-120B's widths)
    takes its parameter whole, in fp32, in the merged model and in the reference (there with peft's
    delta beside it) at once: four fp32 copies, measured 3.8 at GPT-OSS-20B's widths."""
    name, values = None, 0
    for t in tplan.tensors:
        n = math.prod(t.shape)
        if len(t.shape) >= 3 and n > values:
            name, values = t.name, n
    return name, BASE_MEMORY + 4 * 4 * values if name is not None else 0


def _dora(t) -> bool:
    from tui_merger.core.plan.plan import LoraOp

    return any(isinstance(op, LoraOp) and op.magnitude is not None for op in t.ops)


class NoReference(Exception):
    """A model cannot be built for the check; the message says which and why."""


def limit(stored: str, rounded: int) -> float:
    """Largest relative difference rounding explains after ``rounded`` tensors rounded to ``stored``."""
    u = max(UNIT_ROUNDOFF.get(stored, UNIT_ROUNDOFF["float32"]), COMPUTE_ROUNDOFF)
    return SAFETY * u * math.sqrt(max(rounded, 1))


def rounded_by_depth(plan, n_states: int) -> list[int]:
    """For each hidden state (0: the embeddings' output, i: after layer i-1), how many tensors
    rounded by the merge lie before it. Tensors outside the numbered layers count everywhere."""
    per_layer: dict[int, int] = {}
    outside = 0
    for t in plan.tensors:
        if t.raw_copy and not getattr(t.source.source, "computes", False):
            continue
        m = _LAYER.search(t.name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + 1
        else:
            outside += 1
    counts, acc = [], 0
    for i in range(n_states):
        if i > 0:
            acc += per_layer.get(i - 1, 0)
        counts.append(acc + outside)
    return counts


@contextmanager
def adapters_stay_on_cpu():
    """peft moves adapter weights to the device of the layer they wrap; here that is the meta device
    (no weights), so they are kept where peft loaded them while the reference is built."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    original = BaseTunerLayer._move_adapter_to_device_of_base_layer
    BaseTunerLayer._move_adapter_to_device_of_base_layer = lambda self, *a, **k: None
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = original


def quiet():
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def streamer_for_files(cls, config, tensors: dict, what: str, on_event=None, cancel=None):
    """A streamed model of ``cls`` whose weights are the file tensors ``tensors`` (on-disk names).
    Returns (streamer, names transformers would start random)."""
    from tui_merger.core.formats.hf_names import meta_model
    from tui_merger.core.verify.streaming import Streamer, weights_from_files

    model = meta_model(cls, config)  # (built under hf_names.BUILD_LOCK)
    weights, missing, _ = weights_from_files(model, tensors)
    _check_shapes(model, weights, what)
    return Streamer(model, weights, on_unit=_progress(on_event, what), cancel=cancel), missing


def streamer_with_adapter(cls, config, tensors: dict, adapters: list, what: str, on_event=None, cancel=None):
    """The model of ``cls`` from file tensors, with peft adapters applied unmerged.

    ``adapters``: [(folder, weight)]; one adapter is loaded as peft loads it, several are combined
    with peft's add_weighted_adapter ("cat": concatenated ranks, exact). The adapter weights peft
    loads stay in memory (small); the base weights stream from the files."""
    from tui_merger.core.formats.hf_names import BUILD_LOCK

    with BUILD_LOCK:  # peft builds its layers while the base's modules are patched elsewhere otherwise
        streamer, missing = _streamer_with_adapter(cls, config, tensors, adapters, what, on_event, cancel)
    _dora_lora_weight_as_product(streamer.model)
    return streamer, missing


def _dora_lora_weight_as_product(model) -> None:
    """peft's DoRA forward gets B @ A by running lora_A and lora_B over an identity matrix as wide as
    the layer's input (``get_lora_weight``, a workaround for FSDP-sharded weights): a 3B model's
    down_proj made a 11008 x 11008 fp32 identity (484 MB; 3.3 GB at 70B) and 4 GFLOP of products
    with it, per layer. Here nothing is sharded, so each DoRA layer of the reference computes
    ``lora_B.weight @ lora_A.weight``: the same products (multiplying by the identity is exact),
    summed in BLAS's order. Layers whose lora_B has a bias (which the identity run adds to every
    row) keep peft's way."""
    import types

    try:
        from peft.tuners.lora.dora import DoraLinearLayer
    except ImportError:  # pragma: no cover - a peft without DoRA
        return
    for module in model.modules():
        if type(module) is DoraLinearLayer and not module.fan_in_fan_out:
            module.get_lora_weight = types.MethodType(_lora_weight_as_product, module)


def _lora_weight_as_product(self, lora_A, lora_B, adapter_name=None):
    """A DoRA layer's ``get_lora_weight``: B @ A where lora_A and lora_B are bias-free Linear layers,
    else peft's own."""
    import torch
    from peft.tuners.lora.dora import DoraLinearLayer

    if all(type(m) is torch.nn.Linear and m.bias is None for m in (lora_A, lora_B)):
        return lora_B.weight @ lora_A.weight
    return DoraLinearLayer.get_lora_weight(self, lora_A=lora_A, lora_B=lora_B, adapter_name=adapter_name)


# adapter weights kept in the dtype they were saved in (peft would upcast 16-bit ones to fp32: twice
# the memory, the same values); each is upcast when its layer runs
_AS_SAVED = {"low_cpu_mem_usage": True, "autocast_adapter_dtype": False}


def _streamer_with_adapter(cls, config, tensors: dict, adapters: list, what: str, on_event=None, cancel=None):
    from peft import PeftModel

    from tui_merger.core.formats.hf_names import meta_model
    from tui_merger.core.verify.streaming import Streamer, Weight, weights_from_files

    if len(adapters) == 1 and adapters[0][1] is None:
        lazy = _lazy_adapter(cls, config, tensors, Path(adapters[0][0]), what, on_event, cancel)
        if lazy is not None:
            return lazy
    base = meta_model(cls, config)
    base_weights, _, _ = weights_from_files(base, tensors)
    first_name = {}
    for name, p in base.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(p), name)
    with adapters_stay_on_cpu():
        try:
            if len(adapters) == 1 and adapters[0][1] is None:
                model = PeftModel.from_pretrained(base, adapters[0][0], **_AS_SAVED)
            else:
                names, weights = [], []
                for index, (folder, weight) in enumerate(adapters):
                    name = f"a{index}"
                    if index == 0:
                        model = PeftModel.from_pretrained(base, folder, adapter_name=name, **_AS_SAVED)
                    else:
                        model.load_adapter(folder, adapter_name=name, **_AS_SAVED)
                    names.append(name)
                    weights.append(weight)
                model.add_weighted_adapter(names, weights, "weighted", combination_type="cat")
                model.set_adapter("weighted")
        except Exception as err:  # peft's own refusals: say them, skip the check
            raise NoReference(f"peft cannot apply the adapter to the {what} ({first_line(err)})") from None
    model.eval()
    weights = {}
    missing = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type != "meta":
            weights[name] = Weight(tuple(p.shape), held=p.detach())
            continue
        source = base_weights.get(first_name.get(id(p), ""))
        if source is None:
            missing.append(name)
        else:
            weights[name] = source
    if missing and len(adapters) == 1 and adapters[0][1] is None:
        missing = _adapter_file_weights(model, Path(adapters[0][0]), missing, weights)
    _check_shapes(model, weights, what)
    return Streamer(model, weights, on_unit=_progress(on_event, what), cancel=cancel), missing


def _lazy_adapter(cls, config, tensors: dict, folder: Path, what: str, on_event=None, cancel=None):
    """One plain adapter: peft builds its layers on the meta device (``get_peft_model`` with
    ``low_cpu_mem_usage``) and each adapter weight streams from the adapter file under the name peft
    saved it with, like the base's; memory holds no adapter weight (a 7B r=64 adapter is 300 MB), but
    per-expert pairs of experts transformers 5 keeps packed, held as peft converts them (``_peft_conversion``).
    None when an adapter tensor has no such counterpart (DoRA's magnitudes, embeddings,
    modules_to_save, ...): then peft loads the adapter as usual."""
    from peft import PeftConfig, get_peft_model

    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.hf_names import meta_model
    from tui_merger.core.io.sources import TensorSource
    from tui_merger.core.verify.streaming import Streamer, Weight, weights_from_files

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        return None
    try:
        source = TensorSource(folder, [path.name])
    except MergeError:
        return None
    if not all(_PLAIN_LORA.search(key) for key in source.tensors):
        source.close()  # other saved tensors (modules_to_save, embeddings, magnitudes) are peft's to load
        return None
    try:
        peft_config = PeftConfig.from_pretrained(str(folder))
        peft_config.inference_mode = True
        base = meta_model(cls, config)
        base_weights, _, _ = weights_from_files(base, tensors)
        first_name = {}
        for name, p in base.named_parameters(remove_duplicate=False):
            first_name.setdefault(id(p), name)
        model = get_peft_model(base, peft_config, low_cpu_mem_usage=True)
    except Exception:  # noqa: BLE001 - peft's refusals are said by the usual path
        source.close()
        return None
    model.eval()
    weights = {}
    converted = None  # peft's conversion of the file's LoRA tensors, made when a name is not in the file
    for name, p in model.named_parameters(remove_duplicate=False):
        base_source = base_weights.get(first_name.get(id(p), ""))
        if base_source is not None:
            weights[name] = base_source
            continue
        key = name.replace(".default.", ".", 1) if ".default." in name else None
        ref = source.tensors.get(key) if key else None
        if ref is None and key and p.device.type == "meta":  # saved one pair per expert: as peft converts it
            if converted is None:  # only the file's tensors peft has no weight of that name for
                names = {n.replace(".default.", ".", 1) for n, _ in model.named_parameters(remove_duplicate=False)}
                converted = _peft_conversion(model, {k: r.load() for k, r in source.tensors.items() if k not in names})
            held = converted.get(key)
            if held is not None and tuple(held.shape) == tuple(p.shape):
                weights[name] = Weight(tuple(p.shape), held=held)
                continue
        if ref is None or tuple(ref.shape) != tuple(p.shape) or p.device.type != "meta":
            source.close()
            return None
        weights[name] = Weight(tuple(p.shape), ref=ref, nbytes=ref.nbytes)
    try:
        _check_shapes(model, weights, what)
    except NoReference:
        source.close()
        return None  # said by the usual path
    streamer = Streamer(model, weights, on_unit=_progress(on_event, what), cancel=cancel)
    streamer.sources.append(source)
    return streamer, []


_PLAIN_LORA = re.compile(r"\.lora_[AB]\.weight$")


def _adapter_file_weights(model, folder: Path, missing: list[str], weights: dict) -> list[str]:
    """LoRA weights peft left on the meta device (its parameter LoRA, target_parameters, on a meta
    base): read from the adapter file itself, under the name peft saved them with."""
    import torch
    from safetensors import safe_open

    from tui_merger.core.verify.streaming import Weight

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        return missing
    params = dict(model.named_parameters(remove_duplicate=False))
    still = []
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
        for name in missing:
            key = name.replace(".default.", ".", 1)
            if ".lora_" in name and key in keys and tuple(f.get_slice(key).get_shape()) == tuple(params[name].shape):
                weights[name] = Weight(tuple(params[name].shape), held=f.get_tensor(key).to(torch.float32))
            else:
                still.append(name)
        if still and any(".lora_" in name for name in still):
            still = _converted_by_peft(model, f, keys, still, params, weights)
    return still


def _converted_by_peft(model, f, keys: set, missing: list[str], params: dict, weights: dict) -> list[str]:
    """The missing LoRA weights from peft's own conversion of the adapter file (``_peft_conversion``)."""
    from tui_merger.core.verify.streaming import Weight

    converted = _peft_conversion(model, {k: f.get_tensor(k) for k in keys if ".lora_" in k})
    still = []
    for name in missing:
        tensor = converted.get(name.replace(".default.", ".", 1))
        if ".lora_" in name and tensor is not None and tuple(tensor.shape) == tuple(params[name].shape):
            weights[name] = Weight(tuple(params[name].shape), held=tensor)
        else:
            still.append(name)
    return still


def _peft_conversion(model, state: dict) -> dict:
    """LoRA saved one pair per expert (``mlp.experts.3.gate_proj``: Megatron-Bridge's export, adapters
    trained on transformers 4) for experts transformers 5 keeps packed: peft converts such a file
    itself when it loads it onto a real model (target_parameters on the packed experts, gate and up
    fused block-diagonally at 2r), which it cannot do onto a meta base, whose LoRA weights stay
    empty. The reference takes peft's own conversion of the file's LoRA tensors: {saved name:
    tensor}; {} when this peft has none or refuses."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
    except ImportError:  # a peft (or transformers) without it: said as missing weights
        return {}
    try:
        return convert_peft_adapter_state_dict_for_transformers(model, model.peft_config["default"], state)
    except Exception:  # noqa: BLE001 - peft's own refusal: the weights stay missing (the check says so)
        return {}


def _check_shapes(model, weights: dict, what: str) -> None:
    for name, p in model.named_parameters(remove_duplicate=False):
        w = weights.get(name)
        if w is not None and w.ref is not None and tuple(w.ref.shape) != tuple(p.shape):
            raise NoReference(
                f"the {what}'s {w.ref.name} has shape {list(w.ref.shape)} where transformers builds {list(p.shape)}"
            )


def _progress(on_event, what: str):
    if on_event is None:
        return None

    def report(name: str, done: int, total: int, bytes_done: int, bytes_total: int) -> None:
        on_event(TensorProgress(f"{what}: {name}", done, max(total, done), bytes_done, max(bytes_total, bytes_done)))

    return report


def first_line(err: Exception) -> str:
    """The first line of an error's message (its type when it has none), at most 200 characters."""
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


def run(streamer, probes):
    """(logits fp32, [hidden states] or None) of one pass over the probes.

    A multimodal model whose own forward cannot run on text alone (transformers 5.24's
    Llama4ForConditionalGeneration reads ``image_outputs`` its language model never returns) is run
    through its language model (a ``...ForCausalLM`` with its own lm_head, the LoRA layers of an
    unmerged reference in place): ``streamer.text_only`` then says so, and both sides of the check
    take the same path."""
    try:
        out = streamer(input_ids=probes, output_hidden_states=True)
    except AttributeError as err:
        inner = _language_model(streamer.model)
        if inner is None:
            raise
        outer = type(getattr(streamer.model, "get_base_model", lambda: streamer.model)()).__name__
        streamer.text_only = f"{type(inner).__name__} (the language model alone: {outer}'s own forward fails on text)"
        out = streamer.run_module(inner, input_ids=probes, output_hidden_states=True)
    hidden = getattr(out, "hidden_states", None)
    return out.logits.float(), (list(hidden) if hidden is not None else None)


@contextmanager
def recording_calls(model):
    """The names of the modules whose forward runs inside the block (a set filled as they run)."""
    called: set[str] = set()
    handles = [module.register_forward_pre_hook(lambda _m, _a, name=name: called.add(name))
               for name, module in model.named_modules()]
    try:
        yield called
    finally:
        for handle in handles:
            handle.remove()


def bypassed_loras(streamer, called: set[str]) -> list[str]:
    """LoRA layers of an unmerged reference whose forward never ran although their parent's did (the
    parent reads the wrapped weight itself: Jamba's mamba mixer its ``dt_proj.weight``, LongCat's router
    its ``classifier.weight``) and whose lora_B is not zero: the unmerged model leaves them out, a merge
    (peft's merge_and_unload too) puts them in. A LoRA trained there gets no gradient and keeps its zero
    lora_B; one that is not zero was made some other way (or by a forward that does call it)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = streamer.model
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, BaseTunerLayer) or name in called or name.rsplit(".", 1)[0] not in called:
            continue
        if any(n.startswith(name + ".") for n in called):  # a wrapper whose inner layer ran
            continue
        for key in (k for k in streamer.weights if k.startswith(name + ".lora_B.")):
            value = streamer.materialize(key)
            nonzero = bool(value.abs().sum() > 0)
            streamer.give_back(key, value)
            if nonzero:
                out.append(_model_name(name))
                break
    return out


def _model_name(name: str) -> str:
    """A module's name in the model (peft's ``base_model.model.`` prefix dropped)."""
    return name.removeprefix("base_model.model.")


def _language_model(model):
    """The causal LM inside a multimodal model (peft's wrapper looked through), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "language_model", None)
    return inner if inner is not None and _output_embeddings(inner) is not None else None


def _output_embeddings(model):
    """The model's output head as transformers names it (``get_output_embeddings``), or None."""
    try:
        return model.get_output_embeddings()
    except Exception:  # noqa: BLE001 - a module that is no transformers model, or one without a head
        return None


def relative(a, b, centre: bool) -> float:
    """|a - b| / |b| over all values (logits centred per token first: softmax ignores a shift)."""
    if centre:
        a = a - a.mean(-1, keepdim=True)
        b = b - b.mean(-1, keepdim=True)
    scale = b.double().norm().item()
    diff = (a.double() - b.double()).norm().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def kl(ref, other) -> float:
    import torch

    p = torch.log_softmax(ref.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def temporary_folder():
    return tempfile.TemporaryDirectory(prefix="tui-merger-verify-")
