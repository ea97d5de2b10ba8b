"""A loopback stand-in for the Hugging Face Hub, for tests that must never reach the real one.

It serves, on ``127.0.0.1`` at a free port, in a daemon thread, the endpoints that
huggingface_hub 2.4 calls for ``HfApi.create_repo(..., exist_ok=True)``, ``create_branch``,
``repo_info`` and ``upload_folder`` (legacy single-commit path, i.e. with ``HF_HUB_DISABLE_XET=1``):

=======  ==============================================  ==========================================
method   path                                            called by
=======  ==============================================  ==========================================
POST     /api/repos/create                               ``create_repo`` (409 when it exists)
POST     /api/validate-yaml                              ``upload_folder``/``create_commit`` when a
                                                         README.md is part of the upload (twice)
POST     /api/models/{ns}/{name}/preupload/{rev}         ``_fetch_upload_modes``: always "regular"
POST     /api/models/{ns}/{name}/commit/{rev}            ``_send_commit``: NDJSON, base64 files
GET      /api/models/{ns}/{name}[/revision/{rev}]        ``repo_info``/``model_info`` (also used by
                                                         ``create_commit`` when nothing changed)
POST     /api/models/{ns}/{name}/branch/{branch}         ``create_branch``
POST     /api/models/{ns}/{name}/paths-info/{rev}        ``get_paths_info`` (copies; not on our path)
GET      /api/models/{ns}/{name}/tree/{rev}[/{path}]     ``list_repo_tree``/``list_repo_files`` (the
                                                         ``delete_patterns`` of ``upload_folder``);
                                                         ``?recursive=true`` lists subfolders too
GET      /api/whoami-v2                                  ``whoami``
GET      /api/agent-harnesses                            user-agent building, unless telemetry is
                                                         disabled (cached a day in ``HF_HOME``)
=======  ==============================================  ==========================================

Anything else is answered 404 and recorded in :attr:`HubStandIn.unexpected`, so a test can assert
the client called nothing it did not expect. An ``lfsFile`` line in a commit is refused (400) and
recorded too: the preupload answer says "regular" for every file, so the client must never send one.

Point the client at it *before* huggingface_hub is imported (its constants are read at import
time), which is why the push tests run the CLI in a subprocess with :meth:`HubStandIn.env`.

State kept for assertions: :attr:`repos` (private flag, branches, files per branch),
:attr:`commits` (message, revision, create_pr, files), :attr:`auth_headers` (every Authorization
header seen, ``None`` when absent), :attr:`requests` (``(method, path)`` in order).
:meth:`fail` makes the next matching request(s) answer an error status.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

_REPO = r"(?P<repo>[^/]+(?:/[^/]+)?)"
_ROUTES = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("GET", re.compile(r"^/api/agent-harnesses$"), "agent_harnesses"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<rev>[^/]+)$"), "create_branch"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/paths-info/(?P<rev>[^/]+)$"), "paths_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$"), "tree"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$"), "repo_info"),
    ("GET", re.compile(rf"^/api/models/{_REPO}$"), "repo_info"),
]
_ERROR_CODES = {404: "RepoNotFound"}
_VALID_RELATIONS = {"adapter", "merge", "quantized", "finetune"}


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob, as the Hub reports it for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Commit:
    repo_id: str
    revision: str
    message: str
    description: str
    create_pr: bool
    files: dict[str, bytes]
    deleted: list[str]
    oid: str


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})
    heads: dict[str, str] = field(default_factory=lambda: {"main": "0" * 40})
    prs: int = 0

    @property
    def files(self) -> dict[str, bytes]:
        """Files on ``main``."""
        return self.branches["main"]


@dataclass
class _Failure:
    status: int
    times: int
    path_contains: str | None
    method: str | None
    error_code: str | None


class _Reply(Exception):  # noqa: N818 - a control-flow answer, not an error
    def __init__(self, status: int, body: object, headers: dict[str, str] | None = None) -> None:
        super().__init__(status)
        self.status, self.body, self.headers = status, body, headers or {}


class HubStandIn:
    """The stand-in. Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Args:
        user: the account name whoami answers and the namespace of repos created without one.
        token: when set, writes (and reads of private repos) need ``Authorization: Bearer <token>``
            and get 401 otherwise; when None, any or no Authorization is accepted.
    """

    def __init__(self, *, user: str = "tester", token: str | None = None) -> None:
        self.user = user
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.commits: list[Commit] = []
        self.auth_headers: list[str | None] = []
        self.requests: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.yaml_validated: list[str] = []
        self._failures: list[_Failure] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self._server is not None, "stand-in not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubStandIn:
        stand_in = self

        class Handler(_Handler):
            hub = stand_in

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="hub-stand-in", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, hf_home: str, *, disable_xet: bool = True, **extra: str) -> dict[str, str]:
        """Environment variables that point a fresh huggingface_hub process at this stand-in.

        ``disable_xet=False`` keeps huggingface_hub 2.4's default upload path (the pipelined,
        multi-commit ``upload_folder``, taken when hf_xet is installed); it talks to the same
        endpoints as long as every file is "regular", but retries a failed commit with backoff.
        """
        return {
            "HF_ENDPOINT": self.endpoint,
            "HF_HOME": hf_home,
            **({"HF_HUB_DISABLE_XET": "1"} if disable_xet else {}),
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_ETAG_TIMEOUT": "5",
            "HF_HUB_DOWNLOAD_TIMEOUT": "5",
            **extra,
        }

    # -- test controls ---------------------------------------------------------------------
    def fail(
        self,
        status: int,
        *,
        times: int = 1,
        path_contains: str | None = None,
        method: str | None = None,
        error_code: str | None = None,
    ) -> None:
        """Answer ``status`` to the next ``times`` requests whose path contains ``path_contains``
        (any path when None) and whose method is ``method`` (any when None). 404s carry the
        ``X-Error-Code`` header the Hub sends (``RepoNotFound`` unless ``error_code`` says else).
        """
        with self._lock:
            self._failures.append(_Failure(status, times, path_contains, method, error_code))

    def add_repo(self, repo_id: str, *, private: bool = False, files: dict[str, bytes] | None = None) -> Repo:
        """Create a repo directly (as if it already existed on the Hub), optionally with files on main."""
        with self._lock:
            repo = self.repos[repo_id] = Repo(repo_id, private)
            if files:
                repo.files.update(files)
                repo.heads["main"] = hashlib.sha1(repr(sorted(files)).encode()).hexdigest()
            return repo

    # -- request handling (called from the server threads) -----------------------------------
    def _take_failure(self, method: str, path: str) -> _Failure | None:
        with self._lock:
            for failure in self._failures:
                path_matches = failure.path_contains is None or failure.path_contains in path
                if failure.method in (None, method) and path_matches:
                    failure.times -= 1
                    if failure.times <= 0:
                        self._failures.remove(failure)
                    return failure
        return None

    def _authorized(self, auth: str | None) -> bool:
        return self.token is None or auth == f"Bearer {self.token}"

    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> _Reply:
        url = urlsplit(raw_path)
        path, query = url.path, parse_qs(url.query)
        auth = headers.get("authorization")
        with self._lock:
            self.requests.append((method, path))
            self.auth_headers.append(auth)

        failure = self._take_failure(method, path)
        if failure is not None:
            code = failure.error_code or _ERROR_CODES.get(failure.status)
            extra = {"X-Error-Code": code} if code else {}
            return _Reply(failure.status, {"error": f"stand-in: injected {failure.status}"}, extra)

        for route_method, pattern, name in _ROUTES:
            match = pattern.match(path)
            if route_method == method and match:
                groups = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                try:
                    return getattr(self, f"_do_{name}")(body=body, query=query, auth=auth, **groups)
                except _Reply as reply:
                    return reply
        with self._lock:
            self.unexpected.append((method, path))
        return _Reply(404, {"error": f"stand-in: no route for {method} {path}"})

    def _require_auth(self, auth: str | None) -> None:
        if not self._authorized(auth):
            raise _Reply(401, {"error": "Invalid credentials in Authorization header"},
                         {"X-Error-Message": "Invalid credentials in Authorization header"})

    def _repo(self, repo: str, auth: str | None) -> Repo:
        found = self.repos.get(repo)
        if found is None or (found.private and not self._authorized(auth)):
            raise _Reply(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
        return found

    @staticmethod
    def _branch(repo: Repo, rev: str) -> dict[str, bytes]:
        if rev not in repo.branches:
            raise _Reply(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
        return repo.branches[rev]

    def _do_whoami(self, *, auth: str | None, **_: object) -> _Reply:
        self._require_auth(auth)
        return _Reply(200, {"type": "user", "name": self.user, "orgs": [], "auth": {"type": "access_token"}})

    def _do_agent_harnesses(self, **_: object) -> _Reply:
        return _Reply(200, {"standardEnvVars": [], "harnesses": {}})

    def _do_create_repo(self, *, body: bytes, auth: str | None, **_: object) -> _Reply:
        self._require_auth(auth)
        payload = json.loads(body)
        repo_id = f"{payload.get('organization') or self.user}/{payload['name']}"
        with self._lock:
            if repo_id in self.repos:
                raise _Reply(409, {"error": "You already created this model repo", "url": f"{self.endpoint}/{repo_id}"})
            self.repos[repo_id] = Repo(repo_id, payload.get("visibility") == "private" or bool(payload.get("private")))
        return _Reply(200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id})

    def _do_validate_yaml(self, *, body: bytes, **_: object) -> _Reply:
        content = json.loads(body)["content"]
        with self._lock:
            self.yaml_validated.append(content)
        match = re.match(r"^\s*---\r?\n([\s\S]*?)\r?\n---[ \t]*(\r?\n|$)", content)
        errors: list[dict[str, str]] = []
        if match:
            try:
                data = yaml.safe_load(match.group(1)) or {}
            except yaml.YAMLError as e:
                data, errors = {}, [{"message": f"YAML error: {e}"}]
            if not isinstance(data, dict):
                errors.append({"message": "metadata must be a mapping"})
            else:
                tags = data.get("tags", [])
                if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
                    errors.append({"message": '"tags" must be a list of strings'})
                relation = data.get("base_model_relation")
                if relation is not None and relation not in _VALID_RELATIONS:
                    errors.append({"message": f'"base_model_relation" must be one of {sorted(_VALID_RELATIONS)}'})
                if relation is not None and not data.get("base_model"):
                    errors.append({"message": '"base_model_relation" needs "base_model"'})
        if errors:
            return _Reply(400, {"errors": errors, "warnings": []})
        return _Reply(200, {"errors": [], "warnings": []})

    def _do_repo_info(self, *, repo: str, auth: str | None, rev: str = "main", **_: object) -> _Reply:
        with self._lock:
            found = self._repo(repo, auth)
            files = self._branch(found, rev)
            return _Reply(200, {
                "id": found.repo_id,
                "private": found.private,
                "sha": found.heads[rev],
                "siblings": [{"rfilename": name} for name in sorted(files)],
                "tags": [],
            })

    def _do_create_branch(self, *, repo: str, rev: str, auth: str | None, **_: object) -> _Reply:
        self._require_auth(auth)
        with self._lock:
            found = self._repo(repo, auth)
            if rev in found.branches:
                raise _Reply(409, {"error": "Reference already exists"})
            found.branches[rev] = dict(found.files)
            found.heads[rev] = found.heads["main"]
        return _Reply(200, {})

    def _do_preupload(self, *, repo: str, rev: str, body: bytes, auth: str | None, **_: object) -> _Reply:
        self._require_auth(auth)
        with self._lock:
            found = self._repo(repo, auth)
            files = self._branch(found, rev)
            answer = []
            for item in json.loads(body)["files"]:
                existing = files.get(item["path"])
                answer.append({
                    "path": item["path"],
                    "uploadMode": "regular",
                    "shouldIgnore": False,
                    "oid": git_blob_sha1(existing) if existing is not None else None,
                })
        return _Reply(200, {"files": answer, "commitOid": found.heads[rev]})

    def _do_paths_info(self, *, repo: str, rev: str, body: bytes, auth: str | None, **_: object) -> _Reply:
        with self._lock:
            files = self._branch(self._repo(repo, auth), rev)
            wanted = parse_qs(body.decode()).get("paths", [])  # form-encoded, one "paths" per path
            return _Reply(200, [
                {"type": "file", "path": p, "size": len(files[p]), "oid": git_blob_sha1(files[p])}
                for p in wanted if p in files
            ])

    def _do_tree(self, *, repo: str, rev: str, query: dict, auth: str | None, path: str | None = None,
                 **_: object) -> _Reply:
        """One page (no ``Link`` header): the Hub's entries, folders first as it sends them."""
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        prefix = f"{path.strip('/')}/" if path else ""
        with self._lock:
            files = self._branch(self._repo(repo, auth), rev)
            if path and not any(name.startswith(prefix) for name in files):
                raise _Reply(404, {"error": f"Entry not found: {path}"}, {"X-Error-Code": "EntryNotFound"})
            folders, entries = set(), []
            for name in sorted(files):
                if not name.startswith(prefix):
                    continue
                parts = name[len(prefix):].split("/")
                for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                    folders.add(prefix + "/".join(parts[:depth]))
                if recursive or len(parts) == 1:
                    entries.append({"type": "file", "oid": git_blob_sha1(files[name]), "size": len(files[name]),
                                    "path": name})
            tree = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
            return _Reply(200, tree + entries)

    def _do_commit(self, *, repo: str, rev: str, body: bytes, query: dict, auth: str | None, **_: object) -> _Reply:
        self._require_auth(auth)
        create_pr = query.get("create_pr", ["0"])[0] == "1"
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        added: dict[str, bytes] = {}
        deleted: list[str] = []
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise _Reply(400, {"error": f"stand-in: unexpected encoding {value.get('encoding')!r}"})
                added[value["path"]] = base64.b64decode(value["content"])
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
            elif key != "header":
                with self._lock:
                    self.unexpected.append(("COMMIT-LINE", key))
                raise _Reply(400, {"error": f"stand-in: commit line {key!r} not expected (preupload said regular)"})
        with self._lock:
            found = self._repo(repo, auth)
            base = self._branch(found, rev)
            target = rev
            if create_pr:
                found.prs += 1
                target = f"refs/pr/{found.prs}"
                found.branches[target] = dict(base)
            files = found.branches[target]
            for path in deleted:
                files.pop(path, None)
            files.update(added)
            oid = hashlib.sha1(f"{repo}:{target}:{len(self.commits)}".encode()).hexdigest()
            found.heads[target] = oid
            self.commits.append(Commit(repo, rev, header.get("summary", ""), header.get("description", ""),
                                       create_pr, added, deleted, oid))
            answer = {"commitUrl": f"{self.endpoint}/{repo}/commit/{oid}", "commitOid": oid, "success": True}
            if create_pr:
                answer["pullRequestUrl"] = f"{self.endpoint}/{repo}/discussions/{found.prs}"
        return _Reply(200, answer)


class _Handler(BaseHTTPRequestHandler):
    hub: HubStandIn
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib signature
        pass  # keep test output clean

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip().split(b";")[0], 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        body = self._body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        try:
            reply = self.hub.handle(self.command, self.path, headers, body)
        except Exception as e:  # a bug in the stand-in: answer 500 rather than hang the client
            reply = _Reply(500, {"error": f"stand-in crashed: {type(e).__name__}: {e}"})
        data = json.dumps(reply.body).encode()
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in reply.headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve  # noqa: N815 - stdlib naming
