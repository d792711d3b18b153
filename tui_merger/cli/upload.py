"""``tui-merger upload OUT --repo-id ORG/NAME``: push a merged model folder to the Hugging Face Hub."""

from __future__ import annotations

import argparse
from pathlib import Path

from tui_merger.cli.common import print_plan, run_upload


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
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, offline (no token needed); write and send nothing")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_upload)


def cmd_upload(args) -> int:
    from tui_merger.core.ship.hub import plan_upload

    plan = plan_upload(args.folder, args.repo_id, private=not args.public, revision=args.revision, offline=args.dry_run)
    if args.dry_run:
        print_plan(plan)
        return 0
    result = run_upload(plan, message=args.message, plain=args.plain)
    print(result.commit_url)
    return 0


