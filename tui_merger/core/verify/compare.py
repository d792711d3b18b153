"""``tui-merger test``: compare what a checkpoint merges to with a reference Hugging Face model
(verl's ``model_merger test``): same tensor names, shapes and dtypes, values close."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.events import EventSink, PhaseStarted, TensorProgress, ignore_event
from tui_merger.core.formats.inputs import open_inputs
from tui_merger.core.merge.merge_math import compute
from tui_merger.core.options import MergeOptions
from tui_merger.core.merge.requant import output_plan
from tui_merger.core.io.sources import open_model


@dataclass
class Comparison:
    compared: int = 0
    problems: list[str] = field(default_factory=list)
    max_abs_diff: float = 0.0
    behaviour: object = None  # verify's Check: logits of the checkpoint's model vs the reference's


def compare_with_reference(options: MergeOptions, reference: Path, on_event: EventSink = ignore_event) -> Comparison:
    import torch

    report = Comparison()
    on_event(PhaseStarted("plan", f"Reading the checkpoint and the reference {reference}"))
    ref = open_model(Path(reference))
    inputs = open_inputs(options)
    try:
        config = {**inputs.config, **inputs.config_changes}
        plan = output_plan(inputs.base, inputs.adapter, config, options.dtype or inputs.dtype, options.shard_size)
        ours = {t.name: t for t in plan.tensors}
        for name in sorted(set(ref.tensors) - set(ours)):
            report.problems.append(f"{name} is in the reference but not in the checkpoint")
        for name in sorted(set(ours) - set(ref.tensors)):
            report.problems.append(f"{name} is in the checkpoint but not in the reference")
        common = [t for t in plan.tensors if t.name in ref.tensors]
        on_event(PhaseStarted("merge", f"Comparing {len(common)} tensors"))
        total_bytes = sum(t.nbytes for t in common)
        done_bytes = 0
        for i, t in enumerate(common, start=1):
            r = ref.tensors[t.name]
            if tuple(r.shape) != tuple(t.shape):
                report.problems.append(f"{t.name}: shape {list(t.shape)} vs reference {list(r.shape)}")
            elif r.dtype != t.dtype:
                report.problems.append(f"{t.name}: dtype {t.dtype} vs reference {r.dtype}")
            else:
                got = compute(t)
                want = r.load()
                diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
                report.max_abs_diff = max(report.max_abs_diff, diff)
                if not torch.allclose(got.float(), want.float(), **_tolerance(t.dtype)):
                    report.problems.append(f"{t.name}: values differ (max abs diff {diff:.3g})")
                report.compared += 1
            done_bytes += t.nbytes
            on_event(TensorProgress(t.name, i, len(common), done_bytes, total_bytes))
            ref.release(r)
            for x in t.inputs():
                x.release()
        if not report.problems:
            on_event(PhaseStarted("behaviour", "Comparing logits with the reference model"))
            report.behaviour = _compare_logits(plan, config, Path(reference))
            if report.behaviour.status == "fail":
                report.problems.append(report.behaviour.summary)
    finally:
        inputs.close()
        ref.close()
    return report


def _compare_logits(plan, config: dict, reference: Path):
    """verify's behaviour check with the reference folder as the reference: both models are loaded
    by transformers, ours from the checkpoint's tensors as the merge computes them."""
    import gc
    import json
    import tempfile

    import torch
    import transformers

    from tui_merger.core.formats.hf_names import model_class
    from tui_merger.core.verify.checks import Check, probe_ids, quiet_transformers
    from tui_merger.core.verify.checks import compare_logits as compare

    cls = model_class(config)
    if cls is None:
        return Check("behaviour", "skip", "skipped: the architecture is not a transformers class")
    quiet_transformers()
    probes = probe_ids(config, plan)
    with torch.no_grad():
        model = cls.from_pretrained(reference, dtype=torch.float32).eval()
        want = model(probes).logits.float()
        del model
        gc.collect()
        state = {t.name: compute(t).float() for t in plan.tensors}
        with tempfile.TemporaryDirectory(prefix="tui-merger-test-") as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            cfg = transformers.AutoConfig.from_pretrained(tmp)
        model = cls.from_pretrained(None, config=cfg, state_dict=state, dtype=torch.float32).eval()
        del state
        got = model(probes).logits.float()
    stored = plan.tensors[0].dtype if plan.tensors else "float32"
    return compare(got, want, None, stored, [], cls.__name__, "float32")


def _tolerance(dtype: str) -> dict:
    if dtype in ("bfloat16", "float16"):
        return {"rtol": 1.6e-2, "atol": 1e-5}
    return {"rtol": 1.3e-6, "atol": 1e-5}
