"""llama.cpp's side of the GGUF and mmproj checks, run in a child process.

llama.cpp stops its process with ``abort()`` when one of its own asserts fails (``GGML_ASSERT``): run in
tui-merger's process, that would end the user's app (the TUI over SSH included) with a backtrace. So the
checks hand llama.cpp's part to ``python -m tui_merger.core.ship.llama_child <folder>``: the folder holds
``task.json`` (and ``image.npy`` for an image), the child writes ``out.json`` (token ids, or the Python error
llama.cpp raised) and ``logits.npy`` / ``embd.npy``; its stderr (llama.cpp's log, an assert's message) goes
to ``stderr.txt``. ``run`` returns the outputs or raises ``LlamaStopped`` with what stopped it. The parent
watches the user's Stop (a CancelToken) while the child runs and ends it (SIGTERM, then SIGKILL): a Stop during a
long llama.cpp run takes effect within a second.

The child imports numpy and llama_cpp only (no torch): it adds about half a second per check.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

# signals a program sends itself when it fails (abort(), a bad address, a bad instruction): llama.cpp stopped
_CRASHES = {signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP}
_TEST_ABORT = "TUI_MERGER_TEST_LLAMA_ABORT"  # tests only: the child prints this on stderr and calls abort() (or SIGKILL)
_TEST_SLEEP = "TUI_MERGER_TEST_LLAMA_SLEEP"  # tests only: the child sleeps this many seconds first (a long llama.cpp run)
_POLL = 0.1  # seconds between looks at the user's Stop while the child runs
_TERM_GRACE = 0.5  # seconds a stopped child has after SIGTERM before SIGKILL

_scoped = threading.local()  # the cancel token of the check running in this thread (cancel_scope), for callers that pass none


class LlamaStopped(Exception):
    """The child ended without an answer. ``crashed``: by a signal llama.cpp sends itself (an assert's abort,
    a segmentation fault); else stopped from outside (SIGKILL: the system's out-of-memory killer) or an exit
    code. ``why``: what its stderr said, with the signal or exit code."""

    def __init__(self, why: str, crashed: bool) -> None:
        super().__init__(why)
        self.why = why
        self.crashed = crashed

    def sentence(self, doing: str) -> str:
        """The verdict's sentence; ``doing``: "running model.gguf". A crash is llama.cpp's own stop: it cannot run
        the file (FAILED); a process stopped from outside says nothing of the file (not checked)."""
        if self.crashed:
            return f"llama.cpp stopped while {doing} ({self.why}): llama.cpp cannot run this file."
        return f"the llama.cpp process {doing} ended before it answered ({self.why})."


@contextmanager
def cancel_scope(cancel):
    """Within it, ``run`` in this thread watches ``cancel`` when its caller passed no token (a check that does not
    hand its token down, as the mmproj check's image run)."""
    before = getattr(_scoped, "cancel", None)
    _scoped.cancel = cancel
    try:
        yield
    finally:
        _scoped.cancel = before


def run(task: dict, image=None, cancel=None) -> tuple[dict, dict]:
    """Run ``task`` in a child process: returns (out.json's dict, {name: numpy array}). Raises LlamaStopped; and
    MergeCancelled (the engine's Stop) when ``cancel`` (a CancelToken; default: cancel_scope's) is set while the child
    runs: the child is ended (SIGTERM, SIGKILL after half a second) and waited for, so nothing of it is left."""
    import numpy as np

    if cancel is None:
        cancel = getattr(_scoped, "cancel", None)
    if cancel is not None:
        cancel.raise_if_cancelled()

    with tempfile.TemporaryDirectory(prefix="tui-merger-llama-") as tmp:
        work = Path(tmp)
        (work / "task.json").write_text(json.dumps(task))
        if image is not None:
            np.save(work / "image.npy", np.ascontiguousarray(image))
        root = str(Path(__file__).resolve().parents[3])  # the folder that holds the tui_merger package
        env = dict(os.environ, GGML_NO_BACKTRACE="1",  # ggml's abort would run gdb for a backtrace: seconds, noise
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        with open(work / "stderr.txt", "wb") as err:
            child = subprocess.Popen([sys.executable, "-m", "tui_merger.core.ship.llama_child", str(work)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
            code = _wait(child, cancel)
        said = _said((work / "stderr.txt").read_text(errors="replace"))
        out_file = work / "out.json"
        if code != 0 or not out_file.exists():
            if code < 0:
                try:
                    sig = signal.Signals(-code)
                except ValueError:
                    sig = None
                what = sig.name if sig is not None else f"signal {-code}"
                raise LlamaStopped(f"{said}, {what}" if said else what, sig in _CRASHES)
            raise LlamaStopped(f"{said}, exit code {code}" if said else f"exit code {code}", False)
        out = json.loads(out_file.read_text())
        arrays = {p.stem: np.load(p) for p in work.glob("*.npy") if p.name != "image.npy"}
        return out, arrays


def _wait(child: subprocess.Popen, cancel) -> int:
    """The child's exit code; when ``cancel`` is set first, the child is ended and MergeCancelled raised."""
    while True:
        try:
            return child.wait(timeout=_POLL)
        except subprocess.TimeoutExpired:
            pass
        except BaseException:  # Ctrl-C in the parent: the child goes too
            _end(child)
            raise
        if cancel is not None and cancel.cancelled:
            _end(child)
            cancel.raise_if_cancelled()


def _end(child: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not gone within _TERM_GRACE; waited for (no zombie left)."""
    try:
        child.terminate()
        child.wait(timeout=_TERM_GRACE)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    except OSError:  # already gone
        child.wait()


def _said(stderr: str) -> str:
    """The line of a stopped llama.cpp's stderr that says why: its failed assert, else its abort message
    ("clip.cpp:4509: Failed to get tensor window_mask"), else an error line, else the last line; without the
    source file's folders."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for pattern in (r"GGML_ASSERT\(.*\) failed", r"\.(?:c|cc|cpp|h):\d+: ", r"\berror\b|terminate called|what\(\)"):
        hits = [line for line in lines if re.search(pattern, line)]
        if hits:
            return re.sub(r"^\S*/(?=\S+:\d+: )", "", hits[-1])[:300]
    return lines[-1][:300] if lines else ""


# -- the child -----------------------------------------------------------------------------------------


def _text(task: dict, work: Path) -> dict:
    """Load the GGUF (with the GGUF LoRA), tokenize the texts, run the prompt: ids, and every prompt position's logits."""
    import numpy as np
    from llama_cpp import Llama

    lora = task.get("lora")
    try:
        llm = Llama(model_path=task["model"], n_ctx=int(task["n_ctx"]), logits_all=True, verbose=False, seed=0,
                    n_threads=int(task["threads"]), **({"lora_path": lora} if lora else {}))
    except Exception as err:  # noqa: BLE001 - llama.cpp reports a file it refuses as a ValueError or worse
        return {"error": "load", "message": _first_line(err)}
    ids = [list(llm.tokenize(text.encode("utf-8"), add_bos=special, special=True))
           for text, special in zip(task["texts"], task["special"])]
    llm.reset()
    llm.eval(task["prompt"])
    np.save(work / "logits.npy", np.asarray(llm.scores[: len(task["prompt"])], dtype=np.float32))
    return {"ids": ids}


def _image(task: dict, work: Path) -> dict:
    """libmtmd's embeddings of one image through the mmproj: (tokens, width) float32."""
    import ctypes

    import numpy as np

    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    rgb = np.load(work / "image.npy")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    params.vocab_only = False
    model = llama_cpp.llama_model_load_from_file(task["model"].encode(), params)
    if not model:
        return {"error": "load", "message": f"llama.cpp did not load {Path(task['model']).name}"}
    ctx = None
    try:
        ctx_params = mtmd.mtmd_context_params_default()
        ctx_params.use_gpu = False
        ctx_params.print_timings = False
        ctx_params.n_threads = int(task["threads"])
        ctx = mtmd.mtmd_init_from_file(task["mmproj"].encode(), model, ctx_params)
        if not ctx:
            return {"error": "load", "message": "mtmd_init_from_file refused it"}
        height, width = rgb.shape[:2]
        data = (ctypes.c_uint8 * rgb.size).from_buffer_copy(np.ascontiguousarray(rgb).tobytes())
        bitmap = mtmd.mtmd_bitmap_init(width, height, data)
        chunks = mtmd.mtmd_input_chunks_init()
        try:
            prompt = mtmd.mtmd_default_marker()
            text = mtmd.mtmd_input_text(prompt, len(prompt), True, True)
            if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
                return {"error": "encode", "message": "mtmd_tokenize failed"}
            n_embd = llama_cpp.llama_model_n_embd_inp(model) if hasattr(llama_cpp, "llama_model_n_embd_inp") \
                else llama_cpp.llama_model_n_embd(model)
            for i in range(mtmd.mtmd_input_chunks_size(chunks)):
                chunk = mtmd.mtmd_input_chunks_get(chunks, i)
                if mtmd.mtmd_input_chunk_get_type(chunk) != 1:  # MTMD_INPUT_CHUNK_TYPE_IMAGE
                    continue
                n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
                if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                    return {"error": "encode", "message": "mtmd_encode_chunk failed"}
                out = mtmd.mtmd_get_output_embd(ctx)
                np.save(work / "embd.npy", np.ctypeslib.as_array(out, shape=(n * n_embd,)).copy().reshape(n, n_embd))
                return {}
            return {"error": "encode", "message": "llama.cpp made no image chunk"}
        finally:
            mtmd.mtmd_input_chunks_free(chunks)
            mtmd.mtmd_bitmap_free(bitmap)
    finally:
        if ctx:
            mtmd.mtmd_free(ctx)
        llama_cpp.llama_model_free(model)


def _maybe_abort() -> None:
    """Tests only (CI has no llama.cpp): stop where llama.cpp would, as its failed assert does (its message on
    stderr, then abort()); or first run as long as a large llama.cpp run does (TUI_MERGER_TEST_LLAMA_SLEEP seconds,
    SIGTERM ignored, as a thread inside llama.cpp's C code does not answer it: only SIGKILL ends it)."""
    sleep = os.environ.get(_TEST_SLEEP)
    if sleep:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.write(2, f"sleeping {sleep} s\n".encode())
        time.sleep(float(sleep))
    said = os.environ.get(_TEST_ABORT)
    if said == "SIGKILL":  # as the system's out-of-memory killer stops a process
        os.kill(os.getpid(), signal.SIGKILL)
    if said:
        os.write(2, (said + "\n").encode())
        os.abort()


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]


def main(argv: list[str]) -> int:
    work = Path(argv[0])
    task = json.loads((work / "task.json").read_text())
    _maybe_abort()
    try:
        import llama_cpp  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a binding built for another CPU or library raises anything
        out = {"error": "import", "message": _first_line(err)}
    else:
        out = (_image if task["kind"] == "image" else _text)(task, work)
    (work / "out.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
