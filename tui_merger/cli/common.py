"""What the command modules share (each command module imports only this, never another command):
terminals, the merge with its progress display, the verification report, uploads, the next step."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

VERIFY_FAILED = 4  # exit code: the model was written but does not match its inputs


def is_tty(stream) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM", "") not in ("", "dumb")
    except (AttributeError, ValueError):
        return False


def terminal() -> tuple[bool, bool]:
    """(interactive, dumb): stdin and stderr are terminals (Textual draws on stderr); the terminal
    cannot take a full-screen app or questionary's escape codes (TERM empty or dumb, not UTF-8)."""
    interactive = sys.stdin.isatty() and sys.stderr.isatty()
    encoding = (getattr(sys.stderr, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    dumb = os.environ.get("TERM", "") in ("", "dumb") or encoding != "utf8"
    return interactive, dumb


def run_with_progress(options, plain: bool = False, verify: bool = True, perplexity=None, behaviour: bool = True):
    """Merge, record the manifest, verify, with the right progress display.
    Returns (MergeResult, VerifyReport or None)."""
    from contextlib import nullcontext

    from tui_merger.console import PlainProgress, RichProgress
    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.record.provenance import finish_merge

    progress = PlainProgress() if plain or not is_tty(sys.stderr) else RichProgress()
    with progress if isinstance(progress, RichProgress) else nullcontext():
        if verify:
            from tui_merger.core.verify.checks import merge_prewarmed

            result = merge_prewarmed(options, progress, behaviour=behaviour)
        else:
            result = run_merge(options, progress)
        _, report = finish_merge(
            options, result, verify=verify, behaviour=behaviour, perplexity_text=perplexity, on_event=progress
        )
    return result, report


def print_result(result, stream=None) -> None:
    from tui_merger.core.options import human_bytes

    stream = stream or sys.stdout
    print(f"Merged model written to {result.out}", file=stream)
    print(
        f"  {result.tensors_text()}, "
        f"{human_bytes(result.bytes_written)} in {len(result.shards)} shard(s), {result.seconds:.1f} s",
        file=stream,
    )
    tok = {"adapter": "from the adapter folder", "base": "from the base model", None: "none found"}
    print(f"  tokenizer: {tok[result.tokenizer_source]}", file=stream)
    for key, value in result.config_changes.items():
        print(f"  config.json: {key} removed" if value is None else f"  config.json: {key} set to {value}", file=stream)


def preflight(options, dry_run: bool) -> bool:
    """Check everything before writing. A dry run prints the plan and every finding; a merge prints the
    warnings and stops on errors (the first as the error sentence). Returns whether the merge may go on."""
    from tui_merger.core.errors import MergeError
    from tui_merger.core.plan.preflight import ENGINE_SAYS, ERROR, describe, make_plan

    plan = make_plan(options)
    if dry_run:
        print("Merge plan (nothing is written):")
        for line in describe(plan):
            print(line)
        for f in plan.findings:
            print(f"  {f.severity.upper():7} {f.text()}")
        if not plan.findings:
            print("  every check passed")
        if plan.blocked:
            print(f"error: {len(plan.of(ERROR))} problem(s) would stop this merge.", file=sys.stderr)
        return not plan.blocked
    for f in plan.findings:
        if f.severity != ERROR and f.id not in ENGINE_SAYS:
            print(f"{f.severity}: {f.text()}", file=sys.stderr)
    errors = plan.of(ERROR)
    if errors:
        for f in errors[1:]:
            print(f"  also: {f.text()}", file=sys.stderr)
        raise MergeError(errors[0].text())
    return True


def report_verification(report) -> int:
    if report is None:
        print("  not verified (--no-verify): run tui-merger verify on the folder before shipping it")
        return 0
    print_report(report)
    return 0 if report.passed else VERIFY_FAILED


def print_report(report, stream=None) -> None:
    stream = stream or sys.stdout
    print(f"Verification of {report.out}: {'PASSED' if report.passed else 'FAILED'} ({report.seconds:.1f} s)", file=stream)
    for check in report.checks:
        print(f"  {check.status.upper():4}  {check.name}: {check.summary}", file=stream)
        for line in check.details[:10]:
            print(f"          {line}", file=stream)
        if len(check.details) > 10:
            print(f"          ... and {len(check.details) - 10} more", file=stream)
    if not report.passed:
        print(
            "  The model was written but does not match its inputs; it is kept for inspection. "
            "Do not ship it.",
            file=stream,
        )
    elif any(c.status == "skip" for c in report.checks):
        skipped = ", ".join(c.name for c in report.checks if c.status == "skip")
        print(f"  Not fully verified: the {skipped} check did not run (the reason is above).", file=stream)


def upload_after_merge(out: Path, repo_id: str, private: bool = True, on_event=None, plain: bool = False):
    """Upload a folder the merge just wrote; progress goes to ``on_event`` (default: stderr).
    Returns the UploadResult (its commit_url is what to show); raises MergeError."""
    from tui_merger.core.ship.hub import plan_upload, upload

    plan = plan_upload(out, repo_id, private=private)
    if on_event is not None:
        return upload(plan, on_event=on_event)
    return run_upload(plan, plain=plain)


def run_upload(plan, message: str | None = None, plain: bool = False):
    """Upload with a rich bar on a terminal, plain lines elsewhere; a summary line on stderr."""
    from tui_merger.core.ship.hub import upload
    from tui_merger.core.options import human_bytes

    if plain or not is_tty(sys.stderr):
        result = upload(plan, message=message, on_event=_plain_lines())
    else:
        with _rich_bar() as bar:
            result = upload(plan, message=message, on_event=bar)
    if result.changed:
        again = f"; {_files(result.files_skipped)} already on the Hub" if result.files_skipped else ""
        print(
            f"Uploaded {_files(result.files_uploaded)} ({human_bytes(result.bytes_sent)} sent{again}) to "
            f"{plan.repo_id} ({'private' if plan.private else 'public'}).",
            file=sys.stderr,
        )
    return result


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"


def print_plan(plan, stream=None) -> None:
    from tui_merger.core.options import human_bytes

    stream = stream or sys.stdout
    if plan.user is None:  # a dry run: the Hub was not asked (no token, no network needed)
        where = plan.repo_id if "/" in plan.repo_id else f"{plan.repo_id} under your account"
        print(
            f"Would upload {plan.folder} to {where} (branch {plan.revision}; a new repo is created "
            f"{'private' if plan.private else 'public'}; the Hub was not contacted: the token, the repo and "
            "what it already holds are checked by the upload itself):",
            file=stream,
        )
    else:
        state = "exists" if plan.exists else "new repo"
        print(
            f"Would upload {plan.folder} to {plan.repo_id} ({'private' if plan.private else 'public'}, {state}; "
            f"branch {plan.revision}; signed in as {plan.user}):",
            file=stream,
        )
    for f in plan.files:
        print(f"  {'LFS' if f.lfs else 'regular':8}{human_bytes(f.size):>11}  {f.path}", file=stream)
    print(f"  {_files(len(plan.files))}, {human_bytes(plan.total_bytes)}", file=stream)
    for text in plan.notices:
        print(f"note: {text}", file=stream)
    print("Dry run: nothing was written or sent.", file=stream)


def _plain_lines():
    from tui_merger.console import PlainProgress
    from tui_merger.core.ship.hub import UploadProgress
    from tui_merger.core.options import human_bytes

    class PlainUpload(PlainProgress):
        def __call__(self, event) -> None:
            if isinstance(event, UploadProgress):
                what = "already on the Hub" if event.skipped else "sent"
                self._print(
                    f"  {event.files_done}/{event.files_total}  {what}: {event.path}  "
                    f"({human_bytes(event.bytes_done)} / {human_bytes(event.bytes_total)})"
                )
            else:
                super().__call__(event)

    return PlainUpload()


def _rich_bar():
    from tui_merger.console import RichProgress
    from tui_merger.core.ship.hub import UploadProgress

    class RichUpload(RichProgress):
        bar = None  # one bar for the whole upload, across phases

        def __call__(self, event) -> None:
            if isinstance(event, UploadProgress):
                if self.bar is None:
                    self.bar = self.progress.add_task("upload", total=event.bytes_total, tensor="")
                short = event.path if len(event.path) <= 40 else "..." + event.path[-37:]
                self.progress.update(self.bar, completed=event.bytes_done, tensor=short)
            else:
                super().__call__(event)

    return RichUpload()


def next_step(result, where) -> str | None:
    """What to run for the checkpoint the front ends propose (``choices.proposed``: one rule, its reason
    after the command as a shell comment); when none can be merged, why not, for the newest
    latest-marked one (else the newest one)."""
    from tui_merger.core.formats.base import shown
    from tui_merger.core.formats.registry import format_of
    from tui_merger.core.plan.choices import proposed

    found = proposed(result.candidates)
    if found is not None:
        c, reason = found
    else:
        pool = [c for c in result.candidates if c.latest] or result.candidates
        if not pool:
            return None

        def mtime(c) -> float:
            try:
                return os.stat(c.path).st_mtime
            except OSError:
                return 0.0

        c, reason = max(pool, key=mtime), None
    path = where(c.path)
    q = shlex.quote
    base_arg = q(shown(c.base_path)) if c.base_resolves in ("path", "hf-cache") else "BASE_MODEL"
    if c.run is not None:  # beside the run's checkpoints
        out = os.path.join(where(c.run), f"merged-step-{c.step}" + ("-critic" if c.role == "critic" else ""))
    elif any(x.run is not None and os.path.realpath(x.run) == os.path.realpath(c.path) for x in result.candidates):
        out = f"{path}-merged-final"  # a run's final save, beside its checkpoint-N folders
    else:
        out = f"{path}-merged"
    text = format_of(c).next_step(c, path, base_arg, out)
    if reason and text.startswith("tui-merger ") and len(result.candidates) > 1:
        text += f"  # {reason}"
    return text
