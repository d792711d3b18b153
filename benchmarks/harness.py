"""The harness that bench_merge.py and bench_fsdp.py share: child processes, peak RSS, tables.

Every timed case runs in its own child process; its peak RSS is the ru_maxrss that ``os.wait4`` reports
for that child alone. The parent never imports torch (see bench_merge.py for why), so nothing at module
level here may import it either: the helpers used by children import torch / transformers / safetensors
inside the function.

Imported by the scripts as a plain module (``sys.path`` gets benchmarks/), since they run as
``python benchmarks/bench_*.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = HERE / ".cache"

# The environment of every child. A script may add to it before starting children (bench_fsdp.py adds
# TRANSFORMERS_VERBOSITY); run_child reads it at call time.
CHILD_ENV = dict(
    os.environ,
    HF_HUB_OFFLINE="1",
    TRANSFORMERS_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    TOKENIZERS_PARALLELISM="false",
    PYTHONWARNINGS="ignore",
)

# ----------------------------------------------------------------------------------------------
# Used by children (torch & co. imported inside the functions only)
# ----------------------------------------------------------------------------------------------


# Qwen2.5 shapes by name: hidden, intermediate, layers, heads, kv heads (vocab 151936, tied embeddings)
QWEN_SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
    "7b": (3584, 18944, 28, 28, 4),  # Qwen2.5-7B's widths (its embeddings are untied; tied here)
}


def qwen_config(layers: int | None, eos_token_id: int, shape: str = "0.5b"):
    """Qwen2.5 shapes (0.5B by default) with `layers` decoder layers (None: the real model's count)."""
    from transformers import Qwen2Config

    hidden, inter, real_layers, heads, kv = QWEN_SHAPES[shape]
    layers = real_layers if layers is None else layers
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=151936,
        max_position_embeddings=32768,
        max_window_layers=layers,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=eos_token_id,
    )


def load_tensors(folder) -> dict:
    """Every tensor of every *.safetensors file in `folder`, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def profile_run_merge(opts, top: str) -> None:
    """cProfile one run_merge(opts, fsync=False) and print the top rows by tottime and cumulative."""
    import cProfile
    import pstats

    from tui_merger.core.merge.engine import run_merge

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    run_merge(opts, fsync=False)
    prof.disable()
    print(f"run_merge(fsync=False) under cProfile: {time.perf_counter() - t0:.2f} s wall", flush=True)
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.strip_dirs().sort_stats("tottime").print_stats(int(top))
    stats.sort_stats("cumulative").print_stats(int(top))


# ----------------------------------------------------------------------------------------------
# Parent (no torch here)
# ----------------------------------------------------------------------------------------------


class ChildFailed(RuntimeError):
    pass


def run_child(argv: list[str], log: Path | None = None, capture: bool = False) -> dict:
    """Run one process; return wall seconds, its own peak RSS (MiB) and its stdout."""
    out_f = open(log, "wb") if log else subprocess.DEVNULL
    stdout = subprocess.PIPE if capture else out_f
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=stdout, stderr=out_f, env=CHILD_ENV, cwd=REPO)
    text = b""
    if capture:
        text = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if log:
        out_f.close()
    text = text.decode(errors="replace")
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:] if log else ""
        raise ChildFailed(f"{' '.join(map(str, argv))} exited {proc.returncode}\n{text[-4000:]}\n{tail}")
    return {"wall": wall, "rss": usage.ru_maxrss / 1024, "cpu": usage.ru_utime + usage.ru_stime,
            "stdout": text}  # ru_maxrss is KiB on Linux


def code_state() -> str:
    """Which engine code was measured: HEAD and whether tui_merger/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "tui_merger", "pyproject.toml"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\n")
        dirty = [line[3:] for line in dirty if line.strip()]
        return f"git {head}" + (f" + uncommitted changes in {', '.join(dirty)}" if dirty else " (clean)")
    except (OSError, subprocess.CalledProcessError):
        return "git state unknown"


def source_fingerprint() -> str:
    """A hash of tui_merger/'s sources: others may edit them while a long benchmark runs."""
    import hashlib

    h = hashlib.sha1()
    for f in sorted((REPO / "tui_merger").rglob("*.py")):
        h.update(str(f.relative_to(REPO)).encode() + b"\0")
        try:
            h.update(f.read_bytes())
        except OSError:
            pass
    return h.hexdigest()[:12]


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench_json(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            return json.loads(line[len("BENCH_JSON "):])
    return None


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_table(headers, rows) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def slug(name: str) -> str:
    """A file-name-safe tag for a case name: the part before "(", non-alphanumerics as "-"."""
    return "".join(c if c.isalnum() else "-" for c in name.split("(")[0].strip())


class Runner:
    """Runs one case at a time in a fresh output path: sync, settle, inputs warm (or cold), then the child.

    `tag(name)` names the output path and log of a run (default: slug).
    """

    def __init__(self, tmp_root: Path, sync: bool, settle: float, inputs: list[Path], cold: bool = False,
                 tag=slug) -> None:
        self.tmp_root = tmp_root
        self.sync = sync
        self.settle = settle
        self.inputs = inputs
        self.cold = cold
        self.tag = tag
        self.n = 0

    def files(self, folders: list[Path] | None = None) -> list[str]:
        folders = self.inputs if folders is None else folders
        return sorted(str(f) for d in folders for f in Path(d).rglob("*") if f.is_file())

    def preread(self, folders: list[Path] | None = None) -> None:
        """Read the inputs (or `folders`) into the page cache (untimed). This VM runs DAMON 'pageout' on
        physical memory, which drops page-cache pages left unread for a few seconds, so "warm" must be
        renewed right before every case."""
        subprocess.run(["cat", *self.files(folders)], stdout=subprocess.DEVNULL, check=True)

    def evict(self) -> None:
        """Inputs out of the page cache (they are clean after sync): the case reads from the disk."""
        os.sync()
        for f in self.files():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def run(self, name: str, make_argv, keep: bool = False) -> tuple[dict, Path]:
        """make_argv(out) -> argv. Runs in a fresh output path; deletes it unless keep."""
        self.n += 1
        tag = self.tag(name)
        out = self.tmp_root / f"{tag}-{self.n}"
        log = self.tmp_root / f"{tag}-{self.n}.log"
        if self.sync:
            os.sync()
        if self.settle:
            time.sleep(self.settle)
        if self.cold:
            self.evict()
        else:
            self.preread()
        try:
            r = run_child(make_argv(out), log=log, capture=True)
        finally:
            if not keep:
                shutil.rmtree(out, ignore_errors=True)
        if not keep:
            log.unlink(missing_ok=True)
        return r, out


def warm_up(runner: Runner, cases: dict, keep_names) -> dict:
    """One untimed run of every case; returns {name: output path} for the cases in keep_names."""
    print("warm-up (untimed) + verification ...", flush=True)
    kept = {}
    for name, make in cases.items():
        keep = name in keep_names
        r, out = runner.run(name, make, keep=keep)
        print(f"  warm-up {name}: {r['wall']:.2f} s, {r['rss']:.0f} MiB", flush=True)
        if keep:
            kept[name] = out
    return kept


def remove_kept(kept: dict) -> None:
    for out in kept.values():
        shutil.rmtree(out, ignore_errors=True)
        Path(str(out) + ".log").unlink(missing_ok=True)


def timed_rounds(runner: Runner, cases: dict, repeats: int) -> dict:
    """`repeats` round-robin passes over the cases; returns {name: [run_child result, ...]}."""
    results = {name: [] for name in cases}
    print(f"timed: {repeats} round-robin repeats of {len(cases)} cases ...", flush=True)
    for rep in range(repeats):
        for name, make in cases.items():
            r, _ = runner.run(name, make)
            results[name].append(r)
            print(f"  [{rep + 1}/{repeats}] {name}: {r['wall']:.2f} s, {r['rss']:.0f} MiB, cpu {r['cpu']:.1f} s, "
                  f"load {loadavg()}", flush=True)
    return results


RESULT_HEADERS = ["case", "wall median s", "min s", "max s", "cpu (user+sys) s", "peak RSS median MiB",
                  "peak RSS max MiB"]


def summarize(results: dict) -> tuple[dict, dict, list]:
    """Median wall and peak RSS per case, and the rows of the results table (RESULT_HEADERS)."""
    wall = {k: med([r["wall"] for r in v]) for k, v in results.items()}
    rss = {k: med([r["rss"] for r in v]) for k, v in results.items()}
    rows = []
    for name, runs in results.items():
        ws = [r["wall"] for r in runs]
        rows.append([name, f"{wall[name]:.2f}", f"{min(ws):.2f}", f"{max(ws):.2f}",
                     f"{med([r['cpu'] for r in runs]):.2f}",
                     f"{rss[name]:.0f}", f"{max(r['rss'] for r in runs):.0f}"])
    return wall, rss, rows


def rss_floor(commands: dict) -> dict:
    """{label: argv} -> {label: peak RSS MiB}: what a bare process and bare imports cost, for context."""
    return {label: run_child(argv)["rss"] for label, argv in commands.items()}


def print_rss_floor(floor: dict) -> None:
    print("RSS floor for context: " + ", ".join(f"{k}: {v:.0f} MiB" for k, v in floor.items()))


def run_child_command(argv: list[str], children: dict) -> bool:
    """If argv names a child (`_<name> ...`), run it here and return True."""
    if argv and argv[0] in children:
        children[argv[0]](argv[1:])
        return True
    return False


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for the gloo rendezvous of benchmark rank processes)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_cpp_run(path, prompt: list[int], new_tokens: int, lora_path=None, threads: int = 2):
    """llama.cpp itself (llama-cpp-python's ``Llama``; never a dependency of tui-merger) on the GGUF at
    ``path``, with the GGUF LoRA ``lora_path`` applied (llama.cpp's ``--lora``) when given: the prompt's
    logits ([positions, vocab], numpy float32) and ``new_tokens`` greedy tokens after it. The llama.cpp
    scripts (llama_cpp_*_check.py) share it."""
    import numpy as np
    from llama_cpp import Llama

    kw = {"lora_path": str(lora_path)} if lora_path else {}
    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0, n_threads=threads, **kw)
    try:
        llm.eval(prompt)
        logits = np.array(llm.scores[: len(prompt)], dtype=np.float32)
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1) if new_tokens else ():
            tokens.append(token)
            if len(tokens) == new_tokens:
                break
    finally:
        llm.close() if hasattr(llm, "close") else None
        del llm
    return logits, tokens
