"""Step 5, Try it: the merged model answers a prompt beside the model it was made from (the base, or the
adapter unmerged through peft), greedy, so that what the training changed can be read. The memory both
need is said first (``core.ship.trial`` plans it in a worker: it reads the tokenizer); Stop ends an
answer between tokens; the step can be skipped at any time."""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Input, Select, Static

from tui_merger.tui.steps.common import Done, EngineEvent, Step, escape, in_app, visible

TRY_TOKENS = 64  # the most tokens each model answers in Try it
TRY_PROMPT = "Explain in two sentences what you can help me with."
# the demo's random models: a line of its own training text, on which the merged model and the unmerged
# adapter give the same 64 tokens here (bf16 kernels differ between CPUs: where they part is said)
DEMO_PROMPT = "a merge adds the update"
NARROW = 100  # below this many columns the two answers are stacked, not side by side
DEMO_NOTE = "[b]Demo models are random, never trained: they answer in random characters.[/b]"


class TryStep(Step, Vertical):
    FIRST = "#prompt"
    BACK = "verify"
    KEEPS_RUNNING = frozenset({"trial-plan"})  # the models are read while the user may go on: not "busy"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self.trial_plan = None  # core.ship.trial.TrialPlan of the merged model (and what it is compared with)
        self.trial_answers: dict = {}  # side label -> the latest TrialToken / TrialFinished shown
        self.try_tokens = TRY_TOKENS
        self._planned_against = None  # the Compare with value the trial plan was made for
        self._against_choices = [("compare with the base model", "base")]
        self.planning = False
        self.agreement: str | None = None  # where the last two answers part (core.ship.trial.agreement)

    def compose(self) -> ComposeResult:
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

    def nav(self):
        running = self.wizard.running
        status = ""
        if running == "trial":
            status = "answering... (Stop ends it)"
        elif self.planning:
            status = "reading the models... (Finish > skips Try it)"
        return running is not None, running is not None, "Finish >", status

    def advance(self) -> None:
        self.wizard.panes["finish"].enter()

    def resized(self) -> None:
        self.query_one("#answers").set_class(self.app.size.width < NARROW, "stacked")

    def enter(self) -> None:
        """The merged model answers a prompt, beside the model it was made from; the memory both need
        is said first."""
        options = self.wizard.options
        against = self.query_one("#against", Select)
        if options is not None and options.adapter is not None and Path(options.adapter).is_dir():
            choices = [("compare with the base model", "base"), ("compare with the unmerged adapter (peft)", str(options.adapter))]
        else:
            choices = [("compare with the base model", "base")]
        if choices != self._against_choices:
            self._against_choices = choices
            with against.prevent(Select.Changed):
                against.set_options(choices)
                # the demo's models are random: against the base its answers differ as noise does; against
                # the unmerged adapter they agree, which is what the demo is there to show
                against.value = choices[-1][1] if self._is_demo() else "base"
        prompt = self.query_one("#prompt", Input)
        if self._is_demo() and prompt.value == TRY_PROMPT:
            prompt.value = DEMO_PROMPT
        self.wizard.show("try")
        self.resized()
        if self.trial_plan is None or self._planned_against != against.value:
            self.plan_trial()

    def plan_trial(self) -> None:
        against = self.query_one("#against", Select).value
        self.trial_plan, self._planned_against = None, against
        self.trial_answers, self.agreement = {}, None
        for side in ("merged", "other"):
            self.query_one(f"#answer-{side}-text", Static).update("")
            self.query_one(f"#answer-{side}").border_title = ""
            self.query_one(f"#answer-{side}").border_subtitle = ""
        self.query_one("#try-status", Static).update("[dim]Reading the models...[/dim]")
        self.query_one("#ask", Button).disabled = True
        self.planning = True  # not wizard.running: Finish stays one key away
        self.wizard.refresh_nav()
        self._trial_plan_worker(self.wizard.out_path, None if against == "base" else Path(against))

    @work(thread=True, exclusive=True, group="trial", exit_on_error=False)
    def _trial_plan_worker(self, model_dir, against) -> None:
        from tui_merger.core.ship.trial import plan_trial

        self.post_outcome("trial-plan", lambda: plan_trial(model_dir, against))

    def done_trial_plan(self, done: Done) -> None:
        """Read while the user may have gone on: touches Try it's widgets only."""
        self.planning = False
        if done.error:
            self.query_one("#try-status", Static).update(f"[b red]Try it cannot start:[/] {escape(in_app(done.error))}")
        else:
            self.trial_plan = done.value
            self.show_trial_plan()
        if self.wizard.step == "try" and self._planned_against != self.query_one("#against", Select).value:
            self.plan_trial()  # changed while the models were read

    def show_trial_plan(self) -> None:
        plan = self.trial_plan
        labels = [s.label for s in plan.sides]
        for side, label in zip(("merged", "other"), labels + [None]):
            panel = self.query_one(f"#answer-{side}")
            panel.display = label is not None
            panel.border_title = label or ""
        # (the rounding note is left out: the line under the answers says where they part, and why; at
        # 80x24 its three lines pushed the second answer off the screen)
        notes = [escape(in_app(n)) for n in plan.notes if n != plan.rounding_note]
        if not plan.fits:
            notes[0] = f"[b red]{notes[0]}[/]"
        how = "through the chat template" if plan.chat_template else "as plain text (no chat template)"
        if self._is_demo():
            notes.append(DEMO_NOTE)
        said = ""
        if self.agreement:
            colour = "green" if self.agreement.startswith("The two answers are the same") else "yellow"
            said = f"\n[{colour}]{escape(self.agreement)}[/]"
        self.query_one("#try-status", Static).update(
            "\n".join(notes) + f"\n[dim]Greedy, at most {self.try_tokens} tokens; the prompt goes in {how}.[/dim]" + said
        )
        self.query_one("#ask", Button).disabled = False

    def _is_demo(self) -> bool:
        """The model was merged from ``tui-merger demo``'s tiny random models (its folder's marker)."""
        from tui_merger.demo import MARKER

        wizard, folders = self.wizard, [self.wizard.out_path.parent]
        if wizard.options is not None:
            folders += [Path(p).parent for p in (wizard.options.base, wizard.options.adapter) if p is not None]
        return any((folder / MARKER).exists() for folder in folders)

    @on(Select.Changed, "#against")
    def _against(self) -> None:
        if (
            self.wizard.step == "try" and self.wizard.running is None and not self.planning
            and self._planned_against != self.query_one("#against", Select).value
        ):
            self.plan_trial()

    @on(Input.Submitted, "#prompt")
    @on(Button.Pressed, "#ask")
    def ask(self) -> None:
        from tui_merger.core.events import CancelToken

        wizard = self.wizard
        prompt = self.query_one("#prompt", Input).value
        if wizard.running is not None or self.trial_plan is None or self.planning:
            return
        if not prompt.strip():
            self.query_one("#try-status", Static).update("[b red]Type a prompt first.[/]")
            return
        self.trial_answers, self.agreement = {}, None
        for side in ("merged", "other"):
            self.query_one(f"#answer-{side}-text", Static).update("[dim]waiting...[/dim]")
            self.query_one(f"#answer-{side}").border_subtitle = ""
        self.show_trial_plan()
        wizard.trial_cancel = CancelToken()
        wizard.running = "trial"
        self.query_one("#ask", Button).disabled = True
        self.query_one("#try-cancel", Button).disabled = False
        wizard.refresh_nav()
        self._trial_worker(self.trial_plan, prompt, self.try_tokens, wizard.trial_cancel)

    @work(thread=True, exclusive=True, group="trial", exit_on_error=False)
    def _trial_worker(self, plan, prompt, tokens, cancel) -> None:
        from tui_merger.core.ship.trial import run_trial

        self.post_outcome("trial", lambda: run_trial(plan, prompt, max_new_tokens=tokens, on_event=self.forward, cancel=cancel))

    @on(Button.Pressed, "#try-cancel")
    def stop_trial(self) -> None:
        wizard = self.wizard
        if wizard.running == "trial" and wizard.trial_cancel is not None:
            wizard.trial_cancel.cancel()
            self.query_one("#try-cancel", Button).disabled = True
            self.query_one("#try-status", Static).update("Stopping after the current token...")

    def on_engine_event(self, message: EngineEvent) -> None:
        from tui_merger.core.events import TrialFinished, TrialStarted, TrialToken

        message.stop()
        ev = message.event
        if isinstance(ev, (TrialStarted, TrialToken, TrialFinished)) and self.wizard.running == "trial":
            # a token sent before Stop may land after it: not shown then
            self.trial_answers[ev.side] = ev
            self.show_answer(ev.side)

    def show_answer(self, label: str) -> None:
        """One side's answer so far (or whole), with its pace, in its column."""
        from tui_merger.core.events import TrialFinished, TrialStarted

        ev = self.trial_answers.get(label)
        labels = [s.label for s in self.trial_plan.sides] if self.trial_plan else [label]
        side = "merged" if label == labels[0] else "other"
        text, panel = self.query_one(f"#answer-{side}-text", Static), self.query_one(f"#answer-{side}")
        if isinstance(ev, TrialStarted):
            text.update(f"[dim]{escape(ev.message)}[/dim]")
            panel.border_subtitle = "loading..."
            return
        tokens = len(ev.token_ids) if isinstance(ev, TrialFinished) else ev.tokens
        shown = visible(ev.text)
        if shown.strip():
            text.update(escape(shown))
        elif isinstance(ev, TrialFinished):
            text.update(f"[dim](no text: {tokens} token(s) that decode to nothing, such as special tokens)[/dim]")
        else:
            text.update(f"[dim]({tokens} token(s), no whole character yet)[/dim]")
        if isinstance(ev, TrialFinished):
            panel.border_subtitle = f"{len(ev.token_ids)} tokens, {ev.tokens_per_s:.1f} tokens/s"
        else:
            panel.border_subtitle = f"{ev.tokens} tokens, {ev.tokens_per_s:.1f} tokens/s..."

    def done_trial(self, done: Done) -> None:
        self.query_one("#try-cancel", Button).disabled = True
        from tui_merger.core.events import TrialFinished

        self.query_one("#ask", Button).disabled = self.trial_plan is None
        status = self.query_one("#try-status", Static)
        if done.cancelled:
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
            status.update(f"[b red]Try it failed:[/] {escape(in_app(done.error))}")
            for side, label in zip(("merged", "other"), [s.label for s in self.trial_plan.sides]):
                if not isinstance(self.trial_answers.get(label), TrialFinished):  # no "loading..." left behind
                    self.query_one(f"#answer-{side}").border_subtitle = "no answer"
                    self.query_one(f"#answer-{side}-text", Static).update("[dim](no answer: see the red line above)[/dim]")
        else:
            from tui_merger.core.ship.trial import agreement

            # where the answers part: random or small models answer in what no one compares by eye
            self.agreement = agreement(done.value)
            self.show_trial_plan()
