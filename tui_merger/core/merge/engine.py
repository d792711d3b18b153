"""The merge pipeline: sources -> plan -> merge math -> sharded writer -> atomic rename.

``run_merge`` is what every front end calls; it reports through events and raises ``MergeError``
(one sentence for people) on any expected failure, after removing everything it wrote.
"""

from __future__ import annotations

import errno
import json
import queue
import threading
import time
from pathlib import Path

from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import (
    CancelToken,
    EventSink,
    MergeFinished,
    Notice,
    PhaseStarted,
    TensorProgress,
    TensorWritten,
    ignore_event,
)
from tui_merger.core.formats.adapter import empty_adapter
from tui_merger.core.formats.combine import export_adapter_folder, overlap_summary
from tui_merger.core.io import libc
from tui_merger.core.io.files import copy_files, edited_config
from tui_merger.core.formats.inputs import open_inputs, paths_of
from tui_merger.core.merge.journal import Journal, ShardHasher, fingerprint
from tui_merger.core.record.manifest import remember_hash
from tui_merger.core.merge.merge_math import FP16_MAX, Workspace, compute, fp16_overflows, row_blocks, threads_per_job
from tui_merger.core.options import MergeOptions, MergeResult
from tui_merger.core.merge.output import (
    PENDING_NAME,
    OutputFolder,
    OutputLock,
    UnverifiedOutput,
    check_space,
    check_target,
)
from tui_merger.core.plan.lineage import refuse_merged_twice
from tui_merger.core.plan.plan import TensorPlan
from tui_merger.core.merge.requant import output_plan
from tui_merger.core.io.safetensors_io import SafetensorsWriter

INDEX_NAME = "model.safetensors.index.json"
ADAPTER_DIR = "lora_adapter"


def run_merge(
    options: MergeOptions,
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
    fsync: bool = True,
) -> MergeResult:
    cancel = cancel or CancelToken()
    started = time.perf_counter()
    result = MergeResult(out=options.out)
    libc.large_blocks_mapped()  # blocks of 16 MB freed back to the OS, not kept in the threads' arenas

    def notice(level: str, message: str) -> None:
        if level == "warning":
            result.warnings.append(message)
        on_event(Notice(level, message))

    if options.out is None:
        raise MergeError("Say where to write the merged model (--out).")
    on_event(PhaseStarted("plan", "Reading the inputs"))
    unverified = None
    try:
        check_target(options.out, paths_of(options), options.overwrite)
    except UnverifiedOutput as err:
        if err.fingerprint is None:
            raise
        unverified = err
    refuse_merged_twice(options)  # an adapter the base already holds: refused, whatever else was accepted
    inputs = open_inputs(options)
    hasher = None
    try:
        for message in inputs.infos:
            notice("info", message)
        for message in inputs.notices:
            notice("warning", message)
        dtype = options.dtype or inputs.dtype
        config = {**inputs.config, **inputs.config_changes}
        merged_adapter = inputs.adapter
        if options.export_adapter:
            if not inputs.adapter.lora:
                raise MergeError("--export-adapter was given but the checkpoint holds no LoRA weights to export.")
            merged_adapter = empty_adapter(inputs.adapter.folder)
        plan = output_plan(inputs.base, merged_adapter, config, dtype, options.shard_size)
        result.tokenizer_source = inputs.files.tokenizer_source
        _describe_inputs(result, inputs, options)
        result.config_changes = {**inputs.config_changes, **plan.config_changes}
        if unverified is not None:  # a run of this same merge stopped after writing the model
            if unverified.fingerprint != fingerprint(options, inputs.read_files, plan):
                raise MergeError(str(unverified))
            _describe_earlier(result, plan, options)
            notice("info", f"{options.out} was merged by an earlier run of this merge that stopped before it was "
                           "verified; it is kept and verified now")
            result.seconds = time.perf_counter() - started
            on_event(MergeFinished(result))
            return result
        from tui_merger.core.record.manifest import InputHasher

        hasher = InputHasher(result.input_files)  # for the manifest, while the merge reads what it needs
        hasher.start()
        folder = OutputFolder(options.out)
        cancel.raise_if_cancelled()
        folder.make_parents()  # first: a read-only place is refused as such, not as "no space"
        lock = OutputLock(options.out)
        try:
            taken_over = lock.acquire()
        except BaseException:
            folder.remove_parents()
            raise
        if taken_over:
            notice("info", taken_over)
        try:
            tmp = folder.create()
            journal = Journal(tmp, fingerprint(options, inputs.read_files, plan), fsync)
            try:
                kept, resumed = journal.resume()
                if resumed:
                    notice("info", resumed)
                kept_bytes = sum((tmp / name).stat().st_size for name in kept)
                check_space(folder.parent, max(plan.total_bytes - kept_bytes, 0))
                _write(plan, tmp, options, result, on_event, notice, cancel, fsync, journal, set(kept))
                cancel.raise_if_cancelled()
                extra = export_adapter_folder(inputs.memory_adapter or inputs.adapter, tmp / ADAPTER_DIR, fsync) if options.export_adapter else []
                on_event(PhaseStarted("files", "Writing config, tokenizer and the other files"))
                out_config = edited_config(inputs.config, result.config_changes, dtype)
                (tmp / "config.json").write_text(json.dumps(out_config, indent=2, sort_keys=True) + "\n")
                result.files = sorted(
                    result.shards + ["config.json"] + copy_files(inputs.files, tmp) + extra
                )
                if len(plan.shards) > 1:
                    result.files = sorted(result.files + [INDEX_NAME])
                on_event(PhaseStarted("finalize", f"Moving the finished model into {options.out}"))
                cancel.raise_if_cancelled()
                (tmp / PENDING_NAME).write_text(json.dumps({"fingerprint": journal.fingerprint}) + "\n")
                journal.remove()
                folder.finalize(fsync=fsync)
            except BaseException as err:
                _stopped(err, folder, journal, options)
                raise
        finally:
            lock.release()
    except BaseException:
        if hasher is not None:
            hasher.stop()  # nothing will be recorded
        raise
    finally:
        inputs.close()
    result.seconds = time.perf_counter() - started
    on_event(MergeFinished(result))
    return result


def _describe_inputs(result: MergeResult, inputs, options: MergeOptions) -> None:
    """What the manifest needs to say about the inputs (cheap: metadata only)."""
    adapter = inputs.adapter
    result.input_files = list(dict.fromkeys(inputs.read_files))
    result.kind = "export-adapter" if options.export_adapter else ("merge" if adapter.lora else "convert")
    cfg = adapter.config
    if adapter.lora:
        targets = cfg.get("target_modules")
        if not targets:
            targets = sorted({m.rsplit(".", 1)[-1] for m in adapter.lora})
        variant = "dora" if cfg.get("use_dora") else ("rslora" if cfg.get("use_rslora") else "lora")
        result.adapter_info = {
            "r": cfg.get("r"),
            "alpha": cfg.get("lora_alpha"),  # the value used (peft's default or --lora-alpha when not recorded)
            **({"alpha_from": adapter.alpha_from} if getattr(adapter, "alpha_from", "") else {}),
            "variant": variant,
            "target_modules": sorted(targets) if isinstance(targets, list) else targets,
            "modules_to_save": cfg.get("modules_to_save") or [],
            "rank_pattern": cfg.get("rank_pattern") or {},
            "alpha_pattern": cfg.get("alpha_pattern") or {},
        }
        if cfg.get("combined"):  # a weighted merge: each adapter with its weight, and who touches what
            result.adapter_info["adapters"] = cfg["adapters"]
            result.adapter_info["r"] = sorted({d.get("r") for d in cfg["adapters"]}, key=str)
            result.adapter_info["alpha"] = sorted({d.get("lora_alpha") for d in cfg["adapters"]}, key=str)
            result.adapter_info["overlaps"] = overlap_summary(adapter)
    named = cfg.get("base_model_name_or_path") or inputs.config.get("_name_or_path")
    result.base_model = str(named) if named else (str(options.base) if options.base else None)
    result.base_weights = dict(inputs.base_weights)
    if options.checkpoint is None and options.base is not None:
        result.base_used = base_used(options.base, cfg.get("base_model_name_or_path"), len(adapter.lora), inputs.config)


def base_used(base, named, modules: int, config: dict) -> dict:
    """Which base model the adapter went into and why that one, for the manifest and the model card:
    its folder's name (a Hub id for a snapshot of the Hugging Face cache), what the adapter names, whether
    that is this very model (else whether it is on this machine at all), and what fits."""
    import os

    from tui_merger.core.io.hf_refs import resolve_model_reference

    base = Path(base)
    repo = next((p[len("models--"):].replace("--", "/") for p in Path(os.path.realpath(base)).parts
                 if p.startswith("models--")), None)
    named = named if isinstance(named, str) and named else None
    found = resolve_model_reference(named) if named else None
    same = named is not None and (
        (found is not None and os.path.realpath(found) == os.path.realpath(base)) or (repo is not None and named == repo)
    )
    arch = config.get("architectures")
    arch = arch[0] if isinstance(arch, list) and arch and isinstance(arch[0], str) else config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    return {
        "folder": base.name if repo is None else repo.split("/")[-1],
        "repo": repo,
        "named": named,
        "named_is_this": same,
        "named_found": found is not None,
        "modules": modules,
        "architecture": f"{arch}, {layers} layers" if arch and layers else (str(arch) if arch else None),
    }


def _describe_earlier(result: MergeResult, plan: TensorPlan, options: MergeOptions) -> None:
    """The result of the earlier run whose output is kept (what the manifest needs)."""
    from tui_merger.core.record.manifest import MANIFEST_NAME

    out = options.out
    skip = {PENDING_NAME, MANIFEST_NAME, "README.md"}
    result.files = sorted(
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and str(p.relative_to(out)) not in skip
    )
    result.shards = [name for name, _ in plan.shards]
    result.tensors_total = len(plan.tensors)
    result.tensors_merged = plan.merged_modules
    result.bytes_written = plan.total_bytes
    result.kept_earlier = True


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _stopped(err: BaseException, folder: OutputFolder, journal: Journal, options: MergeOptions) -> None:
    """After a failure: keep the finished shards for a resume when the merge was interrupted (Ctrl-C,
    SIGTERM, SIGHUP; ``CancelToken.interrupt``) or the disk filled up, else remove the partial folder;
    raises the sentence."""
    journal.wait()
    interrupted = isinstance(err, KeyboardInterrupt) or getattr(err, "interrupted", False)
    no_space = isinstance(err, OSError) and err.errno in _NO_SPACE
    if journal.kept and (interrupted or no_space):
        shards = f"the {journal.kept} finished shard(s) are kept in {folder.tmp}"
        if no_space:
            raise MergeError(
                f"The disk ran out of space while writing {options.out} ({err.strerror}); {shards}: free some "
                "space and run the same merge again to resume, or delete that folder."
            ) from None
        raise MergeCancelled(
            f"Interrupted: {shards}; run the same merge again to resume, or delete that folder."
        ) from None
    folder.abort()
    if isinstance(err, OSError):
        raise _os_error(err, options) from None


def _write_shard(path, tensors, options: MergeOptions, ws: Workspace, report, clamped: list, cancel: CancelToken,
                 fsync: bool) -> str | None:
    """Write one shard; returns its sha256 (taken while writing), None if it could not be."""
    writer = SafetensorsWriter(
        path,
        [(t.name, t.dtype, t.shape) for t in tensors],
        early_writeback=fsync,
        data_align=_copy_alignment(tensors),
    )
    copier = None
    putter = None
    threads = None
    hasher = None

    def done(t) -> None:
        start, nbytes = writer.places[t.name]
        hasher.add(start, start + nbytes)
        report(t, path)

    try:
        hasher = ShardHasher(path, writer.size)
        hasher.add(0, writer.header_size)
        hasher.start()
        copy_jobs, compute_jobs = [], []
        for t in tensors:
            raw = t.source.source.raw_ranges(t.source) if t.raw_copy else None
            if raw is not None:
                copy_jobs.append((writer, t, raw))
            else:
                compute_jobs.append((writer, t))
        copier = _Copier(copy_jobs, cancel)
        copier.start()
        putter = _Putter(writer, [ws, ws.partner()])
        putter.start()
        threads = _share_cores() if compute_jobs else None

        def drain() -> None:
            for finished in (copier.finished, putter.finished):
                while True:
                    try:
                        done(finished.get_nowait())
                    except queue.Empty:
                        break
            for worker in (copier, putter):
                if worker.error is not None:
                    raise worker.error

        for _, t in compute_jobs:
            cancel.raise_if_cancelled()
            drain()
            blocks = None if t.ops else t.source.source.row_blocks(t.source)
            if blocks is not None:  # a sharded checkpoint tensor: cast and written shard by shard
                _stream_shards(t, blocks, putter, cancel, options, clamped)
                continue
            for ref in t.inputs():
                ref.prefetch()
            streamed = row_blocks(t, ws)
            if streamed is not None:  # the common case: written a few MiB at a time as it is computed
                _stream(t, streamed, putter, options, clamped, cancel)
            else:
                slot = putter.free_slot(cancel)
                tensor = compute(t, ws=slot)
                if fp16_overflows(tensor, t):
                    if not options.force_fp16_overflow:
                        raise _overflow(t)
                    tensor = compute(t, clamp=True, ws=slot)
                    clamped.append(t.name)
                putter.put(slot, t, tensor)  # written by the second thread while the next one computes
                del tensor
            for ref in t.inputs():
                ref.release()
        putter.finish()
        while copier.is_alive() or putter.is_alive():
            drain()
            cancel.raise_if_cancelled()
            copier.join(timeout=0.1)
        drain()
        cancel.raise_if_cancelled()
        writer.close(fsync=fsync)
        return hasher.digest()
    except BaseException:
        if copier is not None:
            copier.halt()
        if putter is not None:
            putter.halt()
        writer.abort()
        if hasher is not None:
            hasher.abort()
        raise
    finally:
        if threads is not None:
            threads()


CHUNK_BYTES = 8 << 20  # a streamed tensor is handed to the writer in pieces of about this size


def _overflow(t) -> MergeError:
    return MergeError(
        f"{t.name} has values beyond float16's range (65504); the fp16 output would "
        "hold inf. Use --dtype bf16 or fp32, or --force to clamp the values."
    )


def _stream(t, blocks, putter: "_Putter", options: MergeOptions, clamped: list, cancel: CancelToken) -> None:
    """Round ``blocks`` (``merge_math.RowBlocks``) into pieces of about ``CHUNK_BYTES`` that the
    writer thread writes while the next piece is computed: two pieces are held, never the tensor
    (a 70B model's 28672x8192 MLP weight is 470 MB; two of them were held until this streamed).
    fp16: a block that holds inf where its source rows hold none overflowed (refused, or clamped
    with --force)."""
    import torch

    out_dtype = getattr(torch, t.dtype)
    rows, cols = blocks.shape
    row_bytes = cols * torch.empty((), dtype=out_dtype).element_size()
    per_piece = blocks.step * max(1, CHUNK_BYTES // (blocks.step * row_bytes))
    fp16 = out_dtype == torch.float16
    slot = piece = None
    start = 0
    for i, j, acc in blocks:
        if piece is None or j - start > piece.shape[0]:
            if piece is not None:
                putter.put_part(slot, t, start * row_bytes, piece[: i - start], last=False)
            slot = putter.free_slot(cancel)
            piece = slot.get("piece", (min(max(per_piece, j - i), rows - i), cols), out_dtype)
            start = i
        out = piece[i - start : j - start]
        out.copy_(acc)
        if fp16 and torch.isinf(out).any() and not torch.isinf(blocks.source_rows(i, j)).any():
            if not options.force_fp16_overflow:
                raise _overflow(t)
            out.copy_(acc.clamp_(-FP16_MAX, FP16_MAX))
            if t.name not in clamped[-1:]:
                clamped.append(t.name)
    putter.put_part(slot, t, start * row_bytes, piece[: rows - start], last=True)


def _share_cores():
    """Half the cores for torch on this thread while it computes (one on 2 cores): the writer, the
    copier, hashing and the checks made while writing use the rest, and small operations split
    across threads that other work keeps descheduled wait on each other (the blocked merge of 3B MLP
    weights: 16 ms per tensor on one thread, 48-225 ms on two of a busy 2-core box). Returns the
    call that puts the previous count back."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads_per_job(2))
    return lambda: torch.set_num_threads(previous)


class _Putter(threading.Thread):
    """Writes computed tensors (or pieces of one, ``_stream``) while the main thread computes the
    next: two workspaces take turns, a workspace is computed into again only once what it holds is
    written (writing 5.5 GB of merged tensors took 9 s at 3B shapes, computing them 3.6 s: in turn
    12.6 s, side by side about 9 s)."""

    def __init__(self, writer, workspaces) -> None:
        super().__init__(name="tui-merger-writer", daemon=True)
        self.writer = writer
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._free = {id(w): threading.Event() for w in workspaces}
        self._workspaces = list(workspaces)
        for event in self._free.values():
            event.set()
        self._turn = 0
        self._halt = threading.Event()

    def free_slot(self, cancel: CancelToken) -> Workspace:
        ws = self._workspaces[self._turn % len(self._workspaces)]
        self._turn += 1
        event = self._free[id(ws)]
        while not event.wait(0.1):
            cancel.raise_if_cancelled()
            if self.error is not None:
                raise self.error
        if self.error is not None:
            raise self.error
        event.clear()
        return ws

    def put(self, ws: Workspace, t, tensor) -> None:
        self.jobs.put((ws, t, None, tensor, True))

    def put_part(self, ws: Workspace, t, pos: int, part, last: bool) -> None:
        """A piece of ``t`` at byte ``pos`` of its place (pieces of one tensor in order, from 0)."""
        self.jobs.put((ws, t, pos, part, last))

    def finish(self) -> None:
        self.jobs.put(None)

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            ws, t, pos, tensor, last = job
            try:
                if self.error is None and not self._halt.is_set():
                    if pos is None:
                        self.writer.write_tensor(t.name, tensor)
                    else:
                        self.writer.write_part(t.name, t.nbytes, pos, tensor, last)
                    if last:
                        self.finished.put(t)
            except BaseException as err:  # handed to the main thread
                self.error = err
            finally:
                del tensor
                self._free[id(ws)].set()

    def halt(self) -> None:
        self._halt.set()
        self.jobs.put(None)
        self.join()


def _os_error(err: OSError, options: MergeOptions) -> MergeError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return MergeError(
            f"The disk ran out of space while writing {options.out} ({err.strerror}); the partial output "
            "was removed and the inputs are untouched: free some space and run the merge again."
        )
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return MergeError(
            f"Permission denied while writing {options.out} ({err.strerror}); choose a folder you can write to."
        )
    return MergeError(f"Writing {options.out} failed: {err.strerror or err}; the partial output was removed.")


def _copy_alignment(tensors) -> int | None:
    """Where in a 4 KiB page this shard's data should start so that the largest copied tensor keeps
    the page offset it has in its source file: copy_file_range is ~2.4x slower between misaligned
    offsets. Tensors following it in the same source file then line up as well."""
    best, rel, offset = None, 0, 0
    for t in tensors:
        if t.raw_copy and (best is None or t.nbytes > best[0]):
            raw = t.source.source.raw_ranges(t.source)
            if raw is not None:
                best, rel = (t.nbytes, raw[0][1]), offset
        offset += t.nbytes
    if best is None:
        return None
    return (best[1] - rel) % 4096


class _Copier(threading.Thread):
    """Copies the untouched tensors (kernel-side byte copies, no torch needed) while the main thread
    imports torch and computes the merged ones. Only the main thread reports progress."""

    def __init__(self, jobs, cancel: CancelToken) -> None:
        super().__init__(name="tui-merger-copier", daemon=True)
        self.jobs = jobs  # [(writer, tensor, [(fd, offset, length), ...])]
        self.cancel = cancel
        self.finished: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            for writer, t, raw in self.jobs:
                if self._halt.is_set() or self.cancel.cancelled:
                    return
                writer.copy_from(t.name, raw)
                self.finished.put(t)
        except BaseException as err:  # handed to the main thread
            self.error = err

    def halt(self) -> None:
        self._halt.set()
        self.join()


def _stream_shards(t, blocks, putter: "_Putter", cancel: CancelToken, options: MergeOptions, clamped: list) -> None:
    """A checkpoint's tensor given in its shards (``row_blocks`` of its source: a verl FSDP tensor's
    rank shards, in order), cast into pieces of about ``CHUNK_BYTES`` that the writer thread writes
    while the next piece is cast; each shard's pages are handed back once it is cast. Memory stays
    at two pieces (a whole rank shard was cast into one buffer: a 0.5B embedding in 4 ranks, 68 MB;
    a 70B one in 8 ranks, 262 MB). fp16: a piece that holds inf where its source holds none
    overflowed (refused, or clamped with --force), as ``_stream`` does (fp16 outputs were cast whole)."""
    import torch

    out_dtype = getattr(torch, t.dtype)
    fp16 = out_dtype == torch.float16
    size = torch.empty((), dtype=out_dtype).element_size()
    per_piece = max(1, CHUNK_BYTES // size)
    pos = 0
    for block, release in blocks:
        flat = block.reshape(-1)
        for k in range(0, flat.numel(), per_piece):
            part = flat[k : k + per_piece]
            slot = putter.free_slot(cancel)
            piece = slot.get("piece", (part.numel(),), out_dtype)
            piece.copy_(part)
            if fp16 and torch.isinf(piece).any() and not torch.isinf(part).any():
                if not options.force_fp16_overflow:
                    raise _overflow(t)
                piece.copy_(part.clamp(-FP16_MAX, FP16_MAX))
                if t.name not in clamped[-1:]:
                    clamped.append(t.name)
            putter.put_part(slot, t, pos, piece, last=pos + part.numel() * size == t.nbytes)
            pos += part.numel() * size
        release()
    if pos == 0 == t.nbytes:  # an empty tensor still takes its place
        putter.put_part(putter.free_slot(cancel), t, 0, torch.empty(0, dtype=out_dtype), last=True)
    elif pos != t.nbytes:
        raise RuntimeError(f"{t.name}: its shards hold {pos} of {t.nbytes} bytes")


def _write(
    plan: TensorPlan,
    tmp,
    options: MergeOptions,
    result: MergeResult,
    on_event: EventSink,
    notice,
    cancel: CancelToken,
    fsync: bool,
    journal: Journal,
    kept: set[str],
) -> None:
    """Write the shards one after the other (a finished shard is journaled, so that an interrupted
    merge resumes after it); within a shard, untouched tensors are copied by a second thread while
    merged ones are computed."""
    total_bytes = plan.total_bytes
    total = len(plan.tensors)
    if plan.merged_modules:
        message = f"Merging {plan.merged_modules} tensors, copying {total - plan.merged_modules}"
    else:
        message = f"Writing {total} tensors"
    on_event(PhaseStarted("merge", message))
    progress = {"done": 0, "bytes": 0}

    def report(t, path=None) -> None:
        cancel.raise_if_cancelled()
        if path is not None:  # written by this run (a kept shard's tensors are only counted)
            on_event(TensorWritten(str(path), t.name))
        progress["done"] += 1
        progress["bytes"] += t.nbytes
        on_event(TensorProgress(t.name, progress["done"], total, progress["bytes"], total_bytes))

    clamped = []
    ws = Workspace()
    for n, (shard_name, tensors) in enumerate(plan.shards):
        if shard_name in kept:  # finished by the interrupted merge, checked against the journal
            for t in tensors:
                report(t)
            result.shards.append(shard_name)
            continue
        digest = _write_shard(tmp / shard_name, tensors, options, ws, report, clamped, cancel, fsync)
        result.shards.append(shard_name)
        if n < len(plan.shards) - 1:  # the last one is followed by the final rename at once
            journal.finished(shard_name, digest)
        elif digest is not None:
            remember_hash(tmp / shard_name, digest)  # the manifest takes it from there
    if clamped:
        notice("warning", f"Clamped values beyond float16's range in {len(clamped)} tensors ({clamped[0]}, ...).")
    if len(plan.shards) > 1:
        weight_map = {t.name: shard_name for shard_name, tensors in plan.shards for t in tensors}
        index = {
            "metadata": {"total_size": total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    result.tensors_total = total
    result.tensors_merged = plan.merged_modules
    result.bytes_written = total_bytes
