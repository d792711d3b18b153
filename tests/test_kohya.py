"""kohya-style LoRA files (lora_down / lora_up / alpha, one safetensors file): made here from a PEFT
adapter by renaming its keys, they merge to exactly what the adapter merges to (and to peft's own
merge_and_unload), convert to a PEFT folder peft loads, and every broken file is one sentence with
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factory import ALL_LINEAR, load_base, qwen_config, read_output, reference, save_adapter, save_base
from safetensors.torch import load_file, save_file

from tui_merger.core.formats.registry import open_adapter as open_any_adapter
from tui_merger.core.merge.engine import run_merge
from tui_merger.core.errors import MergeError
from tui_merger.core.formats.kohya import kohya_to_peft, match_modules
from tui_merger.core.options import MergeOptions
from tui_merger.core.record.provenance import record_merge
from tui_merger.core.io.sources import open_model
from tui_merger.core.verify.checks import verify_merge

PATTERNS = dict(
    target_modules=ALL_LINEAR,
    r=4,
    lora_alpha=8,
    rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
    alpha_pattern={"v_proj": 32, "layers.1.self_attn.k_proj": 3},
)


def peft_ranks_alphas(base: Path, adapter: Path) -> dict[str, tuple[int, float]]:
    """{module: (r, alpha)} as peft itself resolves them when it loads the adapter."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_base(base), adapter)
    found = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "r", {}):
            found[name] = (module.r["default"], module.lora_alpha["default"])
    return found


def kohya_from_peft(adapter: Path, dest: Path, base: Path, with_alpha=True, prefix="lora_transformer_") -> Path:
    """The adapter's tensors under kohya's names: <prefix><module with '.'->'_'>.lora_down/.lora_up
    (.weight) and .alpha (a scalar) per module."""
    settings = peft_ranks_alphas(base, adapter)
    tensors = {}
    for key, value in load_file(adapter / "adapter_model.safetensors").items():
        module, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
        flat = prefix + module.replace(".", "_")
        tensors[f"{flat}.lora_{'down' if rest.startswith('A') else 'up'}.weight"] = value.contiguous()
        if with_alpha:
            tensors[f"{flat}.alpha"] = torch.tensor(float(settings[module][1]))
    save_file(tensors, str(dest), metadata={"ss_network_module": "networks.lora"})
    return dest


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A base, a PEFT adapter with per-module ranks and alphas, and the kohya file made from it;
    another adapter with alpha == r, and its kohya file without .alpha entries."""
    root = tmp_path_factory.mktemp("kohya")
    base = save_base(root / "base", qwen_config())
    adapter = save_adapter(root / "adapter", base, **PATTERNS)
    plain = save_adapter(root / "plain", base, seed=2, target_modules=["q_proj", "v_proj", "up_proj"], r=4, lora_alpha=4)
    return {
        "root": root,
        "base": base,
        "adapter": adapter,
        "kohya": kohya_from_peft(adapter, root / "style.safetensors", base),
        "plain": plain,
        "no_alpha": kohya_from_peft(plain, root / "no_alpha.safetensors", base, with_alpha=False, prefix="lora_"),
    }


def base_names(base: Path) -> list[str]:
    src = open_model(base)
    try:
        return list(src.tensors)
    finally:
        src.close()


def nothing_written(out: Path) -> bool:
    return not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


@pytest.mark.parametrize("case", ["patterns", "no-alpha"])
def test_kohya_merges_like_the_peft_adapter_and_like_peft(made, tmp_path, case):
    base = made["base"]
    adapter, kohya = (made["adapter"], made["kohya"]) if case == "patterns" else (made["plain"], made["no_alpha"])
    res_k = run_merge(MergeOptions(base=base, adapter=kohya, out=tmp_path / "k"), fsync=False)
    run_merge(MergeOptions(base=base, adapter=adapter, out=tmp_path / "p"), fsync=False)
    ours, from_peft_folder = read_output(tmp_path / "k"), read_output(tmp_path / "p")
    _, peft_state, _ = reference(base, adapter)
    assert set(ours) == set(from_peft_folder)
    for name, tensor in ours.items():
        assert torch.equal(tensor, from_peft_folder[name]), name
        assert torch.equal(tensor, peft_state[name]), name
    touched = {n for n in ours if n.endswith(".weight") and any(f".{t}." in n for t in (ALL_LINEAR if case == "patterns" else ["q_proj", "v_proj", "up_proj"]))}
    assert res_k.tensors_merged == len(touched) > 0

    opened = open_any_adapter(kohya, base_names(base))
    try:
        settings = peft_ranks_alphas(base, adapter)
        assert {m: (e.r, e.alpha) for m, e in opened.lora.items()} == settings
        if case == "patterns":
            assert opened.config["r"] == 4 and opened.config["lora_alpha"] == 8
            assert opened.config["rank_pattern"]["model.layers.0.self_attn.q_proj"] == 8
            assert opened.config["alpha_pattern"]["model.layers.1.self_attn.k_proj"] == 3
        else:
            assert any("no .alpha entries" in n for n in opened.notices)
    finally:
        opened.close()

    if case == "patterns":  # tui-merger's own check, and the manifest, with a kohya file as the adapter
        report = verify_merge(tmp_path / "k", MergeOptions(base=base, adapter=kohya, out=tmp_path / "k"))
        assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}
        manifest = record_merge(MergeOptions(base=base, adapter=kohya, out=tmp_path / "k"), res_k, fsync=False)
        (entry,) = [i for i in manifest["inputs"] if i["role"] == "adapter"]
        assert [f["path"] for f in entry["files"]] == [kohya.name] and entry["path"] == str(kohya.parent)
        assert manifest["adapter"]["r"] == 4 and manifest["adapter"]["variant"] == "lora"
        assert "| r | 4 |" in (tmp_path / "k" / "README.md").read_text()


@pytest.mark.parametrize("case", ["patterns", "no-alpha"])
def test_lora_alpha_given_sets_every_modules_alpha(made, tmp_path, case):
    """Issue 38: --lora-alpha was dropped for every adapter given with --adapter. A kohya file records an
    alpha per module (or none: alpha = rank); the value given replaces them all, as peft merges the same
    adapter with that lora_alpha and no alpha_pattern. Verification's reference uses it too."""
    import json
    import shutil

    base = made["base"]
    adapter, kohya = (made["adapter"], made["kohya"]) if case == "patterns" else (made["plain"], made["no_alpha"])
    told = shutil.copytree(adapter, tmp_path / "told")
    cfg = json.loads((told / "adapter_config.json").read_text())
    cfg.update(lora_alpha=12, alpha_pattern={})
    (told / "adapter_config.json").write_text(json.dumps(cfg))
    options = MergeOptions(base=base, adapter=kohya, out=tmp_path / "k", lora_alpha=12)
    result = run_merge(options, fsync=False)
    assert not any("alpha = rank" in w for w in result.warnings)  # no longer true
    _, peft_state, _ = reference(base, told)
    ours = read_output(tmp_path / "k")
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, peft_state[name], atol=1e-6, rtol=0)
    report = verify_merge(tmp_path / "k", options)
    assert {c.name: c.status for c in report.checks} == {"structure": "pass", "recompute": "pass", "behaviour": "pass"}


def test_converted_peft_folder_loads_in_peft_and_merges_the_same(made, tmp_path):
    from peft import PeftModel

    base, kohya = made["base"], made["kohya"]
    dest = tmp_path / "converted"
    kohya_to_peft(kohya, base_names(base), dest, base_model=str(base), fsync=False)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["rank_pattern"] and cfg["alpha_pattern"]
    keys = load_file(dest / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    merged = PeftModel.from_pretrained(load_base(base), dest).merge_and_unload().state_dict()
    _, expected, _ = reference(base, made["adapter"])
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


def test_cli_export_adapter_writes_base_and_a_peft_adapter(made, tmp_path, capsys):
    """`merge --export-adapter` through cli_main in this process (test_cli.py runs the console entry point)."""
    from peft import PeftModel

    from tui_merger.cli import main as cli_main

    base, kohya, out = made["base"], made["kohya"], tmp_path / "exported"
    code = cli_main(["merge", "--base", str(base), "--adapter", str(kohya), "--export-adapter", "--out", str(out)])
    stderr = capsys.readouterr().err
    assert code == 0, stderr
    assert "Traceback" not in stderr
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["kind"] == "export-adapter" and manifest["verification"]["passed"], manifest["verification"]
    merged = PeftModel.from_pretrained(load_base(out), out / "lora_adapter").merge_and_unload().state_dict()
    _, expected, _ = reference(base, made["adapter"])
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


# -- broken and foreign files: one sentence, nothing written ------------------------------------------


def test_matcher_refuses_names_that_fit_several_modules():
    names = ["model.mlp.down_proj.weight", "model.mlp_down.proj.weight", "model.mlp.up_proj.weight"]
    assert match_modules(["lora_model_mlp_up_proj"], names) == {"lora_model_mlp_up_proj": "model.mlp.up_proj"}
    with pytest.raises(MergeError) as err:
        match_modules(["lora_model_mlp_down_proj"], names)
    assert "model.mlp.down_proj, model.mlp_down.proj" in str(err.value)
    # an inner model's names (no leading "model.") still map; a missing tied lm_head is offered to the plan
    tied = ["model.embed_tokens.weight", "model.layers.0.q.weight"]
    assert match_modules(["lora_layers_0_q", "lora_lm_head"], tied) == {"lora_layers_0_q": "model.layers.0.q", "lora_lm_head": "lm_head"}


def test_ambiguous_base_is_refused_with_the_candidates(made, tmp_path):
    """A base whose state dict also has model.layers.0.mlp_down.proj: the flattened name fits both."""
    bad = tmp_path / "colliding"
    bad.mkdir()
    (bad / "config.json").write_text((made["base"] / "config.json").read_text())
    state = load_file(made["base"] / "model.safetensors")
    state["model.layers.0.mlp_down.proj.weight"] = state["model.layers.0.mlp.down_proj.weight"].clone()
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(MergeError) as err:
        run_merge(MergeOptions(base=bad, adapter=made["kohya"], out=out), fsync=False)
    assert "model.layers.0.mlp.down_proj, model.layers.0.mlp_down.proj" in str(err.value)
    assert nothing_written(out)


def _file(tmp_path, tensors: dict, name="bad.safetensors") -> Path:
    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _pair(flat="lora_transformer_model_layers_0_self_attn_q_proj", r=2, down_shape=None):
    return {
        f"{flat}.lora_down.weight": torch.randn(*(down_shape or (r, 64))),
        f"{flat}.lora_up.weight": torch.randn(64, r) if not down_shape or len(down_shape) == 2 else torch.randn(64, r, 1, 1),
        f"{flat}.alpha": torch.tensor(4.0),
    }


@pytest.mark.parametrize(
    "case, tensors, said",
    [
        ("unmatched", {**_pair(), **_pair("lora_unet_input_blocks_1_proj_in")}, "probably not the model the LoRA was trained on"),
        ("no-up", {k: v for k, v in _pair().items() if "lora_up" not in k}, "no lora_up for lora_transformer_model_layers_0_self_attn_q_proj"),
        ("rank", {**_pair(), "lora_transformer_model_layers_0_self_attn_q_proj.lora_up.weight": torch.randn(64, 3)}, "rank 2 but lora_up has rank 3"),
        ("conv", _pair(down_shape=(2, 64, 1, 1)), "convolution LoRA"),
        ("loha", {"lora_unet_x.hada_w1_a": torch.randn(64, 2), "lora_unet_x.hada_w1_b": torch.randn(2, 64), "lora_unet_x.alpha": torch.tensor(1.0)}, "LoHa"),
        ("lokr", {"lora_unet_x.lokr_w1": torch.randn(8, 8), **_pair()}, "LoKr"),
        ("dora", {**_pair(), "lora_transformer_model_layers_0_self_attn_q_proj.dora_scale": torch.randn(1, 64)}, "DoRA"),
        # found by fuzzing: a NaN or infinite alpha merged into a model of NaNs without a word
        ("nan-alpha", {**_pair(), "lora_transformer_model_layers_0_self_attn_q_proj.alpha": torch.tensor(float("nan"))}, "alpha is nan, not a finite number"),
        ("inf-alpha", {**_pair(), "lora_transformer_model_layers_0_self_attn_q_proj.alpha": torch.tensor(float("inf"))}, "alpha is inf, not a finite number"),
    ],
)
def test_broken_kohya_files_are_one_sentence_and_write_nothing(made, tmp_path, case, tensors, said):
    path = _file(tmp_path, tensors)
    out, dest = tmp_path / "out", tmp_path / "converted"
    with pytest.raises(MergeError) as err:
        run_merge(MergeOptions(base=made["base"], adapter=path, out=out), fsync=False)
    assert said in str(err.value)
    assert str(err.value).count(". ") == 0  # one sentence
    assert nothing_written(out)
    with pytest.raises(MergeError):
        kohya_to_peft(path, base_names(made["base"]), dest)
    assert nothing_written(dest)


def test_other_files_as_adapter_are_explained(made, tmp_path):
    names = base_names(made["base"])
    other = _file(tmp_path, {"weight": torch.zeros(2)}, "model.safetensors")
    with pytest.raises(MergeError, match="neither a PEFT adapter folder nor a kohya-style LoRA"):
        open_any_adapter(other, names)
    loose = tmp_path / "loose.safetensors"
    loose.write_bytes((made["adapter"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(MergeError, match="no adapter_config.json beside it"):
        open_any_adapter(loose, names)
    with pytest.raises(MergeError, match="give the base model"):
        open_any_adapter(made["kohya"])
    # the weights file of a PEFT folder opens that folder
    opened = open_any_adapter(made["adapter"] / "adapter_model.safetensors", names)
    assert opened.folder == made["adapter"] and opened.lora
    opened.close()
    with pytest.raises(MergeError, match="already exists"):
        kohya_to_peft(made["kohya"], names, made["adapter"])


def test_convert_kohya_command_writes_only_the_adapter(made, tmp_path, capsys):
    """`tui-merger convert-kohya FILE --base B --out DIR`: a PEFT folder equal to the one peft saved
    (same merged weights), and one sentence for a file that is not kohya; nothing written then."""
    from peft import PeftModel

    from tui_merger.cli import main

    base, dest = made["base"], tmp_path / "peft"
    assert main(["convert-kohya", str(made["kohya"]), "--base", str(base), "--out", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert "PEFT adapter written to" in capsys.readouterr().out
    merged = PeftModel.from_pretrained(load_base(base), dest).merge_and_unload().state_dict()
    _, expected, _ = reference(base, made["adapter"])
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    other = tmp_path / "other"
    assert main(["convert-kohya", str(base / "model.safetensors"), "--base", str(base), "--out", str(other)]) == 1
    assert "is not a kohya-style LoRA file" in capsys.readouterr().err
    assert not other.exists()
