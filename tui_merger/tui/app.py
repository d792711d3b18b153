"""The Textual app: themes, settings, help, the command palette, and the wizard screen.

Nothing heavy is imported here: torch and transformers load in the workers, after the first screen is
drawn.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding

from tui_merger.tui.widgets import Confirm, HelpScreen
from tui_merger.tui.wizard import Wizard

CSS = """
Wizard { layout: vertical; }
#title { height: 1; padding: 0 1; background: $panel; }
#steps { height: 1fr; padding: 0 1; }
#nav { height: 3; padding: 0 1; }
#nav-status { width: 1fr; content-align: center middle; height: 3; color: $text-muted; }
#find { height: 1fr; }
#candidates { height: 1fr; min-height: 4; }
.row { height: auto; }
#path, #more, #base { width: 1fr; }
#path-status { height: auto; min-height: 1; color: $text-muted; }
#review { height: 1fr; }
#review-form { height: 1fr; }
#plan-text { height: auto; margin-bottom: 1; }
#problems { height: auto; max-height: 40%; min-height: 2; border-top: solid $primary; border-title-align: left; }
#problems.has-errors { border-top: solid $error; }
#findings { height: auto; }
#ack { height: 1; border: none; padding: 0; margin: 0; background: transparent; }
#base-note { height: auto; color: $text-muted; margin-bottom: 1; }
#base-choice { width: 1fr; }
#output-format { width: 1fr; }
#format-note { height: auto; }
.field { margin-top: 1; }
#review-form Label { width: 1fr; }
#replace, #detach { width: 1fr; height: auto; }
#next { width: auto; min-width: 16; padding: 0 2; }
#dtype, #tokenizer { width: 1fr; }
#shard { width: 14; }
#merge-progress, #verify-progress { margin: 1 0; }
#merge-detail, #merge-notes, #merge-status, #verify-status { height: auto; }
#checks { height: auto; max-height: 12; }
#check-detail { height: auto; margin-top: 1; }
#summary, #finish-notes, #lora-notes { height: auto; margin-bottom: 1; }
#try { height: 1fr; }
#try-status { height: auto; }
#prompt { width: 1fr; }
#ask, #try-cancel { min-width: 8; }
#against { width: 1fr; max-width: 60; }
#answers { height: 1fr; min-height: 6; }
#answers.stacked { layout: vertical; }
.answer { width: 1fr; height: 1fr; border: round $primary; border-title-align: left; border-subtitle-align: right; padding: 0 1; }
#answer-other { border: round $secondary; }
.dialog { width: 90%; max-width: 100; height: auto; max-height: 90%; padding: 1 2; border: round $primary; background: $surface; }
.dialog.wide { height: 90%; }
.dialog #tree { height: 1fr; min-height: 8; }
.dialog #items { height: 1fr; min-height: 4; margin-top: 1; }
.cleanup-item { height: auto; margin-bottom: 1; }
.cleanup-item Checkbox { width: auto; border: none; padding: 0; }
.item-text { width: 1fr; height: auto; margin-left: 1; }
#cleanup-total { height: auto; margin-top: 1; }
.buttons { height: auto; align-horizontal: right; margin-top: 1; }
.buttons Button { margin-left: 1; }
.dim { color: $text-muted; }
#gguf-progress { margin-bottom: 1; }
#login-note, #picked { height: auto; margin-top: 1; }
#gguf-dialog { padding: 0 2 1 2; }
#gguf-lora { width: 100%; height: auto; border: none; padding: 0; background: transparent; }
#lora-estimate { height: auto; margin-top: 1; }
#public { height: 1; border: none; padding: 0; margin-top: 1; background: transparent; }
#login-note { margin-top: 0; }
Confirm, HelpScreen, FolderPicker, CleanupDialog, UploadDialog, GgufDialog { align: center middle; }
"""


class MergeApp(App):
    TITLE = "tui-merger"
    CSS = CSS
    BINDINGS = [Binding("f1", "help", "Help"), Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(self, path: Path, engine_hook=None, theme_dirs: list[Path] | None = None, today=None,
                 watch_terminal: bool = False) -> None:
        super().__init__()
        self.start_path = Path(path)
        self.watch_terminal = watch_terminal  # run_tui: leave when the terminal goes away (not in tests)
        self.terminal_gone: str | None = None  # why the app is leaving without its terminal
        self.engine_hook = engine_hook
        self.today = today
        self.theme_dirs = theme_dirs or []
        self.wizard: Wizard | None = None
        self._saving_theme = False

    def on_mount(self) -> None:
        from tui_merger import settings
        from tui_merger.tui.themes import DEFAULT_THEME, load_themes

        themes, problems = load_themes(self.theme_dirs)
        for theme in themes:
            self.register_theme(theme)
        saved, problem = settings.load()
        for text in problems + ([problem] if problem else []):
            self.notify(text, severity="warning", timeout=8)
        wanted = saved.theme or DEFAULT_THEME
        self.theme = wanted if wanted in self.available_themes else DEFAULT_THEME
        self.theme_changed_signal.subscribe(self, self._remember_theme)
        self.wizard = Wizard(self.start_path, engine_hook=self.engine_hook, today=self.today)
        self.push_screen(self.wizard)
        if self.watch_terminal:
            self._watch_terminal()

    # -- the terminal going away ----------------------------------------------------------------------
    def _watch_terminal(self) -> None:
        """SIGHUP (the terminal or SSH session closed, tmux's session killed), SIGTERM, or a terminal gone
        without a signal (Textual's input thread then reads nothing, forever, at full CPU): leave. A
        thread of its own does it, not the event loop: Textual's writes to a closed terminal can fill its
        output queue and block the loop for good."""
        import signal
        import threading

        def said(signum, frame) -> None:  # only a flag: the watcher acts on it
            self.terminal_gone = self.terminal_gone or signal.Signals(signum).name

        for sig in (signal.SIGHUP, signal.SIGTERM):
            try:
                signal.signal(sig, said)  # a SIGHUP ignored by nohup or `trap '' HUP` too: the terminal is gone
            except (ValueError, OSError):  # not the main thread
                pass
        threading.Thread(target=self._watch, name="tui-merger-terminal", daemon=True).start()

    def _watch(self) -> None:
        import select
        import sys
        import time

        gone = select.POLLHUP | select.POLLERR | select.POLLNVAL
        try:
            poll = select.poll()
            poll.register(sys.__stdin__.fileno(), gone)
        except (AttributeError, OSError, ValueError):
            poll = None
        while self.terminal_gone is None:
            if poll is not None and any(mask & gone for _, mask in poll.poll(0)):
                self.terminal_gone = "closed terminal"
                break
            time.sleep(0.25)
        self._leave_without_terminal()

    def _leave_without_terminal(self) -> None:
        """A merge in the app's own thread stops as Ctrl-C stops the command line's: its finished shards are
        kept and the same merge resumes (waited for, up to 30 s: the journal keeps them either way). A
        background job keeps running; Try it and a verification stop (the model stays, not verified).
        SIGTERM on a terminal still there closes the app as Ctrl+Q does; else the process ends here."""
        import os
        import threading

        wizard = self.wizard
        if wizard is not None and wizard.job is None and not wizard.merge_idle.is_set() and wizard.cancel_token is not None:
            wizard.cancel_token.interrupt()
            wizard.merge_idle.wait(30)
        if self.terminal_gone == "SIGTERM":
            threading.Timer(5, os._exit, (130,)).start()  # the loop may be blocked on the terminal
            try:
                self.call_from_thread(self.exit, 130)
                return
            except RuntimeError:  # the app has already closed
                pass
        os._exit(130)

    def _remember_theme(self, theme) -> None:
        from tui_merger import settings

        problem = settings.save(settings.Settings(theme=theme.name))
        if problem:
            self.notify(problem, severity="warning")

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    async def action_quit(self) -> None:
        """Quitting during a merge asks first, then stops the merge thread before leaving."""
        wizard = self.wizard
        if wizard is not None and wizard.running == "trial":  # Try it: stop the answer, then leave
            wizard.trial_cancel.cancel()
            self.exit(0)
            return
        if wizard is None or wizard.running != "merge":
            self.exit(0)
            return
        if wizard.job is not None:  # a background job keeps running: stop following it and leave
            wizard.stop_following.set()
            self.exit(0)
            return

        def answer(yes: bool | None) -> None:
            if not yes:
                return
            if wizard.running != "merge":  # it ended while the question was open: what it made stays
                self.exit(0 if wizard.result is not None else 130)
                return
            # the app closes when the merge has stopped (merge step's done_merge), and the terminal
            # then says what is on disk: a merge that finished in the meantime is kept, not verified
            wizard.quit_when_stopped = True
            wizard.cancel_token.cancel()
            wizard.panes["merge"].stopping()

        self.push_screen(Confirm(
            "A merge is running. Stop it and quit? It stops within a second or two and its partial output is "
            "removed; if it has already finished, the model is kept. The terminal then says what is on disk.",
            "Stop and quit", "Keep merging"), answer)

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        if self.wizard is not None:
            yield SystemCommand("Next step", "Go to the next step (ctrl+n)", self.wizard.action_next)
            yield SystemCommand("Previous step", "Go back one step (ctrl+b)", self.wizard.action_back)
            yield SystemCommand("Rescan", "Look for checkpoints again", lambda: self.wizard.rescan(self.wizard.root))
        yield SystemCommand("Help", "Steps and keys", self.action_help)


    def farewell(self) -> str | None:
        """Printed on the terminal once the app has closed: where the model is and how to use it."""
        from tui_merger.tui.steps.finish import farewell

        return farewell(self.wizard) if self.wizard is not None else None


def run_tui(path: Path) -> int:
    app = MergeApp(path, watch_terminal=True)
    code = app.run()
    text = app.farewell()
    if text and app.terminal_gone is None:
        print(text, flush=True)  # stdout: Textual drew on stderr, and the screen it drew is gone
    return code if isinstance(code, int) else 0
