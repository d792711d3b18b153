"""Resume: a real merge process killed between shards (SIGKILL, SIGTERM, SIGHUP) or stopped by a full disk
keeps its finished shards; running the same command again writes only the rest, and the result is
byte-identical to an uninterrupted merge. Changed inputs start over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from factory import qwen_config, save_adapter, save_base

from tui_merger.core.merge.engine import run_merge
from tui_merger.core.merge.journal import JOURNAL_NAME
from tui_merger.core.options import MergeOptions

SHARD = "1MB"
# the real CLI, with each finished shard announced on stdout and a pause after it, so that the test
# can stop the process at a shard boundary it chooses (gated by these lines, not by timing)
SLOW_CLI = """
import sys, time
import tui_merger.core.merge.engine as engine
real = engine._write_shard
def announced(path, *args, **kwargs):
    real(path, *args, **kwargs)
    print("SHARD", path.name, flush=True)
    time.sleep(0.3)
engine._write_shard = announced
from tui_merger.cli import console_defaults, leave, main
console_defaults()
leave(main(sys.argv[1:]))  # as the console script (cli.entry) runs it: no interpreter teardown at the end
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    config = qwen_config(hidden_size=128, intermediate_size=384, num_hidden_layers=6, vocab_size=2048)
    base = save_base(root / "base", config, dtype=torch.float32)
    adapter = save_adapter(root / "adapter", base, target_modules=["q_proj", "v_proj", "down_proj"])
    reference = root / "reference"
    run_merge(MergeOptions(base=base, adapter=adapter, out=reference, shard_size=SHARD), fsync=False)
    shards = sorted(p.name for p in reference.glob("*.safetensors"))
    assert len(shards) >= 5, shards
    return base, adapter, reference


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))


def cli(base, adapter, out) -> list[str]:
    return ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--shard-size", SHARD,
            "--plain", "--no-verify"]


def env(tmp_path) -> dict:
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}


def journaled(partial: Path) -> int:
    try:
        return len(json.loads((partial / JOURNAL_NAME).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def default_sigint() -> None:
    """A child started from a background shell inherits SIGINT ignored (and then Python installs no
    KeyboardInterrupt handler): give it the default disposition, as a terminal's Ctrl-C finds it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(base, adapter, out, tmp_path, after: int, sig, args: list[str] | None = None,
              script: str = SLOW_CLI) -> tuple[int, str]:
    """Run the slowed CLI (``args``, else ``cli(...)``), send ``sig`` once ``after`` shards are finished
    (and all but the last are journaled); returns the exit code and stderr."""
    partial = out.parent / f".{out.name}.tui-merger-partial"
    args = args if args is not None else cli(base, adapter, out)
    child = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(tmp_path),
                             preexec_fn=default_sigint)
    try:
        done = 0
        for line in child.stdout:
            done += line.startswith("SHARD")
            if done == after:
                break
        deadline = time.monotonic() + 30
        while journaled(partial) < after - 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # the journal records a shard once its hash is known
        child.send_signal(sig)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    return child.returncode, err


def rerun(base, adapter, out, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tui_merger", *cli(base, adapter, out)], capture_output=True,
                          text=True, env=env(tmp_path), timeout=120)


def same_model(out: Path, reference: Path) -> None:
    """Every file of the merge (the manifest and card hold timestamps and paths; the marker of a merge
    not yet verified is bookkeeping) byte for byte."""
    skip = ("merge_manifest.json", "README.md", ".tui-merger-unverified.json")
    ours = {p.name: p.read_bytes() for p in out.iterdir() if p.name not in skip}
    theirs = {p.name: p.read_bytes() for p in reference.iterdir() if p.name not in skip}
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name


@pytest.mark.parametrize("sig, stop_after", [(signal.SIGKILL, 3), (signal.SIGTERM, 2), (signal.SIGHUP, 4)],
                         ids=["SIGKILL", "SIGTERM", "SIGHUP"])
def test_a_killed_merge_resumes_to_the_same_bytes(inputs, tmp_path, sig, stop_after):
    base, adapter, reference = inputs
    out = tmp_path / "merged"
    partial = tmp_path / ".merged.tui-merger-partial"
    code, err = interrupt(base, adapter, out, tmp_path, stop_after, sig)
    assert not out.exists()  # nothing that looks like a model
    kept = journaled(partial)
    assert kept >= stop_after - 1
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
    else:
        assert code == 130 and "Traceback" not in err, err
        assert f"the {kept} finished shard(s) are kept in {partial}" in err
    resumed = rerun(base, adapter, out, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming an interrupted merge: {kept} finished shard(s) kept" in resumed.stderr
    assert not partial.exists()
    same_model(out, reference)


def test_changed_inputs_start_over(inputs, tmp_path):
    base, adapter, reference = inputs
    out = tmp_path / "merged"
    interrupt(base, adapter, out, tmp_path, 2, signal.SIGKILL)
    assert journaled(tmp_path / ".merged.tui-merger-partial") >= 1
    weights = adapter / "adapter_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))  # "retrained"
    resumed = rerun(base, adapter, out, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "starts over" in resumed.stderr and "Resuming" not in resumed.stderr
    same_model(out, reference)


def test_a_damaged_kept_shard_is_written_again(inputs, tmp_path):
    """A finished shard whose bytes changed after it was journaled does not match its sha256: rewritten."""
    base, adapter, reference = inputs
    out = tmp_path / "merged"
    partial = tmp_path / ".merged.tui-merger-partial"
    interrupt(base, adapter, out, tmp_path, 3, signal.SIGKILL)
    journal = json.loads((partial / JOURNAL_NAME).read_text())["shards"]
    first = sorted(journal)[0]
    with open(partial / first, "r+b") as f:  # one flipped byte near the end
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    resumed = rerun(base, adapter, out, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming an interrupted merge: {len(journal) - 1} finished shard(s) kept" in resumed.stderr
    same_model(out, reference)


def fill_disk_mid_merge(base, adapter, out, filler: Path, tmp_path, after: int = 3) -> tuple[int, str]:
    """Run the slowed CLI; once ``after`` shards are written, another process fills the disk with
    ``filler``. Returns the merge's exit code and stderr."""
    child = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *cli(base, adapter, out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(tmp_path))
    done = 0
    for line in child.stdout:
        done += line.startswith("SHARD")
        if done == after:
            with open(filler, "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                except OSError:
                    pass
            break
    _, err = child.communicate(timeout=60)
    return child.returncode, err


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_disk_full_keeps_finished_shards_and_resumes_once_space_is_freed(inputs, tmp_path):
    base, adapter, reference = inputs
    total = sum(p.stat().st_size for p in reference.glob("*.safetensors"))
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={total + (70 << 20)}", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "merged"
        filler = disk / "someone-elses-file"
        code, err = fill_disk_mid_merge(base, adapter, out, filler, tmp_path)
        assert code == 1, err
        assert "ran out of space" in err and "run the same merge again to resume" in err
        assert not out.exists()
        filler.unlink()  # space freed
        resumed = rerun(base, adapter, out, tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert "Resuming an interrupted merge" in resumed.stderr
        same_model(out, reference)
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (needs root)")
def test_after_a_full_disk_space_for_the_rest_is_enough_to_resume(inputs, tmp_path):
    """The disk fills mid-merge; freeing space for the shards still to write plus the margin (not for
    the whole model) is enough: --dry-run says what is kept and what is left to write, the same command
    resumes and exits 0 with the same bytes. Other options do not match the partial folder: said, and
    the whole model is needed again."""
    import shutil

    base, adapter, reference = inputs
    shards = sorted(reference.glob("*.safetensors"))
    total = sum(p.stat().st_size for p in shards)
    margin = 64 << 20
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={total + margin + (6 << 20)}", "tmpfs", str(disk)], check=True)
    try:
        out = disk / "merged"
        partial = disk / ".merged.tui-merger-partial"
        filler = disk / "someone-elses-file"
        code, err = fill_disk_mid_merge(base, adapter, out, filler, tmp_path)
        assert code == 1 and "ran out of space" in err, err
        kept = json.loads((partial / JOURNAL_NAME).read_text())["shards"]
        kept_bytes = sum((partial / n).stat().st_size for n in kept)
        assert kept and kept_bytes < total
        # free exactly what the rest needs plus the margin, and half a kept shard's worth: not the whole model
        want = (total - kept_bytes) + margin + kept_bytes // 2
        free = shutil.disk_usage(disk).free
        os.truncate(filler, filler.stat().st_size - (want - free))
        free = shutil.disk_usage(disk).free
        assert total - kept_bytes + margin <= free < total + margin, (free, total, kept_bytes)

        dry = subprocess.run([sys.executable, "-m", "tui_merger", *cli(base, adapter, out), "--dry-run"],
                             capture_output=True, text=True, env=env(tmp_path), timeout=120)
        assert dry.returncode == 0, dry.stdout + dry.stderr
        said = f"{len(kept)} of {len(shards)} shards kept"
        assert f"Resuming: {said}" in dry.stdout and f"resuming   {said}" in dry.stdout, dry.stdout
        assert "free space" not in dry.stdout

        other = subprocess.run([sys.executable, "-m", "tui_merger", *cli(base, adapter, out)[:-4], "--shard-size", "2MB",
                                "--plain", "--no-verify", "--dry-run"], capture_output=True, text=True, env=env(tmp_path),
                               timeout=120)
        assert other.returncode == 1
        assert f"The partial folder {partial} does not match these inputs/options" in other.stdout, other.stdout
        assert "needs" in other.stdout and "free space" in other.stdout  # the whole model again
        assert sorted(json.loads((partial / JOURNAL_NAME).read_text())["shards"]) == sorted(kept)  # untouched

        resumed = rerun(base, adapter, out, tmp_path)
        assert resumed.returncode == 0, resumed.stderr
        assert f"Resuming an interrupted merge: {len(kept)} finished shard(s) kept" in resumed.stderr
        same_model(out, reference)
        assert not partial.exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_sigkill_at_random_moments_then_rerun_gives_the_same_bytes(inputs, tmp_path):
    """No gate at all: the real CLI killed at seeded random moments (start-up, planning, any shard,
    verification, the final rename); running it again always ends with the same model."""
    import random

    base, adapter, reference = inputs
    rng = random.Random(20261130)
    for attempt in range(4):
        out = tmp_path / f"merged-{attempt}"
        args = [sys.executable, "-m", "tui_merger", *cli(base, adapter, out)]
        child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(tmp_path))
        time.sleep(rng.uniform(0.5, 3.0))
        child.kill()
        child.wait()
        again = subprocess.run(args, capture_output=True, text=True, env=env(tmp_path), timeout=120)
        if again.returncode == 1 and ("exists" in again.stderr or "never verified" in again.stderr):
            # killed after the final rename: the model is complete; a rerun says so and how to check it
            # (killed while recording it: the rerun records it and exits 0, the else branch)
            assert out.is_dir() and "--overwrite" in again.stderr
        else:
            assert again.returncode == 0, again.stderr
        same_model(out, reference)
        assert not (tmp_path / f".merged-{attempt}.tui-merger-partial").exists()


GATED = """
import sys, time
import tui_merger.core.record.provenance as provenance
import tui_merger.core.verify.checks as verify

def gate(module, name):
    real = getattr(module, name)
    def gated(*args, **kwargs):
        print("STAGE", name, flush=True)
        time.sleep(60)
        return real(*args, **kwargs)
    setattr(module, name, gated)

owner, _, name = sys.argv[1].rpartition(".")
gate(provenance if name == "record_merge" else getattr(verify, owner) if owner else verify, name)
from tui_merger.cli import console_defaults, leave, main
console_defaults()
leave(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("stage", ["record_merge", "_Recompute.work", "_Models.merged"])
def test_killed_while_recording_or_verifying_the_same_command_finishes(inputs, tmp_path, stage):
    """kill -9 after the model is in place (while hashing it, recomputing, or running the models), then
    the same command: it keeps the model, records and verifies it, exits 0."""
    base, adapter, reference = inputs
    out = tmp_path / "out"
    args = [a for a in cli(base, adapter, out) if a != "--no-verify"]
    child = subprocess.Popen([sys.executable, "-c", GATED, stage, *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(tmp_path))
    try:
        for line in child.stdout:
            if line.startswith("STAGE"):
                break
        child.kill()
    finally:
        child.wait()
    assert out.is_dir() and (out / ".tui-merger-unverified.json").is_file()
    again = subprocess.run([sys.executable, "-m", "tui_merger", *args], capture_output=True, text=True,
                           env=env(tmp_path), timeout=300)
    assert again.returncode == 0, again.stderr
    assert "stopped before it was verified; it is kept and verified now" in again.stderr + again.stdout
    manifest = json.loads((out / "merge_manifest.json").read_text())
    assert manifest["verification"]["passed"] is True
    assert not (out / ".tui-merger-unverified.json").exists()
    same_model(out, reference)
    # a third run is refused: the model is complete and verified; --overwrite replaces it
    third = subprocess.run([sys.executable, "-m", "tui_merger", *args], capture_output=True, text=True,
                           env=env(tmp_path), timeout=300)
    assert third.returncode == 1 and "--overwrite" in third.stderr


def test_ctrl_c_stops_within_a_second_or_two_and_says_so_at_once(inputs, tmp_path):
    """Issue 38 item 4: Ctrl-C took 7-11 s to stop a 2 s merge (the stop waited for the verification's
    imports, started in the background, which cannot be interrupted), with nothing said meanwhile."""
    base, adapter, _ = inputs
    out = tmp_path / "merged"
    args = [a for a in cli(base, adapter, out) if a != "--no-verify"]  # the verification's prewarm runs
    child = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env(tmp_path), preexec_fn=default_sigint)
    try:
        for line in child.stdout:
            if line.startswith("SHARD"):
                break
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        child.kill()
    assert child.returncode == 130 and "Traceback" not in err, err
    assert "Stopping..." in err
    assert took < 2.0, f"{took:.1f} s from Ctrl-C to the end"


# a second Ctrl-C while the first is handled: the engine's cleanup after the first is interrupted
SECOND_CTRL_C = SLOW_CLI.replace("engine._write_shard = announced", """engine._write_shard = announced
def second_ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt
engine._stopped = second_ctrl_c""")


def test_a_second_ctrl_c_says_what_is_really_left(inputs, tmp_path):
    """Issue 38 item 2: a second Ctrl-C while the first was handled printed "the partial output was
    removed" while the partial folder, with its journaled shards, stayed (and the next run resumed from
    it). What is said is read from the disk."""
    base, adapter, reference = inputs
    out = tmp_path / "merged"
    partial = tmp_path / ".merged.tui-merger-partial"
    code, err = interrupt(base, adapter, out, tmp_path, 3, signal.SIGINT, script=SECOND_CTRL_C)
    assert code == 130 and "Traceback" not in err, err
    kept = journaled(partial)
    assert partial.is_dir() and kept >= 2
    assert f"interrupted: the partial output {partial} is kept ({kept} finished shard(s) journaled" in err
    assert "run the same merge again to resume from it, or delete that folder" in err and "removed" not in err
    resumed = rerun(base, adapter, out, tmp_path)
    assert resumed.returncode == 0 and f"{kept} finished shard(s) kept" in resumed.stderr, resumed.stderr
    same_model(out, reference)


def test_ctrl_c_during_verification_says_the_model_is_complete_not_verified(inputs, tmp_path):
    base, adapter, reference = inputs
    out = tmp_path / "out"
    args = [a for a in cli(base, adapter, out) if a != "--no-verify"]
    child = subprocess.Popen([sys.executable, "-c", GATED, "_Recompute.work", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env(tmp_path), preexec_fn=default_sigint)
    try:
        for line in child.stdout:
            if line.startswith("STAGE"):
                break
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 130 and "removed" not in err, err
    assert f"interrupted: the merged model in {out} is complete but not verified: run the same merge again" in err
    again = subprocess.run([sys.executable, "-m", "tui_merger", *args], capture_output=True, text=True,
                           env=env(tmp_path), timeout=300)
    assert again.returncode == 0 and "it is kept and verified now" in again.stderr + again.stdout
    same_model(out, reference)


@pytest.mark.parametrize("how", ["interrupt", "cancel"])
def test_a_token_interrupt_keeps_the_shards_and_a_cancel_removes_them(inputs, tmp_path, monkeypatch, how):
    """The assistant's merge runs in a thread, stopped by its CancelToken. When the app loses its terminal
    (SIGHUP, SIGTERM, a closed tty) it stops the merge as Ctrl-C stops the command line's
    (``interrupt``): the finished shards are kept and the same merge resumes to the same bytes. The
    user's Cancel (``cancel``) removes the partial output, as its dialog says."""
    import tui_merger.core.merge.engine as engine
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken

    base, adapter, reference = inputs
    out = tmp_path / "merged"
    partial = tmp_path / ".merged.tui-merger-partial"
    token = CancelToken()
    real, written = engine._write_shard, []

    def then_stop(path, *args, **kwargs):
        digest = real(path, *args, **kwargs)
        written.append(path.name)
        if len(written) == 3:
            getattr(token, how)()
        return digest

    monkeypatch.setattr(engine, "_write_shard", then_stop)
    options = MergeOptions(base=base, adapter=adapter, out=out, shard_size=SHARD)
    with pytest.raises(MergeCancelled) as stopped:
        run_merge(options, cancel=token, fsync=False)
    assert not out.exists()
    if how == "cancel":
        assert not partial.exists() and str(stopped.value) == "Merge cancelled; nothing was written."
        return
    kept = journaled(partial)
    assert kept == 3 and f"the {kept} finished shard(s) are kept in {partial}" in str(stopped.value)
    monkeypatch.setattr(engine, "_write_shard", real)
    run_merge(options, fsync=False)
    assert not partial.exists()
    same_model(out, reference)
