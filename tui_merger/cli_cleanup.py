"""``tui-merger cleanup PATH``: free the space a verified merge made unnecessary."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("cleanup", help="list and delete what a verified merge made unnecessary")
    p.add_argument("path", help="the training run folder")
    p.add_argument("--dry-run", action="store_true", help="list what could go; delete nothing")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_cleanup)


def cmd_cleanup(args) -> int:
    from tui_merger.core.errors import MergeError

    raise MergeError("cleanup is not written yet.")
