"""A small stand-in for the Hugging Face Hub on 127.0.0.1, enough for huggingface_hub's upload path
(create_repo, preupload, LFS batch / PUT / multipart / verify, ndjson commit, whoami, repo info).

It stores what it receives (repos with their visibility and commits, files by path, LFS objects by
oid) so tests compare bytes, counts requests per kind, and injects faults: unknown tokens get 401,
tokens without write access get 403, and ``fail(kind, when, action)`` drops the connection (mid-body
for uploads) or hangs on chosen requests of a kind.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
import uuid
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

LFS_SIZE = 10_000_000  # the Hub's rule: files from 10 MB up, and binary files, go to LFS
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n*.bin filter=lfs diff=lfs merge=lfs -text\n"

_REPO_API = re.compile(r"^/api/models/([^/]+)/([^/]+)(?:/(preupload|commit|revision|xet-write-token)/(.+))?$")
_LFS_BATCH = re.compile(r"^/([^/]+)/([^/]+)\.git/info/lfs/objects/batch$")
_LFS_OBJECT = re.compile(r"^/lfs/([0-9a-f]{64})(?:/(part)/(\d+)|/(complete|verify))?$")


@dataclass
class StoredFile:
    data: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """What the Hub reports as the file's oid: sha256 for LFS files, the git blob sha1 otherwise."""
        if self.lfs:
            return hashlib.sha256(self.data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class Commit:
    oid: str
    summary: str
    files: dict[str, StoredFile]


@dataclass
class Repo:
    owner: str
    name: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    @property
    def head(self) -> Commit:
        return self.commits[-1]

    def files(self) -> dict[str, bytes]:
        return {path: f.data for path, f in self.head.files.items()}


@dataclass
class Account:
    user: str
    role: str  # "write", "read", or "fineGrained" (here: a token scoped to read only)
    orgs: tuple[str, ...] = ()

    def can_write(self, namespace: str) -> bool:
        return self.role == "write" and namespace in (self.user, *self.orgs)


class HubServer:
    """``with HubServer() as hub:`` serves on ``hub.url`` until the block ends."""

    def __init__(self, multipart_chunk: int | None = None) -> None:
        self.tokens: dict[str, Account] = {}
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.counts: Counter[str] = Counter()
        self.multipart_chunk = multipart_chunk  # LFS objects larger than this are sent in parts
        self._parts: dict[str, dict[int, bytes]] = {}
        self._faults: list[tuple[str, Callable[[int], bool], str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- set-up and fault injection --------------------------------------------------------------
    def add_token(self, token: str, user: str, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = Account(user, role, orgs)

    def add_repo(self, repo_id: str, private: bool) -> Repo:
        owner, name = repo_id.split("/")
        repo = Repo(owner, name, private)
        repo.commits.append(Commit(uuid.uuid4().hex + "0" * 8, "initial commit", {".gitattributes": StoredFile(GITATTRIBUTES, False)}))
        self.repos[repo_id] = repo
        return repo

    def fail(self, kind: str, when: Callable[[int], bool] = lambda n: True, action: str = "drop") -> None:
        """On requests of ``kind`` whose 1-based count satisfies ``when``: "drop" the connection
        (after half of an upload's body) or "hang" without answering."""
        self._faults.append((kind, when, action))

    def clear_faults(self) -> None:
        self._faults.clear()

    def count(self, kind: str) -> int:
        return self.counts[kind]

    def _fault_for(self, kind: str) -> str | None:
        with self._lock:
            self.counts[kind] += 1
            n = self.counts[kind]
        return next((action for k, when, action in self._faults if k == kind and when(n)), None)


def _make_handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        # -- plumbing ----------------------------------------------------------------------------
        def _reply(self, status: int, body=None, headers: dict | None = None) -> None:
            data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, code: str | None = None) -> None:
            self._reply(status, {"error": message}, {"X-Error-Code": code} if code else None)

        def _body(self, fault: str | None) -> bytes | None:
            """The request body; None when a fault ends the request (the connection is gone)."""
            length = int(self.headers.get("Content-Length") or 0)
            if fault == "hang":
                hub._stop.wait(60)
            if fault is not None:
                self.rfile.read(length // 2)
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return None
            return self.rfile.read(length)

        def _account(self) -> Account | None:
            auth = self.headers.get("Authorization", "")
            return hub.tokens.get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?")[0]
            kind, route = _route(method, path)
            body = self._body(hub._fault_for(kind))
            if body is None:
                return
            if route is None:
                return self._error(404, f"{method} {path} is not served here")
            handler, groups = route
            account = self._account()
            if handler not in (_lfs_put, _lfs_part, _lfs_complete) and account is None:
                return self._error(401, "Invalid credentials in Authorization header")
            handler(self, account, body, *groups)

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

    Handler.hub = hub
    return Handler


def _route(method: str, path: str):
    """(counter kind, (handler, groups) or None)."""
    if method == "GET" and path == "/api/whoami-v2":
        return "whoami", (_whoami, ())
    if method == "POST" and path == "/api/repos/create":
        return "create", (_create, ())
    if method == "POST" and path == "/api/validate-yaml":
        return "validate-yaml", (_validate_yaml, ())
    if m := _REPO_API.match(path):
        ns, name, action, rev = m.groups()
        if method == "GET" and action in (None, "revision"):
            return "repo-info", (_repo_info, (f"{ns}/{name}", rev))
        if method == "POST" and action in ("preupload", "commit"):
            return action, ((_preupload if action == "preupload" else _commit), (f"{ns}/{name}", rev))
        return action or "other", None
    if method == "POST" and (m := _LFS_BATCH.match(path)):
        return "lfs-batch", (_lfs_batch, (f"{m[1]}/{m[2]}",))
    if m := _LFS_OBJECT.match(path):
        oid, part, number, action = m.groups()
        if method == "PUT" and part:
            return "lfs-part", (_lfs_part, (oid, int(number)))
        if method == "PUT" and not action:
            return "lfs-put", (_lfs_put, (oid,))
        if method == "POST" and action:
            return f"lfs-{action}", ((_lfs_complete if action == "complete" else _lfs_verify), (oid,))
    return "other", None


def _visible_repo(h, account: Account, repo_id: str) -> Repo | None:
    repo = h.hub.repos.get(repo_id)
    if repo is None or (repo.private and repo.owner not in (account.user, *account.orgs)):
        h._error(404, "Repository not found", "RepoNotFound")
        return None
    return repo


def _writable_repo(h, account: Account, repo_id: str, rev: str) -> Repo | None:
    repo = _visible_repo(h, account, repo_id)
    if repo is None:
        return None
    if not account.can_write(repo.owner):
        h._error(403, f"You don't have the rights to write to {repo_id}")
        return None
    if rev != "main":
        h._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return None
    return repo


# -- the Hub's endpoints -------------------------------------------------------------------------
def _whoami(h, account: Account, body: bytes) -> None:
    h._reply(200, {
        "type": "user",
        "name": account.user,
        "orgs": [{"name": o} for o in account.orgs],
        "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": account.role}},
    })


def _create(h, account: Account, body: bytes) -> None:
    payload = json.loads(body)
    namespace = payload.get("organization") or account.user
    repo_id = f"{namespace}/{payload['name']}"
    url = f"{h.hub.url}/{repo_id}"
    if not account.can_write(namespace):
        return h._error(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
    if repo_id in h.hub.repos:
        return h._reply(409, {"error": "You already created this model repo", "url": url})
    h.hub.add_repo(repo_id, private=payload.get("visibility", "public") == "private")
    h._reply(200, {"url": url, "name": repo_id})


def _validate_yaml(h, account: Account, body: bytes) -> None:
    content = json.loads(body)["content"]
    if content.startswith("---") and content.count("---") < 2:
        return h._reply(400, {"errors": [{"message": "front matter is not closed"}]})
    h._reply(200, {"errors": [], "warnings": []})


def _repo_info(h, account: Account, body: bytes, repo_id: str, rev: str | None) -> None:
    repo = _visible_repo(h, account, repo_id)
    if repo is None:
        return
    if rev not in (None, "main"):
        return h._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
    h._reply(200, {
        "id": repo_id,
        "private": repo.private,
        "sha": repo.head.oid,
        "siblings": [{"rfilename": p} for p in sorted(repo.head.files)],
    })


def _preupload(h, account: Account, body: bytes, repo_id: str, rev: str) -> None:
    repo = _writable_repo(h, account, repo_id, rev)
    if repo is None:
        return
    files = []
    for f in json.loads(body)["files"]:
        binary = b"\0" in base64.b64decode(f["sample"])
        stored = repo.head.files.get(f["path"])
        files.append({
            "path": f["path"],
            "uploadMode": "lfs" if f["size"] >= LFS_SIZE or binary else "regular",
            "shouldIgnore": False,
            "oid": stored.oid if stored else None,
        })
    h._reply(200, {"files": files})


def _lfs_batch(h, account: Account, body: bytes, repo_id: str) -> None:
    if _writable_repo(h, account, repo_id, "main") is None:
        return
    objects = []
    for obj in json.loads(body)["objects"]:
        oid, size = obj["oid"], obj["size"]
        if oid in h.hub.lfs:
            objects.append({"oid": oid, "size": size})  # stored already: no actions
            continue
        base = f"{h.hub.url}/lfs/{oid}"
        chunk = h.hub.multipart_chunk
        if chunk and size > chunk:
            parts = {str(i + 1): f"{base}/part/{i + 1}" for i in range(-(-size // chunk))}
            upload = {"href": f"{base}/complete", "header": {"chunk_size": str(chunk), **parts}}
        else:
            upload = {"href": base}
        objects.append({"oid": oid, "size": size, "actions": {"upload": upload, "verify": {"href": f"{base}/verify"}}})
    h._reply(200, {"transfer": "basic", "objects": objects})


def _store_object(h, oid: str, data: bytes) -> None:
    if hashlib.sha256(data).hexdigest() != oid:
        return h._error(400, "sha256 of the uploaded content does not match its oid")
    h.hub.lfs[oid] = data
    h._reply(200)


def _lfs_put(h, account, body: bytes, oid: str) -> None:
    _store_object(h, oid, body)


def _lfs_part(h, account, body: bytes, oid: str, number: int) -> None:
    h.hub._parts.setdefault(oid, {})[number] = body
    h._reply(200, headers={"ETag": hashlib.md5(body).hexdigest()})


def _lfs_complete(h, account, body: bytes, oid: str) -> None:
    numbers = [p["partNumber"] for p in json.loads(body)["parts"]]
    parts = h.hub._parts.pop(oid, {})
    _store_object(h, oid, b"".join(parts.get(n, b"") for n in numbers))


def _lfs_verify(h, account: Account, body: bytes, oid: str) -> None:
    obj = json.loads(body)
    if oid not in h.hub.lfs or len(h.hub.lfs[oid]) != obj["size"]:
        return h._error(404, f"object {oid} is not stored")
    h._reply(200, {"success": True})


def _commit(h, account: Account, body: bytes, repo_id: str, rev: str) -> None:
    repo = _writable_repo(h, account, repo_id, rev)
    if repo is None:
        return
    files = dict(repo.head.files)
    summary = ""
    for line in body.splitlines():
        item = json.loads(line)
        value = item["value"]
        if item["key"] == "header":
            summary = value["summary"]
        elif item["key"] == "file":
            files[value["path"]] = StoredFile(base64.b64decode(value["content"]), lfs=False)
        elif item["key"] == "lfsFile":
            if value["oid"] not in h.hub.lfs:
                return h._error(422, f"LFS object {value['oid']} of {value['path']} was never uploaded")
            files[value["path"]] = StoredFile(h.hub.lfs[value["oid"]], lfs=True)
    oid = uuid.uuid4().hex + "0" * 8
    repo.commits.append(Commit(oid, summary, files))
    h._reply(200, {"commitOid": oid, "commitUrl": f"{h.hub.url}/{repo_id}/commit/{oid}", "pullRequestUrl": None})
