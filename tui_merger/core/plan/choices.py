"""From a detected checkpoint to merge options: what the interactive front ends (the TUI and the plain
flow) ask the user, and what they fill in by themselves."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tui_merger.core.errors import MergeError
from tui_merger.core.options import MergeOptions


def _format(c):
    from tui_merger.core.formats.registry import format_of

    return format_of(c)


def why_not_mergeable(c) -> str | None:
    """None when tui-merger can merge this candidate, else one sentence why not."""
    fmt = _format(c)
    if fmt is None:
        return f"tui-merger cannot merge a {c.kind}."
    return fmt.why_not_mergeable(c)


def needs_base(c) -> bool:
    """The user must give the base model folder (it is not named, or not on this machine)."""
    return _format(c).needs_base(c)


def needs_alpha(c) -> bool:
    """The checkpoint records no lora_alpha: ask for the one training used."""
    return _format(c).needs_alpha(c)


def alpha_why(c) -> str:
    """Why the alpha is asked, in the words of a clause: none is recorded, or the recorded one is 0."""
    if c.lora and c.lora.get("alpha") is not None and not c.lora.get("alpha"):
        return "the checkpoint records 0, which would change nothing"
    return "the checkpoint does not record it"


def alpha_default(c) -> float | None:
    """The alpha the merge uses when that question is left empty (None: an answer is needed)."""
    return _format(c).alpha_default(c)


def can_weight(c) -> bool:
    """An adapter the user may weight and blend with other adapters (not a checkpoint's own LoRA)."""
    return _format(c).can_weight(c)


def is_checkpoint(c) -> bool:
    """A checkpoint that carries what the merge reads (opened as --checkpoint, not merged into --base)."""
    fmt = _format(c)
    return fmt is not None and fmt.role == "checkpoint"


def _written(c) -> float:
    """When a checkpoint was last written: its newest file (not looking into sub-folders: a run folder's
    own final save is not made newer by the checkpoint-N folders beside it), else its folder."""
    newest = 0.0
    try:
        with os.scandir(c.path) as it:
            for e in it:
                try:
                    if e.is_file():
                        newest = max(newest, e.stat().st_mtime)
                except OSError:
                    continue
        return newest or os.stat(c.path).st_mtime
    except OSError:
        try:
            return os.stat(c.path).st_mtime
        except OSError:
            return 0.0


def proposed(candidates) -> tuple[object, str] | None:
    """The one checkpoint the front ends propose (inspect's "Next:", the plain flow's first choice, the
    assistant's highlighted row), and why, in words; None when none can be merged.

    The rule: the run of the most recently written checkpoint that can be merged; in a run (checkpoint-N or
    global_step_N folders) its newest step (the one ``latest_checkpointed_iteration.txt`` names, else the
    highest), unless the run folder itself holds a final save (HF Trainer's ``save_model`` after training)
    written no earlier than that step: that is what the training ended with, so it is proposed."""
    mergeable = [c for c in candidates if why_not_mergeable(c) is None]
    if not mergeable:
        return None
    newest = max(mergeable, key=_written)
    run = os.path.realpath(newest.run if newest.run is not None else newest.path)
    steps = [c for c in mergeable if c.run is not None and c.step is not None and os.path.realpath(c.run) == run]
    final = next((c for c in mergeable if c.step is None and os.path.realpath(c.path) == run), None)
    top = next((c for c in candidates if c.step is None and os.path.realpath(c.path) == run), None)
    if steps and final is None and top is not None:
        also_top = "; the model at the top of the run is already complete (nothing to merge)"
    else:
        also_top = ""
    if not steps:
        if len(mergeable) == 1:
            return newest, "the only checkpoint here that can be merged"
        return newest, "the most recently written checkpoint here"
    last = next((c for c in steps if c.latest), None) or max(steps, key=lambda c: c.step)
    best = next((c for c in steps if c.best), None)
    also = f"; best_model_checkpoint is step {best.step}" if best is not None and best is not last else ""
    if final is not None:
        if _written(final) >= _written(last):
            return final, (f"the final save at the top of the run: written after its newest checkpoint, step "
                           f"{last.step}, it is what the training ended with{also}")
        return last, f"the newest step, {last.step}: the save at the top of the run is older than it{also}"
    return last, f"the newest step of the run, {last.step}{also}{also_top}"


def proposed_index(candidates) -> int | None:
    """Where ``proposed`` is in the list (the assistant highlights it)."""
    found = proposed(candidates)
    return None if found is None else next(i for i, c in enumerate(candidates) if c is found[0])


def parse_more_adapters(text: str) -> list:
    """'a:0.3; b:0.5' -> [(a, 0.3), (b, 0.5)] (what the TUI's "more adapters" field holds)."""
    from tui_merger.core.options import parse_adapter_spec

    return [parse_adapter_spec(item.strip()) for item in (text or "").split(";") if item.strip()]


def default_out_folder(c) -> tuple[Path, str]:
    """Where the merged model goes by default, and that place in words: beside the training folder
    (the run, else the checkpoint), else (not writable there) the current folder."""
    import os

    beside = Path(c.run or c.path).parent
    if os.access(beside, os.W_OK):
        return beside, f"beside the training folder, into {beside}"
    return Path.cwd(), f"into the current folder, {Path.cwd()}, because {beside} is not writable"


def holds_files(folder: Path) -> bool:
    """A folder with something in it (merging into it needs --overwrite / "Replace")."""
    try:
        return Path(folder).is_dir() and any(Path(folder).iterdir())
    except OSError:
        return True  # unreadable: treat as taken


def free_output(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``, ... : the first name that is not an existing folder with
    files in it (nor a file), so a suggestion never collides with an earlier run's output."""
    path = Path(path)
    candidate, n = path, 1
    while candidate.is_file() or holds_files(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def options_for(c, *, base=None, out=None, lora_alpha=None, weight="1", more="", **write_options) -> MergeOptions:
    """MergeOptions for a candidate; ``write_options``: dtype, shard_size, tokenizer_from, overwrite.
    ``weight`` and ``more`` ('path:weight; ...') make a weighted merge of several adapters."""
    problem = why_not_mergeable(c)
    if problem:
        raise MergeError(problem)
    checkpoint = is_checkpoint(c)
    base = base or (c.base_path if not checkpoint else None)
    if checkpoint:
        return MergeOptions(checkpoint=Path(c.path), base=base, out=out, lora_alpha=lora_alpha, **write_options)
    if not base:
        raise MergeError("Say which base model the adapter was trained on (a folder with config.json).")
    from tui_merger.core.options import parse_weight

    extra = parse_more_adapters(more)
    first = (Path(c.path), parse_weight(weight, Path(c.path).name))
    if extra or first[1] != 1.0:
        return MergeOptions(base=Path(base), adapters=[first, *extra], out=out, lora_alpha=lora_alpha, **write_options)
    return MergeOptions(base=Path(base), adapter=Path(c.path), out=out, lora_alpha=lora_alpha, **write_options)


def not_a_checkpoint(path, base=None, out=None, adapters=False) -> tuple[Path | None, Path, str] | None:
    """A path given where a checkpoint goes (``tui-merger merge PATH``) that is no checkpoint: (the
    adapter, its base, what was taken in words) for an adapter when ``base`` is given or the adapter
    names one on this machine; (None, the model, words) for a complete model when ``adapters`` were
    given (``merge BASE --adapter A``). None when the path is anything else (a checkpoint's kind then
    opens it, or says what is missing). An adapter whose base is unknown, or a complete model with no
    adapter, raises the sentence with the command to run instead."""
    from tui_merger.core.formats.registry import format_of, formats
    from tui_merger.core.formats.scan import scan

    path = Path(path)
    if not path.exists() or any(f.recognizes(path) for f in formats("checkpoint")):
        return None
    try:
        found = scan(path).candidates
    except MergeError:
        return None
    here = os.path.realpath(path)
    c = next((c for c in found if os.path.realpath(c.path) == here), None)
    fmt = format_of(c) if c is not None else None
    if fmt is None or fmt.role not in ("adapter", "model"):
        return None
    import shlex

    q = lambda p: shlex.quote(str(p))  # noqa: E731
    target = q(out) if out else "OUT"
    if fmt.role == "model" and adapters and base is None:
        return None, path, f"{path} is {fmt.label}: it is the base the adapter goes into (--base)."
    if fmt.role == "model":
        raise MergeError(
            f"{path} is already a complete model ({fmt.label}), so there is nothing to merge; to merge an "
            f"adapter into it, run `tui-merger merge --base {q(path)} --adapter ADAPTER --out {target}`."
        )
    if adapters:
        raise MergeError(f"{path} is {fmt.label}; give every adapter with --adapter, and the base model with --base.")
    if base is not None:
        return path, Path(base), f"{path} is {fmt.label}: it is merged into {base} as --adapter."
    if c.base_resolves in ("path", "hf-cache") and c.base_path:
        return path, Path(c.base_path), f"{path} is {fmt.label}: it is merged into {c.base_path}, the base model it names."
    named = f" (it names {c.base_model}, which is not on this machine)" if c.base_model else ""
    raise MergeError(
        f"{path} is {fmt.label}, not a training checkpoint, and its base model is not known here{named}; "
        f"merge it into the model it was trained on with `tui-merger merge --base MODEL --adapter {q(path)} --out {target}`."
    )


def describe_candidate(c, root: Path | None = None) -> str:
    """One line: kind, path, step (latest), LoRA r/alpha."""
    path = Path(c.path)
    try:
        shown = str(path.relative_to(root)) if root else str(path)
    except ValueError:
        shown = str(path)
    if shown in ("", "."):  # the folder itself (an HF Trainer run's final adapter): its name, said so
        shown = f"{path.name or path} (this folder)"
    parts = [c.kind, shown]
    if c.step is not None:
        parts.append(f"step {c.step}" + (" (latest)" if c.latest else "") + (" (best)" if c.best else ""))
    if c.lora:
        alpha = c.lora.get("alpha")
        parts.append(f"LoRA r={c.lora.get('r')} alpha={'missing' if not alpha else alpha}")
    return "  ".join(parts)


# -- the base model, when the adapter's own does not resolve ----------------------------------------


def models_found(candidates) -> list[Path]:
    """The complete models among the candidates of a scan (what an adapter could be merged into)."""
    from tui_merger.core.formats.registry import format_of

    return [Path(c.path) for c in candidates if (f := format_of(c)) is not None and f.role == "model" and c.step is None]


def cached_models() -> list[Path]:
    """The model snapshots in the local Hugging Face cache (read offline by huggingface_hub's
    ``scan_cache_dir``; refs/main first, else the newest revision); none when there is no cache."""
    from tui_merger.core.io.hf_refs import hub_cache

    cache = hub_cache()
    if not cache.is_dir():
        return []
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(cache)
    except Exception:  # no cache, a damaged one, or no huggingface_hub: nothing proposed from there
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        main = repo.refs.get("main")
        revision = main or max(repo.revisions, key=lambda r: r.last_modified)
        if (Path(revision.snapshot_path) / "config.json").is_file():
            found.append(Path(revision.snapshot_path))
    return found


def base_candidates(adapter_path, found_models=(), *, cache: bool = True) -> list[tuple[Path, str]]:
    """The models on this machine the adapter fits, best first, each with why in words: those given
    (the scan's) and, with ``cache``, the Hugging Face cache's. A model fits when every LoRA module of
    the adapter is a weight there whose shape its A/B pair matches (and its model type is the one a
    config saved beside the adapter names). Reads configs and safetensors headers only; models stored
    as .bin, quantized ones, unreadable ones and merged ones (a manifest that records an adapter:
    proposing one would merge an adapter twice, see lineage.py) are left out."""
    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.plan.lineage import records_adapter

    adapter_path = Path(adapter_path)
    named = _named_base(adapter_path)
    side = json_object_or_none(adapter_path / "config.json") if adapter_path.is_dir() else None
    seen, ranked = set(), []
    paths = [(Path(p), True) for p in found_models] + [(p, False) for p in (cached_models() if cache else [])]
    for path, local in paths:
        key = os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        if records_adapter(path):  # a merged model: it holds an adapter already (perhaps this very one)
            continue
        fit = _fit(adapter_path, path, side)
        if fit is None:
            continue
        modules, config, what = fit
        by_name = bool(named) and (named in (path.name, str(path)) or Path(named).name == path.name
                                   or _repo_of(path) in (named, Path(named).name))
        same_arch = bool(side) and (side.get("architectures") or None) == (config.get("architectures") or None)
        why = [f"fits all {modules} {what}", _arch_words(config)]
        if by_name:
            why.insert(0, "named like the adapter's base")
        why.append("found in the folder" if local else "in the Hugging Face cache")
        score = (by_name, same_arch, local, _shared_parts(adapter_path, path))
        ranked.append((score, path, "; ".join(w for w in why if w)))
    ranked.sort(key=lambda item: item[0], reverse=True)
    return [(path, why) for _, path, why in ranked]


def _named_base(adapter_path: Path) -> str | None:
    from tui_merger.core.io.files import json_object_or_none

    if not adapter_path.is_dir():
        return None
    cfg = json_object_or_none(adapter_path / "adapter_config.json") or {}
    named = cfg.get("base_model_name_or_path")
    return named if isinstance(named, str) and named else None


def _repo_of(path: Path) -> str | None:
    """ORG/NAME of a snapshot in the Hugging Face cache (.../models--ORG--NAME/snapshots/SHA)."""
    for part in path.parts:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return None


def _shared_parts(a: Path, b: Path) -> int:
    """How many leading path parts two paths share (a model nearer the adapter ranks higher)."""
    n = 0
    for x, y in zip(Path(os.path.abspath(a)).parts, Path(os.path.abspath(b)).parts):
        if x != y:
            break
        n += 1
    return n


def _arch_words(config: dict) -> str:
    arch = config.get("architectures")
    arch = arch[0] if isinstance(arch, list) and arch else config.get("model_type")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    layers = config.get("num_hidden_layers", text.get("num_hidden_layers"))
    return f"{arch}, {layers} layers" if arch and layers else str(arch or "")


def _fit(adapter_path: Path, model: Path, side: dict | None) -> tuple[int, dict, str] | None:
    """(how many LoRA modules or weights fit, the model's config, what they are in words) when the
    adapter fits the model (a checkpoint of full weights without config: when the model has every one
    of its weights, shape for shape, and no other), else None."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.formats.registry import checkpoint_lora, checkpoint_weights, model_format, open_adapter
    from tui_merger.core.io.files import json_object_or_none
    from tui_merger.core.io.sources import find_weight_files

    config = json_object_or_none(model / "config.json")
    if not config or config.get("quantization_config"):
        return None
    if side and side.get("model_type") and config.get("model_type") and side["model_type"] != config["model_type"]:
        return None
    try:
        files = find_weight_files(model)
        if not files or not all(f.endswith(".safetensors") for f in files):
            return None  # only safetensors headers are cheap to read
        base = model_format().open_base(model)
    except (MergeError, OSError, ValueError):
        return None
    try:
        weights = checkpoint_weights(adapter_path) if adapter_path.is_dir() else None
        if weights:
            from tui_merger.core.plan.plan import embeddings_of

            have = {name: tuple(ref.shape) for name, ref in base.tensors.items()}
            head = embeddings_of(config, have).output  # transformers' name for the output head on disk
            tied_head = head is not None and head in weights and head not in have
            same = all(have.get(n) == tuple(s) for n, s in weights.items() if not (tied_head and n == head))
            return (len(weights), config, "weights") if same and set(have) <= set(weights) else None
        try:
            adapter = (adapter_path.is_dir() and checkpoint_lora(adapter_path)) or open_adapter(adapter_path, base.tensors)
        except (MergeError, OSError, ValueError):
            return None  # a kohya file whose names fit none of this model's modules, or unreadable
        try:
            shapes = {name: tuple(ref.shape) for name, ref in base.tensors.items()}
            return (len(adapter.lora), config, "LoRA modules") if adapter.lora and _shapes_fit(adapter, shapes) else None
        finally:
            adapter.close()
    finally:
        base.close()


def _shapes_fit(adapter, shapes: dict) -> bool:
    """Every LoRA module's A/B pair against the base weight it changes (names as the adapter saved
    them, or the same module path under other leading parts, as vision-language models keep them)."""
    by_tail: dict[str, list[str]] = {}
    for name in shapes:
        if name.endswith(".weight"):
            parts = name[: -len(".weight")].split(".")
            for i in range(1, len(parts) - 1):
                by_tail.setdefault(".".join(parts[i:]), []).append(name)
    flip = adapter.fan_in_fan_out
    for mod, entry in adapter.lora.items():
        name = f"{mod}.weight"
        if name not in shapes:
            parts = mod.split(".")
            name = next((m[0] for i in range(1, len(parts) - 1) if len(m := by_tail.get(".".join(parts[i:]), ())) == 1), None)
            if name is None:
                return False
        shape = shapes[name]
        if len(shape) != 2:
            return False
        if entry.is_embedding:
            a, b = entry.emb_A, entry.emb_B
            if a is None or b is None or (a.shape[-1], b.shape[0]) != shape:
                return False
            continue
        if entry.A is None or entry.B is None:
            return False
        want = (entry.B.shape[0], entry.A.shape[-1])
        if want != tuple(shape) and not (flip and want[::-1] == tuple(shape)):
            return False
    return True


# -- the base model's config, beside the adapter's ---------------------------------------------------


@dataclass
class ConfigField:
    """One field of the base model's config, and what the adapter side says when it differs."""

    name: str  # "layers", "vocab", ...
    value: str  # as the base's config.json has it
    other: str | None = None  # the adapter side's value, when it differs
    where: str = ""  # where that other value comes from ("the adapter's base config", ...)


def base_config_fields(base_dir, adapter_paths=()) -> list[ConfigField]:
    """The base model's config in a few fields (architecture, layers, hidden size, heads / KV heads,
    vocabulary, dtype, rope_theta, max positions), each marked where the first adapter folder's side
    disagrees: the base config saved beside it (or the model its adapter_config.json names, when that is
    on this machine), its saved embedding rows (a resized vocabulary), its tokenizer's size. Reads JSON
    files and one safetensors header; empty when the base has no readable config.json."""
    from tui_merger.core.io.files import config_dtype, json_object_or_none
    from tui_merger.core.plan.preflight import _adapter_side_config, _field, _rope, _tokenizer_size

    config = json_object_or_none(Path(base_dir) / "config.json") if base_dir else None
    if not config:
        return []
    folder = next((Path(p) for p in adapter_paths if Path(p).is_dir()), None)
    side, where = _adapter_side_config(folder) if folder is not None else (None, "")
    side = side or {}
    where = "the adapter's base config" if where else ""

    def arch(cfg):
        names = cfg.get("architectures")
        return str(names[0]) if isinstance(names, list) and names else cfg.get("model_type")

    def kv(cfg):
        return _field(cfg, "num_key_value_heads") or _field(cfg, "num_attention_heads")

    rope, side_rope = _rope(config), _rope(side)
    rows = [
        ("architecture", arch(config), arch(side)),
        ("layers", _field(config, "num_hidden_layers"), _field(side, "num_hidden_layers")),
        ("hidden", _field(config, "hidden_size"), _field(side, "hidden_size")),
        ("heads", _field(config, "num_attention_heads"), _field(side, "num_attention_heads")),
        ("KV heads", kv(config), kv(side) if side else None),
        ("vocab", _field(config, "vocab_size"), _field(side, "vocab_size")),
        ("dtype", config_dtype(config), None),  # a base stored in another dtype than training used is normal
        ("rope_theta", rope.get("rope_theta"), side_rope.get("rope_theta")),
        ("max positions", rope.get("max_position_embeddings"), side_rope.get("max_position_embeddings")),
    ]
    fields = []
    for name, value, other in rows:
        if value is None:
            continue
        differs = other is not None and str(other) != str(value)
        fields.append(ConfigField(name, _plain(value), _plain(other) if differs else None, where if differs else ""))
    vocab = next((f for f in fields if f.name == "vocab"), None)
    if vocab is not None and folder is not None and vocab.other is None:
        rows_saved = _saved_embedding_rows(folder, config)
        tokens = _tokenizer_size(folder)
        if rows_saved and str(rows_saved) != vocab.value:
            vocab.other, vocab.where = str(rows_saved), "the adapter's saved embedding (a resized vocabulary)"
        elif tokens and str(vocab.value).isdigit() and tokens > int(vocab.value):
            vocab.other, vocab.where = f"{tokens} tokens", "the adapter's tokenizer"
    return fields


def _plain(value) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _saved_embedding_rows(folder: Path, config: dict | None = None) -> int | None:
    """Rows of an input embedding the adapter saves whole (modules_to_save after a resize): the tensor
    transformers takes as the input embedding of the model ``config`` describes (``plan.embeddings_of``,
    under the names peft saves: the model's own after ``base_model.model.``)."""
    from tui_merger.core.io.safetensors_io import SafetensorsFile
    from tui_merger.core.plan.plan import embeddings_of

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        return None
    try:
        header = SafetensorsFile(path)
    except Exception:
        return None
    try:
        whole = {name.removeprefix("base_model.model."): tuple(info.shape) for name, info in header.tensors.items()
                 if ".lora_" not in name and len(info.shape) == 2}
    finally:
        header.close()
    if not whole:
        return None
    embed = embeddings_of(config or {}, whole).input
    return int(whole[embed][0]) if embed in whole else None
