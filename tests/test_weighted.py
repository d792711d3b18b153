"""Weighted merges of several LoRA adapters (--adapter A:0.7 --adapter B:0.3): the result equals
W + sum(w_i * s_i * B_i @ A_i) computed here from the adapters' own files, equals peft's exact "cat"
combination, and differs from peft's "linear" one where that has cross terms. Real peft adapters on a
tiny random Qwen2 model."""

from __future__ import annotations

import json

import pytest
import torch
from factory import ALL_LINEAR, edit_adapter_config, load_base, qwen_config, read_output, save_adapter, save_base
from safetensors.torch import load_file

from tui_merger.core.merge.engine import run_merge
from tui_merger.core.errors import MergeError
from tui_merger.core.record.manifest import read_manifest
from tui_merger.core.options import MergeOptions, parse_adapter_spec
from tui_merger.core.plan.preflight import describe, make_plan
from tui_merger.core.record.provenance import finish_merge
from tui_merger.core.verify.checks import verify_merge

PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weighted")
    base = save_base(root / "base", qwen_config())
    a1 = save_adapter(root / "photo", base, seed=1, target_modules=ALL_LINEAR, r=4, lora_alpha=8)
    a2 = save_adapter(root / "pixel", base, seed=2, target_modules=["q_proj", "v_proj", "gate_proj"], r=8, lora_alpha=4)
    a3 = save_adapter(root / "style", base, seed=3, target_modules=["q_proj", "v_proj"], r=4, lora_alpha=16)
    return root, base, a1, a2, a3


def deltas(adapter_dir, weight):
    """module -> weight * scale * (B @ A) in fp32, from the adapter's own files."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        mod = key[len(PREFIX) : key.index(".lora_A.")]
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        scale = cfg["lora_alpha"] / cfg["r"]
        out[mod] = (b.float() @ a.float()).mul_(weight * scale)
    return out


def expected(base_dir, parts):
    base = load_file(base_dir / "model.safetensors")
    result = {k: v.float().clone() for k, v in base.items()}
    for adapter_dir, weight in parts:
        for mod, d in deltas(adapter_dir, weight).items():
            result[f"{mod}.weight"] = d.add_(result[f"{mod}.weight"])  # fp32 sum, in adapter order
    return result


def test_weighted_merge_is_the_exact_sum_of_deltas_and_verifies(models, tmp_path):
    root, base, a1, a2, _ = models
    out = tmp_path / "out"
    options = MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.3)], out=out)
    result = run_merge(options, fsync=False)
    got = read_output(out)
    want = expected(base, [(a1, 0.7), (a2, 0.3)])
    assert set(got) == set(want) - {"lm_head.weight"} or set(got) == set(want)
    changed = 0
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
        changed += not torch.equal(tensor, load_file(base / "model.safetensors")[name])
    assert changed == result.tensors_merged == 2 * 7  # all linear layers of 2 layers
    # the second adapter really counts: without it the q_proj weights differ
    alone = expected(base, [(a1, 0.7)])
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], alone["model.layers.0.self_attn.q_proj.weight"])
    finish_merge(options, result, verify=False, fsync=False)
    manifest = read_manifest(out)
    parts = manifest["adapter"]["adapters"]
    assert [(p["path"], p["weight"]) for p in parts] == [(str(a1), 0.7), (str(a2), 0.3)]
    assert any("q_proj: photo + pixel (2 modules)" == line for line in manifest["adapter"]["overlaps"])
    assert {i["path"] for i in manifest["inputs"] if i["role"] == "adapter"} == {str(a1), str(a2)}
    # verification (behaviour against peft's own "cat" combination) from the manifest alone
    report = verify_merge(out)
    assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}, report.to_dict()
    # and it notices a wrong weight
    wrong = verify_merge(out, MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.6)], out=out), behaviour=False)
    assert not wrong.passed


def test_equals_peft_cat_and_not_peft_linear(models, tmp_path):
    """peft's linear combination averages A and B separately (cross terms w1*w2*B1@A3); ours does not."""
    from peft import PeftModel

    root, base, a1, _, a3 = models
    out = tmp_path / "out"
    run_merge(MergeOptions(base=base, adapters=[(a1, 0.7), (a3, 0.3)], out=out), fsync=False)
    got = read_output(out)

    def peft_combined(kind):
        model = PeftModel.from_pretrained(load_base(base), a1, adapter_name="a")
        model.load_adapter(a3, adapter_name="b")
        model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "mix", combination_type=kind)
        model.set_adapter("mix")
        return model.merge_and_unload().state_dict()

    cat, linear = peft_combined("cat"), peft_combined("linear")
    name = "model.layers.1.self_attn.v_proj.weight"
    for key in got:
        assert torch.allclose(got[key], cat[key], rtol=0, atol=2e-6), key
    assert (got[name] - linear[name]).abs().max() > 1e-3  # the cross terms


def test_single_adapter_weight_scales_its_delta(models, tmp_path):
    root, base, a1, *_ = models
    out = tmp_path / "out"
    run_merge(MergeOptions(base=base, adapters=[(a1, -0.5)], out=out), fsync=False)
    got, want = read_output(out), expected(base, [(a1, -0.5)])
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name


def test_export_combined_adapter_loads_in_peft_and_equals_the_merge(models, tmp_path):
    from peft import PeftModel

    root, base, a1, a2, _ = models
    merged, exported = tmp_path / "merged", tmp_path / "exported"
    run_merge(MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.3)], out=merged), fsync=False)
    options = MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.3)], out=exported, export_adapter=True)
    finish_merge(options, run_merge(options, fsync=False), verify=False, fsync=False)
    cfg = json.loads((exported / "lora_adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 4 + 8 and not cfg.get("rank_pattern")
    model = PeftModel.from_pretrained(load_base(exported), exported / "lora_adapter")
    state = model.merge_and_unload().state_dict()
    for key, tensor in read_output(merged).items():
        assert torch.allclose(tensor, state[key], rtol=0, atol=2e-6), key
    report = verify_merge(exported)
    assert report.passed, report.to_dict()


def test_dry_run_shows_weights_and_overlaps(models, capsys):
    """The CLI's dry run, in this process (the console entry point itself is run in test_cli.py)."""
    from tui_merger.cli import main as cli_main

    root, base, a1, a2, _ = models
    code = cli_main(["merge", "--base", str(base), "--adapter", f"{a1}:0.7", "--adapter", f"{a2}:0.3", "--dry-run"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    assert "0.7 x adapter 1 (photo: r=4 alpha=8, 14 modules)" in stdout
    assert "0.3 x adapter 2 (pixel: r=8 alpha=4, 6 modules)" in stdout
    assert "gate_proj: photo + pixel (2 modules)" in stdout
    assert "down_proj: photo (2 modules)" in stdout
    plan = make_plan(MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.3)]))
    overlap = plan.adapter["overlap_modules"]
    assert overlap["model.layers.0.self_attn.q_proj"] == [str(a1), str(a2)]
    assert "model.layers.0.self_attn.k_proj" not in overlap
    assert any(line.startswith("  adapter 2") for line in describe(plan))


def test_adapter_spec_parsing(tmp_path):
    assert parse_adapter_spec("a/b:0.25")[1] == 0.25
    assert parse_adapter_spec("a/b") == (parse_adapter_spec("a/b")[0], 1.0)
    odd = tmp_path / "run:3"
    odd.mkdir()
    assert parse_adapter_spec(str(odd)) == (odd, 1.0)  # a colon that is part of an existing name
    with pytest.raises(MergeError, match="leaves"):
        parse_adapter_spec("a:0")
    with pytest.raises(MergeError, match="finite"):
        parse_adapter_spec("a:nan")
    with pytest.raises(MergeError, match="'abc', not a number"):
        parse_adapter_spec(f"{odd}:abc")  # an existing adapter with a weight that is not a number
    with pytest.raises(MergeError, match="twice"):
        MergeOptions(base=tmp_path, adapters=["x:0.5", "x:0.2"])
    with pytest.raises(MergeError, match="twice"):  # one folder by two paths
        MergeOptions(base=tmp_path, adapters=[f"{odd}:0.5", f"{odd}/../{odd.name}:0.2"])


@pytest.mark.parametrize("case", ["other-base", "dora", "modules-to-save"])
def test_refusals_write_nothing(models, tmp_path, case):
    root, base, a1, a2, _ = models
    other = tmp_path / "other"
    if case == "other-base":
        import shutil

        shutil.copytree(a2, other)
        edit_adapter_config(other, base_model_name_or_path="meta-llama/Llama-3.1-8B")
        first = tmp_path / "first"
        shutil.copytree(a1, first)
        edit_adapter_config(first, base_model_name_or_path="Qwen/Qwen2.5-0.5B")
        parts, match = [(first, 0.5), (other, 0.5)], "trained on qwen2.5-0.5b but other on llama-3.1-8b"
    elif case == "dora":
        save_adapter(other, base, seed=4, target_modules=["q_proj"], use_dora=True)
        parts, match = [(a1, 0.5), (other, 0.5)], "DoRA"
    else:
        save_adapter(other, base, seed=5, target_modules=["q_proj"], modules_to_save=["lm_head"])
        parts, match = [(other, 0.5)], "full copies"
    out = tmp_path / "out"
    with pytest.raises(MergeError, match=match):
        run_merge(MergeOptions(base=base, adapters=parts, out=out), fsync=False)
    assert not out.exists()
    plan = make_plan(MergeOptions(base=base, adapters=parts, out=out))
    assert plan.blocked and any(match.lower() in f.message.lower() for f in plan.findings)


def test_changed_weights_never_resume_old_shards(models, tmp_path):
    """Kept shards of an interrupted merge are reused only when the weights are the same."""
    from tui_merger.core.formats.inputs import open_inputs
    from tui_merger.core.merge.journal import fingerprint
    from tui_merger.core.plan.plan import build_plan

    root, base, a1, a2, _ = models
    prints = []
    for weights in ((0.7, 0.3), (0.7, 0.3), (0.7, 0.4)):
        options = MergeOptions(base=base, adapters=[(a1, weights[0]), (a2, weights[1])], out=tmp_path / "o")
        inputs = open_inputs(options)
        try:
            plan = build_plan(inputs.base, inputs.adapter, inputs.config, None, options.shard_size)
            prints.append(fingerprint(options, inputs.read_files, plan))
        finally:
            inputs.close()
    assert prints[0] == prints[1] != prints[2]


def test_weighted_options_survive_the_json_round_trip_jobs_and_manifests_use(tmp_path):
    options = MergeOptions(base=tmp_path, adapters=[(tmp_path / "a", 0.7), (tmp_path / "b", -0.3)], out=tmp_path / "o")
    again = MergeOptions(**json.loads(json.dumps(options.to_dict())))
    assert again.adapters == options.adapters and again.adapter == tmp_path / "a" and again.weighted


def test_every_adapter_is_checked_against_the_base(models, tmp_path):
    """The checks against the config an adapter was trained on (rope, vocab, tokenizer) run for each
    adapter of a blend, naming it: before, only the first adapter was looked at."""
    import shutil

    root, base, a1, a2, _ = models
    second = shutil.copytree(a2, tmp_path / "pixel-long")
    config = json.loads((base / "config.json").read_text())
    config["rope_theta"] = 123456.0
    config.setdefault("rope_parameters", {})["rope_theta"] = 123456.0
    (second / "config.json").write_text(json.dumps(config))
    rows = load_file(base / "model.safetensors")["model.embed_tokens.weight"].shape[0]
    vocab = {f"t{i}": i for i in range(rows + 5)}
    (second / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": []}))

    plan = make_plan(MergeOptions(base=base, adapters=[(a1, 0.7), (second, 0.3)], out=tmp_path / "out"))
    rope = [f for f in plan.findings if f.id == "rope"]
    assert len(rope) == 1 and "pixel-long" in rope[0].message and "123456" in rope[0].message, plan.findings
    vocab_errors = [f for f in plan.findings if f.id == "vocab"]
    assert len(vocab_errors) == 1 and "pixel-long" in vocab_errors[0].message and plan.blocked
    # the first adapter alone has neither problem
    plain = make_plan(MergeOptions(base=base, adapters=[(a1, 0.7), (a2, 0.3)], out=tmp_path / "out"))
    assert not [f for f in plain.findings if f.id in ("rope", "vocab")]


def test_one_base_under_two_names_is_one_base(models, tmp_path):
    """Adapters naming the same local folder by two paths (a symlink with another name), or a folder and
    the name in its config, blend; before, the last path components were compared and they were refused."""
    import shutil

    root, base, a1, a2, _ = models
    link = tmp_path / "qwen-copy-link"
    link.symlink_to(base, target_is_directory=True)
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(a1, first)
    shutil.copytree(a2, second)
    edit_adapter_config(first, base_model_name_or_path=str(base))
    edit_adapter_config(second, base_model_name_or_path=str(link))
    out = tmp_path / "out"
    run_merge(MergeOptions(base=base, adapters=[(first, 0.7), (second, 0.3)], out=out), fsync=False)
    got, want = read_output(out), expected(base, [(a1, 0.7), (a2, 0.3)])
    assert all(torch.equal(t, want[n]) for n, t in got.items())
    # a name that leads nowhere here still counts as another base
    edit_adapter_config(second, base_model_name_or_path="someone/another-model")
    with pytest.raises(MergeError, match="another-model"):
        run_merge(MergeOptions(base=base, adapters=[(first, 0.7), (second, 0.3)], out=tmp_path / "out2"), fsync=False)
    assert not (tmp_path / "out2").exists()
