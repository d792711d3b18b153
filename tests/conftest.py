import atexit
import os
import shutil
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# tui-merger's own state (merge history, the hash cache, jobs) goes to a folder of this test session,
# never to the user's $XDG_STATE_HOME: a history grown by earlier runs made every history read slower
# (find_cleanup reads it all), pushed fuzz examples past their deadline, and tests wrote into the
# user's real history. Set once in the controlling process; xdist workers and subprocesses inherit it,
# so the session shares one history as before. Tests that set their own XDG_STATE_HOME still win.
if "PYTEST_XDIST_WORKER" not in os.environ:
    _state = tempfile.mkdtemp(prefix="tui-merger-test-state-")
    os.environ["XDG_STATE_HOME"] = _state
    atexit.register(shutil.rmtree, _state, ignore_errors=True)
