"""``tui-merger inspect``: every kind of checkpoint, built for real (transformers, peft, torch.distributed),
found and described correctly, fast, and bad entries reported one by one while the scan goes on.

Megatron layouts are empty placeholder files in verl's folder structure: megatron-core is not installed
here, and detection only looks at names (a dist checkpoint is never opened by inspect).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from factory import ALL_LINEAR, edit_adapter_config, qwen_config, save_adapter, save_base
from fsdp_factory import REFERENCE_DIRNAME, cached_fsdp_checkpoint, copy_fsdp_checkpoint

from tui_merger.cli import main
from tui_merger.core.formats import scan as inspect_mod
from tui_merger.core.formats.scan import scan

HUB_REPO, HUB_REV = "acme/tiny-qwen", "0123abcd"


def du(path: Path, recursive: bool) -> int:
    """Bytes of the files of a folder (and below), counted independently of inspect."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if recursive:
        return sum((Path(d) / f).stat().st_size for d, _, files in os.walk(path) for f in files)
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def copy_adapter(src: Path, dest: Path, **changes) -> Path:
    shutil.copytree(src, dest)
    if changes:
        edit_adapter_config(dest, **changes)
    return dest


def verl_run(info: dict, dest: Path) -> Path:
    run = Path(copy_fsdp_checkpoint(info, dest)["run_dir"])
    shutil.rmtree(run / REFERENCE_DIRNAME)  # the factory's reference copies are not part of a verl run
    return run


@pytest.fixture(scope="session")
def tree(tmp_path_factory):
    """One folder of training outputs of every kind, plus a Hugging Face cache outside it."""
    top = tmp_path_factory.mktemp("inspect")
    root = top / "runs"
    base = save_base(root / "base", qwen_config(), dtype=torch.bfloat16)
    adapters = root / "adapters"
    plain = save_adapter(adapters / "plain", base, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    save_adapter(
        adapters / "dora", base, r=8, lora_alpha=16, use_dora=True, use_rslora=True, target_modules=ALL_LINEAR,
        rank_pattern={"q_proj": 16}, alpha_pattern={"v_proj": 32},
    )
    save_adapter(adapters / "saved", base, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"], modules_to_save=["lm_head"])
    edit_adapter_config(adapters / "saved", base_model_name_or_path=HUB_REPO)
    copy_adapter(plain, adapters / "nobase", base_model_name_or_path="nobody/not-here")
    noalpha = copy_adapter(plain, adapters / "noalpha")
    cfg = json.loads((noalpha / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (noalpha / "adapter_config.json").write_text(json.dumps(cfg))

    actor_info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, lora=True)
    tokenizer_dir = Path(actor_info["hf_dir"])

    # a trainer run: output/checkpoint-{10,20} (adapter + trainer state), the final adapter in output/
    out = root / "output"
    for step, seed in ((10, 3), (20, 4)):
        ckpt = save_adapter(out / f"checkpoint-{step}", base, seed=seed, r=16, lora_alpha=32, target_modules=ALL_LINEAR)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": []}))
        torch.save({"state": {0: torch.zeros(1000)}}, ckpt / "optimizer.pt")
        torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / "checkpoint-20" / name)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(out / "checkpoint-20" / name, out / name)

    # a trainer checkpoint holding full weights
    full = save_base(root / "fullrun" / "checkpoint-5", qwen_config(), dtype=torch.bfloat16, seed=5)
    (full / "trainer_state.json").write_text("{}")
    torch.save({"state": {0: torch.zeros(500)}}, full / "optimizer.pt")

    # verl FSDP: the LoRA actor run (latest_checkpointed_iteration.txt says 5) plus a newer step 8 that
    # lacks fsdp_config.json and records lora_alpha 0; a critic run
    verl = verl_run(actor_info, root / "verl")
    shutil.copytree(verl / "global_step_5", verl / "global_step_8")
    (verl / "global_step_8" / "actor" / "fsdp_config.json").unlink()
    (verl / "global_step_8" / "actor" / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 0}))
    critic_info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=1, world_size=2, critic=True)
    verl_run(critic_info, root / "verl_critic")

    # verl Megatron layouts (placeholders, see the module docstring)
    config = json.loads((base / "config.json").read_text())

    def files(folder: Path, names: dict) -> None:
        for name, content in names.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(content)

    hf = {"config.json": json.dumps(config).encode(), "tokenizer.json": (tokenizer_dir / "tokenizer.json").read_bytes()}
    actor = root / "megatron" / "legacy" / "global_step_4" / "actor"
    files(actor, {"model/mp_rank_00/model.pt": b"\0" * 100, "model/mp_rank_01/model.pt": b"\0" * 100})
    files(actor / "hf_config_and_tokenizer", hf)
    actor = root / "megatron" / "v1" / "global_step_4" / "actor"
    dist = {f"dist_ckpt/__{r}_0.distcp": b"\0" * 64 for r in range(4)}
    files(actor, {**dist, "dist_ckpt/.metadata": b"", "dist_ckpt/common.pt": b"", "transformer_config.json": b"{}"})
    files(actor, {"dist_ckpt/metadata.json": b'{"sharded_backend": "torch_dist"}'})
    files(actor / "huggingface", hf)
    actor = root / "megatron" / "v2" / "global_step_4" / "actor"
    files(actor, {f"model/{k}": v for k, v in dist.items() if "__0_" in k or "__1_" in k})
    files(actor, {"model/dist_ckpt/.metadata": b"", "optimizer/dist_ckpt/__0_0.distcp": b"\0" * 1000})
    files(actor, {"extra/dist_ckpt/__0_0.distcp": b"\0" * 10, "transformer_config.json": b"{}"})
    files(actor, {"ckpt_contents.json": json.dumps({"schema_version": 2}).encode()})
    files(actor / "model" / "huggingface", {**hf, "model.safetensors": (base / "model.safetensors").read_bytes()})

    # a kohya-style LoRA file made from the plain adapter: fp16 weights, bf16 alphas (one module differs)
    from safetensors.torch import load_file, save_file

    kohya = {}
    for key, value in load_file(plain / "adapter_model.safetensors").items():
        module, _, rest = key.removeprefix("base_model.model.").partition(".lora_")
        name = "lora_" + module.replace(".", "_")
        kohya[f"{name}.lora_{'down' if rest.startswith('A') else 'up'}.weight"] = value.half()
        alpha = 4.0 if module.endswith("layers.1.self_attn.v_proj") else 8.0
        kohya[f"{name}.alpha"] = torch.tensor(alpha, dtype=torch.bfloat16)
    (root / "kohya").mkdir()
    save_file(kohya, str(root / "kohya" / "style.safetensors"), metadata={"ss_network_dim": "4"})

    # a Hugging Face cache (outside the runs): the base as snapshot HUB_REV, files linked to blobs
    hub = top / "hub"
    repo = hub / ("models--" + HUB_REPO.replace("/", "--"))
    snapshot = repo / "snapshots" / HUB_REV
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_REV)
    for i, f in enumerate(sorted(p for p in base.iterdir() if p.is_file())):
        shutil.copy(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    return {"root": root, "hub": hub, "base": base, "plain": plain, "verl": verl}


@pytest.fixture
def found(tree, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tree["hub"]))
    result = scan(tree["root"])
    return result, {os.path.relpath(c.path, tree["root"]): c for c in result.candidates}


def test_every_kind_is_found_in_run_order_newest_step_first(found):
    result, _ = found
    listed = [(c.kind, os.path.relpath(c.path, result.root), c.step, c.latest) for c in result.candidates]
    assert listed == [
        ("peft-adapter", "adapters/dora", None, False),
        ("peft-adapter", "adapters/noalpha", None, False),
        ("peft-adapter", "adapters/nobase", None, False),
        ("peft-adapter", "adapters/plain", None, False),
        ("peft-adapter", "adapters/saved", None, False),
        ("hf-model", "base", None, False),
        ("trainer-checkpoint", "fullrun/checkpoint-5", 5, True),
        ("kohya-lora", "kohya/style.safetensors", None, False),
        ("verl-megatron", "megatron/legacy/global_step_4/actor", 4, True),
        ("verl-megatron", "megatron/v1/global_step_4/actor", 4, True),
        ("verl-megatron", "megatron/v2/global_step_4/actor", 4, True),
        ("peft-adapter", "output", None, False),  # the trainer's final save leads its run
        ("trainer-checkpoint", "output/checkpoint-20", 20, True),
        ("trainer-checkpoint", "output/checkpoint-10", 10, False),
        # latest_checkpointed_iteration.txt names 5: it wins over the higher step 8
        ("verl-fsdp", "verl/global_step_8/actor", 8, False),
        ("verl-fsdp", "verl/global_step_5/actor", 5, True),
        ("verl-fsdp", "verl_critic/global_step_5/critic", 5, True),
    ]
    assert result.problems == []
    assert result.too_deep == 0


def test_peft_adapters_report_their_config_and_base(found, tree):
    _, by = found
    plain = by["adapters/plain"]
    assert plain.lora == {
        "r": 4, "alpha": 8, "rslora": False, "dora": False, "target_modules": ["q_proj", "v_proj"],
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": [], "n_modules": 4,
    }
    assert (plain.dtype, plain.tokenizer, plain.needs_base) == ("float32", False, True)
    assert (plain.base_model, plain.base_resolves, plain.base_path) == (str(tree["base"]), "path", str(tree["base"]))
    assert plain.size_bytes == du(tree["plain"], recursive=False)

    dora = by["adapters/dora"].lora
    assert (dora["r"], dora["alpha"], dora["rslora"], dora["dora"]) == (8, 16, True, True)
    assert dora["target_modules"] == sorted(ALL_LINEAR)
    assert (dora["rank_pattern"], dora["alpha_pattern"], dora["n_modules"]) == ({"q_proj": 16}, {"v_proj": 32}, 14)

    saved = by["adapters/saved"]
    assert saved.lora["modules_to_save"] == ["lm_head"]
    assert (saved.base_model, saved.base_resolves) == (HUB_REPO, "hf-cache")
    assert saved.base_path == str(tree["hub"] / "models--acme--tiny-qwen" / "snapshots" / HUB_REV)

    nobase = by["adapters/nobase"]
    assert (nobase.base_model, nobase.base_resolves, nobase.base_path) == ("nobody/not-here", "missing", None)
    assert any("would need a download" in n and "nobody/not-here" in n for n in nobase.notes)

    noalpha = by["adapters/noalpha"]
    assert noalpha.lora["alpha"] is None and noalpha.lora["r"] == 4  # visible, not defaulted
    assert any("no lora_alpha" in n for n in noalpha.notes)


def test_trainer_checkpoints_adapter_and_full_weights(found, tree):
    _, by = found
    ckpt = by["output/checkpoint-20"]
    assert (ckpt.lora["r"], ckpt.lora["alpha"], ckpt.lora["n_modules"]) == (16, 32, 14)
    assert ckpt.run == str(tree["root"] / "output") and ckpt.tokenizer
    assert not by["output/checkpoint-10"].tokenizer
    assert ckpt.size_bytes == du(tree["root"] / "output" / "checkpoint-20", recursive=True)
    optim = (tree["root"] / "output" / "checkpoint-20" / "optimizer.pt").stat().st_size
    assert any(n.startswith("optimizer state present") for n in ckpt.notes), ckpt.notes
    assert optim > 0
    final = by["output"]
    assert final.size_bytes == du(tree["root"] / "output", recursive=False)  # its checkpoints are not counted

    full = by["fullrun/checkpoint-5"]
    assert (full.kind, full.lora, full.dtype, full.needs_base) == ("trainer-checkpoint", None, "bfloat16", False)
    assert full.size_bytes == du(tree["root"] / "fullrun" / "checkpoint-5", recursive=True)
    base = by["base"]
    assert (base.dtype, base.size_bytes) == ("bfloat16", du(tree["base"], recursive=False))


def test_verl_fsdp_runs(found, tree):
    _, by = found
    actor = by["verl/global_step_5/actor"]
    assert (actor.role, actor.backend, actor.world_size, actor.dtype, actor.tokenizer) == ("actor", "fsdp2", 2, "float32", True)
    assert actor.lora["r"] == 8 and actor.lora["alpha"] == 16
    assert actor.lora["target_modules"] == sorted(ALL_LINEAR) and actor.lora["n_modules"] == 14
    assert (actor.needs_base, actor.base_model) == (False, None)
    assert actor.size_bytes == du(tree["verl"] / "global_step_5" / "actor", recursive=True)
    optim = sum(p.stat().st_size for p in (tree["verl"] / "global_step_5" / "actor").glob("optim_*.pt"))
    from tui_merger.core.options import human_bytes

    assert f"optimizer state present: {human_bytes(optim)}." in actor.notes

    step8 = by["verl/global_step_8/actor"]
    assert (step8.backend, step8.world_size) == ("fsdp", 2)  # no fsdp_config.json: from the file names
    assert step8.lora["alpha"] == 0  # recorded as 0: shown as 0, never replaced
    assert any("no fsdp_config.json" in n for n in step8.notes)
    assert any("lora_alpha is 0" in n for n in step8.notes)

    critic = by["verl_critic/global_step_5/critic"]
    assert (critic.role, critic.backend, critic.world_size, critic.lora) == ("critic", "fsdp1", 2, None)
    assert any("critic" in n for n in critic.notes)


def test_verl_megatron_layouts(found, tree):
    _, by = found
    legacy, v1, v2 = (by[f"megatron/{v}/global_step_4/actor"] for v in ("legacy", "v1", "v2"))
    assert (legacy.backend, legacy.world_size, legacy.dtype, legacy.tokenizer) == ("megatron-legacy", 2, "bfloat16", True)
    assert (v1.backend, v1.world_size, v1.dtype) == ("megatron-v1", 4, "bfloat16")
    assert (v2.backend, v2.world_size, v2.dtype) == ("megatron-v2", 2, "bfloat16")
    assert any("mbridge" in n for n in v2.notes) and "optimizer state present: 1.00 KB." in v2.notes  # 1000 B
    for c in (legacy, v1, v2):
        assert c.size_bytes == du(c.path, recursive=True)


def test_kohya_file_from_its_header(found, tree):
    _, by = found
    k = by["kohya/style.safetensors"]
    assert (k.dtype, k.needs_base, k.size_bytes) == ("float16", True, du(k.path, recursive=False))
    assert (k.lora["r"], k.lora["alpha"], k.lora["n_modules"]) == (4, 8, 4)
    assert k.lora["alpha_pattern"] == {"lora_model_layers_1_self_attn_v_proj": 4}
    assert k.lora["target_modules"] == ["self_attn_q_proj", "self_attn_v_proj"]


def test_the_hf_cache_itself_can_be_scanned(tree):
    result = scan(tree["hub"])
    (c,) = result.candidates
    assert (c.kind, Path(c.path).name, c.dtype) == ("hf-model", HUB_REV, "bfloat16")
    assert c.size_bytes == du(tree["base"], recursive=False)  # linked files count with their targets' sizes
    assert result.problems == []


def test_depth_is_bounded(tree):
    result = scan(tree["root"], max_depth=1)
    assert sorted(os.path.relpath(c.path, tree["root"]) for c in result.candidates) == ["base", "kohya/style.safetensors", "output"]
    assert result.too_deep > 0


def test_latest_file_naming_a_missing_step(tmp_path, tree):
    run = shutil.copytree(tree["verl"], tmp_path / "run", symlinks=True)
    (run / "latest_checkpointed_iteration.txt").write_text("12")
    result = scan(run)
    assert [(c.step, c.latest) for c in result.candidates] == [(8, True), (5, False)]
    (problem,) = result.problems
    assert problem.path.endswith("latest_checkpointed_iteration.txt") and "names step 12" in problem.message


def test_verl_sft_layout(tmp_path, tree):
    """verl's SFT trainer writes the rank files straight into global_step_N/."""
    step = tmp_path / "sft" / "global_step_5"
    shutil.copytree(tree["verl"] / "global_step_5" / "actor", step)
    (c,) = scan(tmp_path / "sft").candidates
    assert (c.kind, c.role, c.step, c.latest, c.run) == ("verl-fsdp", "sft", 5, True, str(tmp_path / "sft"))
    assert (c.backend, c.world_size) == ("fsdp2", 2)


def test_save_lora_only_needs_the_base(tmp_path, tree):
    """A rank file with only LoRA keys (verl's checkpoint.save_lora_only): the merge needs --base."""
    run = shutil.copytree(tree["verl"], tmp_path / "run", symlinks=True)
    shutil.rmtree(run / "global_step_8")
    actor = run / "global_step_5" / "actor"
    import torch.distributed.tensor  # noqa: F401  (DTensors in the rank files)

    for f in actor.glob("model_world_size_*.pt"):
        state = torch.load(f, weights_only=False)
        torch.save({k: v for k, v in state.items() if ".lora_" in k}, f)
    config = json.loads((actor / "huggingface" / "config.json").read_text())
    config["_name_or_path"] = str(tree["base"])
    (actor / "huggingface" / "config.json").write_text(json.dumps(config))
    (c,) = scan(run).candidates
    assert c.needs_base and any(n.startswith("save_lora_only") for n in c.notes)
    assert (c.base_model, c.base_resolves) == (str(tree["base"]), "path")
    assert c.lora["n_modules"] == 14


@pytest.fixture
def bad(tmp_path, tree, monkeypatch):
    """A folder of broken entries beside good ones. Unreadable entries: as root, permissions do not stop
    reads, so listing ``locked/`` and opening ``locked_cfg/adapter_config.json`` are made to fail with
    EACCES (the errors the OS returns to a user); as any other user, chmod 000 does it for real."""
    plain = tree["plain"]
    folder = tmp_path / "bad"
    folder.mkdir()
    copy_adapter(plain, folder / "good")
    broken = copy_adapter(plain, folder / "broken_json")
    (broken / "adapter_config.json").write_text("{not json")
    fifo = folder / "fifo"
    fifo.mkdir()
    shutil.copy(plain / "adapter_model.safetensors", fifo)
    os.mkfifo(fifo / "adapter_config.json")  # reading it would block forever
    (folder / "loop").symlink_to(folder)
    (folder / "l1").symlink_to(folder / "l2")
    (folder / "l2").symlink_to(folder / "l1")
    (folder / "dangling").symlink_to(folder / "missing-target")
    (folder / "elsewhere").symlink_to(tree["base"])  # outside the scanned folder: mentioned, not followed
    (folder / "latest").symlink_to(folder / "good")  # inside it: listed once, where it really is
    truncated = folder / "truncated"
    truncated.mkdir()
    shutil.copy(tree["base"] / "config.json", truncated)
    data = (tree["base"] / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    odd = copy_adapter(plain, Path(os.fsdecode(bytes(folder) + b"/ckpt-\xff")))
    (Path(os.fsdecode(bytes(folder) + b"/junk-\xfe.safetensors"))).write_bytes(b"\x01\x02 not safetensors")
    locked = copy_adapter(plain, folder / "locked")
    locked_cfg = copy_adapter(plain, folder / "locked_cfg") / "adapter_config.json"
    if os.geteuid() != 0:
        locked.chmod(0)
        locked_cfg.chmod(0)
        yield folder, odd
        locked.chmod(0o755)
        locked_cfg.chmod(0o644)
        return
    real_scandir, real_open = os.scandir, open

    def scandir(path="."):
        if os.fspath(path) == str(locked):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(locked))
        return real_scandir(path)

    def opener(path, *args, **kwargs):
        if os.fspath(path) == str(locked_cfg):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(locked_cfg))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(inspect_mod, "open", opener, raising=False)
    yield folder, odd


def test_bad_entries_are_reported_one_by_one_and_the_rest_is_listed(bad):
    folder, odd = bad
    result = scan(folder)
    listed = {os.path.relpath(c.path, folder): c for c in result.candidates}
    assert sorted(listed, key=os.fsencode) == ["broken_json", "ckpt-\udcff", "fifo", "good", "locked_cfg", "truncated"]
    assert listed["good"].lora["r"] == 4 and listed["ckpt-\udcff"].lora["r"] == 4
    assert listed["broken_json"].lora is None and listed["fifo"].lora is None
    problems = {os.path.relpath(p.path, folder): p.message for p in result.problems}
    assert "not valid JSON" in problems["broken_json/adapter_config.json"]
    assert "not a regular file" in problems["fifo/adapter_config.json"]
    assert "loop" in problems["loop"] and "loop" in problems["l1"] and "loop" in problems["l2"]
    assert "broken symbolic link" in problems["dangling"]
    assert "outside the scanned folder" in problems["elsewhere"]
    assert "Permission denied" in problems["locked"] and "Permission denied" in problems["locked_cfg/adapter_config.json"]
    assert "not a valid safetensors file" in problems["truncated/model.safetensors"]
    assert "not a valid safetensors file" in problems["junk-\udcfe.safetensors"]
    assert len(problems) == 11, problems
    for p in result.problems:  # one sentence each
        assert p.message.endswith(".") and "\n" not in p.message and "Traceback" not in p.message

    data = json.loads(json.dumps(result.to_dict()))  # non-UTF-8 names come out escaped
    paths = [c["path"] for c in data["candidates"]] + [p["path"] for p in data["problems"]]
    assert os.path.join(str(folder), "ckpt-\\xff") in paths
    assert os.path.join(str(folder), "junk-\\xfe.safetensors") in paths


def test_cli_prints_the_key_facts_and_the_next_command(found, tree, capsys):
    assert main(["inspect", str(tree["root"])]) == 0
    out = capsys.readouterr().out
    for text in (
        "17 checkpoints, 0 problems",
        "verl-fsdp          ",
        "verl/global_step_5/actor  step 5  (latest)",
        "fsdp2, world size 2, actor",
        "r 8, alpha 16; targets down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj; 14 modules",
        "r 8, alpha 16, rsLoRA, DoRA",
        "r per module: q_proj=16",
        "modules_to_save lm_head",
        f"{HUB_REPO} (in the HF cache: ",
        "nobody/not-here (not on this machine)",
        "tokenizer  yes",
        "note       lora_alpha is 0",
        "megatron-v2, world size 2, actor",
    ):
        assert text in out, text
    # the newest latest-marked checkpoint: the verl critic was built last... or the actor; either way a merge line
    assert "\nNext: " in out


def test_cli_hint_for_an_adapter_with_a_local_base(tree, capsys):
    assert main(["inspect", str(tree["plain"])]) == 0
    out = capsys.readouterr().out
    assert f"Next: tui-merger merge --base {tree['base']} --adapter {tree['plain']} --out {tree['plain']}-merged" in out


def test_cli_reports_problems_and_exits_0(bad, capsys):
    folder, _ = bad
    assert main(["inspect", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "Problems (the scan went on):" in out
    assert "ckpt-\\xff" in out and "junk-\\xfe.safetensors: is not a valid safetensors file" in out


def test_cli_json_matches_the_api(found, tree, capsys):
    """`inspect --json` through cli_main in this process (``found`` set HF_HUB_CACHE to the tree's hub)."""
    capsys.readouterr()
    code = main(["inspect", str(tree["root"]), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stderr
    data = json.loads(stdout)
    expected = found[0].to_dict()
    data.pop("seconds"), expected.pop("seconds")
    assert data == expected
    assert set(data["candidates"][0]) == {
        "kind", "path", "step", "latest", "best", "run", "role", "backend", "world_size", "dtype", "size_bytes",
        "base_model", "base_resolves", "base_path", "needs_base", "tokenizer", "lora", "notes",
    }


def test_cli_missing_path_is_one_sentence(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'nope'} does not exist; check the path.\n"


def test_a_single_file_that_is_not_a_lora(tree):
    result = scan(tree["base"] / "config.json")
    assert result.candidates == [] and "not a kohya-style LoRA file" in result.problems[0].message


def test_config_dtype_as_transformers_writes_it(tmp_path):
    """transformers writes dtype as a name, as "torch.float16" in old files, or as a map of sub-configs
    to names for composite models; all are read, and the map is not taken for a damaged field."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.io.files import config_dtype, read_config

    assert config_dtype({"dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype({"torch_dtype": "torch.float16"}) == "float16"
    assert config_dtype({"text_config": {"dtype": "float32"}}) == "float32"
    assert config_dtype({"dtype": {"text_config": "bfloat16", "vision_config": "float32"}}) == "bfloat16"
    assert config_dtype({"dtype": {"a": "float16", "b": "float16"}}) == "float16"
    assert config_dtype({"dtype": {"a": "float16", "b": "float32"}}) is None
    (tmp_path / "config.json").write_text('{"model_type": "llava", "dtype": {"text_config": "bfloat16", "vision_config": "float32"}}')
    assert read_config(tmp_path)["model_type"] == "llava"
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "dtype": 16}')
    with pytest.raises(MergeError, match="dtype is 16, not a dtype name"):
        read_config(tmp_path)
