"""Upload a model folder to the Hugging Face Hub.

``plan_upload`` checks everything it can before anything is sent: the folder, the repo id, the token
(whoami), and whether the repo exists and how visible it is. ``upload`` then creates the repo (private
unless asked), sends each large file on its own (progress per file), and makes ONE commit. A re-run
after an interruption resumes: large files the Hub already stores are not sent again.

huggingface_hub is imported inside functions only: importing this module stays cheap.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tui_merger.core.record.card import CARD_NAME, ensure_model_card
from tui_merger.core.errors import MergeCancelled, MergeError
from tui_merger.core.io.hf_refs import OFFLINE_BY_DEMO, hf_command
from tui_merger.core.events import CancelToken, Event, EventSink, Notice, PhaseStarted, ignore_event
from tui_merger.core.options import human_bytes

LFS_MIN_SIZE = 10_000_000  # the Hub stores files from 10 MB up in LFS, and binary files of any size
TIMEOUT_S = 60.0  # longest wait for the Hub to accept or answer a read/write, per network operation
CONNECT_TIMEOUT_S = 10.0
MODEL_FILES = ("config.json", "adapter_config.json")


@dataclass(frozen=True)
class UploadProgress(Event):
    path: str  # the file just handled
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    skipped: bool = False  # the Hub already had it: not sent again


@dataclass(frozen=True)
class PlannedFile:
    path: str  # relative to the folder, '/'-separated: the path in the repo
    size: int
    lfs: bool  # as the Hub will store it: LFS from 10 MB up or when binary
    source: str | None = None  # where the file is when not at folder/path (a GGUF written outside the folder)


@dataclass(frozen=True)
class UploadPlan:
    folder: Path
    repo_id: str
    user: str | None  # whom the token belongs to (None: the Hub was not asked, a dry run)
    private: bool  # the visibility the repo has (when it exists) or will be created with
    exists: bool | None  # None: not asked (a dry run: offline, no token)
    revision: str
    head: str | None  # the revision's commit before the upload; None for a new repo
    files: tuple[PlannedFile, ...]
    left_out: tuple[str, ...]  # hidden files and folders (names starting with '.'): never uploaded
    notices: tuple[str, ...]  # things to tell the user before uploading
    endpoint: str | None = None
    token: str | None = field(default=None, repr=False)  # None: HF_TOKEN or the stored login

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class UploadResult:
    repo_id: str
    commit_url: str
    files_uploaded: int
    files_skipped: int  # large files the Hub already stored (a resumed upload), or all when nothing changed
    bytes_sent: int
    changed: bool  # False: the repo already had exactly these files, no commit was made


def plan_upload(
    folder: Path,
    repo_id: str,
    private: bool = True,
    token: str | None = None,
    endpoint: str | None = None,
    revision: str = "main",
    offline: bool = False,
) -> UploadPlan:
    """Check the folder and repo id, then the token (the first call to the Hub), then the repo.
    Writes the model card (README.md) from merge_manifest.json when the folder has none; sends no file.
    ``offline`` (a dry run): the files only, with neither token nor network, and nothing written (the
    card that would be written is listed with its size)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise MergeError(f"{folder} does not exist or is not a folder; give the folder the merge wrote.")
    if not any((folder / name).is_file() for name in MODEL_FILES):
        raise MergeError(
            f"{folder} is not a model folder (it has no config.json or adapter_config.json); "
            "give the folder the merge wrote."
        )
    _check_repo_id(repo_id)
    notices = []
    had_card = (folder / CARD_NAME).is_file()
    card = None if had_card or not offline else _card_text(folder)
    if had_card:
        pass
    elif offline and card is not None:
        notices.append(f"The model card {CARD_NAME} would be written from merge_manifest.json before uploading.")
    elif offline or ensure_model_card(folder) is None:
        notices.append(f"{folder} has no README.md and no merge_manifest.json to write one from: the repo gets no model card.")
    else:
        notices.append(f"Wrote the model card {folder / CARD_NAME} from merge_manifest.json; edit it before uploading if you like.")
    files, left_out = _list_files(folder)
    if card is not None:
        files = sorted([*files, PlannedFile(CARD_NAME, len(card.encode()), False)], key=lambda f: f.path)
    if left_out:
        notices.append(f"Left out (hidden, often partial downloads or caches): {', '.join(left_out)}.")
    outside, said = _recorded_outside(folder, {f.path for f in files})
    files += outside
    notices += said
    if offline:  # a dry run: nothing asked of the Hub, so neither token nor network is needed
        return UploadPlan(folder=folder, repo_id=repo_id, user=None, private=private, exists=None, revision=revision,
                          head=None, files=tuple(files), left_out=tuple(left_out), notices=tuple(notices),
                          endpoint=endpoint, token=token)

    from huggingface_hub.errors import RepositoryNotFoundError

    api = _api(endpoint, token)
    with _hub_errors(repo_id, revision, endpoint, token):
        me = api.whoami()
        if me.get("auth", {}).get("accessToken", {}).get("role") == "read":
            raise MergeError(
                f"The token of {me['name']} is read-only; create one with write access at "
                f"{api.endpoint}/settings/tokens and log in with it (`{hf_command()} auth login`) or set HF_TOKEN to it."
            )
        if "/" not in repo_id:
            repo_id = f"{me['name']}/{repo_id}"
        try:
            info = api.repo_info(repo_id, revision=revision, timeout=TIMEOUT_S)
        except RepositoryNotFoundError:
            info = None
    if info is None and revision != "main":
        raise MergeError(f"{repo_id} does not exist yet, so it has no branch {revision}; leave out --revision.")
    if info is not None and bool(info.private) != private:
        now, asked = ("private", "public") if info.private else ("public", "private")
        notices.append(
            f"{repo_id} already exists and is {now}: it stays {now} (tui-merger does not change the visibility "
            f"of an existing repo; make it {asked} in its settings on the Hub if you want)."
        )
    return UploadPlan(
        folder=folder,
        repo_id=repo_id,
        user=me["name"],
        private=bool(info.private) if info is not None else private,
        exists=info is not None,
        revision=revision,
        head=info.sha if info is not None else None,
        files=tuple(files),
        left_out=tuple(left_out),
        notices=tuple(notices),
        endpoint=endpoint,
        token=token,
    )


def _card_text(folder: Path) -> str | None:
    """The model card an upload would write from the folder's manifest (None: no manifest)."""
    from tui_merger.core.record.card import render_model_card
    from tui_merger.core.record.manifest import read_manifest

    manifest = read_manifest(folder)
    return None if manifest is None else render_model_card({**manifest, "out": str(folder)})


def save_login(token: str) -> str | None:
    """Save a token that worked as `hf auth login` saves it (huggingface_hub's own login), so that the next
    upload needs none; None, or the sentence saying it was used but not saved."""
    from huggingface_hub import login
    from huggingface_hub.utils import logging as hub_logging

    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its log lines would go to the terminal (where the app draws)
    try:
        login(token=token, add_to_git_credential=False)
    except Exception as err:  # noqa: BLE001 - the upload goes on with the token; only saving it failed
        return f"The token was used but not saved for next time ({(str(err).splitlines() or [''])[0][:120]})."
    finally:
        hub_logging.set_verbosity(verbosity)
    return None


def login_state() -> tuple[bool, str]:
    """(whether this machine has a Hub token: HF_TOKEN or a saved login, where write tokens are made)."""
    from huggingface_hub import constants, get_token

    return get_token() is not None, f"{constants.ENDPOINT}/settings/tokens"


def check_token(repo_id: str, token: str | None = None, endpoint: str | None = None) -> str:
    """Check the repo id and that the token may write, before hours of merging; returns the user name."""
    _check_repo_id(repo_id)
    api = _api(endpoint, token)
    with _hub_errors(repo_id, "main", endpoint, token):
        me = api.whoami()
    if me.get("auth", {}).get("accessToken", {}).get("role") == "read":
        raise MergeError(
            f"The token of {me['name']} is read-only; create one with write access at "
            f"{api.endpoint}/settings/tokens and log in with it (`{hf_command()} auth login`) or set HF_TOKEN to it."
        )
    return me["name"]


def upload(
    plan: UploadPlan,
    message: str | None = None,
    on_event: EventSink = ignore_event,
    cancel: CancelToken | None = None,
) -> UploadResult:
    """Create the repo if needed, send the large files one by one, then commit everything at once."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    for text in plan.notices:
        on_event(Notice("info", text))
    visibility = "private" if plan.private else "public"
    on_event(PhaseStarted(
        "upload",
        f"{plan.repo_id} ({visibility}{'' if plan.exists else ', new'}): "
        f"{len(plan.files)} file(s), {human_bytes(plan.total_bytes)}",
    ))
    api = _api(plan.endpoint, plan.token)
    ops = {
        f.path: CommitOperationAdd(path_in_repo=f.path, path_or_fileobj=f.source or str(plan.folder / f.path))
        for f in plan.files
    }
    large = [f for f in plan.files if f.lfs]
    total = len(plan.files)
    done = done_bytes = sent_bytes = skipped = 0
    bars_were_on = not are_progress_bars_disabled()
    disable_progress_bars()  # progress goes through on_event
    try:
        with _hub_errors(plan.repo_id, plan.revision, plan.endpoint, plan.token):
            api.create_repo(plan.repo_id, private=plan.private, exist_ok=True)
            # With Xet (hf_xet installed) the storage itself skips content it already has; without it,
            # ask the LFS endpoint which objects are stored (an object without upload actions is).
            xet = _xet_in_use()
            stored = set() if xet else _stored_objects(api, plan, [ops[f.path] for f in large], on_event)
            for f in large:
                _check_cancel(cancel)
                op = ops[f.path]
                is_stored = not xet and op.upload_info.sha256.hex() in stored
                if not is_stored:
                    api.preupload_lfs_files(plan.repo_id, [op], revision=plan.revision)
                    sent_bytes += f.size
                done, done_bytes, skipped = done + 1, done_bytes + f.size, skipped + is_stored
                on_event(UploadProgress(f.path, done, total, done_bytes, plan.total_bytes, skipped=is_stored))
            _check_cancel(cancel)
            on_event(PhaseStarted("commit", f"committing {total} files to {plan.repo_id} ({plan.revision})"))
            info = api.create_commit(
                plan.repo_id,
                operations=list(ops.values()),
                commit_message=message or f"Upload {plan.folder.name} with tui-merger",
                revision=plan.revision,
            )
    finally:
        if bars_were_on:
            enable_progress_bars()
    changed = info.oid != plan.head
    for f in plan.files:
        if not f.lfs:
            done, done_bytes = done + 1, done_bytes + f.size
            sent_bytes += f.size if changed else 0
            on_event(UploadProgress(f.path, done, total, done_bytes, plan.total_bytes, skipped=not changed))
    if not changed:
        on_event(Notice("info", f"Nothing changed: {plan.repo_id} already has these files."))
        return UploadResult(plan.repo_id, info.commit_url, 0, total, 0, changed=False)
    return UploadResult(plan.repo_id, info.commit_url, total - skipped, skipped, sent_bytes, changed=True)


def _check_cancel(cancel: CancelToken | None) -> None:
    if cancel is not None and cancel.cancelled:
        raise MergeCancelled(
            "Upload cancelled before the commit: nothing was committed, and a re-run does not send the large "
            "files already sent again."
        )


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise MergeError(
            f"{repo_id!r} is not a valid repo id; use ORG/NAME (or NAME for your own account) with letters, "
            "digits, '-', '_' and '.', e.g. alice/qwen-merged."
        ) from None


def _list_files(folder: Path) -> tuple[list[PlannedFile], list[str]]:
    """Every file under ``folder`` except hidden ones (any path part starting with '.')."""
    files, left_out = [], []
    for root, dirs, names in os.walk(folder, followlinks=True):
        rel_root = Path(root).relative_to(folder)
        for d in sorted(dirs):
            if d.startswith("."):
                left_out.append(f"{(rel_root / d).as_posix()}/")
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            rel = (rel_root / name).as_posix()
            if name.startswith("."):
                left_out.append(rel)
                continue
            size = (folder / rel).stat().st_size
            files.append(PlannedFile(rel, size, size >= LFS_MIN_SIZE or _is_binary(folder / rel)))
    return files, left_out


def _recorded_outside(folder: Path, taken: set[str]) -> tuple[list[PlannedFile], list[str]]:
    """GGUF files that ``tui-merger gguf`` wrote outside the folder and recorded in its manifest: uploaded
    beside the model under their file name. One that is gone or has changed since is said, not sent."""
    from tui_merger.core.record.manifest import read_manifest

    files, notices = [], []
    for entry in (read_manifest(folder) or {}).get("gguf") or []:
        path = Path(entry["path"])
        if not path.is_absolute():
            continue  # inside the folder: listed with every other file
        try:
            size = path.stat().st_size
        except OSError:
            notices.append(f"The GGUF {path} recorded in merge_manifest.json is gone: it is not uploaded.")
            continue
        if size != entry["size"]:
            notices.append(f"The GGUF {path} changed since tui-merger wrote it: it is not uploaded (make it again with tui-merger gguf).")
        elif path.name in taken:
            notices.append(f"The GGUF {path} is not uploaded: the folder has a file named {path.name} already.")
        else:
            taken.add(path.name)
            files.append(PlannedFile(path.name, size, True, source=str(path)))
            notices.append(f"Uploading the GGUF {path} (recorded in merge_manifest.json) as {path.name}.")
            modelfile = Path(str(entry.get("modelfile") or ""))  # its Ollama Modelfile, written beside it (FROM ./name)
            if modelfile.is_absolute() and modelfile.is_file() and modelfile.name not in taken:
                taken.add(modelfile.name)
                files.append(PlannedFile(modelfile.name, modelfile.stat().st_size, False, source=str(modelfile)))
                notices.append(f"Uploading its Ollama Modelfile {modelfile} as {modelfile.name}.")
    return files, notices


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(512)


def _xet_in_use() -> bool:
    """huggingface_hub sends large files through Xet when hf_xet is installed and HF_HUB_DISABLE_XET is not set."""
    import importlib.util

    from huggingface_hub import constants

    return not constants.HF_HUB_DISABLE_XET and importlib.util.find_spec("hf_xet") is not None


def _stored_objects(api, plan: UploadPlan, ops: list, on_event: EventSink) -> set[str]:
    """sha256 of the large files whose content the Hub's LFS storage already holds."""
    from huggingface_hub.lfs import post_lfs_batch_info

    if not ops:
        return set()
    on_event(PhaseStarted("check", f"hashing the large files ({len(ops)}) to see which the Hub already has"))
    actions, _errors, _transfer = post_lfs_batch_info(
        upload_infos=[op.upload_info for op in ops],
        token=plan.token,
        repo_type="model",
        repo_id=plan.repo_id,
        revision=plan.revision,
        endpoint=api.endpoint,
    )
    return {a["oid"] for a in actions if not a.get("actions")}


def _api(endpoint: str | None, token: str | None):
    from huggingface_hub import HfApi

    _use_timeouts()
    return HfApi(endpoint=endpoint, token=token)


def _use_timeouts() -> None:
    """huggingface_hub's shared HTTP client waits forever by default: a hung server would hang the
    upload. Give it the same client (same request hooks) with timeouts. Xet transfers use hf_xet's own."""
    from huggingface_hub.utils import get_session, set_client_factory

    session = get_session()
    if session.timeout.read is not None:
        return
    http = _http()
    hooks = session.event_hooks
    timeout = http.Timeout(TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    set_client_factory(lambda: http.Client(event_hooks=hooks, follow_redirects=True, timeout=timeout))


def _http():
    """The HTTP library huggingface_hub's client is made with: httpx2 from huggingface_hub 2.0 on,
    httpx in 1.x (the same API under another name)."""
    import importlib

    from huggingface_hub.utils import get_session

    return importlib.import_module(type(get_session()).__module__.split(".")[0])


@contextmanager
def _hub_errors(repo_id: str, revision: str, endpoint: str | None, token: str | None):
    """Turn what huggingface_hub and the network raise into one sentence for people (never the token)."""
    try:
        yield
    except MergeError:
        raise
    except Exception as err:
        message = _explain(err, repo_id, revision, endpoint or _default_endpoint(), token)
        if message is None:
            raise
        secret = token or _current_token()
        raise MergeError(message.replace(secret, "***") if secret else message) from err


def _explain(err: BaseException, repo_id: str, revision: str, endpoint: str, token: str | None) -> str | None:
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalTokenNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    httpx = _http()
    resume = "run the same command again to resume (large files already sent are not sent twice)"
    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    for e in chain:
        if isinstance(e, LocalTokenNotFoundError):
            return (f"No Hugging Face token found; log in with `{hf_command()} auth login` or set HF_TOKEN to a token "
                    "with write access.")
        if isinstance(e, OfflineModeIsEnabled):
            if os.environ.get(OFFLINE_BY_DEMO):
                return ("The demo runs offline (tui-merger demo set HF_HUB_OFFLINE for itself), so it does not "
                        "upload; upload a model you merged with tui-merger outside the demo.")
            return "HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it to upload."
        if isinstance(e, RevisionNotFoundError):
            return f"{repo_id} has no branch {revision}; create it on the Hub first or leave out --revision."
        if isinstance(e, RepositoryNotFoundError):
            return (f"{repo_id} was not found on the Hub, or your token cannot see it; check --repo-id and that "
                    "the token's account has access to it.")
        if isinstance(e, HfHubHTTPError):
            status = e.response.status_code
            if status == 401:
                return _rejected_token(token)
            if status == 403:
                return (f"Your token may not write to {repo_id} (403 Forbidden); use a token with write access "
                        f"to {repo_id.split('/')[0]} (fine-grained tokens need write permission on this repo).")
            detail = f": {e.server_message.strip()}" if e.server_message else ""
            return f"The Hub refused the upload to {repo_id} ({status}{detail}); fix what it says, or {resume}."
        if isinstance(e, ValueError) and str(e).startswith("Invalid metadata in README.md"):
            problems = "; ".join(line[2:] for line in str(e).splitlines() if line.startswith("- "))
            return (f"The Hub refused the metadata at the top of README.md ({problems}); fix it, or delete "
                    "README.md to let tui-merger write one, then upload again.")
        if isinstance(e, httpx.ConnectError):
            return f"Cannot connect to the Hub at {endpoint}; check your network connection (and HF_ENDPOINT), then {resume}."
        if isinstance(e, httpx.TimeoutException):
            return f"The Hub at {endpoint} did not answer within {TIMEOUT_S:.0f} s; check your connection, then {resume}."
        if isinstance(e, (httpx.TransportError, ConnectionError)):
            text = str(e)
            # (status codes as whole words: the port of a local endpoint, e.g. 40321, holds "403")
            if "xet-write-token" in text and not re.search(r"\b40[13]\b", text):
                return (f"The Hub at {endpoint} does not offer Xet storage, which huggingface_hub uses for large "
                        "files while hf_xet is installed; set HF_HUB_DISABLE_XET=1 and run again.")
            return f"The connection to the Hub at {endpoint} failed during the upload; {resume}."
    return None


def _default_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _current_token() -> str | None:
    from huggingface_hub import get_token

    return get_token()


def _rejected_token(token: str | None) -> str:
    if token:
        return "The Hub rejected the given token (401 Unauthorized); pass a valid token with write access."
    if os.environ.get("HF_TOKEN"):
        return ("The Hub rejected the token in HF_TOKEN (401 Unauthorized); set HF_TOKEN to a valid token, "
                f"or unset it to use the one from `{hf_command()} auth login`.")
    return (f"The Hub rejected the token saved by `{hf_command()} auth login` (401 Unauthorized); log in again "
            f"with `{hf_command()} auth login --force`.")
