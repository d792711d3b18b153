"""Verification of a merged model: does the folder hold what the inputs say it should, and does it
behave like the unmerged model?

- structure: every weight file reads (with the safetensors library, not our reader), the index covers
  every tensor, names / shapes / dtypes are the planned ones, config consistent (tie, vocab), no NaN/Inf;
- recompute: every output tensor equals an independent fp32 recomputation from the inputs, rounded once,
  within one unit in the last place of the output dtype (all rows of small tensors; a seeded random
  sample of rows above ``SAMPLE_LIMIT`` values, stated in the report);
- behaviour: the output loads with transformers' class for its architecture and its logits on fixed
  probes match the unmerged reference (base + adapter through peft, or the checkpoint's reassembled
  weights + its adapter); the models are loaded one after the other, so memory peaks at one model;
- perplexity (optional): on a user's text, merged vs reference, flagged if it moves by more than 0.5.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.events import CancelToken, EventSink, Notice, PhaseStarted, TensorProgress, ignore_event
from tui_merger.core.files import config_dtype, read_json_object
from tui_merger.core.manifest import MANIFEST_NAME, read_manifest
from tui_merger.core.options import MergeOptions, check_option_types

SAMPLE_LIMIT = 1 << 24  # values in a tensor above which a sample of rows is recomputed
SAMPLE_ROWS = 64
BLOCK_VALUES = 1 << 22  # values read at a time when scanning a stored tensor
PROBE_SEED = 20261130
PROBE_SHAPE = (3, 16)  # sequences x tokens
PPL_TOLERANCE = 0.5
PPL_MAX_TOKENS = 2048
# mean KL(reference || merged) per token allowed, by the dtype the weights are stored in: rounding
# every merged weight once to that dtype moves the logits by about this much at most
KL_LIMIT = {"float32": 1e-6, "bfloat16": 2e-3, "float16": 1e-4}
# for one-output models (value heads): max |diff| / max |reference|
REL_LIMIT = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
# a correct merge is far closer to the reference than the base model without the adapter is
ADAPTER_EFFECT_RATIO = 0.1
RESCUE_RATIO = 0.01
_MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}


@dataclass
class Check:
    name: str  # structure, recompute, behaviour, perplexity
    status: str  # pass, fail, warn (a difference the user chose), skip
    summary: str
    details: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


@dataclass
class VerifyReport:
    out: Path
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.checks) and any(c.status == "pass" for c in self.checks)

    @property
    def summary(self) -> str:
        failed = [c.name for c in self.checks if c.status == "fail"]
        if failed:
            return f"failed: {', '.join(failed)}"
        done = [c.name for c in self.checks if c.status == "pass"]
        return f"passed: {', '.join(done)}"

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "summary": self.summary,
            "seconds": round(self.seconds, 3),
            "checks": [asdict(c) for c in self.checks],
        }


def options_from_manifest(out: Path) -> MergeOptions:
    manifest = read_manifest(out)
    if manifest is None:
        raise MergeError(
            f"{out} has no readable merge_manifest.json, so tui-merger does not know what it was merged from; "
            "say it with --base and --adapter, or --against CHECKPOINT."
        )
    names = {f.name for f in fields(MergeOptions)}
    saved = {k: v for k, v in (manifest.get("options") or {}).items() if k in names}
    saved["out"] = out
    try:
        check_option_types(saved)
    except MergeError as err:
        raise _unusable(out, err) from None
    for key in ("base", "adapter", "checkpoint"):
        if saved.get(key) and not Path(saved[key]).exists():
            raise MergeError(
                f"The {key} this model was merged from, {saved[key]}, is no longer there; "
                f"pass its new place with --{key if key != 'checkpoint' else 'against'}."
            )
    for item in saved.get("adapters") or []:
        if isinstance(item, list) and item and not Path(str(item[0])).exists():
            raise MergeError(f"The adapter this model was merged from, {item[0]}, is no longer there; move it back.")
    try:
        return MergeOptions(**saved)
    except MergeError as err:
        raise _unusable(out, err) from None


def _unusable(out: Path, err: MergeError) -> MergeError:
    return MergeError(
        f"{out / MANIFEST_NAME} records options tui-merger cannot use ({str(err).rstrip('.')}); it was edited "
        "or damaged: say what the model was merged from with --base and --adapter, or --against CHECKPOINT."
    )


def verify_merge(
    out: Path,
    options: MergeOptions | None = None,
    *,
    behaviour: bool = True,
    perplexity_text: Path | None = None,
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> VerifyReport:
    """Verify the model in ``out`` against the inputs in ``options`` (default: its manifest's)."""
    from tui_merger.core.adapter import empty_adapter
    from tui_merger.core.inputs import open_inputs
    from tui_merger.core.plan import build_plan

    started = time.perf_counter()
    out = Path(out)
    cancel = cancel or CancelToken()
    if not (out / "config.json").is_file():
        raise MergeError(f"{out} has no config.json; point verify at a merged model folder.")
    options = options or options_from_manifest(out)
    report = VerifyReport(out)
    on_event(PhaseStarted("verify", f"Verifying {out}"))
    out_config = read_json_object(out / "config.json", "the merged model's config is damaged")
    inputs = open_inputs(options)
    try:
        config = {**inputs.config, **inputs.config_changes}
        adapter = empty_adapter(inputs.adapter.folder) if options.export_adapter else inputs.adapter
        dtype = options.dtype or inputs.dtype
        plan = build_plan(inputs.base, adapter, config, dtype, options.shard_size)
        clamp = options.force_fp16_overflow and any(t.dtype == "float16" for t in plan.tensors)
        structure, files = _structure(out, plan, out_config)
        report.checks.append(structure)
        if files is not None:
            report.checks.append(_recompute(out, plan, files, on_event, cancel, clamp))
        else:
            report.checks.append(Check("recompute", "skip", "skipped: the weight files cannot be read"))
        cancel.raise_if_cancelled()
        if behaviour or perplexity_text:
            if structure.status == "fail":
                report.checks.append(Check("behaviour", "skip", "skipped: the structure check failed"))
            else:
                on_event(PhaseStarted("behaviour", "Comparing logits with the unmerged model"))
                checks = _behaviour(out, out_config, options, inputs, plan, perplexity_text, on_event)
                for check in checks:
                    if clamp and check.status == "fail":  # the user chose to change those values
                        check.status = "warn"
                        check.summary += " (expected: values beyond float16's range were clamped, --force)"
                report.checks.extend(checks)
    finally:
        inputs.close()
    report.seconds = time.perf_counter() - started
    return report


# -- structure ---------------------------------------------------------------------------------


def _weight_files(out: Path) -> tuple[list[str], dict | None]:
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        index = read_json_object(index_path, "the merged model's index is damaged")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise MergeError(f"{index_path} has no weight_map; the merged model's index is damaged.")
        return sorted(set(weight_map.values())), weight_map
    return sorted(p.name for p in out.glob("*.safetensors")), None


def _structure(out: Path, plan, config: dict) -> tuple[Check, dict | None]:
    """Returns the check and {tensor name: safetensors file} when every file could be read."""
    from safetensors import safe_open

    problems: list[str] = []
    names, weight_map = _weight_files(out)
    located: dict[str, str] = {}
    readable = True
    for fname in names:
        path = out / fname
        if not path.is_file():
            problems.append(f"{fname} is named in the index but missing")
            readable = False
            continue
        try:
            with safe_open(str(path), framework="pt") as f:
                keys = list(f.keys())
        except Exception as err:  # the library's own error types differ between versions
            problems.append(f"{fname} cannot be read ({str(err).splitlines()[0][:120]}): truncated or corrupt")
            readable = False
            continue
        for k in keys:
            if k in located:
                problems.append(f"{k} is stored twice ({located[k]} and {fname})")
            located[k] = fname
    if weight_map is not None:
        for k, f in weight_map.items():
            if k not in located and (out / f).is_file() and readable:
                problems.append(f"the index says {k} is in {f}, but it is not there")
        for k, f in located.items():
            if weight_map.get(k) != f:
                problems.append(f"{k} is in {f} but the index says {weight_map.get(k)}")
    expected = {t.name: t for t in plan.tensors}
    if readable:
        for k in sorted(set(expected) - set(located)):
            problems.append(f"{k} is missing")
        for k in sorted(set(located) - set(expected)):
            problems.append(f"{k} is not expected")
        for k in sorted(set(expected) & set(located)):
            with safe_open(str(out / located[k]), framework="pt") as f:
                sl = f.get_slice(k)
                shape, dtype = tuple(sl.get_shape()), _dtype_name(sl.get_dtype())
            t = expected[k]
            if shape != tuple(t.shape) or dtype != t.dtype:
                problems.append(f"{k} is {dtype}{list(shape)}, expected {t.dtype}{list(t.shape)}")
    problems += _config_problems(config, {k: expected[k].shape for k in expected})
    n = len(located)
    if problems:
        return Check("structure", "fail", f"{len(problems)} problem(s) in the files", problems[:50]), (
            located if readable else None
        )
    files = f"{len(names)} file(s)" if names else "no weight files"
    return Check("structure", "pass", f"{n} tensors in {files}; names, shapes, dtypes and index as planned"), located


def _dtype_name(st_dtype: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
            "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}.get(st_dtype, st_dtype.lower())


def _config_problems(config: dict, shapes: dict) -> list[str]:
    from tui_merger.core.plan import INPUT_EMBEDDING_SUFFIXES, OUTPUT_EMBEDDING, _has_lm_head

    problems = []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size", text.get("vocab_size"))
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    embeds = [k for k in shapes if k.endswith(INPUT_EMBEDDING_SUFFIXES) and len(shapes[k]) == 2]
    if vocab and embeds and all(shapes[k][0] != vocab for k in embeds):
        problems.append(f"config.json says vocab_size {vocab} but the embedding has {shapes[embeds[0]][0]} rows")
    head = [k for k in shapes if k.endswith(OUTPUT_EMBEDDING)]
    if _has_lm_head(config) and embeds and not head and tie is False:
        problems.append(
            "tie_word_embeddings is false but there is no lm_head.weight: transformers would start it random"
        )
    return problems


# -- recompute ---------------------------------------------------------------------------------


def _sample_rows(name: str, n_rows: int):
    import torch

    g = torch.Generator().manual_seed(PROBE_SEED + sum(name.encode()))
    return torch.randperm(n_rows, generator=g)[: min(SAMPLE_ROWS, n_rows)].sort().values


def _reference(t, rows):
    """fp32 recomputation of output tensor ``t`` (only ``rows`` when given), independent of the
    engine's fast paths: float(W) + s * (B @ A) per op, in order, as peft defines the merge."""
    import torch

    from tui_merger.core.plan import BiasOp, LoraOp, RowsOp

    w = t.source.load()
    acc = (w if rows is None else w[rows]).float().clone()
    for op in t.ops:
        if isinstance(op, LoraOp):
            a, b = op.A.load().float(), op.B.load().float()
            if op.transpose:
                delta = (b @ (a if rows is None else a[:, rows])).T
            else:
                delta = (b if rows is None else b[rows]) @ a
            v = acc + delta * op.scale
            if op.magnitude is not None:
                v_rows = v.T if op.transpose else v
                m = op.magnitude.load().float().reshape(-1)
                if rows is not None and not op.transpose:
                    m = m[rows]
                factor = (m / torch.linalg.vector_norm(v_rows, dim=1)).view(-1, 1)
                v = factor.T * v if op.transpose else factor * v
            acc = v
        elif isinstance(op, BiasOp):
            acc = acc + op.bias.load().float() * op.scale
        elif isinstance(op, RowsOp):
            stored = op.rows.load().float()
            for j, index in enumerate(op.indices):
                if rows is None:
                    acc[index] = stored[j]
                else:
                    hit = (rows == index).nonzero()
                    if len(hit):
                        acc[hit[0, 0]] = stored[j]
    return acc


def _needs_all_rows(t) -> bool:
    from tui_merger.core.plan import BiasOp, LoraOp

    if len(t.shape) < 2 or math.prod(t.shape) <= SAMPLE_LIMIT:
        return True
    return any(isinstance(op, BiasOp) or (isinstance(op, LoraOp) and op.magnitude is not None and op.transpose) for op in t.ops)


def _mismatches(got, want) -> int:
    """Elements of ``got`` further than one unit in the last place of its dtype from ``want`` (fp32,
    already rounded to that dtype). Equal elements, the common case, cost one comparison."""
    import torch

    differ = got != want.to(got.dtype)
    if not differ.any():
        return 0
    g, w = got[differ].float(), want[differ]
    bits = _MANTISSA_BITS.get(str(got.dtype).removeprefix("torch."))
    if bits is None:
        return int(differ.sum())
    _, exp = torch.frexp(w)
    ulp = torch.ldexp(torch.ones_like(w), exp - 1 - bits)
    tiny = 2.0**-24 if got.dtype == torch.float16 else 2.0**-126
    tol = torch.clamp(ulp, min=tiny) * (4 if got.dtype == torch.float32 else 1)  # fp32 sums differ in order
    return int(((g - w).abs() > tol).sum())


def _blocks(t):
    """Row ranges of about BLOCK_VALUES values each."""
    if not t.shape:
        return [None]
    row = max(1, math.prod(t.shape[1:]))
    step = max(1, BLOCK_VALUES // row)
    return [(a, min(a + step, t.shape[0])) for a in range(0, t.shape[0], step)]


def _read(f, name: str, block):
    return f.get_tensor(name) if block is None else f.get_slice(name)[block[0] : block[1]]


def _finite(f, t) -> bool:
    """No NaN or Inf in the stored tensor."""
    import torch

    for block in _blocks(t):
        part = _read(f, t.name, block)
        if part.is_floating_point() and not torch.isfinite(part).all():
            return False
    return True


def _equal_blocks(f, t) -> bool:
    import torch

    src = t.source.load()
    return all(
        torch.equal(_read(f, t.name, block), src if block is None else src[block[0] : block[1]])
        for block in _blocks(t)
    )


def _recompute(out: Path, plan, files: dict, on_event: EventSink, cancel: CancelToken, clamp: bool = False) -> Check:
    import torch
    from safetensors import safe_open

    problems, sampled, nonfinite = [], [], []
    total = len(plan.tensors)
    total_bytes = sum(t.nbytes for t in plan.tensors)
    done_bytes = 0
    for i, t in enumerate(plan.tensors, start=1):
        cancel.raise_if_cancelled()
        if t.name not in files:
            continue
        # opened per tensor (closing unmaps the file) and read in row blocks: memory stays at one block
        # for copied tensors and at one merged tensor (or its sampled rows) for the others
        with safe_open(str(out / files[t.name]), framework="pt") as f:
            raw = not t.ops and t.dtype == t.source.dtype
            if not _finite(f, t):
                nonfinite.append(t.name)
            if raw:
                if not _equal_blocks(f, t):
                    problems.append(f"{t.name}: differs from the input it was copied from")
            else:
                rows = None if _needs_all_rows(t) else _sample_rows(t.name, t.shape[0])
                if rows is None:
                    got = f.get_tensor(t.name)
                else:
                    sampled.append(t.name)
                    sl = f.get_slice(t.name)
                    got = torch.cat([sl[r : r + 1] for r in rows.tolist()])
                want = _reference(t, rows)
                if clamp:  # --force: values beyond fp16's range were clamped on purpose
                    want = want.clamp(-65504.0, 65504.0)
                want = want.to(got.dtype).float()
                bad = _mismatches(got, want)
                if bad:
                    diff = (got.float() - want).abs().max().item()
                    problems.append(
                        f"{t.name}: {bad} of {want.numel()} values differ from the recomputation (max {diff:.3g})"
                    )
                del got, want
        for ref in t.inputs():
            ref.release()
        done_bytes += t.nbytes
        on_event(TensorProgress(t.name, i, total, done_bytes, total_bytes))
    details = problems[:50] + [f"{n}: holds NaN or Inf" for n in nonfinite[:20]]
    metrics = {"tensors": total, "sampled_tensors": len(sampled), "sample_rows": SAMPLE_ROWS, "sample_limit": SAMPLE_LIMIT}
    if problems or nonfinite:
        return Check("recompute", "fail", f"{len(problems) + len(nonfinite)} of {total} tensors are wrong", details, metrics)
    how = f"; {len(sampled)} large tensors on {SAMPLE_ROWS} random rows each" if sampled else ""
    return Check("recompute", "pass", f"all {total} tensors equal the recomputation from the inputs{how}", [], metrics)


# -- behaviour ---------------------------------------------------------------------------------


def model_class(config: dict):
    import transformers

    archs = config.get("architectures") or []
    if archs:
        return getattr(transformers, str(archs[0]), None)
    # no architectures in config.json (old or hand-written configs): a causal LM when its type is one
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(str(config.get("model_type")))
    return getattr(transformers, name, None) if isinstance(name, str) else None


def probe_ids(config: dict, plan):
    """Fixed token ids within both the config's vocabulary and the model's input embedding rows."""
    import torch

    from tui_merger.core.plan import INPUT_EMBEDDING_SUFFIXES

    rows = next((t.shape[0] for t in plan.tensors if t.name.endswith(INPUT_EMBEDDING_SUFFIXES)), None)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = min(v for v in (config.get("vocab_size", text.get("vocab_size")), rows, 1 << 30) if v)
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab, PROBE_SHAPE, generator=g)


def _compute_dtype(n_values: int, stored: str):
    """fp32 (the most exact comparison) when loading the model in fp32 fits: transformers' load peaks
    at about twice the fp32 size, which must stay under 60 % of the available memory. Else the stored
    dtype: then the weights stay memory-mapped from the files and hardly count as process memory."""
    import torch

    available = _available_memory()
    if available is None or n_values * 4 * 2 <= 0.6 * available:
        return torch.float32
    return getattr(torch, stored)


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _kl(ref, other) -> float:
    import torch

    p = torch.log_softmax(ref.double(), dim=-1)
    q = torch.log_softmax(other.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def quiet_transformers():
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def _behaviour(out: Path, config: dict, options: MergeOptions, inputs, plan, text: Path | None, on_event) -> list[Check]:
    import torch

    cls = model_class(config)
    archs = config.get("architectures") or ["(none)"]
    if cls is None:
        return [Check(
            "behaviour", "skip",
            f"skipped: {archs[0]} is not a transformers class (custom code); tui-merger never runs model code",
        )]
    quiet_transformers()
    stored = options.dtype or inputs.dtype or config_dtype(config) or "float32"
    stored = stored if stored in KL_LIMIT else "float32"
    cdtype = _compute_dtype(sum(math.prod(t.shape) for t in plan.tensors), stored)
    probes = probe_ids(config, plan)
    tokens = _perplexity_tokens(out, text) if text else None

    def run(model) -> tuple:
        model.eval()
        with torch.no_grad():
            logits = model(probes).logits.float()
            ppl = _perplexity(model, tokens, config) if tokens is not None else None
        return logits, ppl

    # 1. the merged model, as users will load it
    on_event(Notice("info", f"Loading the merged model with transformers ({cls.__name__}, {str(cdtype)[6:]})"))
    try:
        model, info = cls.from_pretrained(out, dtype=cdtype, output_loading_info=True, local_files_only=True)
    except Exception as err:
        return [Check("behaviour", "fail", f"transformers cannot load the output: {str(err).splitlines()[0][:200]}")]
    missing = [k for k in info.get("missing_keys", [])]
    if options.export_adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, out / "lora_adapter")
    merged, ppl_merged = run(model)
    del model
    gc.collect()

    # 2. the unmerged reference, and the base without the adapter
    on_event(Notice("info", "Loading the unmerged reference (base + adapter through peft)" if inputs.adapter.lora
                    else "Loading the reference (the checkpoint's own weights)"))
    try:
        model = _reference_model(cls, out, options, inputs, cdtype)
    except _NoReference as why:
        return [Check("behaviour", "skip", str(why))]
    reference, ppl_ref = run(model)
    base_logits = None
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            base_logits, _ = run(model)
    del model
    gc.collect()

    checks = [compare_logits(merged, reference, base_logits, stored, missing, cls.__name__, str(cdtype)[6:])]
    if tokens is not None:
        delta = abs(ppl_merged - ppl_ref)
        status = "pass" if delta <= PPL_TOLERANCE else "fail"
        checks.append(Check(
            "perplexity", status,
            f"perplexity {ppl_merged:.3f} merged vs {ppl_ref:.3f} unmerged on {tokens.numel()} tokens of {text.name}"
            + ("" if status == "pass" else f": moved by {delta:.3f} (> {PPL_TOLERANCE})"),
            metrics={"merged": ppl_merged, "reference": ppl_ref, "tokens": tokens.numel()},
        ))
    return checks


def _reference_model(cls, out: Path, options: MergeOptions, inputs, cdtype):
    """base + adapter through peft: from the folders for a PEFT pair, else from the checkpoint's
    reassembled tensors and its adapter saved in peft's format to a temporary folder."""
    import tempfile

    from peft import PeftModel

    if options.checkpoint is None:
        model = cls.from_pretrained(options.base, dtype=cdtype, local_files_only=True)
        if options.base_roundtrip:
            _load_round_trip(model, inputs.base)  # --qlora-base: the weights the adapter was trained against
        vocab = transformers_vocab(out)
        if vocab and model.get_input_embeddings().weight.shape[0] != vocab:
            model.resize_token_embeddings(vocab, mean_resizing=False)  # as the adapter's training did
        if options.weighted:
            model = _weighted_reference(model, inputs)
        elif options.adapter is not None and not inputs.adapter.folder.is_file():
            model = PeftModel.from_pretrained(model, inputs.adapter.folder)
        elif options.adapter is not None and inputs.adapter.lora:  # a kohya file: through peft's format
            from tui_merger.core.adapter import export_peft_adapter

            with tempfile.TemporaryDirectory(prefix="tui-merger-verify-") as tmp:
                export_peft_adapter(inputs.adapter, Path(tmp) / "adapter", fsync=False)
                model = PeftModel.from_pretrained(model, Path(tmp) / "adapter")
        return model
    import transformers

    from tui_merger.core.adapter import export_peft_adapter

    cfg_obj = transformers.AutoConfig.from_pretrained(out)  # the checkpoint's config with our changes
    state = {}
    for name, ref in inputs.base.tensors.items():
        state[name] = ref.load().to(cdtype)
        ref.release()
    model = cls.from_pretrained(None, config=cfg_obj, state_dict=state, dtype=cdtype)
    del state
    if inputs.adapter.lora:
        with tempfile.TemporaryDirectory(prefix="tui-merger-verify-") as tmp:
            export_peft_adapter(inputs.adapter, Path(tmp) / "adapter", fsync=False)
            model = PeftModel.from_pretrained(model, Path(tmp) / "adapter")  # reads the weights in; the folder may go
    return model


def _weighted_reference(model, inputs):
    """Several weighted adapters through peft: each loaded as peft loads it, then combined by peft's own
    add_weighted_adapter with the exact "cat" combination (concatenated ranks, no cross terms)."""
    import tempfile

    from peft import PeftModel

    from tui_merger.core.adapter import export_peft_adapter

    names, weights = [], []
    with tempfile.TemporaryDirectory(prefix="tui-merger-verify-") as tmp:
        for index, (part, weight, _path) in enumerate(inputs.parts):
            folder = part.folder
            if folder.is_file():  # a kohya file: through peft's format
                folder = Path(tmp) / f"adapter{index}"
                export_peft_adapter(part, folder, fsync=False)
            name = f"a{index}"
            if index == 0:
                model = PeftModel.from_pretrained(model, folder, adapter_name=name)
            else:
                model.load_adapter(folder, adapter_name=name)
            names.append(name)
            weights.append(weight)
        model.add_weighted_adapter(names, weights, "weighted", combination_type="cat")
        model.set_adapter("weighted")
    return model


class _NoReference(Exception):
    """The unmerged reference cannot be built; the message says why (the behaviour check is skipped)."""


def _load_round_trip(model, base) -> None:
    """Replace the round-tripped weights of a model loaded from the 16-bit base by dequant(quant(W)),
    as the merge read them (one tensor at a time), found by their names in the files."""
    import torch

    state = model.state_dict()  # shares storage with the parameters
    unplaced = []
    with torch.no_grad():
        for name in base.round_tripped:
            key = name if name in state else next((k for k in state if k.endswith("." + name)), None)
            ref = base.tensors[name]
            if key is None or tuple(state[key].shape) != tuple(ref.shape):
                unplaced.append(name)
                continue
            state[key].copy_(ref.load())
            ref.release()
    if unplaced:
        raise _NoReference(
            f"skipped: the --qlora-base round-tripped weights could not be put into the {type(model).__name__} "
            f"transformers builds ({unplaced[0]} has no parameter of that name and shape); the recompute check "
            "covers them"
        )


def transformers_vocab(out: Path) -> int | None:
    config = read_json_object(out / "config.json", "the merged model's config is damaged")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("vocab_size", text.get("vocab_size"))


def compare_logits(merged, reference, base, stored: str, missing: list, cls_name: str, cdtype: str) -> Check:
    details = [f"missing from the files (transformers starts them random): {', '.join(missing[:10])}"] if missing else []
    diff = (merged - reference).abs().max().item()
    metrics = {"max_abs_diff": diff, "dtype": stored, "compute_dtype": cdtype, "probes": list(PROBE_SHAPE)}
    if merged.shape[-1] > 1:
        kl = _kl(reference, merged)
        metrics["kl"] = kl
        limit = KL_LIMIT[stored]
        ok = kl <= limit
        what = f"KL {kl:.2e} (limit {limit:.0e}), max |logit diff| {diff:.3g}"
        if base is not None:
            effect = _kl(reference, base)
            metrics["adapter_effect_kl"] = effect
            what += f"; the adapter itself moves them by KL {effect:.2e}"
            # rounding noise of a large model may pass the absolute limit yet stay tiny next to the
            # adapter's own effect; a merge no closer to base+adapter than the base alone fails
            ok = ok or kl <= RESCUE_RATIO * effect
            if effect > limit and kl > ADAPTER_EFFECT_RATIO * effect:
                ok = False
                details.append(
                    f"the merged model is not much closer to base+adapter than the base alone is "
                    f"(KL {kl:.2e} vs {effect:.2e}): the adapter looks not (or wrongly) applied"
                )
    else:
        scale = reference.abs().max().item() or 1.0
        rel = diff / scale
        metrics["rel_diff"] = rel
        ok = rel <= REL_LIMIT[stored]
        what = f"relative output difference {rel:.2e} (limit {REL_LIMIT[stored]:.0e})"
    if missing:
        ok = False
    status = "pass" if ok else "fail"
    lead = "logits match the unmerged model" if ok else "logits differ from the unmerged model"
    return Check("behaviour", status, f"{cls_name} loads; {lead}: {what}", details, metrics)


def _perplexity_tokens(out: Path, text: Path):
    import torch

    try:
        content = Path(text).read_text(errors="replace")
    except OSError as err:
        raise MergeError(f"Cannot read the perplexity text {text} ({err.strerror}).") from None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(out)
    except Exception:
        raise MergeError(
            f"{out} has no tokenizer that loads, so perplexity cannot be measured; copy the tokenizer in "
            "or leave out --perplexity."
        ) from None
    ids = tok(content, return_tensors="pt", add_special_tokens=False)["input_ids"][0][:PPL_MAX_TOKENS]
    if ids.numel() < 2:
        raise MergeError(f"{text} is too short to measure perplexity; give a few paragraphs of text.")
    return ids.to(torch.long)


def _perplexity(model, ids, config: dict) -> float:
    import torch

    window = min(512, int(config.get("max_position_embeddings") or 512))
    nll, count = 0.0, 0
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start : start + window + 1]
        if chunk.numel() < 2:
            break
        logits = model(chunk[None, :-1]).logits.float()[0]
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return math.exp(nll / count)
