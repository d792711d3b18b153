"""What every step of the wizard shares: the messages a worker thread posts to the UI, the one place a
worker's outcome is sorted (done, cancelled, a sentence for the user, a bug said in one sentence), and
the text helpers.

A step is a container in the wizard's ContentSwitcher (``Step`` mixed into a Textual container). It
holds its own widgets, handlers and workers; what several steps read (the checkpoint, the options, the
merge result, which worker is busy) lives on the wizard screen, ``self.wizard``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.message import Message

PROGRESS_EVERY = 0.1  # seconds between progress updates sent to the UI


class EngineEvent(Message):
    """An event of the engine, forwarded from a worker thread."""

    def __init__(self, event) -> None:
        super().__init__()
        self.event = event


@dataclass
class Done:
    value: object = None
    error: str | None = None
    cancelled: bool = False


class JobProgress(Message):
    """The latest progress.json of a background job."""

    def __init__(self, progress: dict) -> None:
        super().__init__()
        self.progress = progress


class WorkDone(Message):
    def __init__(self, kind: str, done: Done) -> None:
        super().__init__()
        self.kind = kind
        self.done = done


def escape(text) -> str:
    return str(text).replace("[", r"\[")


def fold_path(path, width: int = 0) -> str:
    """A path as a step shows it: whole, with no line break put into it. Textual folds it where the line
    ends (the ``text-overflow: fold`` of the step's text), so what is selected and copied (Ctrl+C) is
    the path itself; a newline put in after a "/" was copied with it. ``width`` is not used (kept
    for callers written when paths were broken here)."""
    return str(path)


def show_end(field) -> None:
    """After the layout, scroll an Input so that the end of its value shows (a path's file name; an
    Input shows a long value's start and cuts the rest)."""

    def scroll() -> None:
        field.cursor_position = 0
        field.action_end()

    field.call_after_refresh(scroll)


def visible(text: str) -> str:
    """A model's answer as shown: control characters other than newline and tab written as \\xNN (a
    terminal would act on them, or show nothing)."""
    return "".join(c if c in "\n\t" or (ord(c) >= 32 and not 127 <= ord(c) < 160) else f"\\x{ord(c):02x}" for c in text)


# The engine's sentences name command-line flags; in the app the same choice is a field or a switch.
# (phrase as the engine says it, as the app says it), tried in this order.
IN_APP = (
    ("choose another --out, or pass --overwrite to replace it (only once the new file is complete)",
     'type another "File" in "Run it locally..." (the file there is kept)'),
    ("pass --overwrite", 'tick "Replace the existing folder" under the output folder'),
    ("(--overwrite)", '("Replace the existing folder")'),
    ("Use --dtype bf16, or --force to clamp them to ±65504.", 'Choose "dtype: bf16" (or fp32) under the output folder.'),
    ("pass --dtype bf16", 'choose "dtype: bf16" in Review'),
    ("(--tokenizer-from base)", '("tokenizer: base" in Review)'),
    ("pass --base with the", 'type in "Base model folder" the folder of the'),
    ("the merge needs --base", 'the merge needs a "Base model folder"'),
    ("Pass --base ", 'Use as the base model: '),
    ("pass --lora-alpha with the value used in training", 'type the value used in training in "LoRA alpha"'),
    ("the merge needs --lora-alpha", 'the merge needs "LoRA alpha" (in Review)'),
    ("fix it or pass --lora-alpha", 'fix it or type "LoRA alpha" in Review'),
    ("(--lora-alpha)", '("LoRA alpha")'),
    ("give it with --lora-alpha", 'type it in "LoRA alpha" in Review'),
    ("from --lora-alpha", 'from "LoRA alpha"'),
    ("say which model to compare with (--against BASE_OR_ADAPTER)", 'pick "compare with the unmerged adapter" if it is offered'),
    ("give a base model or an adapter to compare with (--against BASE_OR_ADAPTER)", "it answers alone here"),
    ("log in with `hf auth login` or set HF_TOKEN to a token with write access.",
     'paste a token with write access in "Upload..." (it is saved for next time).'),
    ("and log in with it (`hf auth login`) or set HF_TOKEN to it.", 'and paste it in "Upload...".'),
    ("pass a valid token with write access.", 'paste a valid token with write access in "Upload...".'),
    ("log in again with `hf auth login --force`.", 'paste a valid token in "Upload...".'),
    ("; check --repo-id and that", "; check the repo id and that"),
)


def in_app(message) -> str:
    """An engine sentence as the app says it: the fields and switches, not the flags."""
    from tui_merger.core.io.hf_refs import hf_command

    message = str(message).replace(f"`{hf_command()} auth login", "`hf auth login")  # (the full path outside PATH)
    for flag, field in IN_APP:
        message = message.replace(flag, field)
    return message


class Step:
    """Mixed into a container: one step of the wizard.

    ``FIRST``: the widget focused when the step is shown; ``BACK``: the step "< Back" returns to (None:
    none). ``nav()`` says what the navigation bar shows, ``advance()`` is "Next >". A worker of the step
    reports with ``post_outcome`` (or posts ``WorkDone`` itself); ``on_work_done`` calls the step's
    ``done_<kind>`` method.
    """

    FIRST = ""
    BACK: str | None = None
    KEEPS_RUNNING = frozenset()  # WorkDone kinds that are not the busy worker (wizard.running stays)

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(**kwargs)
        self.wizard = wizard
        self._last_progress = 0.0

    # -- navigation ------------------------------------------------------------------------------
    def enter(self) -> None:
        """The step is shown by "Next >" of the step before it."""
        self.wizard.show(self.id)

    def nav(self) -> tuple[bool, bool, str, str]:
        """(back disabled, next disabled, the Next button's label, a few words on why not)."""
        return self.wizard.running is not None, True, "Next >", ""

    def advance(self) -> None:
        """ "Next >" (ctrl+n), when the button is enabled."""

    def refused(self) -> None:
        """ctrl+n while "Next >" is disabled."""

    def resized(self) -> None:
        """The terminal changed size."""

    # -- workers ---------------------------------------------------------------------------------
    def forward(self, event) -> None:
        """Runs in the worker thread: hand an engine event to this step, progress at most every 0.1 s."""
        from tui_merger.core.events import TensorProgress

        if self.wizard.engine_hook is not None:
            self.wizard.engine_hook(event)
        if isinstance(event, TensorProgress) and event.tensors_done < event.tensors_total:
            now = time.monotonic()
            if now - self._last_progress < PROGRESS_EVERY:
                return
            self._last_progress = now
        self.post_message(EngineEvent(event))

    def post_outcome(self, kind: str, call, say_cancel: bool = False) -> None:
        """In a worker thread: ``call()``'s result as WorkDone(kind), posted last (the thread has
        finished its work). A cancel comes as cancelled (with its sentence when ``say_cancel``), an
        expected failure as its sentence, anything else as a bug said in one: never a worker that
        dies while its screen waits."""
        from tui_merger.core.errors import MergeCancelled, MergeError

        try:
            done = Done(call())
        except MergeCancelled as err:
            done = Done(error=str(err) if say_cancel else None, cancelled=True)
        except MergeError as err:
            done = Done(error=str(err))
        except Exception as err:  # noqa: BLE001
            from tui_merger.deps import explain_failure

            done = Done(error=explain_failure(err) or (
                f"Unexpected {type(err).__name__}: {err}. This is a bug in tui-merger; please report it."))
        self.post_message(WorkDone(kind, done))

    def on_work_done(self, message: WorkDone) -> None:
        """Every worker's outcome: the wizard is no longer busy (unless the kind runs beside the busy
        one), the step shows what came out, the navigation follows."""
        message.stop()
        if message.kind not in self.KEEPS_RUNNING:
            self.wizard.running = None
        getattr(self, "done_" + message.kind.replace("-", "_"))(message.done)
        self.wizard.refresh_nav()
