"""Small widgets and modal screens of the wizard: a plain-ASCII folder picker, a yes/no confirmation,
the help screen, and the cleanup, upload and GGUF dialogs."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DirectoryTree, Input, Label, Markdown, Static

HELP = """\
# tui-merger

Turn a training checkpoint into a plain Hugging Face model, in six steps:

1. **Find** - pick a detected checkpoint, type a path, or browse for a folder (backspace goes up).
2. **Review** - read the plan; the checks stay in sight under the form. Errors must be fixed;
   warnings need a tick. When the adapter's base is not here, a model that fits it is proposed.
3. **Merge** - runs in the background; *Cancel* stops it and removes the partial output.
4. **Verify** - the result is read back, recomputed and compared with the unmerged model.
5. **Try it** - type a prompt: the merged model answers, and beside it the base (or the
   unmerged adapter), greedy, so you see what the training changed. *Stop* ends it; skip it freely.
6. **Finish** - where the model is; clean up the training folder, upload to the Hub (a token can
   be pasted there), or make a GGUF file for llama.cpp, Ollama and LM Studio. When the app closes,
   the terminal keeps where the model is and the commands to run it.

## Keys

| key | action |
|---|---|
| ctrl+n | next step |
| ctrl+b | previous step |
| tab / shift+tab | move between fields and buttons |
| enter | press the focused button |
| ctrl+p | command palette (also: change the theme) |
| f1 | this help |
| ctrl+q | quit |

The same steps run without a full-screen terminal: `tui-merger --plain`.
"""


class AsciiDirectoryTree(DirectoryTree):
    """Folders only, with icons every terminal font has."""

    ICON_NODE = "+ "
    ICON_NODE_EXPANDED = "- "
    ICON_FILE = "  "

    def filter_paths(self, paths):
        return [p for p in paths if p.is_dir() and not p.name.startswith(".")]


class FolderPicker(ModalScreen[Path | None]):
    """A folder tree from ``start``; "Up one folder" (or backspace) shows the folder above it, so that a
    checkpoint outside the launch folder can be reached."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("backspace", "up", "Up one folder")]

    def __init__(self, start: Path) -> None:
        super().__init__()
        self.start = Path(start).absolute()
        self.chosen: Path = self.start

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Choose a folder: enter opens it, backspace goes up; then Use this folder.")
            yield AsciiDirectoryTree(self.start, id="tree")
            yield Static(_escape(self.start), id="picked")
            with Horizontal(classes="buttons"):
                yield Button("Up one folder", id="up")
                yield Button("Use this folder", variant="primary", id="use")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#tree").focus()

    def _pick(self, path: Path) -> None:
        self.chosen = Path(path)
        self.query_one("#picked", Static).update(_escape(self.chosen))

    def on_directory_tree_directory_selected(self, event: DirectoryTree.DirectorySelected) -> None:
        self._pick(event.path)

    def action_up(self) -> None:
        tree = self.query_one("#tree", AsciiDirectoryTree)
        top = Path(tree.path).absolute()
        if top.parent != top:  # not at / already
            tree.path = top.parent
            self._pick(top.parent)
            tree.focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "up":
            self.action_up()
            return
        self.dismiss(self.chosen if event.button.id == "use" else None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class Confirm(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"), Binding("escape", "answer(False)", "No")]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No") -> None:
        super().__init__()
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question)
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button(self.no, variant="primary", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "close", "Close"), Binding("f1", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            with VerticalScroll():
                yield Markdown(HELP)
            with Horizontal(classes="buttons"):
                yield Button("Close", variant="primary", id="close")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)


class CleanupDialog(ModalScreen[list | None]):
    """The items a verified merge made unnecessary, one row each: a tick with its size, its whole path(s)
    (wrapped, never cut) and why it can go. Returns the chosen ones (None: cancelled) after a last
    confirmation that names the total and the paths."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, plan) -> None:
        super().__init__()
        self.plan = plan

    def compose(self) -> ComposeResult:
        from textual.widgets import Checkbox

        from tui_merger.core.options import human_bytes

        with Vertical(classes="dialog wide"):
            yield Static(f"Free space in [b]{_escape(self.plan.root)}[/b]: tick what to delete.", id="cleanup-title")
            with VerticalScroll(id="items"):
                for n, item in enumerate(self.plan.items):
                    with Horizontal(classes="cleanup-item"):
                        yield Checkbox(f"{human_bytes(item.size):>9}", item.selected_by_default, id=f"item-{n}")
                        yield Static(_item_text(item), classes="item-text")
            yield Static(id="cleanup-total")
            if self.plan.protected:
                yield Static(
                    f"{len(self.plan.protected)} item(s) are protected and never deleted (merged models, and what "
                    "an unverified merge read).",
                    classes="dim",
                )
            with Horizontal(classes="buttons"):
                yield Button("Delete selected...", variant="error", id="delete")
                yield Button("Cancel", variant="primary", id="cancel")

    def on_mount(self) -> None:
        self._total()
        self.query_one("#item-0").focus()

    def chosen(self) -> list:
        from textual.widgets import Checkbox

        return [item for n, item in enumerate(self.plan.items) if self.query_one(f"#item-{n}", Checkbox).value]

    def _total(self) -> None:
        from tui_merger.core.options import human_bytes

        chosen = self.chosen()
        self.query_one("#cleanup-total", Static).update(
            f"Selected: {len(chosen)} of {len(self.plan.items)}, {human_bytes(sum(i.size for i in chosen))}."
        )
        self.query_one("#delete", Button).disabled = not chosen

    def on_checkbox_changed(self) -> None:
        self._total()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        from tui_merger.core.options import human_bytes

        if event.button.id != "delete":
            self.dismiss(None)
            return
        chosen = self.chosen()
        total = human_bytes(sum(i.size for i in chosen))
        paths = [p for i in chosen for p in i.paths]
        listed = "\n".join(f"  {_escape(p)}" for p in paths[:6]) + (f"\n  ... and {len(paths) - 6} more" if len(paths) > 6 else "")
        question = f"Delete {len(chosen)} item(s), [b]{total}[/b], for good? This cannot be undone.\n{listed}"

        def answer(yes: bool | None) -> None:
            if yes:
                self.dismiss(chosen)

        self.app.push_screen(Confirm(question, f"Delete {total}", "Keep them"), answer)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _escape(text) -> str:
    return str(text).replace("[", r"\[")


def _item_text(item) -> str:
    """A cleanup item's whole path(s), up to three (the rest counted), then why it can go, as markup;
    each path whole on a line of its own (Textual folds it at the edge: a copy is the path)."""
    paths = [str(p) for p in item.paths] or [item.label]
    lines = [_escape(p) for p in paths[:3]]
    if len(paths) > 3:
        lines.append(f"... and {len(paths) - 3} more ({_escape(item.label)})")
    return "\n".join(lines) + f"\n[dim]{_escape(item.reason)}[/dim]"


class UploadDialog(ModalScreen[tuple | None]):
    """Asks the repo id, the visibility and, when this machine is not logged in to the Hub, a token
    (saved with huggingface_hub's login, as `hf auth login` saves it); returns (repo_id, private, token or
    None) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, suggested: str) -> None:
        super().__init__()
        self.suggested = suggested

    def compose(self) -> ComposeResult:
        from huggingface_hub import constants, get_token
        from textual.widgets import Checkbox

        where = f"{constants.ENDPOINT}/settings/tokens"
        if get_token():
            login = "Logged in to the Hub on this machine. Another account: paste its token."
        else:
            login = f"Not logged in: paste a write token from {where}; it is saved, as `hf auth login` does."
        with Vertical(classes="dialog"):
            yield Static("Upload to the Hugging Face Hub. Repo id (ORG/NAME, or NAME for your account):")
            yield Input(self.suggested, id="repo")
            yield Checkbox("Public (default: private)", id="public")
            yield Static(_escape(login), id="login-note")
            yield Input(placeholder="hf_... (leave empty to use the saved login)", password=True, id="token")
            with Horizontal(classes="buttons"):
                yield Button("Upload", variant="primary", id="upload")
                yield Button("Cancel", id="cancel")

    def _answer(self) -> None:
        from textual.widgets import Checkbox

        repo = self.query_one("#repo", Input).value.strip()
        if not repo:
            self.query_one("#repo", Input).focus()
            return
        token = self.query_one("#token", Input).value.strip() or None
        self.dismiss((repo, not self.query_one("#public", Checkbox).value, token))

    def on_input_submitted(self) -> None:
        self._answer()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "upload":
            self._answer()
            return
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class GgufDialog(ModalScreen[tuple | None]):
    """"Run it locally": asks the GGUF type (Q4_K_M preselected) and file, shows the file's size and about
    how long writing it takes before anything is written; after a peft LoRA merge (``lora``: the base and
    adapter folders), also offers the adapter as a GGUF LoRA on the base's GGUF of that type and says what
    that writes. Returns (type, path, the LoRA's run_locally.LoraPlan or None) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    LORA_LABEL = "Also the adapter as a GGUF LoRA (Ollama ADAPTER / --lora)"

    def __init__(self, folder: Path, lora: tuple[Path, Path] | None = None) -> None:
        super().__init__()
        self.folder = folder
        self.lora = lora
        self.lora_plan = None  # run_locally.LoraPlan for the chosen type, once planned

    def compose(self) -> ComposeResult:
        from textual.widgets import Checkbox, Select

        from tui_merger.core.ship.gguf import default_out
        from tui_merger.core.ship.run_locally import LOCAL_TYPE_WORDS, RUN_LOCALLY_TYPE

        # a scroll (not focusable itself: tab goes from the type on) for a small screen once the LoRA is said
        with VerticalScroll(classes="dialog", id="gguf-dialog", can_focus=False):
            yield Label("Run it locally: a GGUF for llama.cpp, Ollama, LM Studio. Type:")
            yield Select(LOCAL_TYPE_WORDS, value=RUN_LOCALLY_TYPE, allow_blank=False, id="gguf-type")
            yield Static(id="gguf-estimate")
            yield Label("File (in the model folder, an upload of the folder includes it):")
            yield Input(str(default_out(self.folder, RUN_LOCALLY_TYPE)), id="gguf-out")
            if self.lora is not None:
                yield Checkbox(self.LORA_LABEL, False, id="gguf-lora")
                lora_estimate = Static(id="lora-estimate")
                lora_estimate.display = False  # said when ticked
                yield lora_estimate
            with Horizontal(classes="buttons"):
                yield Button("Make the GGUF", variant="primary", id="make")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        from tui_merger.core.ship.run_locally import RUN_LOCALLY_TYPE
        from tui_merger.tui.steps.common import show_end

        show_end(self.query_one("#gguf-out", Input))  # the file's name, not only its folder's start
        self.call_after_refresh(self._estimate, RUN_LOCALLY_TYPE)  # the dialog first, then the plan's numbers

    def _estimate(self, type_: str) -> None:
        """Size and time before writing (the plan reads headers only: quick even for a large model)."""
        from tui_merger.core.errors import MergeError
        from tui_merger.core.options import human_bytes
        from tui_merger.core.ship.run_locally import estimate, human_seconds
        from tui_merger.tui.steps.common import escape

        shown = self.query_one("#gguf-estimate", Static)
        try:
            e = estimate(self.folder, type_)
        except MergeError as err:
            shown.update(f"[b red]Cannot be made:[/] {escape(err)}")
            self.query_one("#make", Button).disabled = True
            return
        self.query_one("#make", Button).disabled = False
        mmproj = (f" (with the vision tower's mmproj file beside it, about {human_bytes(e.mmproj_size)}, checked on an "
                  "image)") if e.mmproj_size else ""
        shown.update(f"About {human_bytes(e.size)}{mmproj}, about {human_seconds(e.seconds)} to write (at the speed measured "
                     "on a 2-core machine), then checked against the model, with an Ollama Modelfile beside it.")
        if self.lora is not None:
            self._lora_estimate(type_)

    def _lora_estimate(self, type_: str) -> None:
        """What the GGUF LoRA writes for this type: the LoRA beside the adapter, the base's GGUF (or the one
        already there), sizes and time, and whether llama.cpp is here to check the pair."""
        from textual.widgets import Checkbox

        from tui_merger.core.errors import MergeError
        from tui_merger.core.options import human_bytes
        from tui_merger.core.ship.gguf_check import llama_cpp_version
        from tui_merger.core.ship.run_locally import human_seconds, plan_lora
        from tui_merger.tui.steps.common import escape

        shown = self.query_one("#lora-estimate", Static)
        shown.display = self.query_one("#gguf-lora", Checkbox).value
        self.lora_plan = None
        try:
            plan = plan_lora(*self.lora, type_)
        except MergeError as err:
            shown.update(f"[b red]The GGUF LoRA cannot be made:[/] {escape(err)}")
            return
        self.lora_plan = plan
        replacing = ", replacing the one there" if plan.lora_exists else ""
        if plan.base is None:
            base = f"{escape(plan.base_gguf)} (already there: used as it is)"
        else:
            base = (f"{escape(plan.base_gguf)} (about {human_bytes(plan.base.size)}, written first and checked "
                    "against the base)")
        if llama_cpp_version() is not None:
            check = "then llama.cpp runs the base's GGUF with the LoRA against peft on the base with the adapter"
        else:
            check = "the LoRA will not be checked: only llama.cpp applies a GGUF LoRA, and llama-cpp-python is not installed here"
        shown.update(
            f"The LoRA: {escape(plan.lora_path)} (about {human_bytes(plan.lora_size)}, F32{replacing}), applied to the "
            f"base's GGUF {base}; about {human_seconds(plan.seconds)} to write {'it' if plan.base is None else 'both'}; {check}; an Ollama "
            "Modelfile (FROM the base's GGUF, ADAPTER the LoRA) beside the LoRA."
        )

    def on_checkbox_changed(self, event) -> None:
        event.stop()
        shown = self.query_one("#lora-estimate", Static)
        shown.display = event.value
        if event.value:  # what it writes and the button in sight (the dialog scrolls on a small screen)
            # (not immediate: Textual scrolls after the layout the shown text causes, to the new end)
            self.query_one(".dialog", VerticalScroll).scroll_end(animate=False, immediate=False, force=True)

    def on_select_changed(self, event) -> None:
        from tui_merger.core.ship.gguf import TYPES, default_out
        from tui_merger.tui.steps.common import show_end

        out = self.query_one("#gguf-out", Input)
        suggested = {str(default_out(self.folder, t)) for t in TYPES}
        if out.value in suggested:  # still the suggestion: follow the type
            out.value = str(default_out(self.folder, event.value))
            show_end(out)
        self._estimate(event.value)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        from textual.widgets import Checkbox, Select

        if event.button.id == "make":
            out = self.query_one("#gguf-out", Input).value.strip()
            lora = None
            if self.lora is not None and self.query_one("#gguf-lora", Checkbox).value:
                lora = self.lora_plan
                if lora is None:  # its sentence is on screen: the box stays ticked, nothing is written
                    return
            self.dismiss((self.query_one("#gguf-type", Select).value, Path(out).expanduser() if out else None, lora))
            return
        self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
