"""``tui-merger upload OUT --repo-id ORG/NAME``: push a merged model folder to the Hugging Face Hub."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser(
        "upload",
        help="upload a merged model folder to the Hugging Face Hub (private by default)",
        description="Upload a model folder to a Hub repo in one commit: private unless --public, with a model "
        "card made from merge_manifest.json when there is no README.md. Running it again after an "
        "interruption resumes. The token comes from HF_TOKEN or `hf auth login`.",
    )
    p.add_argument("folder", type=Path, help="the merged model folder")
    p.add_argument("--repo-id", "--repo_id", dest="repo_id", required=True, help="ORG/NAME on the Hub (NAME alone: your account)")
    p.add_argument("--public", action="store_true", help="create the repo public (an existing repo keeps its visibility)")
    p.add_argument("--revision", default="main", help="branch to commit to (default: %(default)s)")
    p.add_argument("--message", help="commit message (default: 'Upload FOLDER with tui-merger')")
    p.add_argument("--dry-run", action="store_true", help="check the token and list what would be uploaded; send nothing")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_upload)


def cmd_upload(args) -> int:
    from tui_merger.core.hub import plan_upload

    plan = plan_upload(args.folder, args.repo_id, private=not args.public, revision=args.revision)
    if args.dry_run:
        print_plan(plan)
        return 0
    result = run_upload(plan, message=args.message, plain=args.plain)
    print(result.commit_url)
    return 0


def upload_after_merge(out: Path, repo_id: str, private: bool = True, on_event=None, plain: bool = False):
    """Upload a folder the merge just wrote; progress goes to ``on_event`` (default: stderr).
    Returns the UploadResult (its commit_url is what to show); raises MergeError."""
    from tui_merger.core.hub import plan_upload, upload

    plan = plan_upload(out, repo_id, private=private)
    if on_event is not None:
        return upload(plan, on_event=on_event)
    return run_upload(plan, plain=plain)


def run_upload(plan, message: str | None = None, plain: bool = False):
    """Upload with a rich bar on a terminal, plain lines elsewhere; a summary line on stderr."""
    from tui_merger.cli import _is_tty
    from tui_merger.core.hub import upload
    from tui_merger.core.options import human_bytes

    if plain or not _is_tty(sys.stderr):
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
    print("Dry run: nothing was sent.", file=stream)


def _plain_lines():
    from tui_merger.console import PlainProgress
    from tui_merger.core.hub import UploadProgress
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
    from tui_merger.core.hub import UploadProgress

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
