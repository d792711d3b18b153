"""The merge assistant: one screen, six steps (Find, Review, Merge, Verify, Try it, Finish) in a ContentSwitcher.

The screen holds no merge logic: it scans with ``core.inspect``, plans with ``core.preflight``, merges
with ``core.engine`` and verifies with ``core.provenance`` in thread workers, and renders the engine's
events, posted to the UI as messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import (
    Button,
    Checkbox,
    ContentSwitcher,
    DataTable,
    Footer,
    Input,
    Label,
    OptionList,
    ProgressBar,
    Select,
    Static,
)
from textual.widgets.option_list import Option

from tui_merger.tui.widgets import CleanupDialog, Confirm, FolderPicker, GgufDialog, UploadDialog

STEPS = ("find", "review", "merge", "verify", "try", "finish")
INDICATOR = STEPS  # the steps the header names
TITLES = {"find": "Find", "review": "Review", "merge": "Merge", "verify": "Verify", "try": "Try", "finish": "Finish"}
PROGRESS_EVERY = 0.1  # seconds between progress updates sent to the UI
TRY_TOKENS = 64  # the most tokens each model answers in Try it
TRY_PROMPT = "Explain in two sentences what you can help me with."
NARROW = 100  # below this many columns the two answers are stacked, not side by side
DTYPES = [("dtype: as the base", ""), ("dtype: bf16", "bf16"), ("dtype: fp16", "fp16"), ("dtype: fp32", "fp32")]
TOKENIZERS = [("tokenizer: auto", "auto"), ("tokenizer: base", "base"), ("tokenizer: adapter", "adapter")]


class EngineEvent(Message):
    """An event of the engine, forwarded from a worker thread."""

    def __init__(self, event) -> None:
        super().__init__()
        self.event = event


@dataclass
class _Done:
    value: object = None
    error: str | None = None
    cancelled: bool = False


class JobProgress(Message):
    """The latest progress.json of a background job."""

    def __init__(self, progress: dict) -> None:
        super().__init__()
        self.progress = progress


class WorkDone(Message):
    def __init__(self, kind: str, done: _Done) -> None:
        super().__init__()
        self.kind = kind
        self.done = done


def _escape(text: str) -> str:
    return str(text).replace("[", r"\[")


def visible(text: str) -> str:
    """A model's answer as shown: control characters other than newline and tab written as \\xNN (a
    terminal would act on them, or show nothing)."""
    return "".join(c if c in "\n\t" or (ord(c) >= 32 and not 127 <= ord(c) < 160) else f"\\x{ord(c):02x}" for c in text)


class Wizard(Screen):
    AUTO_FOCUS = ""
    BINDINGS = [
        Binding("ctrl+n", "next", "Next", priority=True),
        Binding("ctrl+b", "back", "Back", priority=True),
        Binding("f1", "app.help", "Help"),
        Binding("ctrl+j", "follow_job", "Follow job", show=False),
    ]

    def __init__(self, root: Path, engine_hook=None, today=None) -> None:
        super().__init__()
        self.root = Path(root).absolute()
        self.engine_hook = engine_hook  # tests: called in the worker thread with every engine event
        self.today = today  # the date in suggested output names (tests fix it)
        self.step = "find"
        self.candidates = []
        self.candidate = None
        self.plan = None
        self.options = None
        self.plan_stale = True
        self.result = None
        self.report = None
        self.cancel_token = None
        self.running: str | None = None  # which worker is busy: plan, merge, verify, upload, cleanup
        self._last_progress = 0.0
        self._started = 0.0
        self._planned: tuple = ()  # the field values the current plan was made from
        self.job = None  # the background job being followed (core.jobs.Job), when the merge runs detached
        self._roundtrip_offer = None  # the --qlora-base value the Review step offers
        self._reviewed = None  # the checkpoint the Review fields were last filled for
        self._proposals: list = []  # [(path, why)]: the models here that fit an adapter whose base is not here
        self._searched = False  # the proposals were looked for (none found: the note says so)
        self._check_rows: list = []  # the Verify table's rows (status, name, summary), refilled on resize
        self.trial_plan = None  # Try it: core.ship.trial.TrialPlan of the merged model (and what it is compared with)
        self.trial_answers: dict = {}  # side label -> the latest TrialToken / TrialFinished shown
        self.trial_cancel = None
        self.gguf_cancel = None  # the CancelToken of the GGUF being written (Finish step)
        self.try_tokens = TRY_TOKENS
        self._planned_against = None  # the Compare with value the trial plan was made for
        self._against_choices = [("compare with the base model", "base")]
        self._trial_planning = False

    # -- layout -------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="title")
        with ContentSwitcher(initial="find", id="steps"):
            with Vertical(id="find"):
                yield Label("Checkpoints found (newest first):")
                yield OptionList(id="candidates")
                with Horizontal(classes="row"):
                    yield Input(placeholder="or type a path to a checkpoint or a folder", id="path")
                    yield Button("Browse...", id="browse")
                yield Static(id="path-status")
            with Vertical(id="review"):
                with VerticalScroll(id="review-form"):
                    yield Label("Base model folder", classes="base-field")
                    yield Input(id="base", classes="base-field")
                    proposals = Select([], prompt="other models here that fit the adapter", id="base-choice", classes="base-field")
                    proposals.display = False  # shown when the base had to be proposed
                    yield proposals
                    yield Static(id="base-note", classes="base-field")
                    yield Static(id="plan-text")
                    yield Label("LoRA alpha used in training (the checkpoint does not record it)", classes="field alpha-field")
                    yield Input(id="alpha", type="number", classes="alpha-field")
                    yield Label("Weight of this adapter (1 = as trained; e.g. 0.7 to blend it with others)", classes="field weight-field")
                    yield Input("1", id="weight", classes="weight-field")
                    yield Label("More adapters to blend in, as PATH:WEIGHT separated by ;", classes="field weight-field")
                    with Horizontal(classes="row weight-field"):
                        yield Input(id="more", placeholder="e.g. ../pixel-art-lora:0.3")
                        yield Button("Add adapter...", id="add-adapter")
                    yield Label("Base weights (the adapter was trained with QLoRA on a quantized copy of the base)", classes="field qlora-field")
                    yield Select([("the 16-bit weights as stored (usual)", "")], value="", allow_blank=False, id="roundtrip", classes="qlora-field")
                    yield Label("Output folder", classes="field")
                    yield Input(id="out")
                    replace = Checkbox("Replace the existing folder (kept until the new model is complete)", id="replace")
                    replace.display = False  # shown when the output folder holds files
                    yield replace
                    yield Label("Output dtype, largest shard (e.g. 5GB), tokenizer from (auto: the adapter's if it has one)", classes="field")
                    with Horizontal(classes="row"):
                        yield Select(DTYPES, value="", allow_blank=False, id="dtype")
                        yield Input("5GB", id="shard", placeholder="shard size")
                        yield Select(TOKENIZERS, value="auto", allow_blank=False, id="tokenizer")
                    yield Checkbox("Keep running if I disconnect (a background job: tui-merger attach)", id="detach")
                    yield Button("Check again", id="recheck")
                with VerticalScroll(id="problems"):  # pinned below the form: the checks stay in sight
                    yield Static(id="findings")
                    yield Checkbox("I have read the warnings and want to go on", id="ack")
            with Vertical(id="merge"):
                yield Static(id="merge-status")
                yield ProgressBar(show_eta=False, id="merge-progress")
                yield Static(id="merge-detail")
                yield Static(id="merge-notes")
                yield Button("Cancel the merge", variant="error", id="cancel")
            with Vertical(id="verify"):
                yield Static(id="verify-status")
                yield ProgressBar(show_eta=False, id="verify-progress")
                yield DataTable(id="checks", cursor_type="row")
                yield Static(id="check-detail")
            with Vertical(id="try"):
                yield Static(id="try-status")
                with Horizontal(classes="row"):
                    yield Input(TRY_PROMPT, placeholder="type a prompt, then enter", id="prompt")
                    yield Button("Ask", variant="primary", id="ask")
                    yield Button("Stop", variant="error", id="try-cancel", disabled=True)
                yield Select([("compare with the base model", "base")], value="base", allow_blank=False, id="against")
                with Horizontal(id="answers"):
                    with VerticalScroll(id="answer-merged", classes="answer"):
                        yield Static(id="answer-merged-text")
                    with VerticalScroll(id="answer-other", classes="answer"):
                        yield Static(id="answer-other-text")
            with VerticalScroll(id="finish"):
                yield Static(id="summary")
                with Horizontal(classes="row"):
                    yield Button("Clean up...", id="cleanup")
                    yield Button("Upload...", id="upload")
                    yield Button("Make a GGUF...", id="gguf")
                    yield Button("Quit", variant="primary", id="quit")
                gguf_bar = ProgressBar(show_eta=False, id="gguf-progress")
                gguf_bar.display = False  # shown while a GGUF is written
                yield gguf_bar
                yield Static(id="finish-notes")
        with Horizontal(id="nav"):
            yield Button("< Back", id="back")
            yield Static(id="nav-status")
            yield Button("Next >", variant="primary", id="next")
        yield Footer()

    def on_mount(self) -> None:
        self.rescan(self.root)
        self.show("find")
        running = self._running_job()
        if running is not None:
            self.app.notify(
                f"A merge job is running in the background ({running.id}, into {running.out}): press ctrl+j to follow it.",
                timeout=15,
            )

    def _running_job(self):
        from tui_merger.core.merge.jobs import RUNNING, list_jobs

        return next((j for j in list_jobs() if j.state == RUNNING), None)

    def action_follow_job(self) -> None:
        job = self._running_job()
        if job is None or self.running is not None:
            self.app.notify("No background merge job is running.", severity="warning")
            return
        self._start_following(job)

    # -- steps --------------------------------------------------------------------------------
    def show(self, step: str) -> None:
        self.step = step
        self.query_one("#steps", ContentSwitcher).current = step
        self._title()
        self.refresh_nav()
        first = {"find": "#candidates", "review": "#out", "merge": "#cancel", "verify": "#checks", "try": "#prompt", "finish": "#quit"}[step]
        self.query_one(first).focus()

    def _title(self) -> None:
        """tui-merger │ Find > Review > Merge > ... │ folder: the steps, the current one highlighted
        (the ones before it plain, the ones after it dim), then as much of the folder as fits."""
        now = INDICATOR.index(self.step) if self.step in INDICATOR else 0
        parts = []
        for n, step in enumerate(INDICATOR):
            name = TITLES[step]
            parts.append(f"[reverse b] {name} [/]" if n == now else name if n < now else f"[dim]{name}[/dim]")
        steps = " > ".join(parts)
        used = len("tui-merger │ ") + len(" > ".join(TITLES[s] for s in INDICATOR)) + 2 + len(" │ ") + 2
        room = max(self.app.size.width - used, 8)
        folder = str(self.root)
        if len(folder) > room:
            folder = "…" + folder[-(room - 1):]
        self.query_one("#title", Static).update(f"[b]tui-merger[/b] │ {steps} │ [dim]{_escape(folder)}[/dim]")

    def on_resize(self) -> None:
        self._title()
        self.query_one("#answers").set_class(self.app.size.width < NARROW, "stacked")
        if self.step == "verify":
            self._fill_checks(self._check_rows)

    def blocked_reason(self) -> str:
        """Why "Merge >" is disabled, in a few words (empty when it is not)."""
        if self.running == "bases":
            return "looking for a base model that fits..."
        if self.running == "plan":
            return "checking..."
        if self.running is not None:
            return "busy..."
        if self.plan is None:
            return "1 error to fix first (under Checks)"
        if self.plan_stale:
            return "changed: press enter or Check again"
        errors = len(self.plan.of("error"))
        if errors:
            return f"{errors} error{'s' * (errors != 1)} to fix first (under Checks)"
        warnings = len(self.plan.of("warning"))
        if warnings and not self.query_one("#ack", Checkbox).value:
            if self._accepts_proposal():
                return ""
            return f"{warnings} warning{'s' * (warnings != 1)}: tick the box under Checks to go on"
        return ""

    def _accepts_proposal(self) -> bool:
        """The base field holds the proposed base and the only warning is that the adapter names
        another one: "Use this base >" (ctrl+n) accepts it, ticking the box, before "Merge >"."""
        base = self.query_one("#base", Input)
        return (
            self.step == "review" and self.plan is not None and not self.plan_stale and self.running is None
            and base.display and base.value in [str(p) for p, _ in self._proposals]
            and not self.query_one("#ack", Checkbox).value
            and {f.id for f in self.plan.of("warning")} == {"base-name"}
        )

    def refresh_nav(self) -> None:
        back, nxt = self.query_one("#back", Button), self.query_one("#next", Button)
        status = ""
        if self.step == "find":
            back.disabled = True
            nxt.disabled = self.candidate is None
            nxt.label = "Review >"
        elif self.step == "review":
            back.disabled = self.running is not None
            status = self.blocked_reason()
            nxt.disabled = bool(status)
            nxt.label = "Use this base >" if self._accepts_proposal() else "Merge >"
            if self._accepts_proposal():
                status = "accept the proposed base?"
        elif self.step == "merge":
            back.disabled = self.running is not None or self.result is not None
            nxt.disabled = True
            nxt.label = "Verify >"
        elif self.step == "verify":
            back.disabled = True
            nxt.disabled = self.running is not None or (self.result is None and self.job is None)
            nxt.label = "Try it >"
        elif self.step == "try":
            back.disabled = self.running is not None
            nxt.disabled = self.running is not None
            nxt.label = "Finish >"
            if self.running == "trial":
                status = "answering... (Stop ends it)"
            elif self._trial_planning:
                status = "reading the models... (Finish > skips Try it)"
        else:
            back.disabled = self.running is not None
            nxt.disabled = True
            nxt.label = "Next >"
        nxt.tooltip = status or None
        self.query_one("#nav-status", Static).update(_escape(status))

    def action_next(self) -> None:
        if self.query_one("#next", Button).disabled:
            if self.step == "review" and self.blocked_reason():  # say why nothing happens
                self.app.notify(f"Not yet: {self.blocked_reason()}.", severity="warning", timeout=4)
                self.query_one("#problems").scroll_home(animate=False)
            return
        if self.step == "find":
            self.enter_review()
        elif self.step == "review" and self._accepts_proposal():
            self.query_one("#ack", Checkbox).value = True  # refresh_nav follows from Checkbox.Changed
            self.app.notify(f"Base accepted: {self.query_one('#base', Input).value}. ctrl+n again starts the merge.", timeout=5)
        elif self.step == "review":
            self.start_merge()
        elif self.step == "verify":
            self.enter_try()
        elif self.step == "try":
            self.enter_finish()

    def action_back(self) -> None:
        if self.query_one("#back", Button).disabled:
            return
        target = {"review": "find", "merge": "review", "try": "verify", "finish": "try"}.get(self.step)
        if target:
            self.show(target)

    @on(Button.Pressed, "#next")
    def _next(self) -> None:
        self.action_next()

    @on(Button.Pressed, "#back")
    def _back(self) -> None:
        self.action_back()

    # -- Find ---------------------------------------------------------------------------------
    def rescan(self, path: Path) -> None:
        from tui_merger.core.plan.choices import describe_candidate, why_not_mergeable
        from tui_merger.core.errors import MergeError
        from tui_merger.core.formats.scan import scan

        status = self.query_one("#path-status", Static)
        try:
            found = scan(path)
        except MergeError as err:
            status.update(f"[b red]{_escape(err)}[/]")
            return
        self.root = Path(path).absolute() if Path(path).is_dir() else Path(path).absolute().parent
        self.candidates = found.candidates
        options = self.query_one("#candidates", OptionList)
        options.clear_options()
        for n, c in enumerate(self.candidates):
            line = describe_candidate(c, self.root)
            if why_not_mergeable(c):
                line += "  [dim](not mergeable)[/dim]"
            options.add_option(Option(line, id=str(n)))
        problems = f"; {len(found.problems)} entries could not be read" if found.problems else ""
        if self.candidates:
            status.update(f"Found {len(self.candidates)} checkpoint(s) in {_escape(self.root)}{problems}.")
            mergeable = [n for n, c in enumerate(self.candidates) if not why_not_mergeable(c)]
            options.highlighted = mergeable[0] if mergeable else 0
        else:
            status.update(f"No checkpoint found in {_escape(self.root)}{problems}; type a path or browse.")
        self.candidate = None
        self.refresh_nav()

    @on(OptionList.OptionHighlighted, "#candidates")
    @on(OptionList.OptionSelected, "#candidates")
    def _pick(self, event) -> None:
        from tui_merger.core.plan.choices import why_not_mergeable

        c = self.candidates[int(event.option.id)]
        problem = why_not_mergeable(c)
        self.candidate = None if problem else c
        note = problem or self._candidate_text(c)
        self.query_one("#path-status", Static).update(_escape(note))
        self.refresh_nav()
        if isinstance(event, OptionList.OptionSelected) and self.candidate is not None:
            self.enter_review()

    def _candidate_text(self, c) -> str:
        from tui_merger.core.options import human_bytes

        bits = [f"{c.kind}, {human_bytes(c.size_bytes)}"]
        if c.lora:
            bits.append(f"LoRA rank {c.lora.get('r')}, alpha {c.lora.get('alpha') or 'missing'}")
            if c.lora.get("target_parameters"):
                bits.append(f"LoRA on experts ({', '.join(map(str, c.lora['target_parameters']))})")
        if c.base_model:
            where = {"path": "found here", "hf-cache": "in the HF cache", "missing": "not on this machine"}.get(c.base_resolves, "")
            bits.append(f"base {c.base_model} ({where})")
        return "; ".join(bits) + "."

    @on(Input.Submitted, "#path")
    def _typed(self, event: Input.Submitted) -> None:
        path = Path(event.value.strip()).expanduser()
        if not event.value.strip():
            return
        if not path.exists():
            self.query_one("#path-status", Static).update(f"[b red]{_escape(path)} does not exist.[/]")
            return
        self.rescan(path)
        self.query_one("#candidates", OptionList).focus()

    @on(Button.Pressed, "#browse")
    def _browse(self) -> None:
        def chosen(path: Path | None) -> None:
            if path is not None:
                self.query_one("#path", Input).value = str(path)
                self.rescan(path)

        self.app.push_screen(FolderPicker(self.root), chosen)

    # -- Review -------------------------------------------------------------------------------
    def enter_review(self) -> None:
        from tui_merger.core.plan.choices import can_weight, models_found, needs_alpha, needs_base

        c = self.candidate
        for cls, shown in ((".base-field", needs_base(c)), (".alpha-field", needs_alpha(c)), (".weight-field", can_weight(c))):
            for w in self.query(cls):
                w.display = shown
        base = self.query_one("#base", Input)
        if c.path != self._reviewed:  # another checkpoint: its own weights, no adapters blended in yet
            self._reviewed = c.path
            self.query_one("#weight", Input).value = "1"
            self.query_one("#more", Input).value = ""
            base.value = ""
            self._proposals, self._searched = [], False
        if needs_base(c) and not base.value and c.base_path:
            base.value = c.base_path
        self._show_proposals()
        self.query_one("#out", Input).value = ""  # filled with the suggested name by the plan
        self.query_one("#ack", Checkbox).value = False
        for w in self.query(".qlora-field"):
            w.display = False
        self._roundtrip_offer = None
        self.query_one("#roundtrip", Select).set_options([("the 16-bit weights as stored (usual)", "")])
        self.query_one("#roundtrip", Select).value = ""
        self.plan = None
        self.query_one("#plan-text", Static).update("")
        self.show("review")
        if needs_base(c):
            base.focus()  # the question this checkpoint raises, at the top of the form
        if needs_base(c) and not base.value.strip():
            # the adapter's base is not here: propose the models of this folder (and the HF cache) that fit it
            self.running = "bases"
            self._show_checks("[dim]Looking for a model on this machine that the adapter fits...[/dim]", "checking...")
            self.refresh_nav()
            self._bases_worker(c.path, models_found(self.candidates))
            return
        self.replan()

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False)
    def _bases_worker(self, adapter, models) -> None:
        from tui_merger.core.plan.choices import base_candidates

        try:
            done = _Done(base_candidates(adapter, models))
        except Exception as err:  # a bug in the proposal must not kill the app: the user types the base
            done = _Done([], error=f"{type(err).__name__}: {err}")
        self.post_message(WorkDone("bases", done))

    def _proposed(self, proposals) -> None:
        """The base candidates arrived: the best one goes into the base field, the others in the list."""
        self._proposals, self._searched = list(proposals), True
        if self._proposals:
            self.query_one("#base", Input).value = str(self._proposals[0][0])
        self._show_proposals()
        self.replan()

    def _show_proposals(self) -> None:
        """The line under the base field: what was proposed and why (or that nothing here fits), and
        the list of the other models that fit."""
        base = self.query_one("#base", Input)
        choice, note = self.query_one("#base-choice", Select), self.query_one("#base-note", Static)
        c = self.candidate
        choice.display = base.display and len(self._proposals) > 1
        note.display = base.display and (bool(self._proposals) or not c.base_path)
        if not note.display:
            return
        named = (
            f"the adapter's base {_escape(c.base_model)} is not on this machine" if c.base_model
            else "the adapter does not say which base model it was trained on"
        )
        if not self._proposals:
            searched = "; no model in this folder or in the Hugging Face cache fits it" if self._searched else ""
            note.update(f"[dim]{named[0].upper()}{named[1:]}{searched}: type the folder of the model it was trained on.[/dim]")
            return
        paths = [str(p) for p, _ in self._proposals]
        with choice.prevent(Select.Changed):
            choice.set_options([(f"{p.name}: {why}", str(p)) for p, why in self._proposals])
            choice.value = base.value if base.value in paths else Select.BLANK
        why = dict(zip(paths, (w for _, w in self._proposals))).get(base.value)
        more = f" ({len(paths) - 1} more in the list below)" if len(paths) > 1 else ""
        note.update(
            f"[b]Proposed[/b] ({named}): {_escape(why) if why else 'pick one of the models that fit'}{more}. "
            "ctrl+n accepts it; or type another folder."
        )

    @on(Select.Changed, "#base-choice")
    def _base_picked(self, event: Select.Changed) -> None:
        if event.value is not Select.BLANK and self.step == "review":
            self.query_one("#base", Input).value = str(event.value)
            self._show_proposals()
            self.replan()

    def _options(self):
        from tui_merger.core.plan.choices import options_for

        out = self.query_one("#out", Input).value.strip()
        alpha = self.query_one("#alpha", Input).value.strip()
        base = self.query_one("#base", Input).value.strip() if self.query_one("#base", Input).display else None
        extra = {}
        if self.query_one("#roundtrip", Select).display and self.query_one("#roundtrip", Select).value:
            extra["base_roundtrip"] = self.query_one("#roundtrip", Select).value
        if self.query_one("#weight", Input).display:
            extra.update(weight=self.query_one("#weight", Input).value.strip() or "1", more=self.query_one("#more", Input).value)
        return options_for(
            self.candidate,
            **extra,
            base=Path(base).expanduser() if base else None,
            out=Path(out).expanduser() if out else None,
            lora_alpha=float(alpha) if alpha else None,
            dtype=self.query_one("#dtype", Select).value or None,
            shard_size=self.query_one("#shard", Input).value.strip() or "5GB",
            tokenizer_from=self.query_one("#tokenizer", Select).value,
            overwrite=self.query_one("#replace", Checkbox).value and self.query_one("#replace", Checkbox).display,
        )

    def replan(self) -> None:
        from tui_merger.core.errors import MergeError

        try:
            options = self._options()
        except (MergeError, ValueError) as err:
            self.plan, self.plan_stale = None, True
            self._show_checks(f"[b red]ERROR[/]   {_escape(err)}", "[b red]1 error[/]")
            self.refresh_nav()
            return
        self.running = "plan"
        self.refresh_nav()
        self._plan_worker(options)

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False)
    def _plan_worker(self, options) -> None:
        from tui_merger.core.plan.choices import base_config_fields
        from tui_merger.core.plan.preflight import make_plan

        try:
            plan = make_plan(options, today=self.today)
            try:
                fields = base_config_fields(options.base, [p for p, _ in options.adapter_weights()]) if options.base else []
            except Exception:  # the config summary is for reading: never a reason to stop
                fields = []
            done = _Done((options, plan, fields))
        except Exception as err:  # a bug in a check must not kill the app
            done = _Done(error=f"The checks failed unexpectedly ({type(err).__name__}: {err}).")
        self.post_message(WorkDone("plan", done))

    def _show_checks(self, text: str, title: str) -> None:
        """The pinned panel under the form: every finding, errors first, whatever the form shows."""
        self.query_one("#findings", Static).update(text)
        panel = self.query_one("#problems")
        panel.border_title = f"Checks: {title}" if title else "Checks"
        panel.set_class("error" in title, "has-errors")

    def _show_plan(self, options, plan, fields=()) -> None:
        from tui_merger.core.plan.choices import default_out_folder, free_output, holds_files
        from tui_merger.core.plan.preflight import describe

        out_input = self.query_one("#out", Input)
        if options.out is None:  # first plan: propose the suggested name (never a taken one), then plan again
            out_input.value = str(free_output(default_out_folder(self.candidate)[0] / plan.suggested_out))
            self.replan()
            return
        self.options, self.plan, self.plan_stale = options, plan, False
        self._planned = self._fields()
        self.query_one("#plan-text", Static).update(_plan_grid(describe(plan), fields))
        colours = {"error": "red", "warning": "yellow", "info": "cyan"}
        replace = self.query_one("#replace", Checkbox)
        replace.display = options.out is not None and holds_files(options.out)
        order = {"error": 0, "warning": 1, "info": 2}
        lines = [
            f"[b {colours[f.severity]}]{f.severity.upper():7}[/] {_escape(_in_app(f.message))}"
            + (f"\n        [dim]{_escape(f.fix)}[/dim]" if f.fix else "")
            for f in sorted(plan.findings, key=lambda f: order.get(f.severity, 3))
        ] or ["[b green]every check passed[/]"]
        counts = [f"{n} {sev}{'s' * (n != 1)}" for sev in ("error", "warning") if (n := len(plan.of(sev)))]
        title = ", ".join(counts) or ("" if not plan.findings else f"{len(plan.findings)} note{'s' * (len(plan.findings) != 1)}")
        self._show_checks("\n".join(lines), f"[b red]{title}[/]" if plan.blocked else title)
        self.query_one("#ack", Checkbox).display = bool(plan.of("warning"))
        roundtrip = self.query_one("#roundtrip", Select)
        offer = plan.suggested_roundtrip or options.base_roundtrip
        for w in self.query(".qlora-field"):
            w.display = bool(offer)
        if offer and offer != self._roundtrip_offer:
            self._roundtrip_offer = offer
            roundtrip.set_options([
                ("the 16-bit weights as stored (usual)", ""),
                (f"the rounded weights QLoRA training saw ({offer})", offer),
            ])
            roundtrip.value = options.base_roundtrip or ""
            self._planned = self._fields()
        from tui_merger.core.plan.choices import is_checkpoint

        if any(f.id == "quantized" for f in plan.findings) and not is_checkpoint(self.candidate):
            # a quantized base: ask for the 16-bit one, filled in when it was found on this machine
            for w in self.query(".base-field"):
                w.display = True
            self._show_proposals()
            base = self.query_one("#base", Input)
            if plan.suggested_base and base.value.strip() != plan.suggested_base:
                base.value = plan.suggested_base
                base.focus()

    def _fields(self) -> tuple:
        return tuple(self.query_one(f"#{n}").value for n in ("base", "alpha", "out", "shard", "dtype", "tokenizer", "weight", "more", "roundtrip", "replace"))

    @on(Button.Pressed, "#add-adapter")
    def _add_adapter(self) -> None:
        """Pick another adapter folder to blend in, with weight 1 to edit (a kohya file: type its path)."""

        def chosen(path: Path | None) -> None:
            if path is not None:
                more = self.query_one("#more", Input)
                more.value = "; ".join(p for p in (more.value.strip().rstrip(";"), f"{path}:1") if p)
                more.focus()

        self.app.push_screen(FolderPicker(Path(self.candidate.path).parent), chosen)

    @on(Input.Changed, "#base, #alpha, #out, #shard, #weight, #more")
    @on(Select.Changed, "#dtype, #tokenizer, #roundtrip")
    def _edited(self) -> None:
        """An edit makes the plan stale (Next waits for "Check again" or enter) until it is undone."""
        if self.step == "review" and self.plan is not None:
            self.plan_stale = self._fields() != self._planned
            self.refresh_nav()

    @on(Input.Submitted, "#base, #alpha, #out, #shard, #weight, #more")
    @on(Button.Pressed, "#recheck")
    def _recheck(self) -> None:
        if self.step == "review":
            self.replan()

    @on(Checkbox.Changed, "#ack")
    def _ack(self) -> None:
        self.refresh_nav()

    @on(Checkbox.Changed, "#replace")
    def _replace(self) -> None:
        if self.step == "review" and self.plan is not None:
            self.replan()  # the checks depend on it: check again at once

    # -- Merge --------------------------------------------------------------------------------
    def start_merge(self) -> None:
        from tui_merger.core.events import CancelToken

        self.result = None
        self.trial_plan = None  # a new model: Try it plans again
        self.cancel_token = CancelToken()
        self.query_one("#merge-status", Static).update(f"Merging into {_escape(self.options.out)}")
        self.query_one("#merge-detail", Static).update("")
        self.query_one("#merge-notes", Static).update("")
        self.query_one("#merge-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#cancel", Button).disabled = False
        self.running = "merge"
        self._started = time.monotonic()
        if self.query_one("#detach", Checkbox).value:
            self._start_following(None)
            return
        self.show("merge")
        self._merge_worker(self.options, self.cancel_token)

    def _start_following(self, job) -> None:
        """The merge as a background job: started now (job None) or already running; the UI follows it."""
        import threading

        self.result, self.report, self.job = None, None, job
        self.running = "merge"
        self._stop_following = threading.Event()
        self.query_one("#merge-status", Static).update(
            "Starting a background job..." if job is None else f"Following job {job.id} into {_escape(job.out)}"
        )
        self.query_one("#merge-progress", ProgressBar).update(total=None, progress=0)
        self.query_one("#cancel", Button).disabled = False
        self.show("merge")
        self._job_worker(self.options if job is None else None, job, self._stop_following)

    @work(thread=True, exclusive=True, group="merge", exit_on_error=False)
    def _job_worker(self, options, job, stop) -> None:
        from tui_merger.core.errors import MergeError
        from tui_merger.core.merge.jobs import follow, start_detached

        try:
            if job is None:
                job = start_detached(options)
            self.job = job
            self.post_message(JobProgress({"phase": "job", "message": f"job {job.id}: the merge keeps running if you disconnect"}))
            done = _Done(follow(job, lambda line: None, lambda p: self.post_message(JobProgress(p)), stop))
        except MergeError as err:
            done = _Done(error=str(err))
        self.post_message(WorkDone("job", done))

    def on_job_progress(self, message: JobProgress) -> None:
        from tui_merger.core.options import human_bytes

        p = message.progress
        if "message" in p:
            self.query_one("#merge-status", Static).update(f"[b]{_escape(p.get('phase', ''))}[/b]  {_escape(p['message'])}")
        if p.get("bytes_total"):
            self.query_one("#merge-progress", ProgressBar).update(total=p["bytes_total"], progress=p.get("bytes_done", 0))
            self.query_one("#merge-detail", Static).update(
                f"{human_bytes(p.get('bytes_done', 0))} of {human_bytes(p['bytes_total'])}   "
                f"{p.get('done', 0)}/{p.get('total', 0)} tensors\n[dim]{_escape(p.get('tensor', ''))}[/dim]"
            )

    def _forward(self, event) -> None:
        """Runs in the worker thread: hand an engine event to the UI, progress at most every 0.1 s."""
        from tui_merger.core.events import TensorProgress

        if self.engine_hook is not None:
            self.engine_hook(event)
        if isinstance(event, TensorProgress) and event.tensors_done < event.tensors_total:
            now = time.monotonic()
            if now - self._last_progress < PROGRESS_EVERY:
                return
            self._last_progress = now
        self.post_message(EngineEvent(event))

    @work(thread=True, exclusive=True, group="merge", exit_on_error=False)
    def _merge_worker(self, options, cancel) -> None:
        from tui_merger.core.verify.checks import merge_prewarmed

        # verification follows: its recompute and the unmerged run start while the merge writes
        self._post_outcome("merge", lambda: merge_prewarmed(options, self._forward, cancel))

    def _post_outcome(self, kind: str, call, say_cancel: bool = False) -> None:
        """In a worker thread: ``call()``'s result as WorkDone(kind), posted last (the thread has
        finished its work). A cancel comes as cancelled (with its sentence when ``say_cancel``), an
        expected failure as its sentence, anything else as a bug said in one: never a worker that
        dies while its screen waits."""
        from tui_merger.core.errors import MergeCancelled, MergeError

        try:
            done = _Done(call())
        except MergeCancelled as err:
            done = _Done(error=str(err) if say_cancel else None, cancelled=True)
        except MergeError as err:
            done = _Done(error=str(err))
        except Exception as err:  # noqa: BLE001
            from tui_merger.deps import explain_failure

            done = _Done(error=explain_failure(err) or (
                f"Unexpected {type(err).__name__}: {err}. This is a bug in tui-merger; please report it."))
        self.post_message(WorkDone(kind, done))

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        def answer(yes: bool | None) -> None:
            if yes and self.running == "merge" and self.job is not None and self.job.pid:
                import os
                import signal

                os.kill(self.job.pid, signal.SIGTERM)  # the job stops between tensors, keeping finished shards
                self.query_one("#cancel", Button).disabled = True
                self.query_one("#merge-status", Static).update("Stopping the background job...")
                return
            if yes and self.running == "merge" and self.cancel_token is not None:
                self.cancel_token.cancel()
                self.query_one("#cancel", Button).disabled = True
                self.query_one("#merge-status", Static).update("Cancelling: stopping after the current tensor...")

        self.app.push_screen(
            Confirm("Cancel the merge? The partial output is removed; the inputs are untouched.", "Cancel the merge", "Keep merging"),
            answer,
        )

    def on_engine_event(self, message: EngineEvent) -> None:
        from tui_merger.core.events import Notice, PhaseStarted, TensorProgress, TrialFinished, TrialStarted, TrialToken
        from tui_merger.core.options import human_bytes

        ev = message.event
        if self.running == "gguf":
            self.show_gguf_event(ev)
            return
        if isinstance(ev, (TrialStarted, TrialToken, TrialFinished)):
            if self.running == "trial":  # a token sent before Stop may land after it: not shown then
                self.trial_answers[ev.side] = ev
                self.show_answer(ev.side)
            return
        target = "verify" if self.running == "verify" else "merge"
        if isinstance(ev, PhaseStarted):
            self.query_one(f"#{target}-status", Static).update(f"[b]{ev.phase}[/b]  {_escape(ev.message)}")
            if ev.phase in ("merge", "verify"):
                self.query_one(f"#{target}-progress", ProgressBar).update(total=None, progress=0)
                self._started = time.monotonic()
        elif isinstance(ev, Notice):
            notes = self.query_one("#merge-notes", Static)
            notes.update(f"{notes.content}\n[yellow]{ev.level}:[/] {_escape(ev.message)}".strip())
        elif isinstance(ev, TensorProgress) and self.running in ("merge", "verify"):
            bar = self.query_one(f"#{target}-progress", ProgressBar)
            bar.update(total=max(ev.bytes_total, 1), progress=ev.bytes_done)
            if target == "merge":
                elapsed = max(time.monotonic() - self._started, 1e-6)
                speed = ev.bytes_done / elapsed
                eta = (ev.bytes_total - ev.bytes_done) / speed if speed > 0 else 0
                self.query_one("#merge-detail", Static).update(
                    f"{human_bytes(ev.bytes_done)} of {human_bytes(ev.bytes_total)}   "
                    f"{ev.tensors_done}/{ev.tensors_total} tensors   {human_bytes(speed)}/s   "
                    f"about {eta:.0f} s left\n[dim]{_escape(ev.name)}[/dim]"
                )

    def _job_ended(self, done: _Done) -> None:
        """A followed job ended (or following stopped): its verification is read from its manifest."""
        from tui_merger.core.merge.jobs import FINISHED
        from tui_merger.core.record.manifest import read_manifest

        status = self.query_one("#merge-status", Static)
        if done.error:
            status.update(f"[b red]The background job could not start:[/] {_escape(done.error)}")
            return
        job = done.value
        message = (job.result or {}).get("message", "")
        if job.state != FINISHED:
            status.update(f"[b yellow]Job {job.id} {job.state}.[/] {_escape(message)}")
            return
        manifest = read_manifest(Path(job.out)) or {}
        checks = (manifest.get("verification") or {}).get("checks") or []
        self._fill_checks([(str(c.get("status", "")).upper(), c.get("name", ""), c.get("summary", "")) for c in checks])
        verified = (job.result or {}).get("verified")
        verdict = "[b green]PASSED[/]" if verified else "[b red]not passed[/]"
        self.query_one("#verify-status", Static).update(f"Job {job.id}: verification {verdict}. {_escape(message)}")
        self.query_one("#verify-progress", ProgressBar).update(total=1, progress=1)
        self.show("verify")

    # -- Verify -------------------------------------------------------------------------------
    def start_verify(self) -> None:
        self.report = None
        self._fill_checks([])
        self.running = "verify"
        self.show("verify")
        self._verify_worker(self.options, self.result)

    @work(thread=True, exclusive=True, group="verify", exit_on_error=False)
    def _verify_worker(self, options, result) -> None:
        from tui_merger.core.record.provenance import finish_merge

        self._post_outcome("verify", lambda: finish_merge(options, result, on_event=self._forward)[1])

    def show_report(self) -> None:
        self._fill_checks([(c.status.upper(), c.name, c.summary) for c in self.report.checks])
        verdict = "[b green]PASSED[/]" if self.report.passed else "[b red]FAILED: the model does not match its inputs[/]"
        self.query_one("#verify-status", Static).update(f"Verification {verdict} ({self.report.seconds:.1f} s)")
        self.query_one("#verify-progress", ProgressBar).update(total=1, progress=1)

    def _fill_checks(self, rows) -> None:
        """The checks table, its summaries wrapped in the width left by the other columns (not cut)."""
        from rich.text import Text

        self._check_rows = list(rows)
        table = self.query_one("#checks", DataTable)
        row = table.cursor_row
        table.clear(columns=True)
        widths = [max([len(r[i]) for r in rows] + [len(label)]) for i, label in enumerate(("result", "check"))]
        width = self.app.size.width - 2 * 1 - 2 * table.cell_padding * 3 - sum(widths) - 2  # steps' padding, scrollbar
        table.add_column("result", width=widths[0])
        table.add_column("check", width=widths[1])
        table.add_column("summary", width=max(width, 20))
        for status, name, summary in rows:
            colour = {"PASS": "green", "FAIL": "red"}.get(status, "yellow")
            table.add_row(f"[b {colour}]{_escape(status)}[/]", name, Text(summary, end=""), height=None)
        if rows:
            table.move_cursor(row=min(row, len(rows) - 1))

    @on(DataTable.RowHighlighted, "#checks")
    def _check_detail(self, event: DataTable.RowHighlighted) -> None:
        if self.report is None or event.cursor_row >= len(self.report.checks):
            return
        check = self.report.checks[event.cursor_row]
        lines = [f"[b]{check.name}[/b]: {_escape(check.summary)}"] + [f"  {_escape(d)}" for d in check.details[:8]]
        self.query_one("#check-detail", Static).update("\n".join(lines))

    # -- Try it -------------------------------------------------------------------------------
    def enter_try(self) -> None:
        """The merged model answers a prompt, beside the model it was made from; the memory both need
        is said first (core.ship.trial plans it, in a worker: it reads the tokenizer)."""
        against = self.query_one("#against", Select)
        if self.options is not None and self.options.adapter is not None and Path(self.options.adapter).is_dir():
            choices = [("compare with the base model", "base"), ("compare with the unmerged adapter (peft)", str(self.options.adapter))]
        else:
            choices = [("compare with the base model", "base")]
        if choices != self._against_choices:
            self._against_choices = choices
            with against.prevent(Select.Changed):
                against.set_options(choices)
                against.value = "base"
        self.show("try")
        self.query_one("#answers").set_class(self.app.size.width < NARROW, "stacked")
        if self.trial_plan is None or self._planned_against != against.value:
            self.plan_trial()

    def plan_trial(self) -> None:
        against = self.query_one("#against", Select).value
        self.trial_plan, self._planned_against = None, against
        self.trial_answers = {}
        for side in ("merged", "other"):
            self.query_one(f"#answer-{side}-text", Static).update("")
            self.query_one(f"#answer-{side}").border_title = ""
            self.query_one(f"#answer-{side}").border_subtitle = ""
        self.query_one("#try-status", Static).update("[dim]Reading the models...[/dim]")
        self.query_one("#ask", Button).disabled = True
        self._trial_planning = True  # not self.running: Finish stays one key away
        self.refresh_nav()
        self._trial_plan_worker(self.out_path, None if against == "base" else Path(against))

    @work(thread=True, exclusive=True, group="trial", exit_on_error=False)
    def _trial_plan_worker(self, model_dir, against) -> None:
        from tui_merger.core.ship.trial import plan_trial

        self._post_outcome("trial-plan", lambda: plan_trial(model_dir, against))

    def show_trial_plan(self) -> None:
        plan = self.trial_plan
        labels = [s.label for s in plan.sides]
        for side, label in zip(("merged", "other"), labels + [None]):
            panel = self.query_one(f"#answer-{side}")
            panel.display = label is not None
            panel.border_title = label or ""
        notes = [_escape(n) for n in plan.notes]
        if not plan.fits:
            notes[0] = f"[b red]{notes[0]}[/]"
        how = "as one user message through the chat template" if plan.chat_template else "as plain text (no chat template)"
        self.query_one("#try-status", Static).update(
            "\n".join(notes) + f"\n[dim]Greedy, at most {self.try_tokens} tokens; the prompt goes in {how}.[/dim]"
        )
        self.query_one("#ask", Button).disabled = False

    @on(Select.Changed, "#against")
    def _against(self) -> None:
        if self.step == "try" and self.running is None and not self._trial_planning and self._planned_against != self.query_one("#against", Select).value:
            self.plan_trial()

    @on(Input.Submitted, "#prompt")
    @on(Button.Pressed, "#ask")
    def ask(self) -> None:
        from tui_merger.core.events import CancelToken

        prompt = self.query_one("#prompt", Input).value
        if self.running is not None or self.trial_plan is None or self._trial_planning:
            return
        if not prompt.strip():
            self.query_one("#try-status", Static).update("[b red]Type a prompt first.[/]")
            return
        self.trial_answers = {}
        for side in ("merged", "other"):
            self.query_one(f"#answer-{side}-text", Static).update("[dim]waiting...[/dim]")
            self.query_one(f"#answer-{side}").border_subtitle = ""
        self.show_trial_plan()
        self.trial_cancel = CancelToken()
        self.running = "trial"
        self.query_one("#ask", Button).disabled = True
        self.query_one("#try-cancel", Button).disabled = False
        self.refresh_nav()
        self._trial_worker(self.trial_plan, prompt, self.try_tokens, self.trial_cancel)

    @work(thread=True, exclusive=True, group="trial", exit_on_error=False)
    def _trial_worker(self, plan, prompt, tokens, cancel) -> None:
        from tui_merger.core.ship.trial import run_trial

        self._post_outcome("trial", lambda: run_trial(plan, prompt, max_new_tokens=tokens, on_event=self._forward, cancel=cancel))

    @on(Button.Pressed, "#try-cancel")
    def stop_trial(self) -> None:
        if self.running == "trial" and self.trial_cancel is not None:
            self.trial_cancel.cancel()
            self.query_one("#try-cancel", Button).disabled = True
            self.query_one("#try-status", Static).update("Stopping after the current token...")

    def show_answer(self, label: str) -> None:
        """One side's answer so far (or whole), with its pace, in its column."""
        from tui_merger.core.events import TrialFinished, TrialStarted

        ev = self.trial_answers.get(label)
        labels = [s.label for s in self.trial_plan.sides] if self.trial_plan else [label]
        side = "merged" if label == labels[0] else "other"
        text, panel = self.query_one(f"#answer-{side}-text", Static), self.query_one(f"#answer-{side}")
        if isinstance(ev, TrialStarted):
            text.update(f"[dim]{_escape(ev.message)}[/dim]")
            panel.border_subtitle = "loading..."
            return
        tokens = len(ev.token_ids) if isinstance(ev, TrialFinished) else ev.tokens
        shown = visible(ev.text)
        if shown.strip():
            text.update(_escape(shown))
        elif isinstance(ev, TrialFinished):
            text.update(f"[dim](no text: {tokens} token(s) that decode to nothing, such as special tokens)[/dim]")
        else:
            text.update(f"[dim]({tokens} token(s), no whole character yet)[/dim]")
        if isinstance(ev, TrialFinished):
            panel.border_subtitle = f"{len(ev.token_ids)} tokens, {ev.tokens_per_s:.1f} tokens/s"
        else:
            panel.border_subtitle = f"{ev.tokens} tokens, {ev.tokens_per_s:.1f} tokens/s..."

    def _trial_ended(self, done: _Done) -> None:
        self.query_one("#try-cancel", Button).disabled = True
        self.query_one("#ask", Button).disabled = self.trial_plan is None
        status = self.query_one("#try-status", Static)
        if done.cancelled:
            from tui_merger.core.events import TrialFinished

            status.update("[b yellow]Stopped.[/] Ask again, or go on to Finish.")
            labels = [s.label for s in self.trial_plan.sides]
            for side, label in zip(("merged", "other"), labels):
                ev = self.trial_answers.get(label)
                if not isinstance(ev, TrialFinished):
                    tokens = getattr(ev, "tokens", 0)
                    self.query_one(f"#answer-{side}").border_subtitle = f"stopped after {tokens} tokens" if tokens else "stopped"
                    if ev is None:
                        self.query_one(f"#answer-{side}-text", Static).update("[dim](not asked: stopped before)[/dim]")
        elif done.error:
            status.update(f"[b red]Try it failed:[/] {_escape(done.error)}")
        else:
            self.show_trial_plan()

    # -- Finish -------------------------------------------------------------------------------
    @property
    def out_path(self) -> Path:
        return Path(self.result.out if self.result is not None else self.job.out)

    def enter_finish(self) -> None:
        from tui_merger.core.record.manifest import read_manifest
        from tui_merger.core.options import human_bytes

        if self.result is not None:
            r = self.result
            verified = self.report is not None and self.report.passed
            details = (
                f"{r.tensors_text()}, "
                f"{human_bytes(r.bytes_written)} in {len(r.shards)} shard(s), written in {r.seconds:.1f} s.\n"
                f"Files: {_escape(', '.join(r.files))}"
            )
        else:  # a background job: what its manifest says
            manifest = read_manifest(self.out_path) or {}
            verified = bool((manifest.get("verification") or {}).get("passed"))
            outputs = manifest.get("outputs") or []
            details = (
                f"{human_bytes(sum(f.get('size', 0) for f in outputs))} in {len(outputs)} file(s), "
                f"written by job {self.job.id}.\nFiles: {_escape(', '.join(f.get('path', '') for f in outputs))}"
            )
        verdict = "[b green]verified[/]" if verified else "[b red]NOT verified: do not ship it[/]"
        self.query_one("#summary", Static).update(
            f"The merged model is in [b]{_escape(self.out_path)}[/b] ({verdict}).\n{details}"
        )
        self.query_one("#cleanup", Button).disabled = not verified
        self.query_one("#upload", Button).disabled = not verified
        self.query_one("#gguf", Button).disabled = not verified
        self.show("finish")

    @on(Button.Pressed, "#quit")
    def _quit(self) -> None:
        self.app.exit(0)

    @on(Button.Pressed, "#cleanup")
    def _cleanup(self) -> None:
        from tui_merger.core.ship.cleanup import find_cleanup
        from tui_merger.core.errors import MergeError

        if self.candidate is not None:
            folder = Path(self.candidate.run or self.candidate.path)
        else:  # a job followed from an earlier session
            opts = self.job.request["options"]
            folder = Path(opts.get("checkpoint") or opts.get("adapter"))
        notes = self.query_one("#finish-notes", Static)
        try:
            plan = find_cleanup(folder, [self.out_path])
        except MergeError as err:
            notes.update(_escape(err))
            return
        if not plan.items:
            notes.update(f"Nothing to clean up in {_escape(folder)}.")
            return

        def chosen(items) -> None:
            if items:
                self.running = "cleanup"
                self.refresh_nav()
                self._cleanup_worker(plan, items)

        self.app.push_screen(CleanupDialog(plan), chosen)

    @work(thread=True, exclusive=True, group="cleanup", exit_on_error=False)
    def _cleanup_worker(self, plan, items) -> None:
        from tui_merger.core.ship.cleanup import delete_items

        errors = []
        freed = delete_items(plan, items, lambda ev: ev.error and errors.append(ev.error))
        self.post_message(WorkDone("cleanup", _Done((freed, errors))))

    @on(Button.Pressed, "#upload")
    def _upload(self) -> None:
        def chosen(answer) -> None:
            if answer:
                self.running = "upload"
                self.refresh_nav()
                self.query_one("#finish-notes", Static).update(f"Uploading to {_escape(answer[0])}...")
                self._upload_worker(*answer)

        self.app.push_screen(UploadDialog(self.out_path.name), chosen)

    @work(thread=True, exclusive=True, group="upload", exit_on_error=False)
    def _upload_worker(self, repo_id: str, private: bool) -> None:
        from tui_merger.core.ship.hub import plan_upload, upload

        self._post_outcome("upload", lambda: upload(plan_upload(self.out_path, repo_id, private=private), on_event=self._forward))

    @on(Button.Pressed, "#gguf")
    def _gguf(self) -> None:
        if self.running == "gguf":  # the button is "Stop the GGUF" while one is written
            self.gguf_cancel.cancel()
            self.query_one("#gguf", Button).disabled = True
            return

        def chosen(answer) -> None:
            from tui_merger.core.events import CancelToken

            if answer:
                self.running, self.gguf_cancel = "gguf", CancelToken()
                button = self.query_one("#gguf", Button)
                button.label, button.variant = "Stop the GGUF", "error"
                for other in ("#cleanup", "#upload"):  # one thing at a time on the folder
                    self.query_one(other, Button).disabled = True
                self.query_one("#gguf-progress", ProgressBar).display = True
                self.query_one("#gguf-progress", ProgressBar).update(total=None, progress=0)
                self.refresh_nav()
                self._gguf_worker(*answer, self.gguf_cancel)

        self.app.push_screen(GgufDialog(self.out_path), chosen)

    @work(thread=True, exclusive=True, group="gguf", exit_on_error=False)
    def _gguf_worker(self, type_: str, out, cancel) -> None:
        from tui_merger.core.ship.gguf import export_gguf

        self._post_outcome("gguf", lambda: export_gguf(self.out_path, type_, out, on_event=self._forward, cancel=cancel), say_cancel=True)

    def show_gguf_event(self, ev) -> None:
        from tui_merger.core.events import PhaseStarted, TensorProgress

        if isinstance(ev, PhaseStarted):
            self.query_one("#finish-notes", Static).update(f"[b]{ev.phase}[/b]  {_escape(ev.message)}")
        elif isinstance(ev, TensorProgress):
            self.query_one("#gguf-progress", ProgressBar).update(total=max(ev.bytes_total, 1), progress=ev.bytes_done)

    def _gguf_ended(self, done: _Done) -> None:
        from tui_merger.core.options import human_bytes

        button = self.query_one("#gguf", Button)
        button.label, button.variant, button.disabled = "Make a GGUF...", "default", False
        for other in ("#cleanup", "#upload"):  # the GGUF was offered for a verified model only
            self.query_one(other, Button).disabled = False
        self.query_one("#gguf-progress", ProgressBar).display = False
        notes = self.query_one("#finish-notes", Static)
        if done.error:
            notes.update(("[b yellow]Stopped.[/] " if done.cancelled else "[b red]No GGUF:[/] ") + _escape(done.error))
            return
        r = done.value
        where = "recorded in merge_manifest.json; Upload... includes it" if r.recorded else "not recorded (no merge_manifest.json)"
        notes.update(
            f"GGUF written: [b]{_escape(r.path)}[/b] ({r.type.upper()}, {human_bytes(r.size)}, {r.seconds:.1f} s; "
            f"{where}).\nRun it with llama-cli -m {_escape(r.path)}, or FROM it in an Ollama Modelfile."
        )

    # -- workers report here --------------------------------------------------------------------
    def on_work_done(self, message: WorkDone) -> None:
        done, kind = message.done, message.kind
        if kind == "trial-plan":  # read while the user may have gone on: touches Try it's widgets only
            self._trial_planning = False
            if done.error:
                self.query_one("#try-status", Static).update(f"[b red]Try it cannot start:[/] {_escape(done.error)}")
            else:
                self.trial_plan = done.value
                self.show_trial_plan()
            if self.step == "try" and self._planned_against != self.query_one("#against", Select).value:
                self.plan_trial()  # changed while the models were read
            self.refresh_nav()
            return
        self.running = None
        if kind == "plan":
            if done.error:
                self._show_checks(f"[b red]ERROR[/]   {_escape(done.error)}", "[b red]1 error[/]")
            else:
                self._show_plan(*done.value)
        elif kind == "bases":
            self._proposed(done.value)
            return
        elif kind == "trial":
            self._trial_ended(done)
        elif kind == "merge":
            self.query_one("#cancel", Button).disabled = True
            status = self.query_one("#merge-status", Static)
            bar = self.query_one("#merge-progress", ProgressBar)
            if bar.total is None:
                bar.update(total=1, progress=0)  # no animation left running after a stop
            if done.cancelled:
                status.update("[b yellow]Cancelled.[/] The partial output was removed; the inputs are untouched.")
            elif done.error:
                status.update(f"[b red]The merge failed:[/] {_escape(done.error)}\nGo back to Review to change something.")
            else:
                self.result = done.value
                self.refresh_nav()
                self.start_verify()
                return
        elif kind == "job":
            self.query_one("#cancel", Button).disabled = True
            self._job_ended(done)
        elif kind == "verify":
            if done.error:
                self.query_one("#verify-status", Static).update(f"[b red]Verification could not run:[/] {_escape(done.error)}")
                self.report = None
            else:
                self.report = done.value
                self.show_report()
        elif kind == "cleanup":
            from tui_merger.core.options import human_bytes

            freed, errors = done.value
            text = f"Freed {human_bytes(freed)}."
            if errors:
                text += " Not deleted: " + "; ".join(errors[:3])
            self.query_one("#finish-notes", Static).update(_escape(text))
        elif kind == "gguf":
            self._gguf_ended(done)
        elif kind == "upload":
            notes = self.query_one("#finish-notes", Static)
            notes.update(_escape(done.error) if done.error else f"Uploaded: {_escape(done.value.commit_url)}")
        self.refresh_nav()


def _plan_grid(lines: list[str], fields):
    """The plan's lines ("  role       value") as two columns, values wrapping under themselves, with the
    base model's config ("base cfg") under the adapter's line."""
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True, min_width=10, style="bold")
    grid.add_column(ratio=1, overflow="fold")  # long paths fold instead of being cut
    rows = []
    for line in lines:
        role, value = (line[2:12].strip(), line[13:]) if line[12:13] == " " else (line.strip().partition(" ")[::2])
        rows.append((role, Text(value)))
    config = _config_text(fields)
    if config:
        at = next((n + 1 for n, (role, _) in enumerate(rows) if role == "LoRA"), min(len(rows), 3))
        rows.insert(at, ("base cfg", Text.from_markup(config)))
    for role, value in rows:
        grid.add_row(role, value)
    return grid


def _config_text(fields) -> str:
    """The base model's config in words ("Qwen2ForCausalLM, 4 layers, ..."), as markup: a field the
    adapter side disagrees with in yellow, that value beside it."""
    words = {"architecture": "{}", "layers": "{} layers", "hidden": "hidden {}", "heads": "heads {}", "KV heads": "KV {}",
             "vocab": "vocab {}", "dtype": "{}", "rope_theta": "rope_theta {}", "max positions": "max positions {}"}
    text = ""
    for f in fields:
        part = _escape(words.get(f.name, f.name + " {}").format(f.value))
        if f.other is not None:
            part = f"[b yellow]{part} (≠ {_escape(f.other)} in {_escape(f.where)})[/]"
        text += (" / " if f.name == "KV heads" and text else ", " if text else "") + part
    return text


def _in_app(message: str) -> str:
    """The engine's sentences name command-line flags; in the app the same choice is a switch."""
    return message.replace("pass --overwrite", 'tick "Replace the existing folder" under the output folder').replace(
        "(--overwrite)", '("Replace the existing folder")')
