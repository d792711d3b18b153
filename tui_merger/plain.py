"""The plain flow: the wizard's five steps (Find, Review, Merge, Verify, Finish) as questions, for
terminals where a full-screen app cannot run.

Questions go through a small ask layer with two implementations: questionary on a terminal, and numbered
menus read line by line on a dumb one (TERM=dumb, or an encoding other than UTF-8), where questionary
would still send escape codes. Everything else is the core's work; this module only asks and prints.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
from pathlib import Path

from tui_merger.cli.common import VERIFY_FAILED, print_report
from tui_merger.console import PlainProgress
from tui_merger.core.plan.choices import (alpha_default, alpha_why, default_out_folder, free_output, needs_alpha,
                                          options_for, parse_more_adapters, proposed, why_not_mergeable)
from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.events import Notice
from tui_merger.core.formats.scan import scan, shown
from tui_merger.core.options import MergeOptions, human_bytes, parse_size, parse_weight
from tui_merger.core.plan.preflight import ERROR, WARNING, describe, make_plan, output_refusal

STEPS = ("Find", "Review", "Merge", "Verify", "Finish")
TRY_TOKENS = 64  # the longest answer of "Try the merged model with a prompt?"
TYPE_PATH = "type a path"
DTYPES = (("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("as the base", None))
TOKENIZER_FROM = (
    ("auto (the adapter's when it has one, else the base's)", "auto"),
    ("base", "base"),
    ("adapter", "adapter"),
)


# -- lines that fit the terminal ---------------------------------------------------------------------


def columns() -> int:
    """The terminal's width (COLUMNS when set), one column left free: a terminal that wraps at the
    last column leaves an empty line after a line exactly as wide."""
    import shutil

    return max(shutil.get_terminal_size((80, 24)).columns - 1, 20)


def wrap_line(line: str, width: int) -> list[str]:
    """``line`` broken between words to ``width`` (a terminal breaks it anywhere: "abo / ut 1 s"); the
    continuation lines are indented under the text after the line's label ("  verify     about ...")
    or its own indent. A word longer than the width (a long path) stays whole."""
    import re
    import textwrap

    if len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    label = re.match(r" *\d+\) (?:\[.\] )?", line) or re.match(r" *[^ ]+(?: [^ ]+)*? {2,}(?=[^ ])", line[:width])
    hang = len(label.group(0)) if label and len(label.group(0)) <= width // 2 else indent + 2
    return textwrap.wrap(line, width, subsequent_indent=" " * hang, break_long_words=False,
                         break_on_hyphens=False, drop_whitespace=True) or [line]


def wrap_title(title: str, width: int, indent: int = 4) -> str:
    """A menu line that fits: continuation lines indented under the choice (questionary and the dumb
    menus cut or break a line wider than the terminal)."""
    lines = wrap_line(title, width)
    return ("\n" + " " * indent).join([lines[0]] + [line.strip() for line in lines[1:]])


class WrappedStream:
    """A text stream whose whole lines are broken between words to the terminal's width when it is a
    terminal (a file or a pipe gets them as they are). A line still being written (a question waiting
    for its answer) goes out when flushed, its answer to be typed after its last line."""

    def __init__(self, stream) -> None:
        self.stream = stream
        try:
            self.wrap = stream.isatty()
        except (AttributeError, ValueError):
            self.wrap = False
        self._partial = ""

    def write(self, text: str) -> int:
        if not self.wrap:
            return self.stream.write(text)
        *lines, self._partial = (self._partial + text).split("\n")
        if lines:
            width = columns()
            self.stream.write("".join("\n".join(wrap_line(line, width)) + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._partial:  # a question: broken like the rest, the answer typed after its last line
            text = "\n".join(wrap_line(self._partial, columns())) if self.wrap else self._partial
            self.stream.write(text + (" " if self._partial.endswith(" ") and not text.endswith(" ") else ""))
            self._partial = ""
        self.stream.flush()

    def isatty(self) -> bool:
        return self.wrap

    def __getattr__(self, name):
        return getattr(self.stream, name)


# -- the ask layer -----------------------------------------------------------------------------------
# select(message, [(title, value)], default=index) -> value; text(message, default, validate) -> str,
# where validate(text) returns None or the sentence saying what is wrong; confirm(message, default) ->
# bool; checkbox(message, [(title, value, checked)]) -> [value]; secret(message) -> str, not shown as
# typed (a token). End of input raises EOFError.


class QuestionaryAsk:
    """Questions on a terminal. ``input``/``output``: prompt_toolkit's (tests pass a pipe)."""

    def __init__(self, input=None, output=None) -> None:
        self.kw = {k: v for k, v in (("input", input), ("output", output)) if v is not None}

    def select(self, message: str, choices: list, default: int = 0):
        import questionary

        items = [questionary.Choice(wrap_title(title, columns() - 3), value=i) for i, (title, _) in enumerate(choices)]
        picked = questionary.select(message, choices=items, default=items[default], **self.kw).unsafe_ask()
        return choices[picked][1]

    def text(self, message: str, default: str = "", validate=None) -> str:
        import questionary

        check = (lambda s: validate(s.strip()) or True) if validate else None
        answer = questionary.text(message, default=default, validate=check, validate_while_typing=False, **self.kw)
        return answer.unsafe_ask().strip()

    def confirm(self, message: str, default: bool = False) -> bool:
        import questionary

        return questionary.confirm(message, default=default, **self.kw).unsafe_ask()

    def checkbox(self, message: str, choices: list) -> list:
        import questionary

        items = [questionary.Choice(wrap_title(title, columns() - 5, 6), value=i, checked=on)
                 for i, (title, _, on) in enumerate(choices)]
        return [choices[i][1] for i in questionary.checkbox(message, choices=items, **self.kw).unsafe_ask()]

    def secret(self, message: str) -> str:
        import questionary

        return questionary.password(message, **self.kw).unsafe_ask().strip()


class DumbAsk:
    """Numbered menus and plain lines, for terminals that cannot take escape codes."""

    def __init__(self, stdin=None, out=None) -> None:
        self.stdin = stdin
        self.out = out

    def _line(self, prompt: str) -> str:
        print(prompt, end="", file=self.out, flush=True)
        stdin = self.stdin or sys.stdin
        line = stdin.readline()
        if not line:
            raise EOFError
        if not stdin.isatty():  # no terminal echoes the answer: show it, so that the transcript reads
            print(line.rstrip("\n"), file=self.out)
        return line.strip()

    def _menu(self, message: str, titles: list[str]) -> None:
        print(message, file=self.out)
        for i, title in enumerate(titles, 1):
            number = f"  {i}) "
            print(number + title.replace("\n", "\n" + " " * len(number)), file=self.out)

    def select(self, message: str, choices: list, default: int = 0):
        self._menu(message, [title for title, _ in choices])
        while True:
            answer = self._line(f"Number [{default + 1}]: ") or str(default + 1)
            if answer.isdigit() and 1 <= int(answer) <= len(choices):
                return choices[int(answer) - 1][1]
            print(f"Type a number from 1 to {len(choices)}.", file=self.out)

    def text(self, message: str, default: str = "", validate=None) -> str:
        while True:
            answer = self._line(f"{message} [{default}] " if default else f"{message} ") or default
            problem = validate(answer) if validate else None
            if problem is None:
                return answer
            print(problem, file=self.out)

    def confirm(self, message: str, default: bool = False) -> bool:
        while True:
            answer = self._line(f"{message} ({'Y/n' if default else 'y/N'}) ").lower()
            if answer in ("", "y", "yes", "n", "no"):
                return default if not answer else answer.startswith("y")
            print("Answer y or n.", file=self.out)

    def secret(self, message: str) -> str:
        stdin = self.stdin or sys.stdin
        if stdin.isatty():  # typed without echo
            import getpass

            return getpass.getpass(f"{message} ", stream=self.out).strip()
        print(f"{message} ", end="", file=self.out, flush=True)
        line = stdin.readline()
        if not line:
            raise EOFError
        print("(hidden)" if line.strip() else "", file=self.out)  # the transcript never shows a token
        return line.strip()

    def checkbox(self, message: str, choices: list) -> list:
        self._menu(message, [f"[{'x' if on else ' '}] {title}" for title, _, on in choices])
        marked = " ".join(str(i) for i, (_, _, on) in enumerate(choices, 1) if on) or "none"
        while True:
            answer = self._line(f"Numbers separated by spaces, or none [{marked}]: ") or marked
            numbers = answer.replace(",", " ").split()
            if answer.lower() == "none":
                return []
            if all(n.isdigit() and 1 <= int(n) <= len(choices) for n in numbers):
                return [choices[int(n) - 1][1] for n in dict.fromkeys(numbers)]
            print(f"Type numbers from 1 to {len(choices)}, or none.", file=self.out)


# -- the flow ----------------------------------------------------------------------------------------


def run_plain(path: Path, *, input=None, output=None, dumb: bool = False) -> int:
    """Find, review, merge, verify and finish, asking on the terminal; returns the exit code.

    ``dumb``: numbered menus read line by line (``input``/``output``: text streams, default stdin and
    stdout) instead of questionary (``input``/``output``: prompt_toolkit's; messages go to stdout).
    Exit codes: 0 done or quit, 1 the input ended or the user quit after a failed merge, 4 the model is
    not verified, 130 Ctrl-C at a question.
    """
    out = WrappedStream(output if dumb and output is not None else sys.stdout)
    flow = _Flow(DumbAsk(input, out) if dumb else QuestionaryAsk(input, output), out, Path(path))
    try:
        return flow.run()
    except EOFError:
        flow.say("The input ended before every question was answered, so tui-merger stopped.")
        return 1
    except KeyboardInterrupt:
        flow.say("Stopped at your request.")
        return 130


class _Flow:
    def __init__(self, ask, out, root: Path) -> None:
        self.ask = ask
        self.out = out
        self.root = root
        self.candidate = None
        self.options: MergeOptions | None = None
        self.alpha_asked = False  # the checkpoint records no lora_alpha: Review offers to change the answer
        self.alpha_default: float | None = None  # what an empty answer means (peft's 8; None: one is needed)
        self.alpha_why = ""  # why it is asked: none recorded, or a recorded 0

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def step(self, n: int) -> None:
        self.say()
        self.say(f"Step {n} of {len(STEPS)}: {STEPS[n - 1]}")

    def run(self) -> int:
        while True:
            self.step(1)
            self.candidate = self.find()
            if self.candidate is None:
                return 0
            self.step(2)
            self.options = self.setup(self.candidate)
            if self.options is None:
                continue
            while (choice := self.review()) == "start":
                result = self.merge()
                if result is not None:
                    report = self.verify(result)
                    if report is not None and report.passed:
                        self.try_it(Path(result.out))
                    return self.finish(result, report)
                if self.ask.select("What now?", [("Back to Review", "review"), ("Quit", "quit")]) == "quit":
                    return 1
                self.step(2)
            if choice == "quit":
                return 0

    # -- 1. Find ------------------------------------------------------------------------------------
    def find(self):
        """The checkpoint to merge, picked from those under the root; None to quit."""
        while True:
            candidates = self.look(self.root)
            choices = [(self.label(c), c) for c in candidates] + [("Type a path...", TYPE_PATH), ("Quit", None)]
            picked = self.ask.select("Which checkpoint do you want to merge?", choices)
            if picked is not TYPE_PATH:
                return picked
            typed = Path(self.ask.text("Path to a checkpoint, or a folder holding some:", validate=_check_path))
            self.root = typed.expanduser().absolute()
            found = scan(self.root).candidates
            if len(found) == 1:
                self.say(f"Found {self.label(found[0])}.")
                return found[0]

    def look(self, root: Path) -> list:
        try:
            result = scan(root)
        except MergeError as err:
            self.say(str(err))
            return []
        for problem in result.problems:
            self.say(f"  {shown(problem.path)} {problem.message}")
        if not result.candidates:
            self.say(f"No checkpoints found in {shown(root)}; type the path of one, or quit.")
            return []
        n = len(result.candidates)
        self.say(f"Found {n} checkpoint{'s' * (n != 1)} in {shown(root)}.")
        ordered = sorted(result.candidates, key=lambda c: (why_not_mergeable(c) is not None, -_mtime(c)))
        found = proposed(result.candidates)
        if found is not None:
            c, reason = found
            ordered.remove(c)
            ordered.insert(0, c)
            if n > 1:
                self.say(f"Proposed first: {self.label(c, root)}, {reason}.")
        return ordered

    def label(self, c, root: Path | None = None) -> str:
        rel = os.path.relpath(c.path, root or self.root)
        parts = [c.kind, shown(c.path) if rel == "." or rel.startswith("..") else shown(rel)]
        if c.step is not None:
            parts.append(f"step {c.step}")
        if c.lora is not None:
            alpha = c.lora["alpha"]
            parts.append(f"r={c.lora['r'] if c.lora['r'] is not None else '?'} alpha={'?' if alpha is None else alpha}")
        if c.latest:
            parts.append("(latest)")
        if c.best:
            parts.append("(best)")
        return "  ".join(parts)

    # -- 2. Review ----------------------------------------------------------------------------------
    def setup(self, c) -> MergeOptions | None:
        """Options for the picked checkpoint (asking what it does not say); None when it cannot be merged."""
        self.say(f"{c.kind} at {shown(c.path)}")
        for note in c.notes:
            self.say(f"  note: {_in_flow(note)}")
        problem = why_not_mergeable(c)
        if problem:
            self.say(f"{problem} Pick another one.")
            return None
        base = None
        if c.needs_base:
            if c.base_resolves in ("path", "hf-cache"):
                base = Path(c.base_path)
                self.say(f"Base model: {shown(base)} (named by the checkpoint).")
            else:
                base = self.ask_base(self.propose_base(c))
        self.alpha_default = alpha_default(c)
        self.alpha_asked = needs_alpha(c)
        self.alpha_why = alpha_why(c)
        options = options_for(c, base=base, lora_alpha=self.ask_alpha() if needs_alpha(c) else None)
        folder, where = default_out_folder(c)
        self.say(f"The merged model goes {where}; type another folder if you like.")
        default = free_output(folder / make_plan(options).suggested_out)
        out = self.ask.text("Output folder:", default=str(default), validate=_not_empty)
        return dataclasses.replace(options, out=Path(out).expanduser().absolute())

    def propose_base(self, c) -> Path | None:
        """The model here (or in the Hugging Face cache) that fits the adapter best, said with why; the
        default answer of the base question."""
        from tui_merger.core.plan.choices import base_candidates, models_found

        try:
            found = scan(self.root).candidates
        except MergeError:
            found = []
        proposals = base_candidates(c.path, models_found(found))
        if not proposals:
            return None
        best, why = proposals[0]
        others = f" ({len(proposals) - 1} more fit: {', '.join(shown(p) for p, _ in proposals[1:4])})" if len(proposals) > 1 else ""
        self.say(f"Proposed base model: {shown(best)}: {why}{others}. Enter takes it.")
        return best

    def ask_base(self, now: Path | None = None) -> Path:
        answer = self.ask.text(
            "Base model folder (the model the adapter was trained on):",
            default=str(now or ""),
            validate=_check_base,
        )
        return Path(answer).expanduser().absolute()

    def ask_alpha(self, now: float | None = None) -> float | None:
        """The lora_alpha training used; None (an empty answer) where the merge has a default (peft's 8)."""
        default = self.alpha_default
        self.say(f"lora_alpha: {self.alpha_why}; look up the value used in the training config.")
        if default is None:
            return float(self.ask.text("lora_alpha used in training:", default=f"{now:g}" if now else "", validate=_check_alpha))
        answer = self.ask.text(
            f"lora_alpha used in training (empty: {default:g}, peft's default):",
            default=f"{now:g}" if now else "", validate=lambda text: None if not text.strip() else _check_alpha(text),
        )
        return float(answer) if answer.strip() else None

    def review(self) -> str:
        """Show the plan and its findings until the user starts ("start"), picks again ("find") or quits."""
        plan = self.show_plan()
        while True:
            question = (
                f"{len(plan.of(ERROR))} problem(s) stop this merge; what do you want to change?"
                if plan.blocked else "Start the merge?"
            )
            choice = self.ask.select(question, self.review_menu(plan))
            if choice == "start":
                warnings = plan.of(WARNING)
                if not warnings or self.ask.confirm(
                    f"Merge despite the {len(warnings)} warning(s) shown above?", default=False
                ):
                    return "start"
            elif choice in ("find", "quit"):
                return choice
            else:
                before, self.options = self.options, dataclasses.replace(self.options, **choice())
                new = make_plan(self.options)
                refusal = output_refusal(new) if self.options.output_quantization != before.output_quantization else None
                if refusal is not None:  # the engine cannot write that format for this base: keep the one before
                    self.say(f"  {refusal}")
                    self.options = before
                    self.say(f"The output stays {_format_words(plan, before.output_quantization)}.")
                    continue
                plan = self.show_plan(new)

    def show_plan(self, plan=None):
        plan = plan or make_plan(self.options)
        self.say("The plan:")
        for line in describe(plan):
            self.say(_in_flow(line))
        for f in plan.findings:
            self.say(f"  {f.severity.upper():7} {_in_flow(f.message)}")
            if f.fix:
                self.say(f"          fix: {f.fix}")
        if not plan.findings:
            self.say("  Every check passed.")
        return plan

    def review_menu(self, plan) -> list:
        """(title, value): "start", "find", "quit", or a function returning the options to change."""
        o = self.options
        dtype = next(name for name, value in DTYPES if value == o.dtype)
        menu = [] if plan.blocked else [("Start the merge", "start")]
        menu.append((f"Change the output folder (now {shown(o.out)})", self.edit_out))
        if _holds_files(o.out) and not o.overwrite:
            menu.append(("Replace the existing output folder once the new model is complete", lambda: {"overwrite": True}))
        if o.base is not None:
            menu.append((f"Change the base model (now {shown(o.base)})", lambda: {"base": self.ask_base(o.base)}))
        if o.lora_alpha is not None or self.alpha_asked:
            now = f"{o.lora_alpha:g}" if o.lora_alpha is not None else f"{self.alpha_default:g}, peft's default"
            menu.append((f"Change lora_alpha (now {now})", lambda: {"lora_alpha": self.ask_alpha(o.lora_alpha)}))
        if o.adapter is not None and o.checkpoint is None:
            now = ", ".join(f"{p.name} x {w:g}" for p, w in o.adapter_weights())
            menu.append((f"Weight this adapter or blend in others (now {now})", self.edit_weights))
        menu += [
            (f"Change the dtype (now {dtype})", self.edit_dtype),
        ]
        if len(plan.output_choices) > 1:  # the question only where there is a choice to make
            words = _format_words(plan, o.output_quantization)
            menu.append((f"Change the output format (now {words})", lambda: self.edit_format(plan)))
        menu += [
            (f"Change the shard size (now {human_bytes(o.shard_size)})", self.edit_shard_size),
            (f"Change where the tokenizer comes from (now {o.tokenizer_from})", self.edit_tokenizer),
            ("Pick another checkpoint", "find"),
            ("Quit", "quit"),
        ]
        return menu

    def edit_weights(self) -> dict:
        parts = self.options.adapter_weights()
        first, weight = parts[0]
        answer = self.ask.text(f"Weight of {first.name} (1 = as trained):", default=f"{weight:g}", validate=_check_weight)
        more = self.ask.text(
            "Other adapters to blend in, as PATH:WEIGHT separated by ; (empty: none):",
            default="; ".join(f"{p}:{w:g}" for p, w in parts[1:]), validate=_check_more,
        )
        return {"adapter": None, "adapters": [(first, float(answer)), *parse_more_adapters(more)]}

    def edit_out(self) -> dict:
        answer = self.ask.text("Output folder:", default=str(self.options.out), validate=_not_empty)
        return {"out": Path(answer).expanduser().absolute(), "overwrite": False}

    def edit_dtype(self) -> dict:
        now = next(i for i, (_, value) in enumerate(DTYPES) if value == self.options.dtype)
        return {"dtype": self.ask.select("Output dtype:", DTYPES, default=now)}

    def edit_format(self, plan) -> dict:
        """The output formats the plan offers, default first (a plain model; the base's own format or FP8
        blocks for serving); which one the engine can write is its own to say."""
        choices = plan.output_choices
        now = next((i for i, (_, value) in enumerate(choices) if value == self.options.output_quantization), 0)
        return {"output_quantization": self.ask.select("Write the merged model as:", choices, default=now)}

    def edit_shard_size(self) -> dict:
        answer = self.ask.text(
            "Largest shard (e.g. 5GB, 2GiB):", default=human_bytes(self.options.shard_size).replace(".00 ", ""),
            validate=_check_size,
        )
        return {"shard_size": parse_size(answer)}

    def edit_tokenizer(self) -> dict:
        now = next(i for i, (_, value) in enumerate(TOKENIZER_FROM) if value == self.options.tokenizer_from)
        return {"tokenizer_from": self.ask.select("Take the tokenizer from:", TOKENIZER_FROM, default=now)}

    # -- 3. Merge and 4. Verify ---------------------------------------------------------------------
    def merge(self):
        """The MergeResult, or None when the merge failed or was cancelled (nothing is left behind)."""
        from tui_merger.core.verify.checks import merge_prewarmed

        self.step(3)
        self.say("Press Ctrl-C to cancel.")
        try:  # verification follows: its recompute and the unmerged run start while the merge writes
            return merge_prewarmed(self.options, PlainProgress(stream=self.out, words=_in_flow))
        except KeyboardInterrupt:
            from tui_merger.core.merge.output import left_on_disk

            self.say(f"Merge cancelled: {left_on_disk(self.options.out)}; the inputs are untouched.")  # as the disk says
        except MergeCancelled as err:  # stopped with finished shards kept: the sentence says where
            self.say(str(err))
        except MergeError as err:
            self.say(f"error: {_in_flow(str(err))}")
        return None

    def verify(self, result):
        """The VerifyReport, or None when verification could not run."""
        from tui_merger.core.record.provenance import finish_merge

        self.step(4)
        try:
            _, report = finish_merge(self.options, result, on_event=PlainProgress(stream=self.out, words=_in_flow))
        except MergeError as err:
            self.say(f"error: {_in_flow(str(err))}")
            return None
        except KeyboardInterrupt:
            self.say("Verification stopped; the model is written but not verified.")
            return None
        print_report(report, stream=self.out)
        return report

    def try_it(self, out: Path) -> None:
        """Once verified, on request: one prompt, answered by the merged model and then by its base
        (core/ship/trial.py), streamed."""
        if not self.ask.confirm("Try the merged model with a prompt?", default=False):
            return
        from tui_merger.console import TrialPrinter
        from tui_merger.core.ship.trial import STOPPED, agreement, plan_trial, run_trial

        try:
            plan = plan_trial(out)
            for note in plan.notes:
                self.say(note)
            prompt = self.ask.text("Prompt:", validate=_not_empty)
            self.say("Press Ctrl-C to stop.")
            said = agreement(run_trial(plan, prompt, max_new_tokens=TRY_TOKENS, on_event=TrialPrinter(self.out)))
            if said:
                self.say(said)
        except MergeError as err:
            self.say(f"error: {err}")
        except KeyboardInterrupt:
            self.say(STOPPED)

    # -- 5. Finish ----------------------------------------------------------------------------------
    def finish(self, result, report) -> int:
        from tui_merger.cli.common import print_result

        self.step(5)
        print_result(result, stream=self.out)
        sizes = [(name, _size(Path(result.out) / name)) for name in result.files]
        self.say(f"  {len(sizes)} files, {human_bytes(sum(s for _, s in sizes))} in all:")
        for name, size in sizes[:12]:
            self.say(f"  {human_bytes(size):>10}  {name}")
        if len(sizes) > 12:
            self.say(f"  ... and {len(sizes) - 12} more")
        if report is None or not report.passed:
            self.say(
                f"The model is not verified, so cleanup and upload are not offered; run "
                f"`tui-merger verify {shlex.quote(str(result.out))}` once the problem is fixed."
            )
            return VERIFY_FAILED
        cleanup, uploaded = self.cleanup_plan(result), False
        while True:
            menu = []
            if cleanup is not None:
                total = human_bytes(sum(i.size for i in cleanup.items))
                menu.append((f"Free space in the training folder (up to {total} can go)", "cleanup"))
            menu.append(("Run it locally: a GGUF for llama.cpp, Ollama, LM Studio (checked, with an Ollama Modelfile)", "gguf"))
            if not uploaded:
                menu.append(("Upload the model to the Hugging Face Hub", "upload"))
            menu.append(("Done", "done"))
            choice = self.ask.select("What next?", menu)
            if choice == "done":
                return 0
            if choice == "cleanup":
                cleanup = None if self.clean(cleanup) else cleanup
            elif choice == "gguf":
                uploaded = False if self.gguf(Path(result.out)) else uploaded  # a new file: upload again
            else:
                uploaded = self.upload(Path(result.out))

    def cleanup_plan(self, result):
        from tui_merger.core.ship.cleanup import find_cleanup

        training = Path(self.candidate.run or self.candidate.path)
        try:
            plan = find_cleanup(training, [Path(result.out)])
        except MergeError as err:
            self.say(f"note: {err}")
            return None
        return plan if plan.items else None

    def clean(self, plan) -> bool:
        """Let the user pick and confirm, then delete; whether anything was deleted."""
        from tui_merger.core.ship.cleanup import delete_items

        choices = [
            (f"{human_bytes(i.size):>9}  {i.kind:<13}  {i.label}  ({i.reason})", i, i.selected_by_default)
            for i in plan.items
        ]
        picked = self.ask.checkbox(f"What in {shown(plan.root)} may go?", choices)
        size = human_bytes(sum(i.size for i in picked))
        question = f"Delete {len(picked)} item(s), {size}? This cannot be undone."
        if not picked or not self.ask.confirm(question, default=False):
            self.say("Nothing was deleted.")
            return False

        def report(event) -> None:
            if event.error:
                self.say(f"  not removed: {event.error}")
            else:
                self.say(f"  removed {event.item.label} ({human_bytes(event.freed)})")

        self.say(f"Freed {human_bytes(delete_items(plan, picked, report))}.")
        return True

    def gguf(self, folder: Path) -> bool:
        """Run it locally: ask the type (Q4_K_M first) and the file, say the size and time, then write the
        GGUF, its Modelfile, and check it; whether one was written."""
        from tui_merger.core.ship.gguf import default_out
        from tui_merger.core.ship.run_locally import LOCAL_TYPE_WORDS, RUN_LOCALLY_TYPE, estimate, human_seconds, make_local

        default = next(i for i, (_, t) in enumerate(LOCAL_TYPE_WORDS) if t == RUN_LOCALLY_TYPE)
        type_ = self.ask.select("GGUF type:", LOCAL_TYPE_WORDS, default=default)
        try:
            e = estimate(folder, type_)
        except MergeError as err:
            self.say(f"error: {err}")
            return False
        mmproj = (f" (with the vision tower's mmproj file beside it, about {human_bytes(e.mmproj_size)}, checked on an "
                  "image)") if e.mmproj_size else ""
        self.say(f"About {human_bytes(e.size)}{mmproj}, about {human_seconds(e.seconds)} to write (at the speed measured on "
                 "a 2-core machine), then checked against the model.")
        where = self.ask.text("GGUF file (in the model folder, an upload of the folder includes it):",
                              default=str(default_out(folder, type_)), validate=_not_empty)
        lora_plan = self.ask_lora(type_)
        target = Path(where).expanduser()
        try:
            made = make_local(folder, type_, target, on_event=PlainProgress(stream=self.out, words=_in_flow))
        except MergeError as err:
            self.say(f"error: {_in_flow(err)}")
            if lora_plan is not None:  # asked for on its own: the merged model's GGUF does not change it
                self.gguf_lora(lora_plan)
            return False
        except KeyboardInterrupt:  # the file is written under a temporary name, removed on the way out
            self.say(f"Stopped; {target} was written but is not checked." if target.is_file() else "Stopped; no GGUF was written.")
            return False
        r, check = made.result, made.check
        where = "recorded in merge_manifest.json; an upload of the folder includes it" if r.recorded else "not recorded (no merge_manifest.json)"
        self.say(f"GGUF written: {r.path} ({r.type.upper()}, {human_bytes(r.size)}, {r.seconds:.1f} s; {where}).")
        self.say(f"Check {check.line()}")
        if r.mmproj is not None:  # a vision-language model: its vision tower beside it, with its own check
            self.say(f"Vision tower (mmproj): {r.mmproj} ({human_bytes(Path(r.mmproj).stat().st_size)}).")
            if made.mmproj_check is not None:
                self.say(f"mmproj check {made.mmproj_check.line()}")
                if made.mmproj_check.status == "failed":
                    self.say("llama.cpp does not see images through the mmproj file as the model does: do not share it.")
        self.say(f"Ollama Modelfile: {made.modelfile.path}")
        self.say("Run it:")
        for line in made.run_lines():
            self.say(f"  {line}")
        if lora_plan is not None:
            self.gguf_lora(lora_plan)
        return True

    def ask_lora(self, type_: str):
        """After a peft LoRA merge: say what the adapter as a GGUF LoRA writes (the LoRA beside the adapter,
        the base's GGUF of this type, sizes, time, whether llama.cpp can check it) and ask; its
        run_locally.LoraPlan when wanted, else None."""
        from tui_merger.core.ship.gguf_check import llama_cpp_version
        from tui_merger.core.ship.run_locally import human_seconds, lora_source, plan_lora

        source = lora_source(self.options)
        if source is None:
            return None
        try:
            plan = plan_lora(*source, type_)
        except MergeError as err:
            self.say(f"The adapter cannot also be written as a GGUF LoRA: {err}")
            return None
        replacing = ", replacing the one there" if plan.lora_exists else ""
        self.say(f"The adapter can also be written as a GGUF LoRA (for Ollama ADAPTER / llama-cli --lora): "
                 f"{plan.lora_path} (about {human_bytes(plan.lora_size)}, F32{replacing}),")
        if plan.base is None:
            self.say(f"  applied to the base's GGUF {plan.base_gguf} (already there: used as it is);")
        else:
            self.say(f"  applied to the base's GGUF {plan.base_gguf} (about {human_bytes(plan.base.size)}, written first "
                     "and checked against the base);")
        check = ("then llama.cpp runs the base's GGUF with the LoRA against peft on the base with the adapter"
                 if llama_cpp_version() is not None else
                 "the LoRA will not be checked: only llama.cpp applies a GGUF LoRA, and llama-cpp-python is not installed here")
        both = "both" if plan.base is not None else "it"
        self.say(f"  about {human_seconds(plan.seconds)} to write {both}; {check}; an Ollama Modelfile beside the LoRA.")
        return plan if self.ask.confirm("Also write the adapter as a GGUF LoRA?", default=False) else None

    def gguf_lora(self, plan) -> None:
        """Write the GGUF LoRA (run_locally.make_local_lora) and say the files, the checks and the lines to run it."""
        from tui_merger.core.ship.run_locally import make_local_lora

        try:
            made = make_local_lora(plan, on_event=PlainProgress(stream=self.out, words=_in_flow))
        except MergeError as err:
            self.say(f"No GGUF LoRA: {err}")
            return
        except KeyboardInterrupt:  # each file is written under a temporary name, removed on the way out
            done = [p for p in (plan.lora_path, plan.base_gguf) if p.is_file()]
            self.say("Stopped; " + (", ".join(map(str, done)) + " are there" if done else "no GGUF LoRA was written") + ".")
            return
        r = made.lora
        self.say(f"GGUF LoRA written: {r.path} (F32, {human_bytes(r.size)}, {r.pairs} LoRA pairs, rank "
                 f"{', '.join(map(str, r.ranks))}, alpha {r.alpha:g}).")
        if made.base is None:
            self.say(f"  On the base's GGUF {made.base_gguf} (already there: used as it is).")
        else:
            b = made.base.result
            self.say(f"  On the base's GGUF {made.base_gguf}, written now ({b.type.upper()}, {human_bytes(b.size)}, {b.seconds:.1f} s).")
            self.say(f"  Base GGUF check {made.base.check.line()}")
        if made.base_failed:
            self.say("The LoRA was not checked and no Modelfile was written: the base's GGUF does not behave like the base model.")
            return
        self.say(f"  LoRA check {made.check.line()}")
        if made.recorded:
            self.say(f"  Recorded in {made.recorded}" + (f" ({made.not_recorded})." if made.not_recorded else "."))
        else:
            self.say(f"  Not recorded: {made.not_recorded}")
        self.say(f"Ollama Modelfile: {made.modelfile.path}")
        self.say("Run it with the LoRA:")
        for line in made.run_lines():
            self.say(f"  {line}")

    def upload(self, folder: Path) -> bool:
        """Ask, plan, confirm and upload; whether the model was uploaded."""
        from tui_merger.core.ship.hub import UploadProgress, login_state, plan_upload, save_login, upload

        repo = self.ask.text("Hub repository (ORG/NAME, or NAME for your account):", validate=_not_empty)
        private = self.ask.confirm("Make it private?", default=True)
        logged_in, where = login_state()
        if logged_in:
            token = self.ask.secret("Logged in to the Hub on this machine; another account: paste its token "
                                    "(Enter: the saved login):") or None
        else:
            self.say(f"Not logged in to the Hub on this machine: paste a write token from {where} (it is "
                     "saved for next time, as `hf auth login` does).")
            token = self.ask.secret("Token (Enter: stop):") or None
            if token is None:
                self.say("Nothing was uploaded.")
                return False

        lines = PlainProgress(stream=self.out, words=_in_flow)

        def progress(event) -> None:
            if isinstance(event, UploadProgress):
                what = "already on the Hub" if event.skipped else "sent"
                self.say(f"  {event.files_done}/{event.files_total}  {what}: {event.path}")
            elif not (isinstance(event, Notice) and event.message in plan.notices):  # said before asking
                lines(event)

        try:
            plan = plan_upload(folder, repo, private=private, token=token)  # checks the token first
            if token and (problem := save_login(token)):
                self.say(f"note: {problem}")
            state = "existing repo" if plan.exists else "new repo"
            self.say(
                f"{len(plan.files)} files, {human_bytes(plan.total_bytes)}, would go to {plan.repo_id} "
                f"({'private' if plan.private else 'public'}, {state}; signed in as {plan.user})."
            )
            for text in plan.notices:
                self.say(f"note: {text}")
            if not self.ask.confirm("Upload now?", default=False):
                self.say("Nothing was uploaded.")
                return False
            result = upload(plan, on_event=progress)
        except MergeError as err:
            self.say(f"error: {err}")
            return False
        except KeyboardInterrupt:
            self.say("Upload interrupted; choose Upload again to resume where it stopped.")
            return False
        self.say(f"Uploaded: {result.commit_url}")
        return True


# -- helpers -----------------------------------------------------------------------------------------


def _format_words(plan, value) -> str:
    """An output format in the plan's words (its choices), without "(default)"."""
    words = next((w for w, v in plan.output_choices if v == value), value or "as merged")
    return words.replace(" (default)", "")


def _mtime(c) -> float:
    try:
        return os.stat(c.path).st_mtime
    except OSError:
        return 0.0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _holds_files(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def _not_empty(text: str) -> str | None:
    return None if text else "Type a value."


def _check_path(text: str) -> str | None:
    if not text:
        return "Type the path of a checkpoint or of a folder holding checkpoints."
    try:
        found = scan(Path(text).expanduser()).candidates
    except MergeError as err:
        return str(err)
    return None if found else f"Found no checkpoint in {text} or in the folders below it."


def _check_base(text: str) -> str | None:
    folder = Path(text).expanduser()
    if not text or not folder.is_dir():
        return "Type the path of a model folder."
    if not (folder / "config.json").is_file():
        return f"{text} has no config.json, so it is not a Hugging Face model folder."
    return None


def _check_weight(text: str) -> str | None:
    try:
        parse_weight(text, "this adapter")
    except MergeError as err:
        return str(err)
    return None


def _check_more(text: str) -> str | None:
    try:
        for path, _ in parse_more_adapters(text):
            if not path.exists():
                return f"{path} does not exist."
    except MergeError as err:
        return str(err)
    return None


IN_FLOW = (  # the engine's words for flags, as this flow asks them
    ("choose another --out, or pass --overwrite to replace it (only once the new file is complete)",
     "give another name to the GGUF file question (the file there is kept)"),
    ("give it with --lora-alpha", 'pick "Change lora_alpha" below'),
    ("pass --lora-alpha with the value used in training", 'pick "Change lora_alpha" below'),
    ("the merge needs --lora-alpha", "the merge needs the lora_alpha used in training"),
    ("pass --base with the", "give the folder of the"),
    ("the merge needs --base", "the merge needs the base model folder"),
    ("from --lora-alpha", "from your answer"),
)


def _in_flow(text: str) -> str:
    for flag, words in IN_FLOW:
        text = text.replace(flag, words)
    return text


def _check_alpha(text: str) -> str | None:
    try:
        ok = float(text) > 0
    except ValueError:
        ok = False
    return None if ok else "Type a number above 0, such as 16 or 32."


def _check_size(text: str) -> str | None:
    try:
        parse_size(text)
    except MergeError as err:
        return str(err)
    return None


def explain_no_terminal(path: Path) -> str:
    """What to run instead when there is no terminal to ask on: inspect, then the merge command of the
    checkpoint proposed (choices.proposed) and why, when one can be merged."""
    from tui_merger.cli.common import next_step

    given = shown(path)
    text = (
        "There is no terminal to ask questions on, so run the steps as commands: "
        f"`tui-merger inspect {shlex.quote(given)}` lists the checkpoints, then `tui-merger merge` merges one."
    )
    try:
        result = scan(path)
    except MergeError:
        return text
    mergeable = dataclasses.replace(result, candidates=[c for c in result.candidates if why_not_mergeable(c) is None])
    hint = next_step(mergeable, lambda p: shown(os.path.normpath(os.path.join(given, os.path.relpath(p, result.root)))))
    if hint is None:
        return text
    command, _, reason = hint.partition("  # ")  # the proposal's reason (choices.proposed), said after it
    return f"{text} Next: `{command}`" + (f" ({reason})." if reason else ".")
