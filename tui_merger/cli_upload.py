"""``tui-merger upload OUT --repo-id ORG/NAME``: push a merged model folder to the Hugging Face Hub."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("upload", help="upload a merged model folder to the Hugging Face Hub (private by default)")
    p.add_argument("folder", help="the merged model folder")
    p.add_argument("--repo-id", "--repo_id", dest="repo_id", required=True, help="ORG/NAME on the Hub")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_upload)


def cmd_upload(args) -> int:
    from tui_merger.core.errors import MergeError

    raise MergeError("upload is not written yet.")
