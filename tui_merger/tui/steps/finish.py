"""Step 6, Finish: where the model is and whether it was verified; clean up the training folder, upload
to the Hub, make a GGUF file (each a worker), or quit."""

from __future__ import annotations

from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Button, ProgressBar, Static

from tui_merger.tui.steps.common import Done, EngineEvent, Step, WorkDone, escape, fold_path, in_app
from tui_merger.tui.widgets import CleanupDialog, GgufDialog, UploadDialog


def farewell(wizard) -> str | None:
    """What the terminal keeps when the app closes after a merge (None: no model was made): where the
    model is, whether it was verified, and the lines to use it: transformers, vLLM, and llama.cpp for
    each GGUF made of it (and each GGUF LoRA of its adapter, on the base's GGUF)."""
    import json
    import shlex

    from tui_merger.core.options import python_command
    from tui_merger.core.record.manifest import read_manifest

    stopped = getattr(wizard, "stopped", None)
    if stopped is not None and wizard.result is None:  # "Stop and quit": what the disk holds now
        from tui_merger.core.merge.output import left_on_disk

        return f"The merge was stopped: {left_on_disk(stopped)}; the inputs are untouched."
    if wizard.result is None and (wizard.job is None or not (Path(wizard.job.out) / "config.json").is_file()):
        return None
    out = wizard.out_path.absolute()
    manifest = read_manifest(out) or {}
    recorded = manifest.get("verification") or {}
    if wizard.result is not None and wizard.report is not None:
        verified = "verified" if wizard.report.passed else "verification FAILED: do not ship it"
    elif recorded:
        verified = "verified" if recorded.get("passed") else "verification FAILED: do not ship it"
    else:  # closed before the verification ended
        verified = f"not verified yet: run tui-merger verify {shlex.quote(str(out))}"
    code = f'from transformers import pipeline; print(pipeline("text-generation", model={json.dumps(str(out))})("Hello")[0]["generated_text"])'
    lines = [
        f"The merged model is in {out} ({verified}).",
        f"  transformers: {python_command()} -c {shlex.quote(code)}",
        f"  vLLM:         vllm serve {shlex.quote(str(out))}",
    ]
    entries = [g for g in manifest.get("gguf") or [] if isinstance(g, dict)]
    projectors = {g.get("mmproj") for g in entries if g.get("mmproj")}  # a vision tower is run with its GGUF, not alone
    for gguf in entries:
        if gguf.get("path") in projectors:
            continue
        path = Path(gguf.get("path", ""))
        path = path if path.is_absolute() else out / path
        if path.is_file():
            lines.append(f"  llama.cpp:    llama-cli -m {shlex.quote(str(path))}")
            modelfile = Path(str(gguf.get("modelfile") or ""))
            modelfile = modelfile if modelfile.is_absolute() else out / modelfile
            if gguf.get("modelfile") and modelfile.is_file():
                from tui_merger.core.ship.modelfile import ollama_model_name

                name = ollama_model_name(out.name, str(gguf.get("type", "")))
                lines.append(f"  Ollama:       ollama create {name} -f {shlex.quote(str(modelfile))}")
            mmproj = Path(str(gguf.get("mmproj") or ""))
            mmproj = mmproj if mmproj.is_absolute() else out / mmproj
            if gguf.get("mmproj") and mmproj.is_file():  # a vision-language model: llama.cpp reads images with it
                lines.append(f"  images:       llama-mtmd-cli -m {shlex.quote(str(path))} --mmproj {shlex.quote(str(mmproj))}")
    for lora in getattr(wizard, "local_loras", []):  # the adapter as a GGUF LoRA on its base's GGUF
        if lora.modelfile is not None and Path(lora.lora.path).is_file() and Path(lora.base_gguf).is_file():
            ollama, llama = lora.run_lines()
            for line in (f"  llama.cpp:    {llama}", f"  Ollama:       {ollama}"):
                if line not in lines:  # made twice (another type, the same files): said once
                    lines.append(line)
    return "\n".join(lines)


def folder_files(folder: Path) -> tuple[list[str], int]:
    """The names in the output folder as a listing shows them (a folder with a trailing /, hidden ones
    left out) and the bytes of its files, folders included."""
    names, size = [], 0
    try:
        entries = sorted(Path(folder).iterdir())
    except OSError:
        return names, size
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            names.append(entry.name + "/")
            size += sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
        else:
            names.append(entry.name)
            size += entry.stat().st_size
    return names, size


class FinishStep(Step, VerticalScroll):
    FIRST = "#quit"
    BACK = "try"

    def __init__(self, wizard, **kwargs) -> None:
        super().__init__(wizard, **kwargs)
        self.gguf_cancel = None  # the CancelToken of the GGUF being written
        self._login_problem: str | None = None  # a token typed for Upload worked but was not saved

    def compose(self) -> ComposeResult:
        yield Static(id="summary")
        with Horizontal(classes="row"):
            yield Button("Clean up...", id="cleanup")
            yield Button("Upload...", id="upload")
            yield Button("Run it locally...", id="gguf")
            yield Button("Quit", variant="primary", id="quit")
        gguf_bar = ProgressBar(show_eta=False, id="gguf-progress")
        gguf_bar.display = False  # shown while a GGUF is written
        yield gguf_bar
        yield Static(id="finish-notes")
        lora_notes = Static(id="lora-notes")  # the GGUF LoRA's outcome, when one was asked for
        lora_notes.display = False
        yield lora_notes

    def enter(self) -> None:
        from tui_merger.core.options import human_bytes
        from tui_merger.core.record.manifest import read_manifest

        wizard = self.wizard
        names, size = folder_files(wizard.out_path)  # what is there now: the model card and manifest too
        if wizard.result is not None:
            r = wizard.result
            verified = wizard.report is not None and wizard.report.passed
            details = (
                f"{r.tensors_text()}, "
                f"{human_bytes(r.bytes_written)} in {len(r.shards)} shard(s), written in {r.seconds:.1f} s.\n"
                f"Files: {escape(', '.join(names))}"
            )
        else:  # a background job: its verification as its manifest records it
            manifest = read_manifest(wizard.out_path) or {}
            verified = bool((manifest.get("verification") or {}).get("passed"))
            details = (
                f"{human_bytes(size)} in {len(names)} file(s), written by job {wizard.job.id}.\n"
                f"Files: {escape(', '.join(names))}"
            )
        verdict = "[b green]verified[/]" if verified else "[b red]NOT verified: do not ship it[/]"
        where = str(wizard.out_path)  # on a line of its own, whole: Textual folds it, a copy is the path
        self.query_one("#summary", Static).update(f"The merged model is in\n[b]{escape(where)}[/b] ({verdict}).\n{details}")
        self.query_one("#cleanup", Button).disabled = not verified
        self.query_one("#upload", Button).disabled = not verified
        self.query_one("#gguf", Button).disabled = not verified
        wizard.show("finish")

    def text_width(self) -> int:
        """The columns the step's text gets: the screen's, less the step's padding and a scrollbar."""
        return self.app.size.width - 4

    @on(Button.Pressed, "#quit")
    def _quit(self) -> None:
        self.app.exit(0)

    # -- cleanup ---------------------------------------------------------------------------------
    @on(Button.Pressed, "#cleanup")
    def _cleanup(self) -> None:
        from tui_merger.core.errors import MergeError
        from tui_merger.core.ship.cleanup import find_cleanup

        wizard = self.wizard
        if wizard.candidate is not None:
            folder = Path(wizard.candidate.run or wizard.candidate.path)
        else:  # a job followed from an earlier session
            opts = wizard.job.request["options"]
            folder = Path(opts.get("checkpoint") or opts.get("adapter"))
        notes = self.query_one("#finish-notes", Static)
        try:
            plan = find_cleanup(folder, [wizard.out_path])
        except MergeError as err:
            notes.update(escape(err))
            return
        if not plan.items:
            notes.update(f"Nothing to clean up in {escape(folder)}.")
            return

        def chosen(items) -> None:
            if items:
                wizard.running = "cleanup"
                wizard.refresh_nav()
                self._cleanup_worker(plan, items)

        self.app.push_screen(CleanupDialog(plan), chosen)

    @work(thread=True, exclusive=True, group="cleanup", exit_on_error=False)
    def _cleanup_worker(self, plan, items) -> None:
        from tui_merger.core.ship.cleanup import delete_items

        errors = []
        freed = delete_items(plan, items, lambda ev: ev.error and errors.append(ev.error))
        self.post_message(WorkDone("cleanup", Done((freed, errors))))

    def done_cleanup(self, done: Done) -> None:
        from tui_merger.core.options import human_bytes

        freed, errors = done.value
        text = f"Freed {human_bytes(freed)}."
        if errors:
            text += " Not deleted: " + "; ".join(errors[:3])
        self.query_one("#finish-notes", Static).update(escape(text))

    # -- upload ----------------------------------------------------------------------------------
    @on(Button.Pressed, "#upload")
    def _upload(self) -> None:
        wizard = self.wizard

        def chosen(answer) -> None:
            if answer:
                wizard.running = "upload"
                wizard.refresh_nav()
                self.query_one("#finish-notes", Static).update(f"Uploading to {escape(answer[0])}...")
                self._upload_worker(*answer)

        self.app.push_screen(UploadDialog(wizard.out_path.name), chosen)

    @work(thread=True, exclusive=True, group="upload", exit_on_error=False)
    def _upload_worker(self, repo_id: str, private: bool, token: str | None = None) -> None:
        from tui_merger.core.ship.hub import plan_upload, save_login, upload

        out = self.wizard.out_path
        self._login_problem = None

        def send():
            plan = plan_upload(out, repo_id, private=private, token=token)  # checks the token first
            if token:  # it works (the plan checked it): saved, so that the next upload needs none
                self._login_problem = save_login(token)
            return upload(plan, on_event=self.forward)

        self.post_outcome("upload", send)

    def done_upload(self, done: Done) -> None:
        notes = self.query_one("#finish-notes", Static)
        if done.error:
            notes.update(escape(in_app(done.error)))
            return
        saved = f"\n{escape(self._login_problem)}" if self._login_problem else ""
        notes.update(f"Uploaded: {escape(done.value.commit_url)}{saved}")

    # -- GGUF ------------------------------------------------------------------------------------
    @on(Button.Pressed, "#gguf")
    def _gguf(self) -> None:
        wizard = self.wizard
        if wizard.running == "gguf":  # the button is "Stop the GGUF" while one is written
            self.gguf_cancel.cancel()
            self.query_one("#gguf", Button).disabled = True
            return

        def chosen(answer) -> None:
            from tui_merger.core.events import CancelToken

            if answer:
                wizard.running, self.gguf_cancel = "gguf", CancelToken()
                button = self.query_one("#gguf", Button)
                button.label, button.variant = "Stop the GGUF", "error"
                for other in ("#cleanup", "#upload"):  # one thing at a time on the folder
                    self.query_one(other, Button).disabled = True
                self.query_one("#gguf-progress", ProgressBar).display = True
                self.query_one("#gguf-progress", ProgressBar).update(total=None, progress=0)
                wizard.refresh_nav()
                self._gguf_worker(*answer, self.gguf_cancel)

        self.app.push_screen(GgufDialog(wizard.out_path, lora_of(wizard)), chosen)

    @work(thread=True, exclusive=True, group="gguf", exit_on_error=False)
    def _gguf_worker(self, type_: str, out, lora_plan, cancel) -> None:
        from tui_merger.core.errors import MergeCancelled, MergeError
        from tui_merger.core.ship.run_locally import make_local, make_local_lora

        folder = self.wizard.out_path

        def make():
            try:
                made = make_local(folder, type_, out, on_event=self.forward, cancel=cancel)
            except MergeCancelled:
                raise
            except MergeError as err:  # (the file exists...): the LoRA, asked for too, is made all the same
                if lora_plan is None:
                    raise
                made = str(err)
            if lora_plan is None:
                return made, None
            try:  # the merged model's GGUF stands whatever becomes of the LoRA: both are shown
                return made, make_local_lora(lora_plan, on_event=self.forward, cancel=cancel)
            except MergeCancelled as err:
                return made, err
            except MergeError as err:
                return made, str(err)

        self.post_outcome("gguf", make, say_cancel=True)

    def on_engine_event(self, message: EngineEvent) -> None:
        from tui_merger.core.events import PhaseStarted, TensorProgress

        message.stop()
        ev = message.event
        if self.wizard.running != "gguf":
            return
        if isinstance(ev, PhaseStarted):
            self.query_one("#finish-notes", Static).update(f"[b]{ev.phase}[/b]  {escape(ev.message)}")
        elif isinstance(ev, TensorProgress):
            self.query_one("#gguf-progress", ProgressBar).update(total=max(ev.bytes_total, 1), progress=ev.bytes_done)

    def done_gguf(self, done: Done) -> None:
        from tui_merger.core.options import human_bytes

        button = self.query_one("#gguf", Button)
        button.label, button.variant, button.disabled = "Run it locally...", "default", False
        for other in ("#cleanup", "#upload"):  # the GGUF was offered for a verified model only
            self.query_one(other, Button).disabled = False
        self.query_one("#gguf-progress", ProgressBar).display = False
        notes = self.query_one("#finish-notes", Static)
        lora_notes = self.query_one("#lora-notes", Static)
        lora_notes.update("")
        lora_notes.display = False
        if done.error:
            notes.update(("[b yellow]Stopped.[/] " if done.cancelled else "[b red]No GGUF:[/] ") + escape(in_app(done.error)))
            return
        made, lora = done.value
        if lora is not None:  # asked for with the GGUF: its outcome in view (the merged GGUF's above it)
            lora_notes.update(self._lora_text(lora, self.text_width()))
            lora_notes.display = True
            notes = lora_notes
        if isinstance(made, str):  # the merged model's GGUF was refused; the LoRA asked for with it was made
            self.query_one("#finish-notes", Static).update(f"[b red]No GGUF:[/] {escape(in_app(made))}")
            self._bring_into_view(notes)
            return
        r, check = made.result, made.check
        where = "recorded in merge_manifest.json; Upload... includes it" if r.recorded else "not recorded (no merge_manifest.json)"
        width = self.text_width()
        verdict = {"passed": "[b green]PASSED[/]", "failed": "[b red]FAILED: do not share it[/]"}.get(check.status, "[b yellow]not checked[/]")
        commands = "\n".join(escape(fold_path(line, width)) for line in made.run_lines())  # each on its own lines
        self.query_one("#finish-notes", Static).update(
            f"GGUF written ({r.type.upper()}, {human_bytes(r.size)}, {r.seconds:.1f} s; {where}):\n"
            f"[b]{escape(fold_path(r.path, width))}[/b]\n"
            f"Check {verdict}: {escape(check.summary)}\n"
            + self._mmproj_text(made, width)
            + f"Ollama Modelfile beside it: {escape(made.modelfile.path.name)}. Run it with:\n{commands}"
        )
        # on a small screen the notes lie below the fold: bring them (the verdict, the commands) into view
        self._bring_into_view(notes)

    @staticmethod
    def _mmproj_text(made, width: int) -> str:
        """A vision-language model's mmproj file beside the GGUF and its own check, as the command says them
        ("" when there is none)."""
        from tui_merger.core.options import human_bytes

        mmproj = getattr(made.result, "mmproj", None)
        if mmproj is None:
            return ""
        try:
            size = f", {human_bytes(Path(mmproj).stat().st_size)}"
        except OSError:
            size = ""
        text = f"Vision tower beside it (mmproj{size}):\n[b]{escape(fold_path(mmproj, width))}[/b]\n"
        check = made.mmproj_check
        if check is not None:
            verdict = {"passed": "[b green]PASSED[/]", "failed": "[b red]FAILED: do not share it[/]"}.get(
                check.status, "[b yellow]not checked[/]")
            text += f"mmproj check {verdict}: {escape(check.summary)}\n"
        return text

    def _bring_into_view(self, notes, tries: int = 5, layout=None) -> None:
        """Scroll the step so that ``notes`` starts at its top (or the step's end), once the layout that
        its new text causes is done: a scroll before it stops at the old height, so it is tried again
        after the next refresh until the layout holds still (then the user's own scrolling is left alone)."""
        def scroll() -> None:
            now = (notes.virtual_region.y, self.max_scroll_y, notes.size.height)
            if now == layout and notes.size.height:  # laid out, and scrolled there last time: done
                return
            want = min(notes.virtual_region.y, self.max_scroll_y)
            if self.scroll_y != want:
                self.scroll_to(y=want, animate=False, immediate=True)
            if tries > 1:
                self.call_after_refresh(self._bring_into_view, notes, tries - 1, now)

        self.call_after_refresh(scroll)

    def _lora_text(self, lora, width: int) -> str:
        """The GGUF LoRA's outcome: the files, the checks (the base's GGUF, then llama.cpp with the LoRA
        against peft), where it is recorded and the lines to run it; or why there is none."""
        from tui_merger.core.errors import MergeCancelled
        from tui_merger.core.options import human_bytes

        if isinstance(lora, MergeCancelled):
            return f"[b yellow]GGUF LoRA stopped.[/] {escape(lora)}"
        if isinstance(lora, str):
            return f"[b red]No GGUF LoRA:[/] {escape(lora)}"
        self.wizard.local_loras.append(lora)  # for the farewell
        verdicts = {"passed": "[b green]PASSED[/]", "failed": "[b red]FAILED: do not share it[/]"}
        r = lora.lora
        ranks = ", ".join(map(str, r.ranks))
        lines = [
            f"GGUF LoRA written (F32, {human_bytes(r.size)}, {r.pairs} LoRA pairs, rank {ranks}, alpha {r.alpha:g}):",
            f"[b]{escape(fold_path(r.path, width))}[/b]",
        ]
        if lora.base is None:
            lines.append(f"on the base's GGUF (already there, used as it is): {escape(fold_path(lora.base_gguf, width))}")
        else:
            b = lora.base
            lines.append(f"on the base's GGUF, written now ({b.result.type.upper()}, {human_bytes(b.result.size)}, "
                         f"{b.result.seconds:.1f} s): {escape(fold_path(lora.base_gguf, width))}")
            status = verdicts.get(b.check.status, "[b yellow]not checked[/]")
            lines.append(f"Base GGUF check {status}: {escape(b.check.summary)}")
        if lora.base_failed:
            lines.append("The LoRA was not checked and no Modelfile was written: the base's GGUF does not behave like "
                         "the base model.")
            return "\n".join(lines)
        status = verdicts.get(lora.check.status, "[b yellow]not checked[/]")
        lines.append(f"LoRA check {status}: {escape(lora.check.summary)}")
        if lora.recorded:
            lines.append(f"Recorded in {escape(lora.recorded)}" + (f" ({escape(lora.not_recorded)})." if lora.not_recorded else "."))
        else:
            lines.append(f"Not recorded: {escape(lora.not_recorded)}")
        lines.append(f"Ollama Modelfile beside the LoRA: {escape(lora.modelfile.path.name)}. Run it with:")
        lines.extend(escape(fold_path(line, width)) for line in lora.run_lines())
        return "\n".join(lines)


def lora_of(wizard) -> tuple[Path, Path] | None:
    """(base, adapter) when the merge was one peft LoRA adapter on a base folder here (run_locally.lora_source),
    from the app's options or a followed job's request."""
    from tui_merger.core.ship.run_locally import lora_source

    options = wizard.options
    if options is None and wizard.job is not None:
        from tui_merger.core.options import MergeOptions

        try:
            options = MergeOptions(**wizard.job.request["options"])
        except Exception:  # noqa: BLE001 - a request of another version: the LoRA is not offered
            return None
    return lora_source(options)
