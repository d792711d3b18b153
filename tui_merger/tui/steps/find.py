"""Step 1, Find: the checkpoints under the folder (newest first), a typed path, or a folder browsed to."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from tui_merger.tui.steps.common import Step, escape
from tui_merger.tui.widgets import FolderPicker


class FindStep(Step, Vertical):
    FIRST = "#candidates"

    def compose(self) -> ComposeResult:
        yield Label("Checkpoints found (newest first):")
        yield OptionList(id="candidates")
        with Horizontal(classes="row"):
            yield Input(placeholder="or type a path to a checkpoint or a folder", id="path")
            yield Button("Browse...", id="browse")
        yield Static(id="path-status")

    def nav(self):
        return True, self.wizard.candidate is None, "Review >", ""

    def advance(self) -> None:
        self.wizard.panes["review"].enter()

    def rescan(self, path: Path) -> None:
        from tui_merger.core.errors import MergeError
        from tui_merger.core.formats.scan import scan
        from tui_merger.core.plan.choices import describe_candidate, why_not_mergeable

        wizard = self.wizard
        status = self.query_one("#path-status", Static)
        try:
            found = scan(path)
        except MergeError as err:
            status.update(f"[b red]{escape(err)}[/]")
            return
        wizard.root = Path(path).absolute() if Path(path).is_dir() else Path(path).absolute().parent
        wizard.candidates = found.candidates
        options = self.query_one("#candidates", OptionList)
        options.clear_options()
        for n, c in enumerate(wizard.candidates):
            line = describe_candidate(c, wizard.root)
            if why_not_mergeable(c):
                line += "  [dim](not mergeable)[/dim]"
            options.add_option(Option(line, id=str(n)))
        problems = f"; {len(found.problems)} entries could not be read" if found.problems else ""
        if wizard.candidates:
            status.update(f"Found {len(wizard.candidates)} checkpoint(s) in {escape(wizard.root)}{problems}.")
            mergeable = [n for n, c in enumerate(wizard.candidates) if not why_not_mergeable(c)]
            options.highlighted = mergeable[0] if mergeable else 0
        else:
            status.update(f"No checkpoint found in {escape(wizard.root)}{problems}; type a path or browse.")
        wizard.candidate = None
        wizard.refresh_nav()

    @on(OptionList.OptionHighlighted, "#candidates")
    @on(OptionList.OptionSelected, "#candidates")
    def _pick(self, event) -> None:
        from tui_merger.core.plan.choices import why_not_mergeable

        wizard = self.wizard
        c = wizard.candidates[int(event.option.id)]
        problem = why_not_mergeable(c)
        wizard.candidate = None if problem else c
        note = problem or self._candidate_text(c)
        self.query_one("#path-status", Static).update(escape(note))
        wizard.refresh_nav()
        if isinstance(event, OptionList.OptionSelected) and wizard.candidate is not None:
            self.advance()

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
            self.query_one("#path-status", Static).update(f"[b red]{escape(path)} does not exist.[/]")
            return
        self.rescan(path)
        self.query_one("#candidates", OptionList).focus()

    @on(Button.Pressed, "#browse")
    def _browse(self) -> None:
        def chosen(path: Path | None) -> None:
            if path is not None:
                self.query_one("#path", Input).value = str(path)
                self.rescan(path)

        self.app.push_screen(FolderPicker(self.wizard.root), chosen)

