"""Step 1, Find: the checkpoints under the folder (newest first), a typed path, or a folder browsed to."""

from __future__ import annotations

from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, Label, OptionList, Static
from textual.widgets.option_list import Option

from tui_merger.tui.steps.common import Step, escape, in_app
from tui_merger.tui.widgets import FolderPicker


class FindStep(Step, Vertical):
    FIRST = "#candidates"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self.broken: dict[str, str] = {}  # candidate path -> why it cannot be read (a file of it is broken)
        self.proposal = None  # (the candidate proposed first, why in words): choices.proposed

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

    def refused(self) -> None:
        """ctrl+n on a checkpoint that cannot be merged: say why (the line under the list says it too)."""
        highlighted = self.query_one("#candidates", OptionList).highlighted
        if highlighted is not None and highlighted < len(self.wizard.candidates):
            problem = self.why_not(self.wizard.candidates[highlighted])
            if problem:
                self.app.notify(problem, severity="error", timeout=6)

    def rescan(self, path: Path) -> None:
        from tui_merger.core.errors import MergeError
        from tui_merger.core.formats.scan import scan
        from tui_merger.core.plan.choices import describe_candidate

        wizard = self.wizard
        status = self.query_one("#path-status", Static)
        try:
            found = scan(path)
        except MergeError as err:
            status.update(f"[b red]{escape(in_app(err))}[/]")
            return
        wizard.root = Path(path).absolute() if Path(path).is_dir() else Path(path).absolute().parent
        wizard.candidates = found.candidates
        self.broken = _broken(found)
        options = self.query_one("#candidates", OptionList)
        options.clear_options()
        for n, c in enumerate(wizard.candidates):
            line = describe_candidate(c, wizard.root)
            if c.path in self.broken:
                line += "  [b red](cannot be read)[/]"
            elif self.why_not(c):
                line += "  [dim](not mergeable)[/dim]"
            options.add_option(Option(line, id=str(n)))
        unread = len(found.problems) - sum(1 for p in found.problems if _owner(p.path, wizard.candidates))
        problems = f"; {unread} entries could not be read" if unread else ""
        if wizard.candidates:
            status.update(f"Found {len(wizard.candidates)} checkpoint(s) in {escape(wizard.root)}{problems}.")
            from tui_merger.core.plan.choices import proposed

            mergeable = [n for n, c in enumerate(wizard.candidates) if not self.why_not(c)]
            self.proposal = proposed([c for c in wizard.candidates if c.path not in self.broken])
            at = next((n for n, c in enumerate(wizard.candidates) if self.proposal and c is self.proposal[0]), None)
            options.highlighted = at if at is not None else (mergeable[0] if mergeable else 0)
        else:
            status.update(f"No checkpoint found in {escape(wizard.root)}{problems}; type a path or browse.")
        wizard.candidate = None
        wizard.refresh_nav()

    def why_not(self, c) -> str | None:
        """Why this candidate cannot be merged: a file of it that does not read (a broken
        adapter_config.json), or what the assistant says."""
        from tui_merger.core.plan.choices import why_not_mergeable

        return self.broken.get(c.path) or why_not_mergeable(c)

    @on(OptionList.OptionHighlighted, "#candidates")
    @on(OptionList.OptionSelected, "#candidates")
    def _pick(self, event) -> None:
        wizard = self.wizard
        c = wizard.candidates[int(event.option.id)]
        problem = self.why_not(c)
        wizard.candidate = None if problem else c
        note = f"[b red]{escape(problem)}[/]" if c.path in self.broken else escape(in_app(problem or self._candidate_text(c)))
        self.query_one("#path-status", Static).update(note)
        wizard.refresh_nav()
        if isinstance(event, OptionList.OptionSelected) and wizard.candidate is not None:
            self.advance()

    def _candidate_text(self, c) -> str:
        from tui_merger.core.options import human_bytes

        bits = [f"{c.kind}, {human_bytes(c.size_bytes)}"
                + (f", {c.dtype}" if c.dtype else "") + (f", world size {c.world_size}" if c.world_size else "")]
        if c.lora:
            bits.append(f"LoRA rank {c.lora.get('r')}, alpha {c.lora.get('alpha') or 'missing'}")
            if c.lora.get("target_parameters"):
                bits.append(f"LoRA on experts ({', '.join(map(str, c.lora['target_parameters']))})")
        if c.base_model:
            where = {"path": "on this machine", "hf-cache": "in the HF cache", "missing": "not on this machine"}.get(c.base_resolves, "")
            bits.append(f"base {c.base_model} ({where})")
        text = "; ".join(bits) + "."
        if self.proposal is not None and c is self.proposal[0] and len(self.wizard.candidates) > 1:
            text += f" Proposed: {self.proposal[1]}."
        elif c.best:
            text += " The run's best_model_checkpoint."
        return text

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


def _owner(problem_path: str, candidates) -> str | None:
    """The candidate a problem's path belongs to (the path is the candidate or inside its folder)."""
    for c in candidates:
        if problem_path == c.path or problem_path.startswith(c.path.rstrip("/") + "/"):
            return c.path
    return None


def _broken(found) -> dict[str, str]:
    """candidate path -> one sentence: a file of that checkpoint the scan could not read (say an
    adapter_config.json that is not valid JSON). Such a checkpoint is shown but cannot be picked: the
    merge would stop on the same file."""
    broken: dict[str, str] = {}
    for p in found.problems:
        owner = _owner(p.path, found.candidates)
        if owner is not None and owner not in broken:
            name = Path(p.path).name if p.path != owner else "it"
            broken[owner] = f"This checkpoint cannot be read: {name} {p.message}"
    return broken
