"""``tui-merger merge --detach``, ``tui-merger jobs`` and ``tui-merger attach [ID]``: a merge that runs in
its own process session, keeps running when the terminal closes, and is followed from any terminal later
(the jobs themselves live in core/merge/jobs.py)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_DIED = (
    "its process is gone without a result (killed, or the machine restarted); "
    "run the same merge again to resume it from its finished shards."
)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "jobs",
        help="list the detached merges (merge --detach) with their state and progress",
        description="List the merges started with tui-merger merge --detach, newest first: state, start, "
        "elapsed time, progress or result, and output folder.",
    )
    p.add_argument(
        "--prune", nargs="?", type=float, const=30.0, metavar="DAYS",
        help="remove the records (log, progress) of jobs that ended more than DAYS ago (default 30); "
        "running jobs and the merged models are never touched",
    )
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_jobs)

    p = sub.add_parser(
        "attach",
        help="follow a detached merge: its log so far, live progress, then its result",
        description="Print a detached merge's log so far, follow it live, and print its result when it ends "
        "(the exit code is the merge's). Ctrl-C stops following; the merge keeps running.",
    )
    p.add_argument(
        "job", nargs="?", metavar="ID", help="a job id, a unique start of one, or latest (default: the newest running job)"
    )
    p.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_attach)

    p = sub.add_parser("_job-run")  # core.jobs.RUNNER_COMMAND, what the detached process runs; no help: not listed
    p.add_argument("job")
    p.set_defaults(run=cmd_run_job, debug=False)


def detach(args, options) -> int:
    """``merge --detach`` once the foreground checks passed: start the job and say how to follow it."""
    from tui_merger.core.merge.jobs import start_detached

    job = start_detached(
        options, verify=args.verify, behaviour=args.behaviour, perplexity=args.perplexity,
        upload_to=args.hf_upload_path, public=args.public,
    )
    print(f"Started job {job.id}: the merge into {job.out} runs in the background and keeps running if you disconnect.")
    print(f"  follow it:  tui-merger attach {job.id}")
    print("  all jobs:   tui-merger jobs")
    return 0


def cmd_jobs(args) -> int:
    from tui_merger.core.errors import MergeError
    from tui_merger.core.merge.jobs import DIED, list_jobs, prune_jobs

    if args.prune is not None:
        if not args.prune >= 0:
            raise MergeError(f"--prune takes a number of days (0 or more), not {args.prune}.")
        removed = prune_jobs(args.prune)
        for job in removed:
            print(f"removed job {job.id} ({job.state}, {job.out})")
        print(f"{len(removed)} job record(s) removed; the merged models are untouched.")
        return 0
    jobs = list_jobs()
    if not jobs:
        print("No detached jobs; start one with tui-merger merge ... --detach.")
        return 0
    rows = [("ID", "STATE", "STARTED", "ELAPSED", "PROGRESS", "OUTPUT")]
    rows += [(j.id, j.state, _when(j.started), _duration(j.elapsed), _progress(j), j.out) for j in jobs]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[5])
    if any(j.state == DIED for j in jobs):
        print(f"died: {_DIED}")
    return 0


def cmd_attach(args) -> int:
    from tui_merger.core.merge.jobs import DIED, find_job, follow

    job = find_job(args.job)
    try:
        job = follow(job, on_line=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        print(f"\nStopped following job {job.id}; it keeps running (tui-merger attach {job.id} follows it again).",
              file=sys.stderr)
        return 0
    if job.state == DIED:
        print(f"Job {job.id} died: {_DIED}", file=sys.stderr)
        return 1
    print(f"Job {job.id} {job.state}: {(job.result or {}).get('message', 'no result recorded')}")
    return job.exit_code if job.exit_code is not None else 1


def cmd_run_job(args) -> int:
    """The detached process (started by core.jobs.start_detached): the steps of tui-merger merge, with its
    output in the job's log and progress.json kept current; the end is recorded in job.json last."""
    import signal
    import traceback

    from tui_merger.cli.common import preflight, print_result, report_verification
    from tui_merger.console import PlainProgress
    from tui_merger.core.merge.engine import run_merge
    from tui_merger.core.errors import MergeCancelled, MergeError
    from tui_merger.core.merge.jobs import CANCELLED, FAILED, FINISHED, ProgressWriter, finish_job, read_job
    from tui_merger.core.options import MergeOptions
    from tui_merger.core.record.provenance import finish_merge

    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # SIGTERM (kill PID) still stops it, keeping finished shards
    sys.stdout.reconfigure(line_buffering=True)  # the log keeps stdout's and stderr's lines in order
    job = read_job(args.job)
    request = job.request
    print(f"Job {job.id} (pid {os.getpid()}), started {_when(job.started)}: merging into {job.out}", flush=True)
    log, progress = PlainProgress(stream=sys.stderr), ProgressWriter(job)

    def on_event(event) -> None:
        log(event)
        progress(event)

    state, code, verified, result = FAILED, 3, None, None
    try:
        options = MergeOptions(**request["options"])
        preflight(options, dry_run=False)
        if request["verify"]:
            from tui_merger.core.verify.checks import merge_prewarmed

            result = merge_prewarmed(options, on_event, behaviour=request.get("behaviour", True))
        else:
            result = run_merge(options, on_event)
        perplexity = Path(request["perplexity"]) if request["perplexity"] else None
        _, report = finish_merge(
            options, result, verify=request["verify"], behaviour=request.get("behaviour", True),
            perplexity_text=perplexity, on_event=on_event,
        )
        print_result(result)
        code = report_verification(report)
        verified = None if report is None else report.passed
        message = {
            True: f"the merged model in {job.out} passed verification",
            False: f"the merged model in {job.out} failed verification; do not ship it",
            None: f"the merged model is in {job.out}, not verified (--no-verify)",
        }[verified]
        if request["upload_to"]:
            if code != 0:
                raise MergeError(f"Nothing was uploaded to {request['upload_to']}: the merged model failed verification.")
            from tui_merger.cli.common import upload_after_merge

            uploaded = upload_after_merge(result.out, request["upload_to"], private=not request["public"], plain=True)
            print(f"  uploaded: {uploaded.commit_url}")
            message += f" and was uploaded to {request['upload_to']}"
        state = FINISHED if code == 0 else FAILED
        message += "."
    except MergeCancelled as err:
        state, code, message = CANCELLED, 130, str(err)
    except KeyboardInterrupt:  # SIGTERM where nothing could be kept, or during verification
        from tui_merger.core.merge.output import left_on_disk

        state, code = CANCELLED, 130
        message = f"Interrupted: {left_on_disk(Path(job.out))}; the inputs are untouched."  # as the disk says
    except MergeError as err:
        code, message = 1, str(err)
    except Exception as err:  # a library outside its range, else a bug of ours: the traceback goes into the log
        traceback.print_exc()
        from tui_merger.deps import explain_failure

        message = explain_failure(err) or (
            f"unexpected {type(err).__name__}: {err}. This is a bug in tui-merger; "
            f"please report it with the log {job.log_path}."
        )
    if state != FINISHED:
        print(message if state == CANCELLED else f"error: {message}", file=sys.stderr, flush=True)
    finish_job(job, state, code, message, verified)
    return code


def _progress(job) -> str:
    """What the PROGRESS column says: the result of a finished job, else the phase and how far it got."""
    from tui_merger.core.merge.jobs import FINISHED, RUNNING

    verified = (job.result or {}).get("verified")
    if job.state == FINISHED:
        return "verified" if verified else "not verified"
    if verified is False:
        return "verification failed"
    progress = job.progress()
    if progress is None:
        return "starting" if job.state == RUNNING else "-"
    if progress.get("bytes_total"):
        return f"{progress['phase']} {progress['bytes_done'] / progress['bytes_total']:.0%}"
    return progress["phase"]


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
