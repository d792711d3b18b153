#!/usr/bin/env python
"""How fast tui-merger starts. Targets: ``tui-merger --help`` under 0.3 s, the TUI's first screen under 1 s.

    python benchmarks/bench_startup.py              # medians of 5
    python benchmarks/bench_startup.py --repeats 9

Timed, each in a fresh process:

- ``tui-merger --help`` (the console script, interpreter start included);
- ``python -c "import tui_merger.cli"``;
- the first screen of the assistant: ``tui-merger DEMO`` runs in a detached 100x30 tmux session on a
  private tmux server, and the pane is captured every ~10 ms until the header's "Find > Review" shows. DEMO is a folder
  that ``python -m tui_merger demo --workspace DEMO`` builds first (untimed).

Also reported: whether ``from tui_merger.tui.app import MergeApp`` imports torch or transformers
(``python -X importtime``), which would put seconds in front of the first screen.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import REPO, code_state, fmt_table, loadavg, med  # noqa: E402

FIRST_SCREEN = "Find  > Review"  # the header's step indicator, the current step padded
FIRST_SCREEN_TIMEOUT_S = 20.0
HEAVY = ("torch", "transformers")


class NotAvailable(Exception):
    """The TUI cannot be measured yet; the message says why."""


def time_command(argv: list[str], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, cwd=REPO)
        times.append(time.perf_counter() - t0)
    return times


class Tmux:
    """A tmux server of our own (a socket in our temporary folder): the user's sessions are never touched."""

    def __init__(self, socket: Path) -> None:
        self.socket = str(socket)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True, text=True, check=check)

    def __enter__(self) -> Tmux:
        # A session that outlives the timed ones: the server is up before timing starts.
        self("new-session", "-d", "-s", "keepalive", "sleep 3600")
        return self

    def __exit__(self, *exc) -> None:
        self("kill-server", check=False)


def first_screen_once(tmux: Tmux, command: str, name: str) -> float:
    """Seconds from starting `command` in a fresh tmux session until FIRST_SCREEN is on it."""
    t0 = time.perf_counter()
    tmux("new-session", "-d", "-s", name, "-x", "100", "-y", "30", f"{command}; echo EXIT=$?; sleep 600")
    try:
        while time.perf_counter() - t0 < FIRST_SCREEN_TIMEOUT_S:
            screen = tmux("capture-pane", "-p", "-t", name, check=False).stdout
            if FIRST_SCREEN in screen:
                return time.perf_counter() - t0
            if "EXIT=" in screen:
                last = [line for line in screen.splitlines() if line.strip()][-3:-1]
                raise NotAvailable(f"`{command}` ended before its first screen: {' / '.join(last)}")
            time.sleep(0.01)
        raise NotAvailable(f"{FIRST_SCREEN!r} did not show within {FIRST_SCREEN_TIMEOUT_S:.0f} s")
    finally:
        tmux("kill-session", "-t", name, check=False)


def time_first_screen(cli: str, repeats: int, work: Path) -> list[float]:
    if importlib.util.find_spec("tui_merger.tui.app") is None:
        raise NotAvailable("tui_merger/tui/app.py does not exist")
    if not shutil.which("tmux"):
        raise NotAvailable("tmux is not installed")
    demo = work / "demo"
    print(f"building the demo workspace {demo} (untimed) ...", flush=True)
    subprocess.run([sys.executable, "-m", "tui_merger", "demo", "--workspace", str(demo)], cwd=REPO,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    # An empty config folder: the user's saved theme and theme files play no part.
    command = shlex.join(["env", f"XDG_CONFIG_HOME={work / 'config'}", cli, str(demo)])
    with Tmux(work / "tmux.sock") as tmux:
        first_screen_once(tmux, command, "warm-up")  # untimed: fills the page cache
        return [first_screen_once(tmux, command, f"run-{i}") for i in range(repeats)]


def heavy_imports_of_the_app() -> str:
    """Which of HEAVY importing MergeApp pulls in, from ``python -X importtime``."""
    if importlib.util.find_spec("tui_merger.tui.app") is None:
        return "skipped: tui_merger/tui/app.py does not exist yet"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", "from tui_merger.tui.app import MergeApp"],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        return f"skipped: importing MergeApp failed: {out.stderr.strip().splitlines()[-1]}"
    # Lines look like "import time:       412 |      12345 | torch.nn"; the total is on the app's line.
    rows = [line.split("|") for line in out.stderr.splitlines() if line.startswith("import time:")]
    modules = {row[2].strip(): int(row[1]) for row in rows if row[1].strip().isdigit()}
    found = sorted({m.split(".")[0] for m in modules} & set(HEAVY))
    total = modules.get("tui_merger.tui.app", 0) / 1e6
    return (f"{', '.join(found)} imported (import of tui_merger.tui.app: {total:.2f} s)" if found
            else f"no torch or transformers (import of tui_merger.tui.app: {total:.2f} s)")


def row(what: str, times: list[float], target: float | None) -> list[str]:
    figure = f"{med(times):.3f} s ({min(times):.3f}-{max(times):.3f})"
    verdict = "-" if target is None else ("ok" if med(times) < target else "OVER")
    return [what, figure, f"< {target} s" if target else "-", verdict]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (default: %(default)s)")
    args = parser.parse_args()

    cli = shutil.which("tui-merger", path=str(Path(sys.executable).parent)) or shutil.which("tui-merger")
    if cli is None:
        print("tui-merger is not installed (pip install -e .)", file=sys.stderr)
        return 1
    print(f"{code_state()}; load average {loadavg()}; {args.repeats} runs each", flush=True)
    rows = [
        row("tui-merger --help", time_command([cli, "--help"], args.repeats), 0.3),
        row("python -c 'import tui_merger.cli'",
            time_command([sys.executable, "-c", "import tui_merger.cli"], args.repeats), None),
    ]
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as work:
        try:
            rows.append(row("tui-merger DEMO: first screen", time_first_screen(cli, args.repeats, Path(work)), 1.0))
        except NotAvailable as why:
            rows.append(["tui-merger DEMO: first screen", f"TUI not available yet ({why})", "< 1.0 s", "-"])
    print()
    print(fmt_table(["measurement", "median (min-max)", "target", "verdict"], rows))
    print(f"\ntorch / transformers before the first screen: {heavy_imports_of_the_app()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
