"""``tui-merger cleanup``: what a verified merge makes unnecessary, on real run folders with real files."""

from __future__ import annotations

import os
import stat
import subprocess
import types
from pathlib import Path

import pytest
import torch

from tui_merger.cli import main
from tui_merger.core.ship.cleanup import (
    CACHE,
    CHECKPOINT,
    KINDS,
    MERGED_INPUTS,
    OPTIMIZER,
    RESUME,
    delete_items,
    find_cleanup,
)
from tui_merger.core.errors import MergeError
from tui_merger.core.record.manifest import FORMAT, describe_files, now_iso, record_history, write_manifest


@pytest.fixture(autouse=True)
def state_home(tmp_path, monkeypatch):
    """Never read or write the user's real merge history."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


# --------------------------------------------------------------------------------------------------
# Real run folders and merge outputs
# --------------------------------------------------------------------------------------------------

VERL_MODEL = ["actor/model_world_size_1_rank_0.pt", "actor/huggingface/config.json"]


def make_verl_run(run: Path, steps=(1, 2, 3)) -> Path:
    """run/global_step_N/{data.pt, actor/{model,optim,extra_state}_world_size_1_rank_0.pt, actor/huggingface/}."""
    for n in steps:
        step = run / f"global_step_{n}"
        (step / "actor" / "huggingface").mkdir(parents=True)
        torch.manual_seed(n)
        torch.save({"model.embed_tokens.weight": torch.randn(16, 8)}, step / "actor" / "model_world_size_1_rank_0.pt")
        optim = {"state": {0: {"step": torch.tensor(n), "exp_avg": torch.randn(16, 8), "exp_avg_sq": torch.rand(16, 8)}}}
        torch.save(optim, step / "actor" / "optim_world_size_1_rank_0.pt")
        torch.save({"lr_scheduler": {"last_epoch": n}, "rng": {"cpu": torch.get_rng_state()}}, step / "actor" / "extra_state_world_size_1_rank_0.pt")
        (step / "actor" / "huggingface" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 8}\n')
        (step / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}\n')
        torch.save({"dataloader": {"epoch": 0, "index": n}}, step / "data.pt")
    (run / "latest_checkpointed_iteration.txt").write_text(str(max(steps)))
    (run / "__pycache__").mkdir()
    (run / "__pycache__" / "reward.cpython-311.pyc").write_bytes(b"\x00" * 333)
    return run


def make_trainer_run(run: Path, steps=(10, 20)) -> Path:
    """HF Trainer + PEFT: run/checkpoint-N/ with an adapter, optimizer.pt, scheduler.pt, rng_state.pth and a
    DeepSpeed global_stepN/ holding ZeRO optimizer shards."""
    for n in steps:
        ckpt = run / f"checkpoint-{n}"
        (ckpt / f"global_step{n}").mkdir(parents=True)
        (ckpt / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "peft_type": "LORA"}\n')
        torch.save({"base_model.model.lm_head.lora_A.weight": torch.randn(4, 8)}, ckpt / "adapter_model.bin")
        torch.save({"state": {0: {"exp_avg": torch.randn(4, 8)}}}, ckpt / "optimizer.pt")
        torch.save({"last_epoch": n}, ckpt / "scheduler.pt")
        torch.save({"cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
        torch.save({"exp_avg": torch.randn(32)}, ckpt / f"global_step{n}" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        (ckpt / "trainer_state.json").write_text(f'{{"global_step": {n}}}\n')
    return run


def make_merge(out: Path, inputs, passed: bool | None = True, history: bool = False) -> Path:
    """A merged model folder with a manifest that follows tui_merger.core.record.manifest's schema.
    ``inputs``: [(role, folder, [file names relative to folder])]."""
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(os.urandom(256))
    (out / "config.json").write_text('{"model_type": "qwen2"}\n')
    manifest = {
        "format": FORMAT,
        "tool": {"name": "tui-merger", "version": "0.1.0"},
        "merged_at": now_iso(),
        "kind": "convert",
        "inputs": [
            {"role": role, "path": str(folder.absolute()), "files": describe_files(folder, names)}
            for role, folder, names in inputs
        ],
        "outputs": describe_files(out, ["config.json", "model.safetensors"]),
        "verification": None if passed is None else {"passed": passed, "summary": "logits compared", "checks": []},
    }
    write_manifest(out, manifest, fsync=False)
    if history:
        record_history(out, manifest)
    return out


def verl_merge(run: Path, step: int, out: Path, **kw) -> Path:
    """A merge of run/global_step_N's actor, given as the run folder plus the files it read (as the CLI records it)."""
    return make_merge(out, [("checkpoint", run, [f"global_step_{step}/{f}" for f in VERL_MODEL])], **kw)


def listing(root: Path) -> dict[str, tuple]:
    """Every entry under root (not following links): type, size, link target, content of small files."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = os.lstat(p)
            link = os.readlink(p) if stat.S_ISLNK(st.st_mode) else None
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_size, link)
    return out


def du(*paths: Path) -> int:
    return sum(sum(os.lstat(v).st_size for v in _files(p)) for p in paths)


def _files(path: Path):
    if path.is_dir() and not path.is_symlink():
        return [Path(d, f) for d, dirs, files in os.walk(path) for f in files + [x for x in dirs if Path(d, x).is_symlink()]]
    return [path]


def by_kind(plan) -> dict[str, list]:
    kinds: dict[str, list] = {}
    for item in plan.items:
        kinds.setdefault(item.kind, []).append(item)
    return kinds


def rel(plan, item) -> list[str]:
    return [str(p.relative_to(plan.root)) for p in item.paths]


# --------------------------------------------------------------------------------------------------
# What is offered
# --------------------------------------------------------------------------------------------------


def test_verified_verl_merge_lists_the_right_items_with_sizes(tmp_path):
    run = make_verl_run(tmp_path / "run")
    out = verl_merge(run, 2, run / "merged_step2")  # inside the run folder: found by the scan
    plan = find_cleanup(run)

    assert [m.out for m in plan.merges] == [out] and plan.merges[0].verified
    assert plan.protected == [(out, "a merged model")]
    s2 = run / "global_step_2"
    expected = {  # kind -> (paths, selected by default)
        CHECKPOINT: [(["global_step_1"], True), (["global_step_3"], False)],
        OPTIMIZER: [(["global_step_2/actor/optim_world_size_1_rank_0.pt"], True)],
        RESUME: [(["global_step_2/actor/extra_state_world_size_1_rank_0.pt"], True), (["global_step_2/data.pt"], True)],
        MERGED_INPUTS: [(["global_step_2/actor/huggingface/config.json", "global_step_2/actor/model_world_size_1_rank_0.pt"], False)],
        CACHE: [(["__pycache__"], True)],
    }
    got = {k: sorted((rel(plan, i), i.selected_by_default) for i in items) for k, items in by_kind(plan).items()}
    assert got == {k: sorted(v) for k, v in expected.items()}
    for item in plan.items:
        assert item.size == du(*item.paths) > 0, item.label
    assert by_kind(plan)[MERGED_INPUTS][0].size == du(s2 / "actor" / "model_world_size_1_rank_0.pt", s2 / "actor/huggingface/config.json")
    assert "older than global_step_2" in by_kind(plan)[CHECKPOINT][0].reason


def test_yes_deletes_exactly_the_default_selection_and_reports_bytes_freed(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    out = verl_merge(run, 2, run / "merged_step2")
    selected = [p for i in find_cleanup(run).items if i.selected_by_default for p in i.paths]
    freed = du(*selected)
    before = listing(run)

    assert main(["cleanup", str(run), "--yes"]) == 0
    printed = capsys.readouterr().out
    after = listing(run)
    gone = {k for k in before if k not in after}
    expected_gone = {k for k in before if any((run / k).is_relative_to(p) for p in selected)}
    assert gone == expected_gone and gone
    assert all(after[k] == before[k] for k in after)
    assert (run / "global_step_2/actor/model_world_size_1_rank_0.pt").is_file()  # merged input: not by default
    assert (run / "global_step_3/actor/optim_world_size_1_rank_0.pt").is_file()  # newer step: kept
    assert (out / "model.safetensors").is_file()
    from tui_merger.core.options import human_bytes

    assert f"Freed {human_bytes(freed)}." in printed
    assert "[ ]" in printed and "[x]" in printed and "merged_step2  (a merged model)" in printed


def test_output_inside_the_folder_survives_including_every_kind(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    out = verl_merge(run, 2, run / "global_step_2" / "merged")  # even inside the merged checkpoint
    (out / "__pycache__").mkdir()  # candidates inside an output are not offered
    (out / "__pycache__" / "x.pyc").write_bytes(b"1" * 10)
    (out / "optimizer.pt").write_bytes(b"1" * 10)
    kept = listing(out)
    argv = ["cleanup", str(run), "--yes"]
    for kind in KINDS:
        argv += ["--include", kind]

    assert main(argv) == 0
    assert listing(out) == kept
    left = sorted(listing(run))
    assert [p for p in left if not p.startswith("global_step_2/merged/")] == [
        "global_step_2",
        "global_step_2/actor",
        "global_step_2/actor/fsdp_config.json",
        "global_step_2/actor/huggingface",
        "global_step_2/merged",
        "latest_checkpointed_iteration.txt",
    ]


def test_trainer_adapter_merge_found_in_history(tmp_path):
    run = make_trainer_run(tmp_path / "sft")
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    out = make_merge(
        tmp_path / "merged",  # outside the run: only the history knows it
        [("base", base, ["config.json"]), ("adapter", run / "checkpoint-20", ["adapter_config.json", "adapter_model.bin"])],
        history=True,
    )
    plan = find_cleanup(run)

    assert [m.out for m in plan.merges] == [out]
    got = {k: sorted((rel(plan, i), i.selected_by_default) for i in items) for k, items in by_kind(plan).items()}
    assert got == {
        CHECKPOINT: [(["checkpoint-10"], True)],
        OPTIMIZER: [
            (["checkpoint-20/global_step20/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"], True),
            (["checkpoint-20/optimizer.pt"], True),
        ],
        RESUME: [(["checkpoint-20/rng_state.pth", "checkpoint-20/scheduler.pt"], True)],
        MERGED_INPUTS: [(["checkpoint-20/adapter_config.json", "checkpoint-20/adapter_model.bin"], False)],
    }
    # the checkpoint folder itself as PATH: its adapter is the merged input, the other checkpoint is outside
    inner = find_cleanup(run / "checkpoint-20")
    assert sorted(i.kind for i in inner.items) == [MERGED_INPUTS, OPTIMIZER, OPTIMIZER, RESUME]


# --------------------------------------------------------------------------------------------------
# Refusals and protection
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("passed", [False, None], ids=["failed", "never-verified"])
def test_unverified_merge_refuses_and_deletes_nothing(tmp_path, capsys, passed):
    run = make_verl_run(tmp_path / "run")
    out = verl_merge(run, 2, run / "merged", passed=passed)
    before = listing(run)

    assert main(["cleanup", str(run), "--yes", "--include", MERGED_INPUTS]) == 1
    err = capsys.readouterr().err
    assert f"run `tui-merger verify {out}` first" in err and "has not passed verification" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert listing(run) == before


def test_no_merge_at_all_refuses(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    before = listing(run)
    assert main(["cleanup", str(run), "--dry-run"]) == 1
    assert "Found no merge made from" in capsys.readouterr().err
    assert listing(run) == before


def test_output_changed_after_verification_refuses(tmp_path):
    run = make_verl_run(tmp_path / "run")
    out = verl_merge(run, 2, tmp_path / "merged")
    (out / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(MergeError, match="has a different model.safetensors than when it was verified"):
        find_cleanup(run, [out])


def test_input_of_unverified_merge_protected_while_a_verified_one_allows_cleanup(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 3, tmp_path / "out3", passed=False, history=True)
    good = verl_merge(run, 2, tmp_path / "out2")
    plan = find_cleanup(run, [good])

    actor3 = run / "global_step_3" / "actor"
    assert [(p, "verify" in why) for p, why in plan.protected] == [(actor3, True)]
    paths = [p for i in plan.items for p in i.paths]
    assert not any(p.is_relative_to(actor3) for p in paths)
    assert run / "global_step_2/actor/optim_world_size_1_rank_0.pt" in paths
    data3 = next(i for i in plan.items if i.paths == (run / "global_step_3" / "data.pt",))
    assert not data3.selected_by_default  # a newer, unmerged step's resume state stays unless picked
    before = listing(actor3)

    argv = ["cleanup", str(run), "--merged", str(good), "--yes"]
    for kind in KINDS:
        argv += ["--include", kind]
    assert main(argv) == 0
    assert listing(actor3) == before
    assert not (run / "global_step_2/actor/optim_world_size_1_rank_0.pt").exists()
    assert "global_step_3/actor  (read by the merge into" in capsys.readouterr().out


def test_root_and_home_refused(tmp_path, monkeypatch, capsys):
    assert main(["cleanup", "/", "--dry-run"]) == 1
    assert "Refusing to clean /" in capsys.readouterr().err
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for path in (home, tmp_path):
        with pytest.raises(MergeError, match="holds your home folder"):
            find_cleanup(path)


def test_merged_argument_must_be_a_merge_from_the_folder(tmp_path):
    run = make_verl_run(tmp_path / "run", steps=(1,))
    with pytest.raises(MergeError, match="has no readable merge_manifest.json"):
        find_cleanup(run, [tmp_path])
    other = make_verl_run(tmp_path / "other", steps=(1,))
    with pytest.raises(MergeError, match="was not merged from anything in"):
        find_cleanup(run, [verl_merge(other, 1, tmp_path / "out")])


# --------------------------------------------------------------------------------------------------
# Links, dry run, failures, prompts
# --------------------------------------------------------------------------------------------------


def test_links_are_removed_as_links_and_never_followed(tmp_path):
    run = make_verl_run(tmp_path / "run")
    outside = tmp_path / "outside"
    (outside / "dir" / "__pycache__").mkdir(parents=True)
    (outside / "dir" / "optim_world_size_1_rank_0.pt").write_bytes(b"o" * 1000)
    (outside / "dir" / "__pycache__" / "m.pyc").write_bytes(b"c" * 100)
    (outside / "secret.bin").write_bytes(b"s" * 5000)
    step1 = run / "global_step_1" / "actor"
    (step1 / "to_file").symlink_to(outside / "secret.bin")  # inside an old checkpoint that goes
    (step1 / "to_dir").symlink_to(outside / "dir")
    (run / "global_step_2" / "optimizer.pt").symlink_to(outside / "secret.bin")  # a linked candidate
    (run / ".ipynb_checkpoints").symlink_to(outside / "dir")  # a linked cache folder
    (run / "linked").symlink_to(outside / "dir", target_is_directory=True)  # never entered
    outside_before = listing(outside)
    verl_merge(run, 2, run / "merged")
    plan = find_cleanup(run)

    paths = [p for i in plan.items for p in i.paths]
    assert not any(p.is_relative_to(run / "linked") for p in paths)
    link = run / "global_step_2/optimizer.pt"
    link_item = next(i for i in plan.items if i.paths == (link,))
    assert link_item.label == "global_step_2/optimizer.pt (link)" and link_item.size == os.lstat(link).st_size < 5000
    assert delete_items(plan, plan.items) == sum(i.size for i in plan.items)
    assert listing(outside) == outside_before
    assert not os.path.lexists(link) and not os.path.lexists(run / ".ipynb_checkpoints")
    assert (run / "linked").is_symlink()


def test_item_replaced_by_a_link_after_listing_is_skipped(tmp_path):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 2, run / "merged")
    plan = find_cleanup(run)
    target = tmp_path / "precious"
    target.mkdir()
    (target / "data.bin").write_bytes(b"p" * 100)
    os.rename(run / "global_step_1", tmp_path / "moved")
    (run / "global_step_1").symlink_to(target)
    events = []

    delete_items(plan, [i for i in plan.items if i.kind == CHECKPOINT], events.append)
    assert (target / "data.bin").read_bytes() == b"p" * 100 and (run / "global_step_1").is_symlink()
    assert "replaced after it was listed" in events[0].error and events[0].freed == 0


def test_dry_run_deletes_nothing(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 2, run / "merged")
    before = listing(run)
    assert main(["cleanup", str(run), "--dry-run", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "Dry run: nothing was deleted." in out and "global_step_1/" in out
    assert listing(run) == before


def test_no_terminal_and_no_yes_explains_and_deletes_nothing(tmp_path, capsys):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 2, run / "merged")
    before = listing(run)
    assert main(["cleanup", str(run)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: Nothing was deleted:") and "--yes" in err and err.count("\n") == 1
    assert listing(run) == before


@pytest.fixture
def locked(tmp_path):
    """Make a folder's entries undeletable: chmod for a normal user; as root (which chmod does not stop),
    the immutable attribute where the file system supports it."""
    done = []

    def lock(folder: Path) -> None:
        if os.geteuid() != 0:
            folder.chmod(0o500)
            done.append(lambda: folder.chmod(0o700))
            return
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
            pytest.skip("running as root on a file system without chattr +i: nothing can refuse a deletion")
        done.append(lambda: subprocess.run(["chattr", "-i", str(folder)], check=True))

    yield lock
    for undo in done:
        undo()


def test_undeletable_item_is_reported_and_the_rest_continues(tmp_path, locked, capsys):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 2, run / "merged")
    plan = find_cleanup(run)
    chosen = plan.default_selection()
    locked(run / "global_step_1" / "actor")
    events = []

    freed = delete_items(plan, chosen, events.append)
    failed = [e for e in events if e.error]
    assert [e.item.label for e in failed] == ["global_step_1/"]
    assert "global_step_1/actor/" in failed[0].error
    stuck = du(run / "global_step_1")
    assert stuck > 0 and freed == sum(i.size for i in chosen) - stuck
    assert not (run / "global_step_1" / "data.pt").exists()  # what could go in that item went
    for item in chosen:
        if item.label != "global_step_1/":
            assert not any(os.path.lexists(p) for p in item.paths), item.label

    assert main(["cleanup", str(run), "--yes"]) == 1  # the CLI says so and exits 1
    captured = capsys.readouterr()
    assert "not removed: global_step_1/actor/" in captured.out and "could not be removed" in captured.err


def test_interactive_pick_and_confirm(tmp_path, monkeypatch, capsys):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 2, run / "merged")
    answers = {}

    class Prompt:
        def __init__(self, value):
            self.value = value

        def ask(self):
            return self.value

    fake = types.SimpleNamespace(
        Choice=lambda title, value, checked: types.SimpleNamespace(title=title, value=value, checked=checked),
        checkbox=lambda message, choices: Prompt([c.value for c in choices if c.value.kind == answers["pick"]]),
        confirm=lambda message, default: Prompt(answers["confirm"]),
    )
    monkeypatch.setitem(__import__("sys").modules, "questionary", fake)
    monkeypatch.setattr("tui_merger.cli.cleanup._interactive", lambda: True)
    before = listing(run)

    answers.update(pick=MERGED_INPUTS, confirm=False)
    assert main(["cleanup", str(run)]) == 0
    assert "Nothing was deleted." in capsys.readouterr().out and listing(run) == before

    answers.update(confirm=True)
    assert main(["cleanup", str(run)]) == 0
    gone = set(before) - set(listing(run))
    assert gone == {"global_step_2/actor/model_world_size_1_rank_0.pt", "global_step_2/actor/huggingface/config.json"}


def test_hard_linked_file_counts_once(tmp_path):
    run = make_verl_run(tmp_path / "run")
    verl_merge(run, 3, run / "merged")
    os.link(run / "global_step_1/actor/optim_world_size_1_rank_0.pt", run / "global_step_2/actor/optimizer_copy.pt")
    plan = find_cleanup(run)
    old = [i for i in plan.items if i.kind == CHECKPOINT]
    assert sum(i.size for i in old) == du(run / "global_step_1", run / "global_step_2") - du(
        run / "global_step_1/actor/optim_world_size_1_rank_0.pt"
    )


# --------------------------------------------------------------------------------------------------
# The whole flow with a real merge: merge without verifying, cleanup refuses, verify, cleanup
# --------------------------------------------------------------------------------------------------


def test_real_merge_then_verify_then_cleanup(tmp_path, capsys):
    from factory import qwen_config, save_adapter, save_base

    base = save_base(tmp_path / "base", qwen_config())
    run = tmp_path / "sft"
    for n in (10, 20):
        ckpt = save_adapter(run / f"checkpoint-{n}", base, seed=n, target_modules=["q_proj", "v_proj"])
        torch.save({"state": {}, "param_groups": []}, ckpt / "optimizer.pt")
        torch.save({"last_epoch": n}, ckpt / "scheduler.pt")
    out = tmp_path / "merged"
    merge = ["merge", "--base", str(base), "--adapter", str(run / "checkpoint-20"), "--out", str(out), "--plain"]
    assert main([*merge, "--no-verify"]) == 0
    before = listing(run)

    assert main(["cleanup", str(run), "--yes"]) == 1  # found through the history, but not verified
    assert f"run `tui-merger verify {out}` first" in capsys.readouterr().err
    assert listing(run) == before

    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["cleanup", str(run), "--yes"]) == 0
    gone = set(before) - set(listing(run))
    assert gone == {"checkpoint-20/optimizer.pt", "checkpoint-20/scheduler.pt"} | {
        k for k in before if k.startswith("checkpoint-10")
    }
    assert (run / "checkpoint-20" / "adapter_model.safetensors").is_file()  # merged input: only when picked
