"""Bad input, full disks and unwritable outputs: every expected failure must end with exit code 1, one
``error:`` sentence that names the culprit (no traceback), untouched inputs, and no output left behind
(neither the output folder nor a hidden ``.<name>.tui-merger-partial-*`` folder).

Everything here uses the real libraries on real files: tiny random models built from a config with
transformers, LoRA adapters saved by peft, safetensors files damaged on disk. Nothing is downloaded.
The fixtures are built once per module to keep the file fast.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file, save_file  # noqa: E402

from tui_merger.cli import main as cli_main  # noqa: E402
from tui_merger.core.merge.engine import run_merge  # noqa: E402
from tui_merger.core.errors import MergeError  # noqa: E402
from tui_merger.core.events import PhaseStarted  # noqa: E402
from tui_merger.core.options import MergeOptions  # noqa: E402

PARTIAL_TAG = ".tui-merger-partial"
OLD_TAG = ".tui-merger-old-"
QPROJ = "model.layers.0.self_attn.q_proj.weight"
PEFT_PREFIX = "base_model.model."


# ------------------------------------------------------------------------------------------------
# fixtures: tiny real models and adapters, built once
# ------------------------------------------------------------------------------------------------
def _qwen_config(hidden: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
    )


def _save_adapter(model, folder: Path, target_modules, **extra) -> Path:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=target_modules,
        init_lora_weights=False,  # random A and B: a real, non-zero update
        task_type="CAUSAL_LM",
        **extra,
    )
    get_peft_model(model, lora).save_pretrained(folder)
    assert (folder / "adapter_config.json").is_file()
    assert (folder / "adapter_model.safetensors").is_file()
    return folder


class World:
    """Paths of the module's pristine inputs. Tests never modify these: they copy what they damage."""

    def __init__(self, root: Path) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel, Qwen2ForCausalLM

        torch.manual_seed(0)
        self.root = root
        cfg = _qwen_config(64)

        self.base = root / "base"  # one model.safetensors, float32
        Qwen2ForCausalLM(cfg).save_pretrained(self.base)

        self.sharded = root / "base-sharded"  # the same kind of model in 2+ shards with an index
        Qwen2ForCausalLM(cfg).save_pretrained(self.sharded, max_shard_size="150KB")

        self.adapter = _save_adapter(Qwen2ForCausalLM(cfg), root / "adapter", ["q_proj", "v_proj"])
        # trained on a hidden_size=32 model of the same architecture
        self.small_adapter = _save_adapter(
            Qwen2ForCausalLM(_qwen_config(32)), root / "adapter-h32", ["q_proj", "v_proj"]
        )
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64))
        self.gpt2_adapter = _save_adapter(gpt2, root / "adapter-gpt2", ["c_attn"], fan_in_fan_out=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    w = World(tmp_path_factory.mktemp("inputs"))
    shards = sorted(w.sharded.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (w.sharded / "model.safetensors.index.json").is_file()
    return w


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def tree_hash(path: Path):
    """Every entry under path with the sha256 of each file (None when the path does not exist)."""
    path = Path(path)
    if not path.exists():
        return None
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


def leftovers(parent: Path) -> list[str]:
    if not parent.is_dir():
        return []
    return sorted(p.name for p in parent.iterdir() if PARTIAL_TAG in p.name or OLD_TAG in p.name)


def assert_no_output(out: Path, existed_empty: bool = False) -> None:
    if existed_empty:
        assert out.is_dir() and not any(out.iterdir()), f"{out} should still be empty: {list(out.iterdir())}"
    else:
        assert not out.exists(), f"{out} was left behind: {tree_hash(out)}"
    assert leftovers(out.parent) == [], f"partial folders left in {out.parent}"


def error_line(err: str) -> str:
    """The one ``error:`` line of stderr (checks that there is exactly one and no traceback)."""
    assert "Traceback" not in err, err
    assert "This is a bug" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, f"expected exactly one error line in stderr:\n{err}"
    message = lines[0][len("error:"):].strip()
    assert message and message[-1] in ".?", f"not a finished sentence: {message!r}"
    return message


def merge_args(base, adapter, out, *extra) -> list[str]:
    return ["merge", "--base", str(base), "--adapter", str(adapter), "--out", str(out), "--plain", *extra]


def run_cli(capsys, argv) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything printed before
    rc = cli_main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def expect_refusal(capsys, base, adapter, out, *extra, mentions=(), inputs=None, existed_empty=False) -> str:
    """Run the CLI in-process and check the four promises of a refused merge; returns the message."""
    inputs = [Path(p) for p in (inputs if inputs is not None else (base, adapter))]
    before = {p: tree_hash(p) for p in inputs}
    rc, out_text, err = run_cli(capsys, merge_args(base, adapter, out, *extra))
    assert rc == 1, f"exit code {rc}\nstdout:\n{out_text}\nstderr:\n{err}"
    message = error_line(err)
    for thing in mentions:
        assert str(thing) in message, f"the message does not mention {thing!r}: {message}"
    assert "Merged model written" not in out_text
    for p in inputs:
        assert tree_hash(p) == before[p], f"input {p} was changed"
    assert_no_output(Path(out), existed_empty=existed_empty)
    return message


def copy_of(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, indent=2))


def can_mount() -> bool:
    return sys.platform.startswith("linux") and os.geteuid() == 0 and shutil.which("mount") is not None


@contextmanager
def mounted(target: Path, *mount_args: str):
    """``mount <args> <target>``, skipping the test when mounting is not permitted; unmounted after."""
    if not can_mount():
        pytest.skip("mounting needs root on Linux")
    target.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", *mount_args, str(target)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"mount not permitted here: {res.stderr.strip()}")
    try:
        yield target
    finally:
        res = subprocess.run(["umount", str(target)], capture_output=True, text=True)
        if res.returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, text=True)


@contextmanager
def tmpfs(target: Path, options: str):
    with mounted(target, "-t", "tmpfs", "-o", options, "tmpfs") as path:
        yield path


def merged_bytes(world: World) -> int:
    """What the merge of the base writes (tensor bytes): the size of its weights, give or take the header."""
    return (world.base / "model.safetensors").stat().st_size


# ------------------------------------------------------------------------------------------------
# the adapter folder is not an adapter
# ------------------------------------------------------------------------------------------------
def test_adapter_folder_without_adapter_config(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    (adapter / "adapter_config.json").unlink()
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, adapter, out, mentions=["adapter_config.json", str(adapter)])
    assert "not a PEFT adapter" in msg


def test_adapter_is_a_full_model(world, tmp_path, capsys):
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, world.sharded, out, mentions=["adapter_config.json", str(world.sharded)])
    assert "full model" in msg


def test_adapter_folder_missing(world, tmp_path, capsys):
    missing = tmp_path / "no-such-adapter"
    out = tmp_path / "merged"
    expect_refusal(capsys, world.base, missing, out, mentions=[str(missing), "does not exist"])


def test_base_is_an_adapter(world, tmp_path, capsys):
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.adapter, world.adapter, out, mentions=[str(world.adapter)])
    assert "adapter" in msg.lower()


def test_adapter_path_is_the_config_file(world, tmp_path, capsys):
    out = tmp_path / "merged"
    cfg = world.adapter / "adapter_config.json"
    msg = expect_refusal(capsys, world.base, cfg, out, mentions=[str(cfg)], inputs=[world.base, world.adapter])
    assert "does not exist" not in msg, msg


def test_base_path_is_the_weights_file(world, tmp_path, capsys):
    out = tmp_path / "merged"
    weights = world.base / "model.safetensors"
    msg = expect_refusal(capsys, weights, world.adapter, out, mentions=[str(weights)], inputs=[world.base, world.adapter])
    assert "does not exist" not in msg, msg


def test_adapter_config_is_not_json(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    cfg = adapter / "adapter_config.json"
    cfg.write_text(cfg.read_text()[:40])  # cut short, as by an interrupted copy
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, adapter, out, mentions=[str(cfg)])
    assert "not valid JSON" in msg


def test_adapter_without_tensor_file_subprocess(world, tmp_path):
    """The same refusal through a real ``python -m tui_merger`` process."""
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    (adapter / "adapter_model.safetensors").unlink()
    out = tmp_path / "merged"
    before = {p: tree_hash(p) for p in (world.base, adapter)}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tui_merger", *merge_args(world.base, adapter, out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    msg = error_line(proc.stderr)
    assert "adapter_model.safetensors" in msg and str(adapter) in msg
    assert "Merged model written" not in proc.stdout
    assert {p: tree_hash(p) for p in (world.base, adapter)} == before
    assert_no_output(out)


# ------------------------------------------------------------------------------------------------
# the adapter belongs to another model
# ------------------------------------------------------------------------------------------------
def test_adapter_for_a_smaller_model(world, tmp_path, capsys):
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, world.small_adapter, out)
    m = re.search(
        r"Adapter tensor (\S+) has shape \[(\d+), (\d+)\] but base tensor (\S+) has shape \[(\d+), (\d+)\]", msg
    )
    assert m, msg
    a_name, a_shape = m.group(1), [int(m.group(2)), int(m.group(3))]
    b_name, b_shape = m.group(4), [int(m.group(5)), int(m.group(6))]
    adapter_tensors = load_file(world.small_adapter / "adapter_model.safetensors")
    base_tensors = load_file(world.base / "model.safetensors")
    assert list(adapter_tensors[a_name].shape) == a_shape  # the named tensor and its real shape
    assert list(base_tensors[b_name].shape) == b_shape
    assert 32 in a_shape and 64 in b_shape


def test_adapter_for_another_architecture(world, tmp_path, capsys):
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, world.gpt2_adapter, out, mentions=["c_attn"])
    assert "does not have" in msg


# ------------------------------------------------------------------------------------------------
# base files missing or damaged
# ------------------------------------------------------------------------------------------------
def test_base_folder_missing(world, tmp_path, capsys):
    missing = tmp_path / "no-such-base"
    out = tmp_path / "merged"
    expect_refusal(capsys, missing, world.adapter, out, mentions=[str(missing), "does not exist"])


def test_sharded_base_with_a_shard_deleted(world, tmp_path, capsys):
    base = copy_of(world.sharded, tmp_path / "base")
    shard = sorted(base.glob("model-*.safetensors"))[-1]
    shard.unlink()
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, base, world.adapter, out, mentions=[shard.name])
    assert "missing" in msg


def test_sharded_base_with_a_shard_and_the_index_deleted(world, tmp_path, capsys):
    base = copy_of(world.sharded, tmp_path / "base")
    shard = sorted(base.glob("model-*.safetensors"))[-1]
    shard.unlink()
    (base / "model.safetensors.index.json").unlink()
    out = tmp_path / "merged"
    expect_refusal(capsys, base, world.adapter, out, mentions=[shard.name])


def test_sharded_base_index_is_not_json(world, tmp_path, capsys):
    base = copy_of(world.sharded, tmp_path / "base")
    index = base / "model.safetensors.index.json"
    index.write_text("{ this is not json")
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, base, world.adapter, out, mentions=[str(index)])
    assert "index" in msg


def test_base_folder_without_weights(world, tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(world.base / "config.json", base / "config.json")
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, base, world.adapter, out, mentions=[str(base)])
    assert "No model weights" in msg


def test_base_folder_without_config(world, tmp_path, capsys):
    base = copy_of(world.base, tmp_path / "base")
    (base / "config.json").unlink()
    out = tmp_path / "merged"
    expect_refusal(capsys, base, world.adapter, out, mentions=["config.json", str(base)])


def test_bin_base_keyed_by_a_tensor(world, tmp_path, capsys):
    """A pytorch_model.bin whose state dict keys a weight by a tensor: refused, the tensor not printed."""
    base = tmp_path / "base"
    base.mkdir()
    shutil.copy(world.base / "config.json", base / "config.json")
    state = load_file(str(world.base / "model.safetensors"))
    state[torch.full((3,), 7.0)] = torch.ones(2)
    torch.save(state, base / "pytorch_model.bin")
    msg = expect_refusal(capsys, base, world.adapter, tmp_path / "merged", mentions=["pytorch_model.bin"])
    assert "keyed by a Tensor" in msg and "7." not in msg


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_truncated_base_safetensors(world, tmp_path, capsys, layout):
    base = copy_of(world.base if layout == "single" else world.sharded, tmp_path / "base")
    victim = sorted(base.glob("model*.safetensors"))[0]
    size = victim.stat().st_size
    with open(victim, "r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "merged"
    out.mkdir()  # an existing empty output folder must stay as it was
    msg = expect_refusal(capsys, base, world.adapter, out, mentions=[str(victim)], existed_empty=True)
    assert "truncated" in msg or "too short" in msg


@pytest.mark.parametrize("damage", ["header-length", "header-json"])
def test_corrupt_base_safetensors(world, tmp_path, capsys, damage):
    base = copy_of(world.sharded, tmp_path / "base")
    victim = sorted(base.glob("model-*.safetensors"))[1]
    with open(victim, "r+b") as f:
        if damage == "header-length":
            f.write(b"\xde\xad\xbe\xef\xfe\xed\xfa\xce")  # the 8-byte header length becomes garbage
        else:
            f.seek(8)
            f.write(b"\x00\xff garbage \xfe\x01" * 4)  # the JSON header becomes garbage
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, base, world.adapter, out, mentions=[str(victim)])
    assert "not a valid safetensors file" in msg


def test_truncated_adapter_safetensors(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    victim = adapter / "adapter_model.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, world.base, adapter, out, mentions=[str(victim)])
    assert "truncated" in msg or "too short" in msg


# ------------------------------------------------------------------------------------------------
# outputs that cannot be written
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["top", "nested"])
def test_output_on_read_only_tmpfs(world, tmp_path, capsys, where):
    # big enough (tmpfs sizes are limits, not allocations) that the free-space check passes
    with tmpfs(tmp_path / "ro", "size=256m,ro") as ro:
        out = ro / "merged" if where == "top" else ro / "runs" / "v1" / "merged"
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[str(ro)])
        assert "Read-only file system" in msg and ("write" in msg or "create" in msg.lower())
        assert list(ro.iterdir()) == []


def test_output_on_read_only_bind_mount(world, tmp_path, capsys):
    src = tmp_path / "writable"
    src.mkdir()
    target = tmp_path / "ro-bind"
    with mounted(target, "--bind", str(src)):
        res = subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"read-only remount not permitted: {res.stderr.strip()}")
        out = target / "merged"
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[str(target)])
        assert "Read-only file system" in msg
    assert list(src.iterdir()) == []


def test_output_on_small_read_only_tmpfs(world, tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        out = ro / "merged"
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[str(ro)])
        assert "Read-only" in msg or "write" in msg, msg


def test_disk_full_refused_before_writing(world, tmp_path, capsys):
    with tmpfs(tmp_path / "small", "size=300k") as small:
        assert merged_bytes(world) > 300 * 1024  # the model cannot fit
        out = small / "merged"
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[str(small)])
        assert "free" in msg and "needs" in msg
        assert list(small.iterdir()) == []  # not even the hidden partial folder was created


def test_refused_merge_creates_no_parent_folders(world, tmp_path, capsys):
    with tmpfs(tmp_path / "small", "size=300k") as small:
        out = small / "a" / "b" / "merged"
        expect_refusal(capsys, world.base, world.adapter, out, mentions=["free"])
        assert list(small.iterdir()) == [], f"left behind: {sorted(str(p) for p in small.rglob('*'))}"


def test_disk_full_message_is_consistent(world, tmp_path, capsys):
    # more free space than the model needs, less than the model plus the engine's safety margin
    with tmpfs(tmp_path / "small", "size=32m") as small:
        out = small / "merged"
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[str(small)])
        m = re.search(r"needs ([\d.]+) (\w+) of free space .* has ([\d.]+) (\w+) free", msg)
        assert m, msg
        units = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        needed = float(m.group(1)) * units[m.group(2)]
        free = float(m.group(3)) * units[m.group(4)]
        assert needed > free, msg  # the numbers shown explain the refusal
        assert abs(free - shutil.disk_usage(small).free) < 0.01 * free + 1e4, msg


@pytest.mark.parametrize("existing", [False, True], ids=["new-output", "overwrite-old-output"])
def test_disk_full_while_writing(world, tmp_path, existing):
    """The free-space check passes, then another process fills the disk before the shards are written
    (a real ENOSPC from a real tmpfs): the partial output is removed, the message says so, and an old
    output being replaced with --overwrite survives untouched."""
    margin = 64 << 20
    size_kib = (merged_bytes(world) + margin + (4 << 20)) // 1024
    with tmpfs(tmp_path / "disk", f"size={size_kib}k") as disk:
        out = disk / "merged"
        if existing:
            out.mkdir()
            (out / "model.safetensors").write_bytes(b"an older merge\n")
        old_output = tree_hash(out)
        filler = disk / "someone-elses-file"
        filled = []

        def fill_disk_when_merge_starts(event) -> None:
            if isinstance(event, PhaseStarted) and event.phase == "merge" and not filled:
                fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
                chunk = b"\0" * (1 << 20)
                try:
                    while True:
                        os.write(fd, chunk)
                except OSError as err:
                    assert err.errno == errno.ENOSPC
                finally:
                    os.close(fd)
                filled.append(filler.stat().st_size)

        before = {p: tree_hash(p) for p in (world.base, world.adapter)}
        with pytest.raises(MergeError) as info:
            run_merge(
                MergeOptions(base=world.base, adapter=world.adapter, out=out, overwrite=existing),
                on_event=fill_disk_when_merge_starts,
            )
        assert filled, "the merge never reached the write phase (the pre-check refused?)"
        msg = str(info.value)
        assert "\n" not in msg and "ran out of space" in msg and str(out) in msg, msg
        assert "No space left on device" in msg
        assert {p: tree_hash(p) for p in (world.base, world.adapter)} == before
        assert leftovers(disk) == []
        if existing:
            assert tree_hash(out) == old_output  # the old output was not touched
            assert sorted(p.name for p in disk.iterdir()) == sorted([filler.name, out.name])
        else:
            assert_no_output(out)
            assert sorted(p.name for p in disk.iterdir()) == [filler.name]


def test_file_size_limit_while_writing_subprocess(world, tmp_path):
    """A real ``python -m tui_merger`` whose writes fail with EFBIG (RLIMIT_FSIZE; Python ignores
    SIGXFSZ): same message and clean-up as a full disk, exit code 1."""
    resource = pytest.importorskip("resource")
    import signal

    limit = 100_000
    assert merged_bytes(world) > 2 * limit
    out = tmp_path / "merged"

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = {p: tree_hash(p) for p in (world.base, world.adapter)}
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "tui_merger", *merge_args(world.base, world.adapter, out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        preexec_fn=limit_file_size,
    )
    assert proc.returncode == 1, proc.stderr
    msg = error_line(proc.stderr)
    assert "ran out of space" in msg and "File too large" in msg and str(out) in msg, msg
    assert {p: tree_hash(p) for p in (world.base, world.adapter)} == before
    assert_no_output(out)


# ------------------------------------------------------------------------------------------------
# outputs that would clobber something
# ------------------------------------------------------------------------------------------------
def test_output_exists_and_is_not_empty(world, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    before = {p: tree_hash(p) for p in (world.base, world.adapter, out)}
    rc, _, err = run_cli(capsys, merge_args(world.base, world.adapter, out))
    assert rc == 1
    msg = error_line(err)
    assert str(out) in msg and "--overwrite" in msg and "not empty" in msg
    assert {p: tree_hash(p) for p in (world.base, world.adapter, out)} == before  # the old output too
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_output_is_the_base_folder(world, tmp_path, capsys, overwrite):
    base = copy_of(world.base, tmp_path / "base")
    before = tree_hash(base)
    extra = ["--overwrite"] if overwrite else []
    rc, _, err = run_cli(capsys, merge_args(base, world.adapter, base, *extra))
    assert rc == 1
    msg = error_line(err)
    assert str(base) in msg and "input" in msg
    assert tree_hash(base) == before
    assert leftovers(tmp_path) == []


def test_output_contains_the_adapter_with_overwrite(world, tmp_path, capsys):
    parent = tmp_path / "runs"
    adapter = copy_of(world.adapter, parent / "checkpoint-100")
    before = tree_hash(parent)
    rc, _, err = run_cli(capsys, merge_args(world.base, adapter, parent, "--overwrite"))
    assert rc == 1
    msg = error_line(err)
    assert str(parent) in msg and str(adapter) in msg and "contains" in msg
    assert tree_hash(parent) == before  # the adapter was not deleted
    assert leftovers(tmp_path) == []


def test_output_is_a_file(world, tmp_path, capsys):
    out = tmp_path / "merged"
    out.write_text("not a folder\n")
    rc, _, err = run_cli(capsys, merge_args(world.base, world.adapter, out, "--overwrite"))
    assert rc == 1
    msg = error_line(err)
    assert str(out) in msg and "file" in msg
    assert out.read_text() == "not a folder\n"
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# adapter config and tensors that disagree
# ------------------------------------------------------------------------------------------------
def test_lora_alpha_zero(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    edit_json(adapter / "adapter_config.json", lora_alpha=0)
    out = tmp_path / "merged"
    expect_refusal(capsys, world.base, adapter, out, mentions=["lora_alpha", "adapter_config.json"])


def test_rank_in_config_disagrees_with_tensors(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    edit_json(adapter / "adapter_config.json", r=4)
    out = tmp_path / "merged"
    expect_refusal(capsys, world.base, adapter, out, mentions=["r=4", "rank 8"])


def test_unknown_tensor_in_adapter(world, tmp_path, capsys):
    adapter = copy_of(world.adapter, tmp_path / "adapter")
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    stray = PEFT_PREFIX + "model.layers.0.self_attn.q_proj.lora_C.weight"
    tensors[stray] = torch.zeros(8, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    out = tmp_path / "merged"
    expect_refusal(capsys, world.base, adapter, out, mentions=[stray])


def test_tokenizer_from_adapter_without_tokenizer(world, tmp_path, capsys):
    assert not (world.adapter / "tokenizer_config.json").exists()
    out = tmp_path / "merged"
    expect_refusal(
        capsys, world.base, world.adapter, out, "--tokenizer-from", "adapter",
        mentions=["--tokenizer-from adapter", str(world.adapter), "tokenizer"],
    )


def test_bad_shard_size(world, tmp_path, capsys):
    out = tmp_path / "merged"
    expect_refusal(capsys, world.base, world.adapter, out, "--shard-size", "5XB", mentions=["5XB"])


# ------------------------------------------------------------------------------------------------
# fp16 overflow
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def huge_base(world, tmp_path_factory) -> Path:
    """The base with the q_proj weight of layer 0 (which the adapter touches) beyond fp16's range."""
    base = copy_of(world.base, tmp_path_factory.mktemp("huge") / "base")
    path = base / "model.safetensors"
    tensors = load_file(path)
    w = tensors[QPROJ]
    tensors[QPROJ] = w / w.abs().max() * 1e6  # |values| up to 1e6 > 65504
    save_file(tensors, path, metadata={"format": "pt"})
    return base


def test_fp16_overflow_is_refused(world, huge_base, tmp_path, capsys):
    out = tmp_path / "merged"
    msg = expect_refusal(capsys, huge_base, world.adapter, out, "--dtype", "fp16", mentions=[QPROJ, "--force"])
    assert "65504" in msg


def test_fp16_overflow_with_force_is_clamped(world, huge_base, tmp_path, capsys):
    out = tmp_path / "merged"
    before = {p: tree_hash(p) for p in (huge_base, world.adapter)}
    rc, stdout, err = run_cli(capsys, merge_args(huge_base, world.adapter, out, "--dtype", "fp16", "--force"))
    assert rc == 0, err
    assert "Traceback" not in err and "Merged model written" in stdout
    assert "Clamped" in err
    assert {p: tree_hash(p) for p in (huge_base, world.adapter)} == before
    tensors = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert all(torch.isfinite(t).all() for t in tensors.values()), "the fp16 output holds inf or nan"
    assert tensors[QPROJ].abs().max().item() == 65504.0
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# two merges into one output
# ------------------------------------------------------------------------------------------------
def _lock_file(out: Path) -> Path:
    return out.parent / f".{out.name}.tui-merger.lock"


def test_a_second_merge_into_the_same_output_is_refused(world, tmp_path, capsys):
    """The first merge's lock (a live process owns it) stops the second before it writes anything."""
    import socket

    out = tmp_path / "merged"
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_file(out).write_text(json.dumps({"pid": owner.pid, "host": socket.gethostname(), "started": "now"}))
        msg = expect_refusal(capsys, world.base, world.adapter, out, mentions=[f"pid {owner.pid}", str(out)])
        assert "Another merge" in msg
        assert _lock_file(out).exists()  # not ours to remove
    finally:
        owner.kill()
        owner.wait()


def test_a_stale_lock_is_taken_over_and_released(world, tmp_path, capsys):
    import socket

    out = tmp_path / "merged"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _lock_file(out).write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname(), "started": "then"}))
    rc, stdout, err = run_cli(capsys, merge_args(world.base, world.adapter, out, "--no-verify"))
    assert rc == 0, err
    assert "stale lock" in err and (out / "model.safetensors").is_file()
    assert not _lock_file(out).exists()


def test_the_lock_is_released_after_a_failed_merge(world, tmp_path):
    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken, TensorProgress

    out = tmp_path / "merged"
    cancel = CancelToken()

    def stop(event):
        if isinstance(event, TensorProgress):
            assert _lock_file(out).exists()  # held while writing
            cancel.cancel()

    with pytest.raises(MergeCancelled):
        run_merge(MergeOptions(base=world.base, adapter=world.adapter, out=out), stop, cancel)
    assert not _lock_file(out).exists() and not out.exists()
