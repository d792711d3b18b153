"""Step 2, Review: the plan of the merge, the fields that change it, and the checks, pinned under the form
so that they stay in sight. Errors block "Merge >"; warnings need a tick. An adapter whose base is not on
this machine gets the models here that fit it proposed (a worker: it reads their headers)."""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Button, Checkbox, Input, Label, Select, Static

from tui_merger.tui.steps.common import Done, Step, WorkDone, escape, in_app, show_end
from tui_merger.tui.widgets import FolderPicker

DTYPES = [("dtype: as the base", ""), ("dtype: bf16", "bf16"), ("dtype: fp16", "fp16"), ("dtype: fp32", "fp32")]
TOKENIZERS = [("tokenizer: auto", "auto"), ("tokenizer: base", "base"), ("tokenizer: adapter", "adapter")]
SETTINGS = "Output dtype, largest shard (e.g. 5GB), tokenizer from (auto: the adapter's if it has one)"
# a training checkpoint (verl) brings its own weights, config and tokenizer: no base, no adapter folder
CHECKPOINT_DTYPES = [("dtype: as the checkpoint", "")] + DTYPES[1:]
CHECKPOINT_TOKENIZERS = [("tokenizer: auto", "auto"), ("tokenizer: base", "base"), ("tokenizer: the checkpoint's", "adapter")]
CHECKPOINT_SETTINGS = "Output dtype, largest shard (e.g. 5GB), tokenizer from (auto: the checkpoint's if it has one)"


class ReviewStep(Step, Vertical):
    # Focus order (tab): base model (when the checkpoint needs one: focused first then), the other
    # models that fit, output folder (focused first otherwise), replace, alpha, weight, more adapters,
    # QLoRA base weights, dtype, shard size, tokenizer, output format, background job, Check again, the
    # warnings' tick.
    FIRST = "#out"
    BACK = "find"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self._planned: tuple = ()  # the field values the current plan was made from
        self._roundtrip_offer = None  # the --qlora-base value the Review step offers
        self._reviewed = None  # the checkpoint the Review fields were last filled for
        self._proposals: list = []  # [(path, why)]: the models here that fit an adapter whose base is not here
        self._searched = False  # the proposals were looked for (none found: the note says so)
        self._misfit = None  # the adapter (path) whose named base the plan found not to fit: base field shown
        self._suggested = ("", "")  # (the output folder we put in the field, the name it came from)
        self._from_top = False  # the next plan shown scrolls the form to its top (entering the step)
        self._format_ok = ""  # the output format of the last plan that the engine could write ("": default)
        self._format_refusal = ""  # the engine's sentence refusing the format chosen last (shown under it)
        self._format_offered: list = []  # the (words, value) pairs the select holds
        self._format_for = None  # the checkpoint they were offered for
        self._accepted: str | None = None  # the proposed base accepted with "Use this base >" (ctrl+n)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="review-form"):
            yield Label("Base model folder", classes="base-field")
            with Horizontal(classes="row base-field"):
                yield Input(id="base", classes="base-field")
                yield Button("Browse...", id="browse-base")
            proposals = Select([], prompt="other models here that fit the adapter", id="base-choice", classes="base-field")
            proposals.display = False  # shown when the base had to be proposed
            yield proposals
            yield Static(id="base-note", classes="base-field")
            # the field people change most, at the top: focused on entering, in sight at 80x24 (the plan
            # below it grows when it arrives; a field under it would be focused out of sight)
            yield Label("Output folder", id="out-label")
            yield Input(id="out")
            replace = Checkbox("Replace the existing folder (kept until the new model is complete)", id="replace")
            replace.display = False  # shown when the output folder holds files
            yield replace
            yield Static(id="plan-text")
            yield Label("LoRA alpha used in training (the checkpoint does not record it)", id="alpha-label", classes="field alpha-field")
            yield Input(id="alpha", type="number", classes="alpha-field")
            yield Label("Weight of this adapter (1 = as trained; e.g. 0.7 to blend it with others)", classes="field weight-field")
            yield Input("1", id="weight", classes="weight-field")
            yield Label("More adapters to blend in, as PATH:WEIGHT separated by ;", classes="field weight-field")
            with Horizontal(classes="row weight-field"):
                yield Input(id="more", placeholder="e.g. ../pixel-art-lora:0.3")
                yield Button("Add adapter...", id="add-adapter")
            yield Label("Base weights (the adapter was trained with QLoRA on a quantized copy of the base)", classes="field qlora-field")
            yield Select([("the 16-bit weights as stored (usual)", "")], value="", allow_blank=False, id="roundtrip", classes="qlora-field")
            yield Label(SETTINGS, classes="field", id="settings-label")
            with Horizontal(classes="row"):
                yield Select(DTYPES, value="", allow_blank=False, id="dtype")
                yield Input("5GB", id="shard", placeholder="shard size")
                yield Select(TOKENIZERS, value="auto", allow_blank=False, id="tokenizer")
            # the output format: offered as the plan says (plan.output_choices), hidden until a plan has some
            yield Label("Output format (what the merged model is written as)", classes="field format-field")
            yield Select([("as merged (default)", "")], value="", allow_blank=False, id="output-format", classes="format-field")
            yield Static(id="format-note", classes="format-field")
            yield Checkbox("Keep running if I disconnect (a background job: tui-merger attach)", id="detach")
            yield Button("Check again", id="recheck")
        with VerticalScroll(id="problems"):  # pinned below the form: the checks stay in sight
            yield Static(id="findings")
            yield Checkbox("I have read the warnings and want to go on", id="ack")

    # -- navigation ------------------------------------------------------------------------------
    def nav(self):
        status = self.blocked_reason()
        if self.accepts_proposal():
            return self.wizard.running is not None, bool(status), "Use this base >", "accept the proposed base?"
        return self.wizard.running is not None, bool(status), "Merge >", status

    def refused(self) -> None:
        if not self.blocked_reason():
            return
        ack = self.query_one("#ack", Checkbox)
        if ack.display and not ack.value:  # only the tick box stands in the way: take the user to it
            base, accepted = self.query_one("#base", Input), ""
            if base.display and base.value in [str(p) for p, _ in self._proposals] and base.value != self._accepted:
                self._accepted = base.value  # ctrl+n accepts the proposed base, as its note says
                accepted = f"Base accepted: {base.value}. "
                self._show_ack()
                self.wizard.refresh_nav()
                if not self.blocked_reason():
                    self.app.notify(f"{accepted}ctrl+n again starts the merge.", timeout=5)
                    return
            n = len(self._open_warnings())
            ack.focus()  # scrolled into sight under the warnings; space ticks it
            self.app.notify(f"{accepted}{n} warning{'s' * (n != 1)} under Checks: read {'them' if n != 1 else 'it'}, "
                            "then tick the box (space) to go on.", severity="warning", timeout=6)
            return
        self.app.notify(f"Not yet: {self.blocked_reason()}.", severity="warning", timeout=4)  # say why nothing happens
        self.query_one("#problems").scroll_home(animate=False)

    def advance(self) -> None:
        if self.accepts_proposal():
            # the warning is "the adapter names another base": taking the proposed one answers it; the
            # tick box (for the other warnings) stays the user's own
            self._accepted = self.query_one("#base", Input).value
            self._show_ack()
            self.wizard.refresh_nav()
            self.app.notify(f"Base accepted: {self.query_one('#base', Input).value}. ctrl+n again starts the merge.", timeout=5)
        else:
            self.wizard.panes["merge"].start()

    def blocked_reason(self) -> str:
        """Why "Merge >" is disabled, in a few words (empty when it is not)."""
        wizard = self.wizard
        if wizard.running == "bases":
            return "looking for a base model that fits..."
        if wizard.running == "plan":
            return "checking..."
        if wizard.running is not None:
            return "busy..."
        if wizard.plan is None:
            return "1 error to fix first (under Checks)"
        if wizard.plan_stale:
            return "changed: press enter or Check again"
        errors = len(wizard.plan.of("error"))
        if errors:
            return f"{errors} error{'s' * (errors != 1)} to fix first (under Checks)"
        warnings = len(self._open_warnings())
        if warnings and not self.query_one("#ack", Checkbox).value:
            if self.accepts_proposal():
                return ""
            return f"{warnings} warning{'s' * (warnings != 1)}: tick the box under Checks to go on"
        return ""

    def accepts_proposal(self) -> bool:
        """The base field holds the proposed base and the only warning is that the adapter names
        another one: "Use this base >" (ctrl+n) accepts it, which answers that warning, before "Merge >"."""
        wizard = self.wizard
        base = self.query_one("#base", Input)
        return (
            wizard.step == "review" and wizard.plan is not None and not wizard.plan_stale and wizard.running is None
            and base.display and base.value in [str(p) for p, _ in self._proposals]
            and base.value != self._accepted and not self.query_one("#ack", Checkbox).value
            and {f.id for f in wizard.plan.of("warning")} == {"base-name"}
        )

    def _open_warnings(self) -> list:
        """The plan's warnings the user has not answered otherwise than by the tick box: all of them, but
        "the adapter names another base" once the proposed base was accepted (ctrl+n)."""
        wizard = self.wizard
        if wizard.plan is None:
            return []
        accepted = self._accepted is not None and self.query_one("#base", Input).value == self._accepted
        return [f for f in wizard.plan.of("warning") if not (accepted and f.id == "base-name")]

    def _show_ack(self) -> None:
        """The tick box, only when it is what stands between the user and the merge: a finished plan
        with warnings still open and no error (while checking, or with errors to fix, it asks nothing)."""
        wizard = self.wizard
        ready = wizard.plan is not None and not wizard.plan_stale and wizard.running != "plan"
        self.query_one("#ack", Checkbox).display = ready and not wizard.plan.blocked and bool(self._open_warnings())

    # -- entering --------------------------------------------------------------------------------
    def enter(self) -> None:
        from tui_merger.core.plan.choices import alpha_default, alpha_why, can_weight, is_checkpoint, models_found, needs_alpha, needs_base

        wizard = self.wizard
        c = wizard.candidate
        if c.path != self._reviewed:
            self._misfit = None
        base_shown = needs_base(c) or self._misfit == c.path  # a named base that did not fit: still asked
        for cls, shown in ((".base-field", base_shown), (".alpha-field", needs_alpha(c)), (".weight-field", can_weight(c))):
            for w in self.query(cls):
                w.display = shown
        default = alpha_default(c)  # an empty alpha: the merge's default (peft's 8), said in the field
        self.query_one("#alpha", Input).placeholder = f"empty: {default:g}, peft's default" if default is not None else ""
        self.query_one("#alpha-label", Label).update(f"LoRA alpha used in training ({alpha_why(c)})")
        checkpoint = is_checkpoint(c)
        self.query_one("#settings-label", Label).update(CHECKPOINT_SETTINGS if checkpoint else SETTINGS)
        for selector, choices in (("#dtype", CHECKPOINT_DTYPES if checkpoint else DTYPES),
                                  ("#tokenizer", CHECKPOINT_TOKENIZERS if checkpoint else TOKENIZERS)):
            select = self.query_one(selector, Select)
            with select.prevent(Select.Changed):
                value = select.value
                select.set_options(choices)
                select.value = value
        base = self.query_one("#base", Input)
        if c.path != self._reviewed:  # another checkpoint: its own weights, no adapters blended in yet
            self._reviewed = c.path
            self.query_one("#weight", Input).value = "1"
            self.query_one("#more", Input).value = ""
            self.query_one("#alpha", Input).value = ""
            base.value = ""
            self._proposals, self._searched = [], False
        if needs_base(c) and not base.value and c.base_path:
            base.value = c.base_path
        self._show_proposals()
        self.query_one("#out", Input).value = ""  # filled with the suggested name by the plan
        self.query_one("#ack", Checkbox).value = False
        self._accepted = None
        for w in self.query(".qlora-field"):
            w.display = False
        self._roundtrip_offer = None
        for w in self.query(".format-field"):
            w.display = False  # shown again by the plan that offers formats
        if c.path != self._format_for:  # another checkpoint: the default format (the same one: as chosen)
            self._format_for = c.path
            fmt = self.query_one("#output-format", Select)
            with fmt.prevent(Select.Changed):
                fmt.set_options([("as merged (default)", "")])
                fmt.value = ""
            self._format_ok, self._format_offered = "", []
        self._format_refusal = ""
        self.query_one("#roundtrip", Select).set_options([("the 16-bit weights as stored (usual)", "")])
        self.query_one("#roundtrip", Select).value = ""
        wizard.plan = None
        self.query_one("#plan-text", Static).update("")
        self._from_top = True
        wizard.show("review")
        if needs_base(c):
            base.focus()  # the question this checkpoint raises, at the top of the form
        if needs_base(c) and not base.value.strip():
            # the adapter's base is not here: propose the models of this folder (and the HF cache) that fit it
            wizard.running = "bases"
            self._show_checks("[dim]Looking for a model on this machine that the adapter fits...[/dim]", "checking...")
            wizard.refresh_nav()
            self._bases_worker(c.path, models_found(wizard.candidates))
            return
        self.replan()

    # -- the base proposal -----------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="plan", exit_on_error=False)
    def _bases_worker(self, adapter, models) -> None:
        from tui_merger.core.plan.choices import base_candidates

        try:
            done = Done(base_candidates(adapter, models))
        except Exception as err:  # a bug in the proposal must not kill the app: the user types the base
            done = Done([], error=f"{type(err).__name__}: {err}")
        self.post_message(WorkDone("bases", done))

    def done_bases(self, done: Done) -> None:
        """The base candidates arrived: the best one goes into the base field, the others in the list."""
        self._proposals, self._searched = list(done.value), True
        if self._proposals:
            self.query_one("#base", Input).value = str(self._proposals[0][0])
        self._show_proposals()
        self.replan()

    def _show_proposals(self) -> None:
        """The line under the base field: what was proposed and why (or that nothing here fits), and
        the list of the other models that fit."""
        base = self.query_one("#base", Input)
        choice, note = self.query_one("#base-choice", Select), self.query_one("#base-note", Static)
        c = self.wizard.candidate
        choice.display = base.display and len(self._proposals) > 1
        misfit = self._misfit == c.path
        note.display = base.display and (bool(self._proposals) or not c.base_path or misfit)
        if not note.display:
            return
        from tui_merger.core.plan.choices import is_checkpoint

        what = "the checkpoint" if is_checkpoint(c) else "the adapter"
        named = (
            f"the base {what} names, {escape(c.base_path)}, does not fit it" if misfit
            else f"{what}'s base {escape(c.base_model)} is not on this machine" if c.base_model
            else f"{what} does not say which base model it was trained on"
        )
        if not self._proposals:
            from tui_merger.core.io.hf_refs import hf_command, is_repo_id

            searched = "; no model in this folder or in the Hugging Face cache fits it" if self._searched else ""
            fetch = (  # as inspect says it: tui-merger never downloads
                f" On a machine with internet access, `{hf_command()} download {c.base_model}` puts it in the "
                "Hugging Face cache, where tui-merger finds it."
                if c.base_model and is_repo_id(c.base_model) else ""
            )
            note.update(
                f"[dim]{named[0].upper()}{named[1:]}{searched}: type the folder of the model it was trained on, "
                f"or find it with Browse...{escape(fetch)}[/dim]"
            )
            return
        paths = [str(p) for p, _ in self._proposals]
        with choice.prevent(Select.Changed):
            choice.set_options([(f"{p.name}: {why}", str(p)) for p, why in self._proposals])
            choice.value = base.value if base.value in paths else Select.BLANK
        why = dict(zip(paths, (w for _, w in self._proposals))).get(base.value)
        more = f" ({len(paths) - 1} more in the list below)" if len(paths) > 1 else ""
        note.update(
            f"[b]Proposed[/b] ({named}): {escape(why) if why else 'pick one of the models that fit'}{more}. "
            "ctrl+n accepts it; or type another folder."
        )

    @on(Select.Changed, "#base-choice")
    def _base_picked(self, event: Select.Changed) -> None:
        if event.value is not Select.BLANK and self.wizard.step == "review":
            self.query_one("#base", Input).value = str(event.value)
            self._show_proposals()
            self.replan()

    # -- the plan --------------------------------------------------------------------------------
    def _options(self):
        from tui_merger.core.plan.choices import options_for

        out = self.query_one("#out", Input).value.strip()
        alpha = self.query_one("#alpha", Input).value.strip()
        base = self.query_one("#base", Input).value.strip() if self.query_one("#base", Input).display else None
        extra = {}
        if self.query_one("#roundtrip", Select).display and self.query_one("#roundtrip", Select).value:
            extra["base_roundtrip"] = self.query_one("#roundtrip", Select).value
        if self.query_one("#output-format", Select).value:  # only ever set to a format a plan offered
            extra["output_quantization"] = self.query_one("#output-format", Select).value
        if self.query_one("#weight", Input).display:
            extra.update(weight=self.query_one("#weight", Input).value.strip() or "1", more=self.query_one("#more", Input).value)
        return options_for(
            self.wizard.candidate,
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

        wizard = self.wizard
        try:
            options = self._options()
        except (MergeError, ValueError) as err:
            wizard.plan, wizard.plan_stale = None, True
            self._show_checks(f"[b red]ERROR[/]   {escape(in_app(err))}", "[b red]1 error[/]")
            self._show_ack()
            wizard.refresh_nav()
            return
        wizard.running = "plan"
        self._show_ack()  # hidden while checking
        wizard.refresh_nav()
        self._plan_worker(options)

    @work(thread=True, exclusive=True, group="plan", exit_on_error=False)
    def _plan_worker(self, options) -> None:
        from tui_merger.core.plan.choices import base_config_fields
        from tui_merger.core.plan.preflight import make_plan

        try:
            plan = make_plan(options, today=self.wizard.today)
            try:
                fields = base_config_fields(options.base, [p for p, _ in options.adapter_weights()]) if options.base else []
            except Exception:  # the config summary is for reading: never a reason to stop
                fields = []
            done = Done((options, plan, fields))
        except Exception as err:  # a bug in a check must not kill the app
            done = Done(error=f"The checks failed unexpectedly ({type(err).__name__}: {err}).")
        self.post_message(WorkDone("plan", done))

    def done_plan(self, done: Done) -> None:
        if done.error:
            self.wizard.plan = None
            self._show_checks(f"[b red]ERROR[/]   {escape(in_app(done.error))}", "[b red]1 error[/]")
            self._show_ack()
        else:
            self._show_plan(*done.value)

    def _show_checks(self, text: str, title: str) -> None:
        """The pinned panel under the form: every finding, errors first, whatever the form shows."""
        self.query_one("#findings", Static).update(text)
        panel = self.query_one("#problems")
        panel.border_title = f"Checks: {title}" if title else "Checks"
        panel.set_class("error" in title, "has-errors")

    def _show_plan(self, options, plan, fields=()) -> None:
        from tui_merger.core.plan.choices import default_out_folder, free_output, holds_files, is_checkpoint
        from tui_merger.core.plan.preflight import describe

        wizard = self.wizard
        out_input = self.query_one("#out", Input)
        # first plan: propose the suggested name (never a taken one), then plan again; and again when the
        # name follows another base (a proposed one in place of a named base that did not fit) while the
        # field still holds our suggestion, untouched
        ours, named = self._suggested
        if options.out is None or (plan.suggested_out and out_input.value == ours and plan.suggested_out != named):
            out_input.value = str(free_output(default_out_folder(wizard.candidate)[0] / plan.suggested_out))
            self._suggested = (out_input.value, plan.suggested_out)
            show_end(out_input)  # the suggested name, not only the start of its folder
            self.replan()
            return
        if self._format_refused(options, plan):
            return
        wizard.options, wizard.plan, wizard.plan_stale = options, plan, False
        self._planned = self._fields()
        if self._from_top:  # the form starts at its top, the focused field (output or base) and its label in sight
            self._from_top = False
            form = self.query_one("#review-form")
            self.call_after_refresh(form.scroll_home, animate=False)
        self.query_one("#plan-text", Static).update(_plan_grid([in_app(line) for line in describe(plan)], fields))
        colours = {"error": "red", "warning": "yellow", "info": "cyan"}
        replace = self.query_one("#replace", Checkbox)
        replace.display = options.out is not None and holds_files(options.out)
        order = {"error": 0, "warning": 1, "info": 2}
        lines = [
            f"[b {colours[f.severity]}]{f.severity.upper():7}[/] {escape(in_app(f.message))}"
            + (f"\n        [dim]{escape(in_app(f.fix))}[/dim]" if f.fix else "")
            for f in sorted(plan.findings, key=lambda f: order.get(f.severity, 3))
        ] or ["[b green]every check passed[/]"]
        counts = [f"{n} {sev}{'s' * (n != 1)}" for sev in ("error", "warning") if (n := len(plan.of(sev)))]
        title = ", ".join(counts) or ("" if not plan.findings else f"{len(plan.findings)} note{'s' * (len(plan.findings) != 1)}")
        self._show_checks("\n".join(lines), f"[b red]{title}[/]" if plan.blocked else title)
        self._show_ack()
        self._show_format(options, plan)
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
        if self._base_misfit(options, plan):
            return
        if any(f.id == "quantized" for f in plan.findings) and not is_checkpoint(wizard.candidate):
            # a quantized base: ask for the 16-bit one, filled in when it was found on this machine
            for w in self.query(".base-field"):
                w.display = True
            self._show_proposals()
            base = self.query_one("#base", Input)
            if plan.suggested_base and base.value.strip() != plan.suggested_base:
                base.value = plan.suggested_base
                base.focus()

    def _base_misfit(self, options, plan) -> bool:
        """The base the adapter names is here but does not fit it (another model: shapes, architecture):
        the error's control goes on this screen: the base field, holding that base, and the models here
        that fit, proposed as for an adapter whose base is missing (a worker; the plan follows)."""
        from tui_merger.core.plan.choices import is_checkpoint, models_found
        from tui_merger.core.plan.preflight import BASE_FINDINGS

        wizard = self.wizard
        base = self.query_one("#base", Input)
        if base.display or is_checkpoint(wizard.candidate) or options.base is None:
            return False
        if not any(f.id in BASE_FINDINGS for f in plan.of("error")):
            return False
        self._misfit = wizard.candidate.path
        for w in self.query(".base-field"):
            w.display = True
        with base.prevent(Input.Changed):
            base.value = str(options.base)  # what the plan used: the same plan, not a stale one
        self._planned = self._fields()
        base.focus()
        if self._searched:
            self._show_proposals()
            return False
        wizard.running = "bases"
        wizard.refresh_nav()
        self._bases_worker(wizard.candidate.path, models_found(wizard.candidates))
        return True

    # -- the output format ------------------------------------------------------------------------
    def _format_refused(self, options, plan) -> bool:
        """The engine refused the output format of this plan: say its sentence under the format, choose
        the format the last plan had again (the default when that was this one) and plan again."""
        from tui_merger.core.plan.preflight import output_refusal

        chosen = options.output_quantization or ""
        refusal = output_refusal(plan) if chosen else None
        if refusal is None:
            self._format_ok = chosen
            return False
        self._format_refusal = refusal
        fmt = self.query_one("#output-format", Select)
        with fmt.prevent(Select.Changed):
            fmt.value = self._format_ok if self._format_ok != chosen else ""
        self.app.notify(f"Not available for this base: {in_app(refusal)}", severity="warning", timeout=8)
        self.replan()
        return True

    def _show_format(self, options, plan) -> None:
        """The formats the plan offers (none: as it was), the one the plan was made with, and the engine's
        refusal of the one chosen before, if it refused it."""
        fmt = self.query_one("#output-format", Select)
        offered = [(words, value or "") for words, value in plan.output_choices]
        chosen = options.output_quantization or ""
        if offered and chosen in [value for _, value in offered]:
            with fmt.prevent(Select.Changed):
                if offered != self._format_offered:
                    self._format_offered = offered
                    fmt.set_options(offered)
                fmt.value = chosen
            for w in self.query(".format-field"):
                w.display = True
        note = self.query_one("#format-note", Static)
        note.display = fmt.display and bool(self._format_refusal)
        note.update(f"[b yellow]Not available:[/] {escape(in_app(self._format_refusal))}" if self._format_refusal else "")

    @on(Select.Changed, "#output-format")
    def _format_picked(self) -> None:
        if self.wizard.step == "review" and self.wizard.plan is not None:
            self._format_refusal = ""
            self.replan()  # the plan's lines, the size and the checks change with it: at once

    def _fields(self) -> tuple:
        return tuple(self.query_one(f"#{n}").value for n in ("base", "alpha", "out", "shard", "dtype", "tokenizer", "weight", "more", "roundtrip", "output-format", "replace"))

    @on(Button.Pressed, "#browse-base")
    def _browse_base(self) -> None:
        """Pick the base model folder (the adapter's own is not here, or another is wanted)."""

        def chosen(path: Path | None) -> None:
            if path is not None:
                base = self.query_one("#base", Input)
                base.value = str(path)
                self._show_proposals()
                self.replan()

        start = Path(self.query_one("#base", Input).value.strip() or self.wizard.candidate.path).expanduser()
        self.app.push_screen(FolderPicker(start.parent if start.exists() else Path(self.wizard.candidate.path).parent), chosen)

    @on(Button.Pressed, "#add-adapter")
    def _add_adapter(self) -> None:
        """Pick another adapter folder to blend in, with weight 1 to edit (a kohya file: type its path)."""

        def chosen(path: Path | None) -> None:
            if path is not None:
                more = self.query_one("#more", Input)
                more.value = "; ".join(p for p in (more.value.strip().rstrip(";"), f"{path}:1") if p)
                more.focus()

        self.app.push_screen(FolderPicker(Path(self.wizard.candidate.path).parent), chosen)

    @on(Input.Changed, "#base, #alpha, #out, #shard, #weight, #more")
    @on(Select.Changed, "#dtype, #tokenizer, #roundtrip")
    def _edited(self) -> None:
        """An edit makes the plan stale (Next waits for "Check again" or enter) until it is undone."""
        wizard = self.wizard
        if wizard.step == "review" and wizard.plan is not None:
            wizard.plan_stale = self._fields() != self._planned
            wizard.refresh_nav()

    @on(Input.Submitted, "#base, #alpha, #out, #shard, #weight, #more")
    @on(Button.Pressed, "#recheck")
    def _recheck(self) -> None:
        if self.wizard.step == "review":
            self.replan()

    @on(Checkbox.Changed, "#ack")
    def _ack(self) -> None:
        self.wizard.refresh_nav()

    @on(Checkbox.Changed, "#replace")
    def _replace(self) -> None:
        if self.wizard.step == "review" and self.wizard.plan is not None:
            self.replan()  # the checks depend on it: check again at once


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
    config = config_text(fields)
    if config:
        at = next((n + 1 for n, (role, _) in enumerate(rows) if role == "LoRA"), min(len(rows), 3))
        rows.insert(at, ("base cfg", Text.from_markup(config)))
    for role, value in rows:
        grid.add_row(role, value)
    return grid


def config_text(fields) -> str:
    """The base model's config in words ("Qwen2ForCausalLM, 4 layers, ..."), as markup: a field the
    adapter side disagrees with in yellow, that value beside it."""
    words = {"architecture": "{}", "layers": "{} layers", "hidden": "hidden {}", "heads": "heads {}", "KV heads": "KV {}",
             "vocab": "vocab {}", "dtype": "{}", "rope_theta": "rope_theta {}", "max positions": "max positions {}"}
    text = ""
    for f in fields:
        part = escape(words.get(f.name, f.name + " {}").format(f.value))
        if f.other is not None:
            part = f"[b yellow]{part} (≠ {escape(f.other)} in {escape(f.where)})[/]"
        text += (" / " if f.name == "KV heads" and text else ", " if text else "") + part
    return text

