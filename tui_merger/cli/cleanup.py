"""``tui-merger cleanup PATH``: free the space a verified merge made unnecessary."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub) -> None:
    from tui_merger.core.ship.cleanup import KINDS

    p = sub.add_parser(
        "cleanup",
        help="list and delete what a verified merge made unnecessary",
        description="After a verified merge, list what the training folder PATH no longer needs (optimizer and "
        "resume state, older checkpoints, caches and, only if you pick them, the files the merge read), with sizes; "
        "you pick, confirm, and it is deleted. Merged models and the inputs of unverified merges are never touched.",
    )
    p.add_argument("path", metavar="PATH", type=Path, help="the training run folder")
    p.add_argument(
        "--merged",
        metavar="OUT",
        type=Path,
        action="append",
        default=[],
        help="a merged model folder made from PATH (found by itself when it is inside PATH or in your merge history)",
    )
    p.add_argument("--dry-run", action="store_true", help="list what could go; delete nothing")
    p.add_argument("--yes", "-y", action="store_true", help="delete the selection without asking (needed without a terminal)")
    kinds = ", ".join(KINDS)
    p.add_argument("--include", metavar="KIND", action="append", default=[], choices=KINDS, help=f"also select every item of KIND ({kinds})")
    p.add_argument("--exclude", metavar="KIND", action="append", default=[], choices=KINDS, help="do not select the items of KIND")
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_cleanup)


def _interactive() -> bool:
    from tui_merger.cli.common import is_tty

    return is_tty(sys.stdin) and is_tty(sys.stdout)


def cmd_cleanup(args) -> int:
    from tui_merger.core.ship.cleanup import ItemDeleted, delete_items, find_cleanup
    from tui_merger.core.errors import MergeError
    from tui_merger.core.options import human_bytes

    plan = find_cleanup(args.path, args.merged)
    print(f"Cleanup of {plan.root}")
    for m in plan.merges:
        print(f"  merged into {m.out}: {'verified' if m.verified else m.problem}")
    if plan.protected:
        print("Kept, never deleted:")
        for path, why in plan.protected:
            shown = path.relative_to(plan.root) if path.is_relative_to(plan.root) else path
            print(f"  {shown}  ({why})")
    if not plan.items:
        print("Nothing to clean up.")
        return 0
    chosen = [
        i for i in plan.items
        if (i.selected_by_default or i.kind in args.include) and i.kind not in args.exclude
    ]
    print(f"{'':3} {'size':>9}  {'kind':<13}  what  (why)")
    for item in plan.items:
        mark = "[x]" if item in chosen else "[ ]"
        print(f"{mark} {human_bytes(item.size):>9}  {item.kind:<13}  {item.label}  ({item.reason})")
    print(
        f"Selected {len(chosen)} of {len(plan.items)} items: "
        f"{human_bytes(_bytes(chosen))} of {human_bytes(_bytes(plan.items))}."
    )

    if args.dry_run:
        print("Dry run: nothing was deleted.")
        return 0
    if not args.yes:
        if not _interactive():
            raise MergeError(
                "Nothing was deleted: without a terminal to ask on, run again with --yes to delete the selection "
                "marked [x] (change it with --include KIND / --exclude KIND), or with --dry-run to only list it."
            )
        chosen = _ask(plan.items, chosen)
        if not chosen:
            print("Nothing was deleted.")
            return 0
    if not chosen:
        print("Nothing is selected; nothing was deleted.")
        return 0

    failed = 0

    def report(event) -> None:
        nonlocal failed
        if isinstance(event, ItemDeleted):
            if event.error:
                failed += 1
                print(f"  not removed: {event.error} (freed {human_bytes(event.freed)} of {human_bytes(event.item.size)})")
            else:
                print(f"  removed {event.item.label} ({human_bytes(event.freed)})")

    freed = delete_items(plan, chosen, report)
    print(f"Freed {human_bytes(freed)}.")
    if failed:
        raise MergeError(f"{failed} item(s) could not be removed completely (see above); fix that and run cleanup again.")
    return 0


def _bytes(items) -> int:
    return sum(i.size for i in items)


def _ask(items, chosen):
    """Let the user change the selection on the terminal, then confirm; [] when they decline."""
    import questionary

    from tui_merger.core.options import human_bytes

    choices = [
        questionary.Choice(f"{human_bytes(i.size):>9}  {i.kind:<13}  {i.label}", value=i, checked=i in chosen)
        for i in items
    ]
    picked = questionary.checkbox("Pick what to delete (space toggles, enter accepts):", choices=choices).ask()
    if not picked:
        return []
    ok = questionary.confirm(
        f"Delete {len(picked)} item(s), {human_bytes(_bytes(picked))}? This cannot be undone.", default=False
    ).ask()
    return picked if ok else []
