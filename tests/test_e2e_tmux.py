"""End to end in a real terminal: README's first command (`tui-merger demo`) in tmux, driven with keys to
a finished, verified merge, through Try it (both models answer the prompt); then the files are checked."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from tui_merger.core.record.manifest import read_manifest

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")


class Tmux:
    def __init__(self, tmp_path) -> None:
        self.socket = str(tmp_path / "tmux.sock")
        self.name = f"tm-{uuid.uuid4().hex[:8]}"

    def run(self, *args) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=True).stdout

    def start(self, command: str, cwd) -> None:
        self.run("new-session", "-d", "-s", self.name, "-x", "100", "-y", "30", "-c", str(cwd),
                 f"{command}; echo EXIT=$?; sleep 60")

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.name)

    def keys(self, *keys) -> None:
        self.run("send-keys", "-t", self.name, *keys)

    def wait_for(self, text: str, timeout: float = 90) -> str:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.1)
        raise AssertionError(f"{text!r} did not appear; the screen shows:\n{self.screen()}")

    def kill(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True)


def test_demo_in_a_real_terminal_to_a_verified_merge(tmp_path):
    tmux = Tmux(tmp_path)
    env = f"XDG_CONFIG_HOME={shlex.quote(str(tmp_path / 'config'))} XDG_STATE_HOME={shlex.quote(str(tmp_path / 'state'))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    try:
        tmux.start(f"env {env} {shlex.quote(sys.executable)} -m tui_merger demo --workspace ws", tmp_path)
        screen = tmux.wait_for("Checkpoints found")
        assert "tui-merger │  Find  > Review > Merge > Verify > " in screen  # the steps, the current one padded (and highlighted)
        tmux.wait_for("LoRA rank 8, alpha 16")
        tmux.keys("C-n")
        tmux.wait_for("every check passed")
        assert "Find >  Review  > Merge" in tmux.screen()
        tmux.keys("C-n")
        tmux.wait_for("Verification PASSED")
        tmux.keys("C-n")  # Try it: the memory said first, then both answers to the prompt box's question
        tmux.wait_for("Needs about")
        # the demo compares with the unmerged adapter on a line of its own text (issue 38 item 19)
        screen = tmux.wait_for("compare with the unmerged adapter (peft)")
        assert "merged model" in screen and "unmerged adapter" in screen and "a merge adds the update" in screen
        tmux.keys("Enter")  # the prompt box holds a question: ask it
        end = time.monotonic() + 90
        while not (tmux.screen().count(" tokens/s ") == 2 and "tokens/s..." not in tmux.screen()) and time.monotonic() < end:
            time.sleep(0.2)  # both answers streamed in, each with its speed
        assert tmux.screen().count("64 tokens, ") == 2, tmux.screen()
        while "answering..." in tmux.screen() and time.monotonic() < end:
            time.sleep(0.2)  # the last token is shown a moment before the worker has handed its models back
        tmux.keys("C-n")
        tmux.wait_for("The merged model is in")
        assert "Verify > Try >  Finish  │" in tmux.screen()
        tmux.keys("C-q")
        screen = tmux.wait_for("EXIT=0")
        # the app has closed; the terminal keeps where the model is and how to use it (issue 32 item 6)
        assert "The merged model is in " in screen and "(verified)." in screen, screen
        assert f"transformers: {sys.executable} -c " in screen and "vLLM:         vllm serve " in screen, screen
    finally:
        tmux.kill()
    [out] = (tmp_path / "ws").glob("*-r8-*")  # the suggested name, beside the adapter
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert read_manifest(out)["verification"]["passed"] is True
    assert not [p for p in (tmp_path / "ws").iterdir() if "partial" in p.name]
    assert os.path.isfile(tmp_path / "ws" / "adapter" / "adapter_config.json")  # inputs untouched


def test_upload_logs_in_from_the_app(tmp_path):
    """Issue 32 item 10: Upload had no way to log in from the app. On a machine that is not logged in, the
    Upload dialog says so and takes a token; the model goes to the Hub (the in-repo stand-in) and the
    token is saved where `hf auth login` saves it."""
    from hub_server import HubServer

    token = "hf_alice_write_5ecret"
    tmux = Tmux(tmp_path)
    hf_home = tmp_path / "hf-home"
    with HubServer() as hub:
        hub.add_token(token, "alice", "write")
        env = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in {
            "XDG_CONFIG_HOME": tmp_path / "config", "XDG_STATE_HOME": tmp_path / "state", "HF_HOME": hf_home,
            "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "TERM": "xterm-256color",
        }.items())
        try:
            tmux.start(f"env -u HF_TOKEN {env} {shlex.quote(sys.executable)} -m tui_merger demo --workspace ws", tmp_path)
            tmux.wait_for("LoRA rank 8, alpha 16")
            tmux.keys("C-n")
            tmux.wait_for("every check passed")
            tmux.keys("C-n")
            tmux.wait_for("Verification PASSED")
            tmux.keys("C-n")
            tmux.wait_for("Finish >")
            tmux.keys("C-n")  # Try it skipped
            tmux.wait_for("The merged model is in")
            tmux.keys("BTab", "BTab", "Enter")  # Quit is focused: back to Upload...
            tmux.wait_for("Not logged in: paste a write token")
            time.sleep(0.5)
            tmux.keys("C-u")
            time.sleep(0.5)
            tmux.keys("-l", "alice/demo")
            tmux.wait_for("alice/demo")
            tmux.keys("Tab", "Tab")  # the visibility, then the token
            time.sleep(0.5)
            tmux.keys("-l", token)
            time.sleep(0.5)
            tmux.keys("Enter")
            screen = tmux.wait_for("Uploaded:")
            assert token not in screen  # a password field
            tmux.keys("C-q")
            tmux.wait_for("EXIT=0")
        finally:
            tmux.kill()
        repo = hub.repos["alice/demo"]
        assert repo.private and "model.safetensors" in repo.files() and "config.json" in repo.files()
    assert (hf_home / "token").read_text().strip() == token  # saved by huggingface_hub's login


def test_run_it_locally_from_finish_in_a_real_terminal(tmp_path):
    """Issue 40: Finish > Run it locally... preselects q4_k_m and says size and time before writing; the
    GGUF is written, checked (transformers' reader here) and its Modelfile made; the farewell gives the
    ollama and llama.cpp lines."""
    tmux = Tmux(tmp_path)
    env = f"XDG_CONFIG_HOME={shlex.quote(str(tmp_path / 'config'))} XDG_STATE_HOME={shlex.quote(str(tmp_path / 'state'))} HF_HUB_OFFLINE=1 TERM=xterm-256color"
    try:
        tmux.start(f"env {env} {shlex.quote(sys.executable)} -m tui_merger demo --workspace ws", tmp_path)
        tmux.wait_for("LoRA rank 8, alpha 16")
        tmux.keys("C-n")
        tmux.wait_for("every check passed")
        tmux.keys("C-n")
        tmux.wait_for("Verification PASSED")
        tmux.keys("C-n")
        tmux.wait_for("Finish >")
        tmux.keys("C-n")  # Try it skipped
        tmux.wait_for("Run it locally...")
        tmux.keys("BTab", "Enter")  # Quit is focused: back to Run it locally...
        tmux.wait_for("to write (at the speed")
        screen = tmux.wait_for("-Q4_K_M.gguf", timeout=10)  # the file field scrolled to its end
        assert "q4_k_m (recommended)" in screen, screen
        tmux.keys("Tab", "Tab", "Enter")  # the type, the file, Make the GGUF
        screen = tmux.wait_for("Run it with:", timeout=240)
        assert "Check PASSED" in screen and "Modelfile" in screen, screen
        tmux.keys("C-q")
        screen = tmux.wait_for("EXIT=0")
        assert "llama.cpp:    llama-cli -m " in screen and "Ollama:       ollama create " in screen, screen
    finally:
        tmux.kill()
    [out] = (tmp_path / "ws").glob("*-r8-*")
    [gguf_file] = out.glob("*-Q4_K_M.gguf")
    assert gguf_file.with_suffix(".Modelfile").is_file()
    assert read_manifest(out)["gguf"][0]["check"]["status"] == "passed"
