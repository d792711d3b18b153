"""Every LoRA variant merged by tui-merger equals peft's own merge (``merge_and_unload``) and the merged
model gives the logits of the unmerged PeftModel. Tiny real models; adapters saved by peft."""

from __future__ import annotations

import json

import pytest
import torch
from factory import (
    ALL_LINEAR,
    assert_same_or_one_unit,
    gpt2_config,
    logits_of,
    probe_ids,
    qwen_config,
    read_output,
    reference,
    save_adapter,
    save_base,
)

from tui_merger.core.merge.engine import run_merge
from tui_merger.core.options import MergeOptions
from tui_merger.core.verify.checks import verify_merge


def assert_verified(base, adapter, out, **options):
    """tui-merger's own verification passes every check on an output the test proved right."""
    report = verify_merge(out, MergeOptions(base=base, adapter=adapter, out=out, **options))
    statuses = {c.name: c.status for c in report.checks}
    assert statuses == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, report.to_dict()

CASES = {
    # id: (base kwargs, adapter kwargs, options)
    "all-linear-fp32": (dict(config=qwen_config()), dict(target_modules=ALL_LINEAR), {}),
    "all-linear-bf16": (dict(config=qwen_config(), dtype=torch.bfloat16), dict(target_modules=ALL_LINEAR), {}),
    "rslora": (dict(config=qwen_config()), dict(target_modules=ALL_LINEAR, r=8, lora_alpha=16, use_rslora=True), {}),
    # a scale that is no power of two (16/sqrt(8)) on a bf16 base: the blocked mm, mul and add
    "rslora-bf16": (
        dict(config=qwen_config(), dtype=torch.bfloat16),
        dict(target_modules=ALL_LINEAR, r=8, lora_alpha=16, use_rslora=True),
        {},
    ),
    "rank-alpha-patterns": (
        dict(config=qwen_config()),
        dict(
            target_modules=["q_proj", "v_proj", "k_proj"],
            r=4,
            lora_alpha=8,
            rank_pattern={"q_proj": 8},
            alpha_pattern={"v_proj": 32, "layers.1.self_attn.k_proj": 3},
        ),
        {},
    ),
    "dora-fp32": (dict(config=qwen_config()), dict(target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=True), {}),
    "dora-bf16": (
        dict(config=qwen_config(), dtype=torch.bfloat16),
        dict(target_modules=["q_proj", "v_proj", "gate_proj"], use_dora=True),
        {},
    ),
    "lora-bias": (dict(config=qwen_config()), dict(target_modules=["q_proj", "k_proj", "v_proj"], lora_bias=True), {}),
    "gpt2-fan-in-fan-out": (
        dict(config=gpt2_config()),
        dict(target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True),
        {},
    ),
    "sharded-base-sharded-out": (
        dict(config=qwen_config(), max_shard_size="60KB"),
        dict(target_modules=ALL_LINEAR),
        dict(shard_size="100KB"),
    ),
    "bin-base": (dict(config=qwen_config(), bin_format=True), dict(target_modules=["q_proj", "down_proj"]), {}),
    "fp32-to-bf16": (dict(config=qwen_config()), dict(target_modules=ALL_LINEAR), dict(dtype="bf16")),
}


def _merge(tmp_path, base_kw, adapter_kw, options):
    base = save_base(tmp_path / "base", **base_kw)
    adapter = save_adapter(tmp_path / "adapter", base, **adapter_kw)
    out = tmp_path / "out"
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=out, **options))
    return base, adapter, out, result


@pytest.mark.parametrize("case", list(CASES))
def test_merge_equals_peft(tmp_path, case):
    base_kw, adapter_kw, options = CASES[case]
    base, adapter, out, result = _merge(tmp_path, base_kw, adapter_kw, options)
    dtype = base_kw.get("dtype", torch.float32)
    vocab = base_kw["config"].vocab_size
    probe = probe_ids(vocab)
    ref_logits, ref_state, _ = reference(base, adapter, dtype=dtype, probe=probe)

    ours = read_output(out)
    tied = json.loads((out / "config.json").read_text()).get("tie_word_embeddings", False)
    expected_keys = set(ref_state) - ({"lm_head.weight"} if tied else set())
    assert set(ours) == expected_keys
    out_dtype = {"bf16": torch.bfloat16}.get(options.get("dtype"))
    changed = 0
    for name, tensor in ours.items():
        ref = ref_state[name] if out_dtype is None else ref_state[name].to(out_dtype)
        assert tensor.dtype == ref.dtype, name
        assert torch.equal(tensor, ref), f"{name}: max diff {(tensor.float() - ref.float()).abs().max()}"
    base_state = read_base(base)
    for name, tensor in ours.items():
        changed += not torch.equal(tensor, base_state[name].to(tensor.dtype))
    assert changed >= 2  # the adapter really changed the model
    assert result.tensors_merged == changed

    if dtype == torch.float32 and out_dtype is None:
        got = logits_of(out, probe)
        torch.testing.assert_close(got, ref_logits, atol=1e-5, rtol=0)
    assert_verified(base, adapter, out, **options)


@pytest.mark.parametrize("case, merged", [
    ("all-linear-bf16", 14), ("rslora-bf16", 14), ("dora-bf16", 6), ("all-linear-fp32", 14), ("dora-fp32", 6)])
def test_a_merged_weight_is_written_in_pieces_and_never_held_whole(tmp_path, monkeypatch, case, merged):
    """The merge hands a merged weight to the writer a few rows at a time: with tiny blocks (3 rows
    of a 64-wide weight, 2 of a 128-wide one) and pieces (2 blocks; the last block of 64 rows in 3s
    takes the row left over, the last piece is shorter) every merged tensor
    goes out in several pieces, the output still equals peft's bit for bit, and no buffer the merge
    takes is as large as a merged tensor (it used to hold two whole ones: 940 MB at 70B; DoRA's
    too, whose norm is per row; and fp32 outputs)."""
    from tui_merger.core.io.safetensors_io import SafetensorsWriter
    from tui_merger.core.merge import engine, merge_math

    monkeypatch.setattr(merge_math, "BLOCK_VALUES", 3 * 64)
    monkeypatch.setattr(merge_math, "block_rows", lambda cols: max(2, 3 * 64 // cols))  # whatever the cores
    monkeypatch.setattr(engine, "CHUNK_BYTES", 1000)  # 6 rows of bf16 64-wide rows, 2 blocks of 2 of 128-wide
    largest = []
    real_get = merge_math.Workspace.get

    def get(self, key, shape, dtype):
        buf = real_get(self, key, shape, dtype)
        largest.append((buf.numel() * buf.element_size(), key))
        return buf

    pieces = {}
    real_part = SafetensorsWriter.write_part

    def write_part(self, name, nbytes, pos, part, last):
        pieces.setdefault(name, []).append((pos, part.numel() * part.element_size(), last))
        return real_part(self, name, nbytes, pos, part, last)

    monkeypatch.setattr(merge_math.Workspace, "get", get)
    monkeypatch.setattr(SafetensorsWriter, "write_part", write_part)
    base_kw, adapter_kw, options = CASES[case]
    base, adapter, out, result = _merge(tmp_path, base_kw, adapter_kw, options)
    _, ref_state, _ = reference(base, adapter, dtype=base_kw.get("dtype", torch.float32))
    ours = read_output(out)
    for name, tensor in ours.items():
        assert_same_or_one_unit(tensor, ref_state[name], name)
    assert len(pieces) == result.tensors_merged == merged
    for name, parts in pieces.items():
        nbytes = ours[name].numel() * ours[name].element_size()
        assert len(parts) >= 5, name
        assert [p[2] for p in parts] == [False] * (len(parts) - 1) + [True]
        assert [p[0] for p in parts] == [sum(q[1] for q in parts[:i]) for i in range(len(parts))]
        assert sum(p[1] for p in parts) == nbytes
    largest_merged = max(ours[name].numel() * ours[name].element_size() for name in pieces)
    assert max(largest)[0] < largest_merged / 8, max(largest)
    assert_verified(base, adapter, out, **options)


def read_base(base):
    from tui_merger.core.io.sources import open_model

    src = open_model(base)
    try:
        return {n: ref.load().clone() for n, ref in src.tensors.items()}
    finally:
        src.close()


@pytest.mark.parametrize("rows, cols", [(2048, 11008), (45, 64), (7, 64)])
def test_row_blocks_equal_the_whole_product_bit_for_bit(rows, cols):
    """The blocked merge's fp32 values equal one whole-matrix addmm (peft's ``B @ A`` is one), also
    where the rows do not divide into blocks: a 3B model's 2048x11008 down_proj in blocks of 23 rows
    left one row, which BLAS computed with its matrix-vector kernel, one fp32 unit off."""
    from types import SimpleNamespace

    from tui_merger.core.merge.merge_math import RowBlocks, Workspace

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    b = torch.randn(rows, 16, generator=g) * 0.01
    a = torch.randn(16, cols, generator=g) * 0.01
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = torch.addmm(w.float(), b, a)
        blocks = RowBlocks(SimpleNamespace(source=SimpleNamespace(load=lambda: w)), a, b, Workspace(), None)
        blocks.step = 23 if rows == 2048 else 11  # 2048 = 89 x 23 + 1, 45 = 4 x 11 + 1, 7 < 11
        spans = []
        for i, j, acc in blocks:
            spans.append(j - i)
            assert torch.equal(acc, whole[i:j]), (i, j)
    finally:
        torch.set_num_threads(threads)
    assert sum(spans) == rows and (min(spans) > 1)


@pytest.mark.parametrize("rows, cols, threads", [(2048, 11008, 1), (2048, 11008, 2), (45, 64, 1)])
def test_dora_row_blocks_equal_the_whole_tensor_merge_bit_for_bit(rows, cols, threads):
    """DoRA merged a block of rows at a time: V = W + s * (B @ A), each row scaled by m / ||row||,
    equals peft's formula on the whole fp32 matrix (norm over dim 1 of all of V, computed with the
    default threads) bit for bit, with the blocks on one or two threads."""
    from types import SimpleNamespace

    from tui_merger.core.merge.merge_math import RowBlocks, Workspace

    g = torch.Generator().manual_seed(cols)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    b = torch.randn(rows, 16, generator=g) * 0.01
    a = torch.randn(16, cols, generator=g) * 0.01
    m = torch.rand(rows, generator=g) + 0.5
    scale = 1.5
    v = w.float() + (b @ a) * scale
    whole = (m / torch.linalg.norm(v, dim=1)).view(-1, 1) * v
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        blocks = RowBlocks(SimpleNamespace(source=SimpleNamespace(load=lambda: w)), a, b, Workspace(), scale, m)
        blocks.step = 23 if rows == 2048 else 11
        done = 0
        for i, j, acc in blocks:
            assert torch.equal(acc, whole[i:j]), (i, j, (acc - whole[i:j]).abs().max())
            done = j
    finally:
        torch.set_num_threads(before)
    assert done == rows


def test_untouched_tensors_are_byte_identical(tmp_path):
    base, adapter, out, _ = _merge(
        tmp_path, dict(config=qwen_config(), dtype=torch.bfloat16), dict(target_modules=["q_proj"]), {}
    )
    from safetensors import safe_open

    with safe_open(base / "model.safetensors", "pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    ours = read_output(out)
    untouched = [k for k in src if "q_proj" not in k]
    assert len(untouched) > 10
    for k in untouched:
        assert ours[k].dtype == src[k].dtype
        assert ours[k].view(torch.uint8).numpy().tobytes() == src[k].view(torch.uint8).numpy().tobytes(), k


# -- embeddings and tied weights: compared with the unmerged PeftModel, which is the truth peft's
# merge_and_unload does not always reproduce for tied weights --------------------------------------


def _tied_case(tmp_path, adapter_kw, dtype=torch.float32):
    base = save_base(tmp_path / "base", qwen_config(tie_word_embeddings=True), dtype=dtype)
    adapter = save_adapter(tmp_path / "adapter", base, **adapter_kw)
    out = tmp_path / "out"
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=out))
    probe = probe_ids()
    ref_logits, ref_state, peft_model = reference(base, adapter, dtype=dtype, probe=probe)
    assert_verified(base, adapter, out)
    return base, out, result, probe, ref_logits, ref_state, peft_model


def test_embedding_lora_on_tied_model_unties(tmp_path):
    base, out, result, probe, ref_logits, ref_state, _ = _tied_case(
        tmp_path, dict(target_modules=["embed_tokens", "q_proj"])
    )
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    ours = read_output(out)
    base_embed = read_base(base)["model.embed_tokens.weight"]
    assert torch.equal(ours["lm_head.weight"], base_embed)  # the output side keeps the original
    assert torch.equal(ours["model.embed_tokens.weight"], ref_state["model.embed_tokens.weight"])
    for name in ours:
        if "embed" not in name and "lm_head" not in name:
            assert torch.equal(ours[name], ref_state[name]), name
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)


def test_embedding_lora_bf16_rounds_once(tmp_path):
    """peft rounds an embedding delta to bf16 before adding it; we add in fp32 and round once, so we
    compare with peft's own fp32 delta added to the base and rounded once."""
    base, out, _, _, _, _, peft_model = _tied_case(
        tmp_path, dict(target_modules=["embed_tokens"]), dtype=torch.bfloat16
    )
    ours = read_output(out)
    w = read_base(base)["model.embed_tokens.weight"]
    # peft_model is merged by now: rebuild the delta from a fresh load
    from factory import load_base
    from peft import PeftModel

    fresh = PeftModel.from_pretrained(load_base(base, torch.bfloat16), tmp_path / "adapter")
    layer = fresh.base_model.model.model.embed_tokens
    delta = layer.get_delta_weight("default")
    assert delta.dtype == torch.float32
    expected = (w.float() + delta).to(torch.bfloat16)
    assert torch.equal(ours["model.embed_tokens.weight"], expected)


def test_modules_to_save_on_tied_model(tmp_path):
    _, out, _, probe, ref_logits, _, _ = _tied_case(tmp_path, dict(target_modules=["q_proj"], modules_to_save=["lm_head"]))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" in read_output(out)
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)


def test_trainable_tokens_on_tied_model_stay_tied(tmp_path):
    _, out, _, probe, ref_logits, ref_state, _ = _tied_case(
        tmp_path, dict(target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1, 5, 7]})
    )
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    ours = read_output(out)
    assert "lm_head.weight" not in ours
    assert torch.equal(ours["model.embed_tokens.weight"], ref_state["model.embed_tokens.weight"])
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)


def test_q_proj_only_adapter_keeps_tied_model_tied(tmp_path):
    _, out, _, probe, ref_logits, ref_state, _ = _tied_case(tmp_path, dict(target_modules=["q_proj"]))
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    ours = read_output(out)
    assert "lm_head.weight" not in ours
    for name in ours:
        assert torch.equal(ours[name], ref_state[name]), name
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)


def test_resized_vocab_with_modules_to_save(tmp_path):
    base = save_base(tmp_path / "base", qwen_config(tie_word_embeddings=False))
    adapter = save_adapter(
        tmp_path / "adapter",
        base,
        resize_to=264,
        target_modules=["q_proj"],
        modules_to_save=["embed_tokens", "lm_head"],
    )
    out = tmp_path / "out"
    result = run_merge(MergeOptions(base=base, adapter=adapter, out=out))
    assert result.config_changes == {"vocab_size": 264}
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 264
    probe = probe_ids(264)
    ref_logits, ref_state, _ = reference(base, adapter, resize_to=264, probe=probe)
    ours = read_output(out)
    assert ours["model.embed_tokens.weight"].shape == (264, 64)
    for name in ours:
        assert torch.equal(ours[name], ref_state[name]), name
    torch.testing.assert_close(logits_of(out, probe), ref_logits, atol=1e-5, rtol=0)
    assert_verified(base, adapter, out)


def test_sharded_output_index_is_complete(tmp_path):
    base, adapter, out, result = _merge(
        tmp_path, dict(config=qwen_config()), dict(target_modules=["q_proj"]), dict(shard_size="80KB")
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3 and sorted(set(index["weight_map"].values())) == shards == sorted(result.shards)
    from safetensors import safe_open

    total = 0
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == shard
                t = f.get_tensor(key)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    assert set(index["weight_map"]) == set(read_base(base))


@pytest.mark.parametrize(
    "adapter_kw",
    [
        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True),
        dict(target_modules=["q_proj"], modules_to_save=["embed_tokens", "lm_head"], ensure_weight_tying=True),
        dict(target_modules=["embed_tokens", "q_proj"], ensure_weight_tying=True),
    ],
    ids=["mts-embed", "mts-both", "embedding-lora"],
)
def test_ensure_weight_tying_adapters(tmp_path, adapter_kw):
    """peft >= 0.17 can keep the output embedding tied to a trained input embedding. The merged model
    must behave like the unmerged one (peft's own merge_and_unload adds a tied LoRA delta twice here,
    so it is not the reference) and both embeddings must hold the same values."""
    _, out, _, probe, ref_logits, _, _ = _tied_case(tmp_path, adapter_kw)
    ours = read_output(out)
    if "lm_head.weight" in ours:
        assert torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])
    got = logits_of(out, probe)
    scale = ref_logits.abs().max().item()
    torch.testing.assert_close(got, ref_logits, atol=1e-5 * max(scale, 1.0), rtol=0)


def test_classifier_on_a_tied_base_gets_no_lm_head(tmp_path):
    """A reward/classification model keeps tie_word_embeddings from its LM config but has no lm_head:
    an embedding LoRA must not invent one."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    config = qwen_config(tie_word_embeddings=True, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "base")
    from peft import LoraConfig, get_peft_model

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], task_type="SEQ_CLS", init_lora_weights=False)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p))
    peft_model.save_pretrained(tmp_path / "adapter")
    run_merge(MergeOptions(base=tmp_path / "base", adapter=tmp_path / "adapter", out=tmp_path / "out"))
    ours = read_output(tmp_path / "out")
    assert "lm_head.weight" not in ours and "score.weight" in ours
    probe = probe_ids()
    ref = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        expected = ref(probe).logits
        got = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")(probe).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert_verified(tmp_path / "base", tmp_path / "adapter", tmp_path / "out")


def test_adapter_saved_as_bin(tmp_path):
    """Older trainers save adapter_model.bin (a torch.save'd dict); it merges like the safetensors one."""
    from safetensors.torch import load_file

    base = save_base(tmp_path / "base", qwen_config())
    adapter = save_adapter(tmp_path / "adapter", base, target_modules=ALL_LINEAR)
    ref_logits, ref_state, _ = reference(base, adapter, probe=probe_ids())
    state = load_file(adapter / "adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").unlink()
    torch.save(state, adapter / "adapter_model.bin")
    run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "out"))
    ours = read_output(tmp_path / "out")
    for name in ours:
        assert torch.equal(ours[name], ref_state[name]), name
    torch.testing.assert_close(logits_of(tmp_path / "out", probe_ids()), ref_logits, atol=1e-5, rtol=0)
    assert_verified(base, adapter, tmp_path / "out")
