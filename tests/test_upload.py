"""``tui-merger upload``: the real huggingface_hub client against the in-repo Hub stand-in (hub_server).

huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE and HF_HUB_DISABLE_XET when it is imported, and
conftest sets HF_HUB_OFFLINE=1 for the session: every upload therefore runs in a subprocess with its
own environment.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hub_server import HubServer
from tui_merger.cli import main
from tui_merger.core.ship import hub as hub_module
from tui_merger.core.record.manifest import FORMAT, write_manifest

ROOT = Path(__file__).resolve().parents[1]
WRITE, READ, SCOPED = "hf_alice_write_5ecret", "hf_alice_read_5ecret", "hf_alice_scoped_5ecret"
TOKENIZER_SIZE = 10_500_000  # a text file over the Hub's 10 MB line: LFS because of its size
CLI = "import sys; from tui_merger.cli import main; sys.exit(main(sys.argv[1:]))"
# huggingface_hub retries uploads 5 times with 1+2+4+8+8 s pauses; tests that exhaust them skip the pauses
CLI_NO_PAUSES = "import time; time.sleep = lambda s: None; " + CLI
CLI_1S_TIMEOUT = "import tui_merger.core.ship.hub as h; h.TIMEOUT_S = 1; " + CLI


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """A real merge (three safetensors shards), its manifest, and a 10.5 MB tokenizer.json."""
    from factory import qwen_config, save_adapter, save_base

    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.options import MergeOptions

    root = tmp_path_factory.mktemp("merged")
    base = save_base(root / "base", qwen_config())
    adapter = save_adapter(root / "adapter", base)
    out = root / "out"
    run_merge(MergeOptions(base=base, adapter=adapter, out=out, shard_size="200KB"))
    write_manifest(out, {
        "format": FORMAT,
        "merged_at": "2026-11-30T06:30:00+00:00",
        "kind": "merge",
        "inputs": [{"role": "base", "path": str(base)}, {"role": "adapter", "path": str(adapter)}],
        "adapter": {"r": 4, "alpha": 8, "variant": "lora", "target_modules": ["q_proj", "v_proj"]},
        "base_model": "Qwen/Qwen2.5-0.5B",
    })
    line = b'{"token": "abcdefghijklmnopqrstuvwxyz", "id": 123456789},\n'
    (out / "tokenizer.json").write_bytes((line * (TOKENIZER_SIZE // len(line) + 1))[:TOKENIZER_SIZE])
    return out


@pytest.fixture
def folder(merged, tmp_path) -> Path:
    """A copy of the merged model with hidden leftovers that must not be uploaded."""
    copy = shutil.copytree(merged, tmp_path / "model")
    (copy / ".cache").mkdir()
    (copy / ".cache" / "partial.safetensors").write_bytes(b"\0" * 100)
    (copy / ".model.safetensors.tmp").write_bytes(b"\0" * 100)
    return copy


@pytest.fixture
def small(tmp_path) -> Path:
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}\n')
    (folder / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}      " + bytes(range(256)) * 40)
    return folder


@pytest.fixture
def hub():
    with HubServer() as server:
        server.add_token(WRITE, "alice", "write", orgs=("lab",))
        server.add_token(READ, "alice", "read")
        server.add_token(SCOPED, "alice", "fineGrained")
        yield server


@pytest.fixture
def upload(tmp_path):
    """``upload(endpoint, *cli_args)``: run ``tui-merger upload`` in a subprocess against ``endpoint``,
    with HF_TOKEN set to ``token`` (None: no token) and an empty HF_HOME (no stored login)."""

    def run(endpoint: str, *args, token: str | None = WRITE, code: str = CLI, xet: bool = False, command="upload"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1", HF_HOME=str(tmp_path / "hf-home"))
        if not xet:
            env["HF_HUB_DISABLE_XET"] = "1"
        if token:
            env["HF_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-c", code, command, *map(str, args)],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=60,
        )

    return run


def local_files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    }


def one_error(run, *, code: int = 1) -> str:
    """The single 'error:' sentence of a failed run; no traceback, no token."""
    assert run.returncode == code, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, run.stderr
    output = run.stdout + run.stderr
    assert "Traceback" not in output
    assert not any(t in output for t in (WRITE, READ, SCOPED, "bad_token_5ecret"))
    return errors[0]


def test_upload_stores_every_byte_private_by_default_and_a_rerun_changes_nothing(upload, hub, folder):
    hub.multipart_chunk = 4_000_000  # tokenizer.json goes in three parts, as the Hub does for large files
    run = upload(hub.url, folder, "--repo-id", "alice/merged")
    assert run.returncode == 0, run.stderr
    repo = hub.repos["alice/merged"]
    assert repo.private
    stored = repo.files()
    expected = local_files(folder)
    assert "README.md" in expected and 'base_model: "Qwen/Qwen2.5-0.5B"' in expected["README.md"].decode()
    assert {p: stored[p] for p in expected} == expected  # byte for byte
    assert set(stored) - set(expected) == {".gitattributes"}  # hidden leftovers were not sent
    large = [p for p in expected if p.endswith(".safetensors")] + ["tokenizer.json"]
    assert {p for p, f in repo.head.files.items() if f.lfs} == set(large)
    assert hub.count("lfs-put") == 3 and hub.count("lfs-part") == 3 and hub.count("commit") == 1
    assert run.stdout.strip() == f"{hub.url}/alice/merged/commit/{repo.head.oid}"
    assert ".cache/" in run.stderr and ".model.safetensors.tmp" in run.stderr  # left out, and said so
    assert "sent: tokenizer.json" in run.stderr

    again = upload(hub.url, folder, "--repo-id", "alice/merged")
    assert again.returncode == 0, again.stderr
    assert "Nothing changed" in again.stderr
    assert len(repo.commits) == 2 and hub.count("commit") == 1
    assert hub.count("lfs-put") == 3 and hub.count("lfs-part") == 3  # nothing sent again


def test_dry_run_lists_the_files_offline_with_no_token_and_writes_nothing(upload, folder):
    """Issue 38 item 11: the dry run needed a token and the network before it listed anything, and then
    said "run the same command again to resume". It lists offline, with no token, writes nothing (the
    card it would write is listed), and says only what is true."""
    (folder / "README.md").unlink(missing_ok=True)  # the card an upload writes from merge_manifest.json
    before = local_files(folder)
    with socket.socket() as s:  # nothing listens there: any call to the Hub would fail
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = upload(f"http://127.0.0.1:{port}", folder, "--repo-id", "alice/merged", "--dry-run", token=None)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "to alice/merged (branch main; a new repo is created private; the Hub was not contacted" in lines[0]
    assert any(line.split()[:3] == ["LFS", "10.50", "MB"] and line.endswith("tokenizer.json") for line in lines)
    assert any(line.split()[0] == "LFS" and line.endswith("model-00001-of-00003.safetensors") for line in lines)
    assert any(line.split()[0] == "regular" and line.endswith("config.json") for line in lines)
    assert any(line.split()[0] == "regular" and line.endswith("README.md") for line in lines)
    assert "The model card README.md would be written from merge_manifest.json" in run.stdout
    assert "Dry run: nothing was written or sent." in run.stdout
    assert "resume" not in run.stdout + run.stderr and "error" not in run.stderr
    assert local_files(folder) == before  # no README.md written


@pytest.mark.parametrize("existing, flag, private", [(None, "--public", False), (False, None, False), (True, "--public", True)])
def test_visibility_of_new_and_existing_repos(upload, hub, small, existing, flag, private):
    if existing is not None:
        hub.add_repo("alice/tiny", private=existing)
    run = upload(hub.url, small, "--repo-id", "tiny", *([flag] if flag else []))
    assert run.returncode == 0, run.stderr
    assert hub.repos["alice/tiny"].private is private
    assert hub.repos["alice/tiny"].files()["model.safetensors"] == (small / "model.safetensors").read_bytes()
    if existing is not None:  # asked for the other visibility
        now = "private" if existing else "public"
        assert f"alice/tiny already exists and is {now}: it stays {now}" in run.stderr


@pytest.mark.parametrize("token, says", [("bad_token_5ecret", "rejected the token in HF_TOKEN"), (None, "No Hugging Face token found")])
def test_bad_or_missing_token_is_one_sentence(upload, hub, small, token, says):
    run = upload(hub.url, small, "--repo-id", "alice/tiny", token=token)
    assert says in one_error(run)
    assert dict(hub.counts) == ({"whoami": 1} if token else {})


@pytest.mark.parametrize("token, repo, says", [
    (READ, "alice/tiny", "read-only"),  # seen at the token check
    (SCOPED, "alice/tiny", "may not write to alice/tiny (403"),  # the repo exists; the upload is refused
    (WRITE, "bob/tiny", "may not write to bob/tiny (403"),  # someone else's namespace
])
def test_missing_permission_is_one_sentence(upload, hub, small, token, repo, says):
    hub.add_repo("alice/tiny", private=True)
    run = upload(hub.url, small, "--repo-id", repo, token=token)
    assert says in one_error(run)
    assert hub.count("lfs-put") == 0 and hub.count("commit") == 0


def test_dropped_connection_then_rerun_resumes_without_resending(upload, hub, folder):
    hub.fail("lfs-put", when=lambda n: n >= 2)  # the second large file never gets through
    run = upload(hub.url, folder, "--repo-id", "alice/merged", code=CLI_NO_PAUSES)
    assert "connection to the Hub" in one_error(run) and "run the same command again" in run.stderr
    assert len(hub.lfs) == 1 and len(hub.repos["alice/merged"].commits) == 1  # one object stored, no commit

    hub.clear_faults()
    puts = hub.count("lfs-put")
    again = upload(hub.url, folder, "--repo-id", "alice/merged")
    assert again.returncode == 0, again.stderr
    assert hub.count("lfs-put") - puts == 3  # the three large files not stored yet, not the first
    assert "already on the Hub: model-00001-of-00003.safetensors" in again.stderr
    assert "1 file already on the Hub" in again.stderr
    stored = hub.repos["alice/merged"].files()
    assert {p: stored[p] for p in local_files(folder)} == local_files(folder)


def test_dropped_commit_then_rerun_sends_no_large_file_again(upload, hub, small):
    hub.fail("commit", when=lambda n: n == 1)  # not retried by huggingface_hub
    assert "connection to the Hub" in one_error(upload(hub.url, small, "--repo-id", "alice/tiny"))
    again = upload(hub.url, small, "--repo-id", "alice/tiny")
    assert again.returncode == 0, again.stderr
    assert hub.count("lfs-put") == 1 and hub.count("commit") == 2


def test_invalid_model_card_is_one_sentence(upload, hub, small):
    (small / "README.md").write_text("---\nbase_model: x\n")  # front matter never closed
    run = upload(hub.url, small, "--repo-id", "alice/tiny")
    assert "The Hub refused the metadata at the top of README.md (front matter is not closed)" in one_error(run)


def test_engine_api_reports_progress_cancels_and_resumes(hub, small, monkeypatch):
    """In-process, as the TUI and ``merge --hf_upload_path`` call it."""
    from huggingface_hub import constants

    from tui_merger.core.errors import MergeCancelled
    from tui_merger.core.events import CancelToken

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    (small / "model-2.safetensors").write_bytes(b"\0" * 5000)
    plan = hub_module.plan_upload(small, "lab/tiny", token=WRITE, endpoint=hub.url)
    assert (plan.repo_id, plan.user, plan.private, plan.exists) == ("lab/tiny", "alice", True, False)
    assert [(f.path, f.lfs) for f in plan.files] == [
        ("config.json", False), ("model-2.safetensors", True), ("model.safetensors", True)
    ]
    assert WRITE not in repr(plan)

    cancel, events = CancelToken(), []

    def cancel_after_first_file(event):
        events.append(event)
        if isinstance(event, hub_module.UploadProgress):
            cancel.cancel()

    with pytest.raises(MergeCancelled):
        hub_module.upload(plan, on_event=cancel_after_first_file, cancel=cancel)
    assert len(hub.repos["lab/tiny"].commits) == 1 and len(hub.lfs) == 1  # one file sent, nothing committed

    events.clear()
    result = hub_module.upload(plan, message="resume", on_event=events.append)
    progress = [e for e in events if isinstance(e, hub_module.UploadProgress)]
    assert [(e.path, e.files_done, e.skipped) for e in progress] == [
        ("model-2.safetensors", 1, True), ("model.safetensors", 2, False), ("config.json", 3, False)
    ]
    assert progress[-1].bytes_done == progress[-1].bytes_total == plan.total_bytes
    assert (result.files_uploaded, result.files_skipped, result.changed) == (2, 1, True)
    assert result.bytes_sent == plan.total_bytes - 5000
    repo = hub.repos["lab/tiny"]
    assert result.commit_url.endswith(repo.head.oid) and repo.head.summary == "resume"


def test_nothing_listening_is_one_sentence(upload, small):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = upload(f"http://127.0.0.1:{port}", small, "--repo-id", "alice/tiny")
    assert f"Cannot connect to the Hub at http://127.0.0.1:{port}" in one_error(run)


def test_a_hung_hub_times_out(upload, hub, small):
    hub.fail("whoami", action="hang")
    run = upload(hub.url, small, "--repo-id", "alice/tiny", code=CLI_1S_TIMEOUT)
    assert "did not answer within 1 s" in one_error(run)


@pytest.mark.skipif(importlib.util.find_spec("hf_xet") is None, reason="hf_xet is not installed")
def test_endpoint_without_xet_says_to_disable_it(upload, hub, small):
    run = upload(hub.url, small, "--repo-id", "alice/tiny", xet=True)
    assert "set HF_HUB_DISABLE_XET=1" in one_error(run)


def test_xet_error_mapping():
    """The sentence for hf_xet's error, without hf_xet (checked end to end above when it is installed)."""
    err = ConnectionError(
        "Network error: Request error: HTTP status client error (404 Not Found), "
        "domain: http://hub.local/api/models/alice/tiny/xet-write-token/main"
    )
    message = hub_module._explain(err, "alice/tiny", "main", "http://hub.local", None)
    assert message.startswith("The Hub at http://hub.local does not offer Xet storage") and "HF_HUB_DISABLE_XET=1" in message
    # a local endpoint whose port holds "403" is still not a 403 (a CI run failed on port 40321 once)
    port = ConnectionError(
        "Network error: Request error: HTTP status client error (404 Not Found), "
        "domain: http://127.0.0.1:40321/api/models/alice/tiny/xet-write-token/main"
    )
    assert "HF_HUB_DISABLE_XET=1" in hub_module._explain(port, "alice/tiny", "main", "http://127.0.0.1:40321", None)
    denied = ConnectionError("HTTP status client error (403 Forbidden), domain: http://hub.local/api/models/a/b/xet-write-token/main")
    assert "HF_HUB_DISABLE_XET" not in hub_module._explain(denied, "a/b", "main", "http://hub.local", None)


@pytest.mark.parametrize("make, repo_id, says", [
    (lambda tmp: tmp / "missing", "alice/tiny", "does not exist"),
    (lambda tmp: tmp, "alice/tiny", "is not a model folder"),
    (None, "alice/tiny/extra", "is not a valid repo id"),
    (None, "alice/bad name", "is not a valid repo id"),
])
def test_bad_input_is_refused_before_anything_is_sent(small, tmp_path, capsys, make, repo_id, says):
    folder = make(tmp_path / "empty") if make else small
    if make:
        (tmp_path / "empty").mkdir()
    assert main(["upload", str(folder), "--repo-id", repo_id]) == 1  # offline (conftest): nothing could be sent
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_verl_merge_command_line_uploads_the_verified_model(upload, hub, tmp_path_factory, tmp_path):
    """verl's `merge --backend fsdp --local_dir D --target_dir O --hf_upload_path R --private`: merged,
    verified, then uploaded (private: our default, and what --private asks)."""
    from fsdp_factory import cached_fsdp_checkpoint

    info = cached_fsdp_checkpoint(tmp_path_factory, fsdp_version=2, world_size=2, lora=True)
    out = tmp_path / "merged"
    args = ["--backend", "fsdp", "--local_dir", info["checkpoint_dir"], "--target_dir", out,
            "--hf_upload_path", "alice/verl-lora", "--private", "--plain"]
    run = upload(hub.url, *args, command="merge")
    assert run.returncode == 0, run.stderr
    assert "PASS  behaviour" in run.stdout and "uploaded: " in run.stdout
    repo = hub.repos["alice/verl-lora"]
    assert repo.private
    stored = repo.files()
    stored.pop(".gitattributes")  # the server's own, as the Hub makes at creation
    assert stored == local_files(out)
    assert "merge_manifest.json" in local_files(out) and "README.md" in local_files(out)


def test_merge_with_upload_checks_the_token_before_merging(upload, hub, merged, tmp_path):
    out = tmp_path / "never"
    base = merged.parent / "base"
    adapter = merged.parent / "adapter"
    run = upload(hub.url, "--base", base, "--adapter", adapter, "--out", out, "--hf_upload_path", "alice/x",
                 token="bad_token_5ecret", command="merge")
    assert "rejected" in one_error(run)
    assert not out.exists() and "alice/x" not in hub.repos


def test_an_upload_from_the_demo_says_the_demo_went_offline(tmp_path):
    """Issue 38 item 8: the demo sets HF_HUB_OFFLINE itself; a refused upload says so instead of telling the
    user to unset a variable they never set. Where the user set it, the sentence tells them to unset it."""
    script = ("import sys; from tui_merger.demo import build_demo; from tui_merger.core.ship.hub import plan_upload\n"
              "from tui_merger.core.errors import MergeError\n"
              "base, _ = build_demo(sys.argv[1])\n"
              "try:\n    plan_upload(base, 'alice/demo')\nexcept MergeError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_x")
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ws")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.strip() == ("The demo runs offline (tui-merger demo set HF_HUB_OFFLINE for itself), so it "
                                  "does not upload; upload a model you merged with tui-merger outside the demo."), run
    env["HF_HUB_OFFLINE"] = "1"
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ws")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.stdout.strip() == "HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to upload.", run


def test_the_plain_flow_makes_a_gguf_and_uploads_with_a_pasted_token(hub, tmp_path):
    """Issue 38 item 12: the plain flow's "What next?" offers the GGUF (the assistant's Finish does) and its
    upload takes a token when the machine is not logged in, saves it as `hf auth login` does, and never
    shows it. A real merge of the demo, then the real client against the Hub stand-in."""
    from tui_merger.demo import build_demo

    base, _ = build_demo(tmp_path / "ws")
    answers = [
        "1", "", "1", "",  # the adapter, the output folder, Start the merge; Try it: no
        "2", "1", "", "",  # What next: Run it locally, the type f16 (q4_k_m is preselected), its file (the suggestion),
        # the adapter as a GGUF LoRA too: no (the default)
        "3", "alice/plain-merged", "", WRITE, "y",  # upload: repo, private, the token, upload now
        "3",  # Done
    ]
    script = ("import io, sys; from tui_merger.plain import run_plain\n"
              "sys.exit(run_plain(__import__('pathlib').Path(sys.argv[1]), dumb=True, output=sys.stdout))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1",
               HF_HOME=str(tmp_path / "hf-home"), PYTHONPATH=str(ROOT), XDG_STATE_HOME=str(tmp_path / "state"))
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ws")], input="\n".join(answers) + "\n",
                         env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    assert "Run it locally: a GGUF for llama.cpp, Ollama, LM Studio (checked, with an Ollama Modelfile)" in out
    assert "  1) f16: 16-bit, every llama.cpp build runs it" in out and "q4_k_m (recommended)" in out
    [gguf] = [p for p in (tmp_path / "ws").glob("*/*-F16.gguf")]
    assert f"GGUF written: {gguf} (F16, " in out and f"Run it:\n  ollama create " in out and f"  llama-cli -m {gguf}\n" in out
    assert f"Not logged in to the Hub on this machine: paste a write token from {hub.url}/settings/tokens" in out
    assert WRITE not in out + run.stderr and "(hidden)" in out
    assert "Uploaded: " in out
    files = hub.repos["alice/plain-merged"].files()
    assert gguf.name in files and "model.safetensors" in files and "README.md" in files
    assert files[gguf.with_suffix(".Modelfile").name] == gguf.with_suffix(".Modelfile").read_bytes()
    assert (tmp_path / "hf-home" / "token").read_text().strip() == WRITE  # saved for next time
