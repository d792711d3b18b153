"""Verification of a merged model: does the folder hold what the inputs say it should, and does it
behave like the unmerged model?

- structure: every weight file reads (with the safetensors library, not our reader), the index covers
  every tensor, names / shapes / dtypes are the planned ones, config consistent (tie, vocab), no NaN/Inf;
- recompute: every output tensor equals an independent fp32 recomputation from the inputs, rounded once,
  within one unit in the last place of the output dtype (all rows of small tensors; a seeded random
  sample of rows above ``SAMPLE_LIMIT`` values, stated in the report);
- behaviour: the output loads with transformers' class for its architecture and its logits on fixed
  probes match the unmerged reference (base + adapter through peft, or the checkpoint's reassembled
  weights + its adapter); both stream one module's weights at a time (``streaming.py``);
- the recompute and the behaviour check run side by side, each on one core (``parallel.py``);
- perplexity (optional): on a user's text, merged vs reference, flagged if it moves by more than 0.5.
"""

from __future__ import annotations


import math
import time
from dataclasses import asdict, fields
from pathlib import Path

from tui_merger.core.formats.hf_names import model_class
from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.verify.parallel import Shares, run_side_by_side, threads_per_job
from tui_merger.core.verify.streaming import StreamError
from tui_merger.core.events import CancelToken, EventSink, MergeFinished, PhaseStarted, TensorProgress, TensorWritten, ignore_event
from tui_merger.core.io import libc
from tui_merger.core.io.files import config_dtype, json_object_or_none, read_json_object
from tui_merger.core.io.system import available_memory as _available_memory  # tests set it
from tui_merger.core.record.manifest import MANIFEST_NAME, read_manifest
from tui_merger.core.options import MergeOptions, check_option_types

from tui_merger.core.verify.dequant_ref import independent_base
from tui_merger.core.verify.recompute import PROBE_SEED, WhileWriting, _Recompute, writing_key
from tui_merger.core.verify.report import Check, VerifyReport

PROBE_SHAPE = (1, 12)  # sequences x tokens: every pass costs two multiply-adds per weight and token
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
IMPORT_SWITCH_INTERVAL = 0.0005  # seconds a thread holds the GIL before yielding, while the imports run


def prewarming(options: MergeOptions, on_event: EventSink, behaviour: bool = True) -> EventSink:
    """``on_event``, which also starts importing what the behaviour check needs (transformers' model
    code, peft, accelerate: seconds of Python) in a background thread at once when torch is imported
    (the preflight imports it), else once the merge writes its first tensor (torch is imported by
    then): the merge spends its time in torch and the kernel. The check waits for this thread's
    imports before it imports anything itself. Never fails: an import error shows later, where it is
    handled. And every tensor is recomputed as soon as the merge has written it
    (``recompute.WhileWriting``); verification takes those results for the files that were checked.
    ``behaviour``: False when verification will not run the models (no imports, no reference)."""
    import threading

    started = threading.Event()
    global _WRITING
    if _WRITING is not None:  # an earlier merge's, never taken
        _WRITING.take()
    writing = _WRITING = WhileWriting(options)

    imported = threading.Event()
    halt = CancelToken()  # the merge failed: stop reading the inputs
    # the thread reads the inputs (the reference's run) only once ``reading`` is set, under ``gate``: a
    # merge stopped before that does not wait for its imports (seconds that cannot be interrupted)
    gate, reading, ours = threading.Lock(), threading.Event(), []

    def load() -> None:
        import sys

        from tui_merger.core.formats.inputs import cycle_collector_paused

        # Seconds of imports hold the GIL while the merge thread needs it for a moment between torch
        # calls; at the default 5 ms switch interval it waited that long each time (a 0.5B merge's
        # writing took 4-6 s instead of 3). Shorter slices while the imports run.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, IMPORT_SWITCH_INTERVAL))
        try:
            with cycle_collector_paused():
                import accelerate.hooks  # noqa: F401
                import transformers  # noqa: F401

                if options.checkpoint is None:  # an adapter merge builds its reference with peft
                    import peft  # noqa: F401

                for folder in (options.checkpoint and Path(options.checkpoint) / "huggingface", options.base):
                    if folder and (Path(folder) / "config.json").is_file():
                        model_class(read_json_object(Path(folder) / "config.json", ""))
                        break
                with gate:
                    if not halt.cancelled:  # else abandon() has thawed already: nothing would thaw this
                        _freeze()
            sys.setswitchinterval(interval)
            imported.set()  # verification may build and run the merged model from here on
            if options.checkpoint is None and options.base is not None:
                with gate:
                    if halt.cancelled:
                        return
                    reading.set()
                _reference_ahead(options, halt)
        except Exception:  # noqa: BLE001 - a best effort; the real import reports
            pass
        finally:
            sys.setswitchinterval(interval)
            imported.set()

    def start() -> None:
        started.set()
        thread = threading.Thread(target=load, name="tui-merger-prewarm", daemon=True)
        _PREWARMING.append((thread, imported))
        ours.append(thread)
        thread.start()

    def sink(event) -> None:
        if isinstance(event, TensorWritten):
            writing.written(event.path, event.name)
            return
        if isinstance(event, MergeFinished):
            writing.merge_ended()
        if behaviour and isinstance(event, TensorProgress) and not started.is_set():
            start()
        on_event(event)

    def abandon() -> None:
        """The merge failed or was cancelled: the threads reading its inputs stop (after the tensor
        or module they are on) and are waited for, so nothing reads a file the user may now change
        (a file truncated under a mapping that is read kills the process with SIGBUS)."""
        with gate:
            halt.cancel()
            importing = [] if reading.is_set() else ours  # only importing: nothing of the inputs is read
        writing.take()
        for thread, _ in list(_PREWARMING):
            if thread not in importing:
                thread.join()
        _thaw()

    sink.abandon = abandon
    if behaviour and _imported("torch"):  # the preflight imported it: no half-imported torch to meet
        start()
    return sink


def merge_prewarmed(options: MergeOptions, on_event: EventSink, cancel: CancelToken | None = None,
                    behaviour: bool = True):
    """``run_merge`` with the verification started while it writes (``prewarming``); if the merge
    fails, what was started for the verification is stopped before the error goes on."""
    from tui_merger.core.merge.engine import run_merge

    libc.large_blocks_mapped()  # before the checks' threads start (see run_merge)
    sink = prewarming(options, on_event, behaviour)
    try:
        return run_merge(options, sink, cancel)
    except BaseException:
        sink.abandon()
        raise


_FROZEN = False  # gc.freeze() was called after the prewarm imports and not undone yet


def _freeze() -> None:
    """Leave the objects that exist now, mostly the modules just imported (hundreds of thousands of
    transformers' and peft's), out of the cycle collector's passes until ``_thaw``: every pass over
    the oldest generation walked them all again while the merge and its verification made new
    objects (a 0.5B default merge, collector paused during the imports and frozen after them: 6.57
    -> 5.88 s, 9.06 -> 8.32 CPU-s, A/B x3; 3B level). Only a reference cycle among objects alive now
    waits for ``_thaw`` to be collected; other garbage is freed at once, as always."""
    import gc

    global _FROZEN
    gc.freeze()
    _FROZEN = True


def _thaw() -> None:
    """Hand the frozen objects back to the cycle collector (the verification is over, or the merge
    it was started for failed): a long-lived process, the assistant, keeps collecting them."""
    import gc

    global _FROZEN
    if _FROZEN:
        _FROZEN = False
        gc.unfreeze()


def _imported(name: str) -> bool:
    """``name`` is imported, and not still being imported by some thread."""
    import sys

    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


_PREWARMING: list = []  # prewarm threads; the behaviour check waits for them (a half-imported
# transformers seen from another thread lacks attributes)
_AHEAD: dict = {}  # the unmerged reference's run, made while the merge wrote: key -> (logits, hidden, peak)
_WRITING: WhileWriting | None = None  # the recompute made while the merge wrote


def _take_writing() -> WhileWriting | None:
    """The recompute made while the last merge wrote, stopped after its current tensor (once)."""
    global _WRITING
    writing, _WRITING = _WRITING, None
    return writing.take() if writing is not None else None


def _ahead_key(options: MergeOptions, config: dict, probes) -> str:
    """What the reference's run depends on: the options (the inputs), the output's config, the probes."""
    import json

    return json.dumps([asdict(options), config, probes.tolist()], sort_keys=True, default=str)


def _reference_ahead(options: MergeOptions, cancel: CancelToken | None = None) -> None:
    """The unmerged reference of an adapter merge needs nothing the merge writes: run it while the
    merge writes (on half the cores: the merge's work is mostly the kernel's, writing files), with
    the output's config as the merge will write it. The behaviour check takes the result if the
    options, the written config and the probes are the same; otherwise it runs it again."""
    import json

    import torch
    import transformers

    from tui_merger.core.formats.adapter import empty_adapter
    from tui_merger.core.formats.inputs import open_inputs
    from tui_merger.core.formats.inputs import reference as reference_of
    from tui_merger.core.io.files import edited_config
    from tui_merger.core.merge.requant import output_plan
    from tui_merger.core.verify import behaviour as bh

    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_job(2))  # the merge keeps the other half of the cores
    inputs = open_inputs(options)
    try:
        dtype = options.dtype or inputs.dtype
        adapter = empty_adapter(inputs.adapter.folder) if options.export_adapter else inputs.adapter
        plan = output_plan(inputs.base, adapter, {**inputs.config, **inputs.config_changes}, dtype, options.shard_size)
        config = json.loads(json.dumps(edited_config(inputs.config, {**inputs.config_changes, **plan.config_changes}, dtype)))
        cls = model_class(config)
        if cls is None:
            return
        quiet_transformers()
        bh.quiet()
        probes = probe_ids(config, plan)
        with bh.temporary_folder() as tmp:
            folder = Path(tmp) / "config"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(config))
            spec = reference_of(inputs, options, Path(tmp))
            if spec is None:
                return
            model = _reference_streamer(cls, config, transformers.AutoConfig.from_pretrained(folder), spec, inputs, None, cancel)
            with bh.recording_calls(model.model) as called:
                logits, hidden = bh.run(model, probes)
            _AHEAD[_ahead_key(options, config, probes)] = (logits, hidden, model.stats.peak_live_values, model.text_only,
                                                           bh.bypassed_loras(model, called))
            model.close()
    finally:
        inputs.close()
        libc.trim_heap()
        torch.set_num_threads(previous)


def _prewarmed() -> None:
    """Wait until the prewarm threads' imports are done (their reference run may go on)."""
    for thread, imported in list(_PREWARMING):
        while not imported.wait(0.05) and thread.is_alive():
            pass


def _prewarm_finished() -> None:
    """Wait for the prewarm threads to end (the unmerged reference's run made while merging)."""
    while _PREWARMING:
        _PREWARMING.pop()[0].join()


def _prewarm_running() -> bool:
    return any(thread.is_alive() for thread, _ in list(_PREWARMING))


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
    from tui_merger.core.formats.adapter import empty_adapter
    from tui_merger.core.formats.inputs import open_inputs
    from tui_merger.core.merge.requant import output_plan
    from tui_merger.core.plan.plan import embeddings_of

    started = time.perf_counter()
    out = Path(out)
    cancel = cancel or CancelToken()
    libc.large_blocks_mapped()  # as run_merge: large blocks freed back to the OS
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
        plan = output_plan(inputs.base, adapter, config, dtype, options.shard_size)
        clamp = options.force_fp16_overflow and any(t.dtype == "float16" for t in plan.tensors)
        structure, files = _structure(out, plan, out_config)
        files_fine = structure.status != "fail"
        if not options.export_adapter:  # the plan's LoRA against peft's own wrapping of the base (targets.py)
            from tui_merger.core.verify.targets import expected_loras, expected_weighted, plan_problems

            weights = options.adapter_weights()
            if len(weights) > 1 or any(w != 1.0 for _, w in weights):  # several adapters, each at its weight
                expected = expected_weighted(inputs.config, weights, options.lora_alpha)
            else:
                expected = expected_loras(inputs.config, adapter, options.lora_alpha)
            wrong = plan_problems(plan, expected)
            if wrong:
                details = [*(structure.details if structure.status == "fail" else []), *wrong]
                structure = Check("structure", "fail", f"{len(details)} problem(s) in the files", details[:50])
        report.checks.append(structure)
        run_models = bool(behaviour or perplexity_text) and files_fine
        # the recompute and the two models side by side, one core each (parallel.py)
        shares = Shares(on_event)
        size = sum(t.nbytes for t in plan.tensors)
        writing = _take_writing()
        recompute = None
        if files is not None:
            recompute = _Recompute(out, plan, files, shares.add("recompute", size, count=len(plan.tensors)), clamp,
                                   writing, writing_key(options))
        models = None
        if run_models:
            modules = len({t.name.rsplit(".", 1)[0] for t in plan.tensors})  # the units each model run loads
            text = out_config.get("text_config") if isinstance(out_config.get("text_config"), dict) else {}
            tied = out_config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
            head = embeddings_of(config, {t.name: t.shape for t in plan.tensors}).output
            modules += bool(tied) and head is not None and not any(t.name == head for t in plan.tensors)
            lora = 0 if adapter.config.get("use_dora") else 2 * len(adapter.lora)  # peft's lora_A / lora_B, plain LoRA
            models = _Models(out, out_config, options, inputs, plan, perplexity_text,
                             shares.add("merged", size, count=modules), shares.add("reference", size, count=modules + lora))
        jobs = _verify_jobs(recompute, models, shares)
        if jobs:
            on_event(PhaseStarted("verify", _what_runs(recompute, models, plan)))
        try:
            run_side_by_side(jobs, cancel)
        finally:
            if recompute is not None:
                recompute.close()
        shares.close()
        report.checks.append(
            recompute.check() if recompute is not None else Check("recompute", "skip", "skipped: the weight files cannot be read"))
        if run_models:
            checks = models.checks()
            for check in checks:
                if clamp and check.status == "fail":  # the user chose to change those values
                    check.status = "warn"
                    check.summary += " (expected: values beyond float16's range were clamped, --force)"
            report.checks.extend(checks)
        elif behaviour or perplexity_text:
            report.checks.append(Check("behaviour", "skip", "skipped: the structure check failed"))
    finally:
        inputs.close()
        _thaw()
    report.seconds = time.perf_counter() - started
    return report


def _verify_jobs(recompute, models, shares) -> dict:
    """Two threads: one prepares the models and runs the merged one, the other recomputes tensors and
    takes the unmerged model's run as soon as the models are prepared; then both take tensors from
    the recompute's queue until it is empty."""
    def recompute_all(token) -> None:
        if recompute is not None:
            recompute.work(token)

    if models is None:
        return {"recompute": recompute_all} if recompute is not None else {}

    def reference_once(token) -> None:
        if models.claimed.acquire(blocking=False):
            models.ready.wait()
            models.reference(token)
            shares.finish("reference")

    if recompute is None or not recompute.remaining:  # nothing to recompute (checked while writing)
        def alone(token) -> None:  # the merged model's run gets every core
            models.prepare()
            models.merged(token)
            shares.finish("merged")
            reference_once(token)
            recompute_all(token)

        return {"merged model": alone}

    def first(token) -> None:
        models.prepare()
        models.merged(token)
        shares.finish("merged")
        reference_once(token)  # when the other thread had no time for it
        recompute_all(token)

    def second(token) -> None:
        if recompute is not None:
            recompute.work(token, until=models.ready)
            while _prewarm_running() and recompute.work_one(token):  # the reference's run is on its way
                pass
        reference_once(token)
        recompute_all(token)

    return {"merged model": first, "recompute": second}


def _what_runs(recompute, models, plan) -> str:
    what = []
    if recompute is not None and recompute.remaining:
        what.append(f"recomputing {recompute.remaining} tensors from the inputs")
    if recompute is not None and recompute.reused:
        what.insert(0, f"{len(recompute.reused)} tensors were recomputed while the merge wrote them")
    if models is not None:
        what.append("running the merged model and the unmerged one layer by layer")
    side = recompute is not None and recompute.remaining and models is not None
    return "; ".join(what)[:1].upper() + "; ".join(what)[1:] + (" (side by side)" if side else "")


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
        common = sorted(set(expected) & set(located))
        for fname in sorted({located[k] for k in common}):
            with safe_open(str(out / fname), framework="pt") as f:
                for k in (k for k in common if located[k] == fname):
                    sl = f.get_slice(k)
                    shape, dtype = tuple(sl.get_shape()), _dtype_name(sl.get_dtype())
                    t = expected[k]
                    if shape != tuple(t.shape) or dtype != t.dtype:
                        problems.append(f"{k} is {dtype}{list(shape)}, expected {t.dtype}{list(t.shape)}")
    # config.json against the tensors the files hold (the plan's, where the files cannot all be read)
    problems += _config_problems(config, {k: expected[k].shape for k in expected if k in located or not readable})
    if readable:
        from tui_merger.core.formats.hf_names import expert_gaps

        problems += expert_gaps(config, {k: tuple(expected[k].shape) for k in located if k in expected})
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
            "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}.get(st_dtype, st_dtype.lower())


def _config_problems(config: dict, shapes: dict) -> list[str]:
    """vocab_size against the input embedding's rows, and a head that transformers would start random:
    the embeddings are the ones transformers names for this model (``plan.embeddings_of``)."""
    from tui_merger.core.plan.plan import embeddings_of

    problems = []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = config.get("vocab_size", text.get("vocab_size"))
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    embeddings = embeddings_of(config, shapes)
    embed = embeddings.input if embeddings.input in shapes and len(shapes[embeddings.input]) == 2 else None
    if vocab and embed and shapes[embed][0] != vocab:
        problems.append(f"config.json says vocab_size {vocab} but the embedding {embed} has {shapes[embed][0]} rows")
    head = embeddings.output
    if head and embed and head not in shapes and tie is False:
        problems.append(
            f"tie_word_embeddings is false but there is no {head}: transformers would start the output head random"
        )
    return problems


# -- recompute ---------------------------------------------------------------------------------


# -- behaviour ---------------------------------------------------------------------------------


def probe_ids(config: dict, plan):
    """Fixed token ids within both the config's vocabulary and the model's input embedding rows."""
    import torch

    from tui_merger.core.plan.plan import embeddings_of

    shapes = {t.name: t.shape for t in plan.tensors}
    embed = embeddings_of(config, shapes).input
    rows = shapes[embed][0] if embed in shapes and len(shapes[embed]) == 2 else None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab = min(v for v in (config.get("vocab_size", text.get("vocab_size")), rows, 1 << 30) if v)
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab, PROBE_SHAPE, generator=g)


def quiet_transformers():
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


class _Models:
    """The behaviour check in three steps that may run on different threads: ``prepare`` (imports,
    probes: once), ``merged`` (the merged model, as users will load it) and ``reference`` (the
    unmerged one, from the inputs); ``checks()`` compares them. A step that cannot run leaves the
    check to report (``early``) and the others are then not needed."""

    def __init__(self, out: Path, config: dict, options: MergeOptions, inputs, plan, text: Path | None,
                 merged_sink, reference_sink) -> None:
        import threading

        self.out, self.config, self.options, self.inputs, self.plan, self.text = out, config, options, inputs, plan, text
        self.merged_sink, self.reference_sink = merged_sink, reference_sink
        self.early: list[Check] | None = None  # the check's result without (both) runs
        self.ready = threading.Event()  # prepare() is done
        self.claimed = threading.Lock()  # whoever takes it runs the reference pass
        self.merged_out = self.reference_out = None
        self.peak = 0
        self.conversion = False
        self.merged_text_only = self.reference_text_only = None  # run through the language model (behaviour.run)
        self.bypassed: list[str] = []  # LoRA layers with non-zero B the reference's forward never called

    def _stop(self, checks: list[Check]) -> None:
        if self.early is None:
            self.early = checks

    def prepare(self) -> None:
        _prewarmed()
        try:
            self._prepare()
        finally:
            self.ready.set()

    def _prepare(self) -> None:
        import transformers

        from tui_merger.core.verify import behaviour as bh

        self.cls = model_class(self.config)
        if self.cls is None:
            archs = self.config.get("architectures") or ["(none)"]
            return self._stop([Check(
                "behaviour", "skip",
                f"skipped: {archs[0]} is not a transformers class (custom code); tui-merger never runs model code",
            )])
        quiet_transformers()
        bh.quiet()
        stored = self.options.dtype or self.inputs.dtype or config_dtype(self.config) or "float32"
        if self.options.output_quantization is not None:  # the changed weights are rounded to e4m3 (MXFP4: e2m1)
            scheme = getattr(self.inputs.base, "scheme", None)
            stored = "mxfp4" if scheme is not None and scheme.method == "mxfp4" else "float8_e4m3fn"
        self.stored = stored if stored in bh.UNIT_ROUNDOFF else "float32"
        self.probes = probe_ids(self.config, self.plan)
        name, need = bh.whole_unit_bytes(self.plan)
        available = _available_memory()
        if name is not None and available is not None and need > available:
            from tui_merger.core.options import human_bytes

            return self._stop([Check(
                "behaviour", "skip",
                f"skipped: running the model needs {name} whole in fp32, for the merged model and the unmerged "
                f"reference at once: about {human_bytes(need)} of memory, and {human_bytes(available)} is available; "
                "not fully verified: structure and recompute still hold (a machine with more memory runs it)",
                metrics={"probes": list(PROBE_SHAPE), "needs_bytes": need, "available_bytes": available},
            )])
        self.tokens = _perplexity_tokens(self.out, self.text) if self.text else None
        try:
            self.out_config = transformers.AutoConfig.from_pretrained(self.out)
        except Exception as err:  # noqa: BLE001 - transformers' own refusal of the file, said as it is
            return self._stop([Check("behaviour", "fail", f"transformers cannot read the merged model's config.json: {bh.first_line(err)}")])

    def merged(self, cancel: CancelToken) -> None:
        """1. the merged model, as users will load it"""
        from tui_merger.core.io.sources import open_model
        from tui_merger.core.verify import behaviour as bh

        if self.early is not None:
            return
        cls, out, on_event = self.cls, self.out, self.merged_sink
        try:
            written = _dequantized(open_model(out), out)
        except MergeError as err:
            return self._stop([Check("behaviour", "fail", f"the merged model's weights cannot be read: {err}")])
        try:
            on_event(PhaseStarted("behaviour", f"Running the merged model layer by layer ({cls.__name__}, fp32)"))
            try:
                if self.options.export_adapter:
                    model, missing = bh.streamer_with_adapter(
                        cls, self.out_config, written.tensors, [(out / "lora_adapter", None)], "merged model", on_event, cancel)
                else:
                    model, missing = bh.streamer_for_files(cls, self.out_config, written.tensors, "merged model", on_event, cancel)
            except StreamError as why:
                return self._stop([_cannot_stream("merged model", why)])
            except bh.NoReference as why:
                return self._stop([Check("behaviour", "fail", f"transformers cannot build the output as {cls.__name__}: {why}")])
            if missing and self.options.export_adapter and all(".lora_" in m for m in missing):
                # peft built LoRA layers it found no tensors for: it cannot place the exported adapter's
                # (per-expert LoRA on experts transformers 5 keeps packed), as it cannot for the reference
                return self._stop([Check(
                    "behaviour", "skip",
                    f"skipped: peft cannot apply the exported adapter to {cls.__name__} ({len(missing)} LoRA weight(s) "
                    f"it expects are not in lora_adapter/: {', '.join(missing[:3])}); not fully verified",
                    metrics={"probes": list(PROBE_SHAPE)},
                )])
            if missing:
                return self._stop([Check(
                    "behaviour", "fail", f"{cls.__name__} does not find {len(missing)} of its weights in the files",
                    [f"missing from the files (transformers starts them random): {', '.join(missing[:10])}"],
                )])
            try:
                logits, hidden = bh.run(model, self.probes)
                ppl = _perplexity(model, self.tokens, self.config) if self.tokens is not None else None
            except (MergeCancelled, KeyboardInterrupt):
                raise
            except Exception as why:  # noqa: BLE001 - transformers' forward over streamed weights
                return self._stop([_cannot_stream("merged model", why)])
            self.peak = max(self.peak, model.stats.peak_live_values)
            self.merged_out = (logits, hidden, ppl)
            self.merged_text_only = model.text_only
            model.close()
        finally:
            written.close()
            libc.trim_heap()

    def reference(self, cancel: CancelToken) -> None:
        """2. the unmerged reference (what it is, the checkpoint's kind says)"""
        from tui_merger.core.formats.inputs import reference as reference_of
        from tui_merger.core.verify import behaviour as bh

        if self.early is not None:
            return
        _prewarm_finished()  # its run of the reference, if it is making one
        ahead = _AHEAD.pop(_ahead_key(self.options, self.config, self.probes), None) if self.tokens is None else None
        if ahead is not None:  # run while the merge was writing (prewarming)
            logits, hidden, peak, self.reference_text_only, self.bypassed = ahead
            self.peak = max(self.peak, peak)
            self.reference_out = (logits, hidden, None)
            return
        on_event = self.reference_sink
        with bh.temporary_folder() as tmp:
            spec = reference_of(self.inputs, self.options, tmp)
            if spec is None:  # a conversion: the tensors are the checkpoint's
                self.conversion = True
                return
            on_event(PhaseStarted("behaviour", "Running the unmerged reference (base + adapter through peft) layer by layer"))
            try:
                model = _reference_streamer(self.cls, self.config, self.out_config, spec, self.inputs, on_event, cancel)
            except (bh.NoReference, StreamError) as why:
                self.reference_out = Check("behaviour", "skip", f"skipped: {why}; not fully verified",
                                           metrics={"probes": list(PROBE_SHAPE)})
                return
            try:
                with bh.recording_calls(model.model) as called:
                    logits, hidden = bh.run(model, self.probes)
                self.bypassed = bh.bypassed_loras(model, called)
                ppl = _perplexity(model, self.tokens, self.config) if self.tokens is not None else None
            except (MergeCancelled, KeyboardInterrupt):
                raise
            except Exception as why:  # noqa: BLE001
                self.reference_out = _cannot_stream("unmerged reference", why)
                return
            self.peak = max(self.peak, model.stats.peak_live_values)
            self.reference_out = (logits, hidden, ppl)
            self.reference_text_only = model.text_only
            model.close()
            libc.trim_heap()

    def checks(self) -> list[Check]:
        if self.early is not None:
            return self.early
        merged, merged_hidden, ppl_merged = self.merged_out
        if self.conversion:
            return [_loads_check(self.cls.__name__, merged, self.peak)]
        if isinstance(self.reference_out, Check):
            return [self.reference_out]
        reference, ref_hidden, ppl_ref = self.reference_out
        name = self.cls.__name__
        if self.merged_text_only != self.reference_text_only:  # one side ran whole, the other only its text part
            return [Check("behaviour", "skip", "skipped: the merged model and the unmerged reference could not be run "
                          "the same way; not fully verified", metrics={"probes": list(PROBE_SHAPE)})]
        if self.merged_text_only:
            name = self.merged_text_only
        checks = [_layer_check(name, self.plan, self.stored, merged, reference, merged_hidden, ref_hidden,
                               self.peak, _reference_words(self.options))]
        if checks[0].status == "fail" and self.bypassed:
            checks[0] = _bypassed_check(self.bypassed, name, checks[0])
        if self.tokens is not None:
            delta = abs(ppl_merged - ppl_ref)
            status = "pass" if delta <= PPL_TOLERANCE else "fail"
            checks.append(Check(
                "perplexity", status,
                f"perplexity {ppl_merged:.3f} merged vs {ppl_ref:.3f} unmerged on {self.tokens.numel()} tokens of {self.text.name}"
                + ("" if status == "pass" else f": moved by {delta:.3f} (> {PPL_TOLERANCE})"),
                metrics={"merged": ppl_merged, "reference": ppl_ref, "tokens": self.tokens.numel()},
            ))
        return checks


def _bypassed_check(bypassed: list[str], cls_name: str, compared: Check) -> Check:
    """The outputs differ, and the adapter has LoRA the unmerged model never applies: the comparison
    cannot tell a wrong merge from that, so it judges nothing (recompute still holds every tensor)."""
    more = f" and {len(bypassed) - 1} more" if len(bypassed) > 1 else ""
    return Check(
        "behaviour", "skip",
        f"skipped: the adapter has a non-zero LoRA on {bypassed[0]}{more}, which {cls_name}'s forward never calls "
        "(it reads the weight itself), so the unmerged adapter leaves it out while the merge puts it in, as peft's "
        "merge_and_unload does; the two cannot be compared. Training through this forward gives such a LoRA no "
        "gradient (its lora_B stays zero), so check how the adapter was made. Not fully verified: structure and "
        "recompute still hold",
        [f"compared anyway: {compared.summary}", *compared.details, f"LoRA the unmerged forward never calls: {', '.join(bypassed[:10])}"],
        {**compared.metrics, "bypassed_loras": bypassed},
    )


def _cannot_stream(what: str, why: Exception) -> Check:
    from tui_merger.core.verify.behaviour import first_line

    reason = first_line(why)
    return Check(
        "behaviour", "skip",
        f"skipped: the {what} could not be run layer by layer ({reason}); not fully verified: structure and "
        "recompute still hold",
        metrics={"probes": list(PROBE_SHAPE)},
    )


def _reference_streamer(cls, config_dict: dict, out_config, spec, inputs, on_event, cancel=None):
    """The reference's adapters through peft on the base streamed from the inputs as the merge read
    them, built from the base's config (the adapter's resized vocabulary kept) or the output's
    (``config_dict``: its config.json, ``out_config``: as transformers reads it)."""
    import transformers

    from tui_merger.core.verify import behaviour as bh

    config = out_config
    if spec.config_dir is not None:
        config = transformers.AutoConfig.from_pretrained(spec.config_dir)
        vocab = _vocab_of(config_dict)
        text = getattr(config, "text_config", None) if not hasattr(config, "vocab_size") else None
        holder = text if text is not None else config
        if vocab and getattr(holder, "vocab_size", vocab) != vocab:
            holder.vocab_size = vocab  # as the adapter's training resized it; its saved rows replace the base's
    streamer, missing = bh.streamer_with_adapter(
        cls, config, independent_base(inputs.base).tensors, spec.adapters, "unmerged reference", on_event, cancel)
    if missing:
        raise bh.NoReference(
            f"the unmerged reference lacks {len(missing)} weight(s) transformers expects ({', '.join(missing[:3])})"
        )
    return streamer


def _loads_check(cls_name: str, logits, peak: int) -> Check:
    import torch

    metrics = {"probes": list(PROBE_SHAPE), "peak_live_values": peak}
    if not bool(torch.isfinite(logits).all()):
        return Check("behaviour", "fail", f"{cls_name} loads but its outputs hold NaN or Inf", [], metrics)
    return Check(
        "behaviour", "pass",
        f"{cls_name} loads every weight and runs: finite outputs (a conversion: the tensors equal the checkpoint's, "
        "see recompute; no second model is built)", [], metrics,
    )


def _layer_check(cls_name: str, plan, stored: str, merged, reference, merged_hidden, ref_hidden, peak: int,
                 who: str = "the adapter on the base") -> Check:
    """The behaviour check's result; its summary opens with a plain sentence (``who``: the unmerged
    reference in words) and gives the figures after it."""
    from tui_merger.core.verify import behaviour as bh

    details: list[str] = []
    layers = []
    if merged_hidden is not None and ref_hidden is not None and len(merged_hidden) == len(ref_hidden):
        counts = bh.rounded_by_depth(plan, len(ref_hidden))
        for i, (m, r) in enumerate(zip(merged_hidden, ref_hidden)):
            rel = bh.relative(m.float(), r.float(), centre=False)
            layers.append((i, rel, bh.limit(stored, counts[i])))
    total_rounded = sum(1 for t in plan.tensors if not t.raw_copy)
    centre = merged.shape[-1] > 1
    out_rel = bh.relative(merged, reference, centre=centre)
    out_limit = bh.limit(stored, total_rounded)
    first = next(((i, rel, lim) for i, rel, lim in layers if not rel <= lim), None)
    worst = max([rel / lim for _, rel, lim in layers] + [out_rel / out_limit])
    metrics = {
        "dtype": stored, "compute_dtype": "float32", "probes": list(PROBE_SHAPE),
        "output_rel_diff": out_rel, "output_limit": out_limit, "worst_ratio": worst,
        "layers": [[i, rel, lim] for i, rel, lim in layers], "max_abs_diff": (merged - reference).abs().max().item(),
        "peak_live_values": peak,
    }
    if centre:
        metrics["kl"] = bh.kl(reference, merged)
    ok = first is None and out_rel <= out_limit
    if first is not None:
        i, rel, lim = first
        where = "the embeddings' output" if i == 0 else f"layer {i - 1}'s output"
        details.append(f"{where} differs from the unmerged model by {rel:.2e} (limit {lim:.2e}): the first place it diverges")
        metrics["first_divergent"] = i
    what = f"{'logits' if centre else 'outputs'} {out_rel:.2e} apart, limit {out_limit:.2e}"
    if layers:
        what = f"{len(layers)} hidden states and {what}"
    if ok:
        plain = f"The merged model answers like {who}: largest difference {worst:.0%} of what rounding allows"
    else:
        import math

        plain = f"The merged model does not answer like {who}: " + (
            f"differences up to {worst:.1f} times what rounding allows" if math.isfinite(worst) else "its outputs hold NaN or Inf"
        )
        if first is not None:
            plain += f", from {details[0].split(' differs')[0]} on"
    lead = "layer by layer" if layers else "compared"
    return Check("behaviour", "pass" if ok else "fail", f"{plain} ({cls_name} {lead}: {what})", details, metrics)


def _reference_words(options) -> str:
    """What the merged model is compared with, in plain words."""
    if options.checkpoint is not None:
        return "the training checkpoint with its LoRA on the base"
    return "the adapters on the base" if len(options.adapter_weights()) > 1 else "the adapter on the base"


def _vocab_of(config: dict) -> int | None:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("vocab_size", text.get("vocab_size"))


def compare_logits(merged, reference, base, stored: str, missing: list, cls_name: str, cdtype: str) -> Check:
    details = [f"missing from the files (transformers starts them random): {', '.join(missing[:10])}"] if missing else []
    diff = (merged - reference).abs().max().item()
    metrics = {"max_abs_diff": diff, "dtype": stored, "compute_dtype": cdtype, "probes": list(PROBE_SHAPE)}
    if merged.shape[-1] > 1:
        from tui_merger.core.verify.behaviour import kl as kl_of

        kl = kl_of(reference, merged)
        metrics["kl"] = kl
        limit = KL_LIMIT[stored]
        ok = kl <= limit
        what = f"KL {kl:.2e} (limit {limit:.0e}), max |logit diff| {diff:.3g}"
        if base is not None:
            effect = kl_of(reference, base)
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
        logits = model(input_ids=chunk[None, :-1]).logits.float()[0]
        nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
        count += chunk.numel() - 1
    return math.exp(nll / count)


def _dequantized(written, out: Path):
    """An output written quantized (--keep-quantization, --quantize fp8) as transformers' dequantizing
    load reads it; a plain one as it is."""
    from tui_merger.core.formats.dequant import DequantSource, scheme_of

    config = json_object_or_none(out / "config.json") or {}
    scheme = scheme_of(config)
    if scheme is None:
        return written
    # read by the format's own dequantizing code (verify/dequant_ref.py), not the one the merge used
    view = independent_base(DequantSource(written, scheme, config))
    view.close = written.close  # the behaviour check closes what it opened
    return view
