"""A local stand-in for the Hugging Face Hub, for tests of the Hub baseline backend.

No pip-installable Hub server accepts uploads (huggingface_hub's own tests run against a staging Hub), so this
threaded HTTP server on 127.0.0.1 implements exactly the endpoints huggingface_hub 1.33 calls for our commands,
with the fields and headers its parsers read:

- ``POST /api/repos/create`` (an initial commit holding ``.gitattributes``, as the Hub makes; 409 if it exists)
- ``GET /api/datasets/{repo}[/revision/{rev}]`` (repo info: ``sha``, ``siblings``), 404 for an unknown revision
- ``GET /api/datasets/{repo}/tree/{rev}[/{path}]`` (``oid`` = git blob sha1, ``lfs.oid`` = sha256, paginated by a
  ``Link: <...>; rel="next"`` header like the Hub's)
- ``POST /api/validate-yaml`` (the dataset card's front matter must parse as a YAML mapping)
- ``POST /api/datasets/{repo}/preupload/{rev}`` -> ``uploadMode`` "lfs" for binary samples, ``.gitattributes``
  LFS suffixes or files of 10 MiB and more, else "regular" (the Hub's rule)
- ``POST /datasets/{repo}.git/info/lfs/objects/batch`` (git-LFS basic transfer: upload + verify actions),
  ``PUT /lfs-upload/{oid}`` (the bytes must hash to the oid) and ``POST /lfs-verify/{oid}``
- ``POST /api/datasets/{repo}/commit/{rev}`` (NDJSON: header, ``file`` base64 inline, ``lfsFile``, ``deletedFile``);
  a ``parentCommit`` that is not the branch head -> HTTP 412, as the Hub answers a stale parent
- ``HEAD``/``GET /datasets/{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (git sha1 of a regular file),
  and for LFS files a 302 to ``/lfs-objects/{sha256}`` with ``X-Linked-Etag`` / ``X-Linked-Size``, as the Hub
  redirects to its CDN; the redirect names the host ``localhost`` (the same socket) so that the client, like with
  the real CDN, reads the metadata from the redirect instead of following it.

Xet storage (the client's default upload path when hf_xet is installed) talks a binary protocol to a separate
content store; tests run the client with ``HF_HUB_DISABLE_XET=1`` so it uses the git-LFS transfer instead.
``corrupt`` (a set of repo paths) makes downloads of those files return the right length with one byte flipped,
to test that a corrupt download is caught.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar, Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

import yaml

LFS_SUFFIXES = (".parquet", ".npz", ".npy", ".arrow", ".bin", ".safetensors", ".pt", ".zip", ".gz")
LFS_MIN_SIZE = 10 * 1024 * 1024
TREE_PAGE = 50  # entries per tree page: small enough that the tests exercise pagination
GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in LFS_SUFFIXES).encode()


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class _File:
    data: bytes
    lfs: bool


@dataclass
class _Repo:
    commits: dict[str, dict[str, _File]] = field(default_factory=dict)
    head: str = ""


class HubState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.repos: dict[str, _Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 -> bytes, uploaded but maybe not yet committed
        self.corrupt: set[str] = set()
        self.requests: list[str] = []  # "METHOD path" of every request, for tests to assert on

    def new_commit(self, repo: _Repo, files: dict[str, _File], summary: str) -> str:
        sha = hashlib.sha1(f"{repo.head}\n{summary}\n{time.time_ns()}\n{len(repo.commits)}".encode()).hexdigest()
        repo.commits[sha] = files
        repo.head = sha
        return sha

    def resolve(self, repo_id: str, rev: str) -> tuple[_Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return None
        if rev == "main":
            return repo, repo.head
        return (repo, rev) if rev in repo.commits else None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(
        self,
        code: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        ctype: str = "application/json",
        head: bool = False,
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, code: int, obj, headers: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(obj).encode(), headers)

    def _error(self, code: int, message: str, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(
            code, json.dumps({"error": message}).encode(), {"X-Error-Message": message, **(headers or {})}, head=head
        )

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = unquote(url.path), parse_qs(url.query)
        state = self.server.state
        with state.lock:
            state.requests.append(f"{method} {path}")
        for pattern, handler in self.ROUTES.get(method, ()):
            m = re.fullmatch(pattern, path)
            if m:
                handler(self, *m.groups(), query=query)
                return
        self._error(404, f"no route for {method} {path}", head=method == "HEAD")

    def do_GET(self) -> None:
        self._route("GET")

    def do_HEAD(self) -> None:
        self._route("HEAD")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    @property
    def _base(self) -> str:
        return f"http://{self.server.server_address[0]}:{self.server.server_address[1]}"

    # -- repos ------------------------------------------------------------------------------------------------
    def create_repo(self, query) -> None:
        req = json.loads(self._body())
        repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else req["name"]
        state = self.server.state
        with state.lock:
            if repo_id in state.repos:
                self._error(409, "You already created this dataset repo")
                return
            repo = state.repos[repo_id] = _Repo()
            state.new_commit(repo, {".gitattributes": _File(GITATTRIBUTES, False)}, "initial commit")
        self._json(200, {"url": f"{self._base}/datasets/{repo_id}", "name": repo_id})

    def repo_info(self, repo_id: str, rev: str | None, query) -> None:
        state = self.server.state
        with state.lock:
            found = state.resolve(repo_id, rev or "main")
            if found is None:
                code = 404
                msg = "Repository not found" if repo_id not in state.repos else f"Invalid rev id: {rev}"
                self._error(
                    code, msg, {"X-Error-Code": "RepoNotFound" if repo_id not in state.repos else "RevisionNotFound"}
                )
                return
            repo, sha = found
            files = repo.commits[sha]
        self._json(
            200,
            {
                "id": repo_id,
                "sha": sha,
                "private": False,
                "tags": [],
                "siblings": [{"rfilename": p} for p in sorted(files)],
            },
        )

    def tree(self, repo_id: str, rev: str, sub: str | None, query) -> None:
        state = self.server.state
        with state.lock:
            found = state.resolve(repo_id, rev)
            if found is None:
                self._error(404, f"Invalid rev id: {rev}", {"X-Error-Code": "RevisionNotFound"})
                return
            repo, sha = found
            files = dict(repo.commits[sha])
        prefix = f"{sub.rstrip('/')}/" if sub else ""
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        entries, dirs = [], set()
        for p in sorted(files):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix) :]
            if "/" in rest and not recursive:
                dirs.add(prefix + rest.split("/")[0])
                continue
            if recursive:
                parts = rest.split("/")[:-1]
                dirs.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
            f = files[p]
            e = {"type": "file", "path": p, "size": len(f.data), "oid": git_blob_sha1(f.data)}
            if f.lfs:
                e["lfs"] = {"oid": hashlib.sha256(f.data).hexdigest(), "size": len(f.data), "pointerSize": 134}
            entries.append(e)
        entries += [
            {"type": "directory", "path": d, "size": 0, "oid": hashlib.sha1(d.encode()).hexdigest()}
            for d in sorted(dirs)
        ]
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + TREE_PAGE]
        headers = {}
        if start + TREE_PAGE < len(entries):
            nxt = (
                f"{self._base}/api/datasets/{repo_id}/tree/{quote(rev, safe='')}{'/' + quote(sub) if sub else ''}"
                f"?recursive={str(recursive).lower()}&expand=false&cursor={start + TREE_PAGE}"
            )
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._json(200, page, headers)

    def validate_yaml(self, query) -> None:
        content = json.loads(self._body())["content"]
        m = re.match(r"^---\n(.*?)\n---\n", content, re.DOTALL)
        errors = []
        try:
            meta = yaml.safe_load(m.group(1)) if m else {}
            if not isinstance(meta, dict):
                errors.append({"message": "metadata must be a YAML mapping"})
        except yaml.YAMLError as e:
            errors.append({"message": f"invalid YAML: {e}"})
        self._json(400 if errors else 200, {"errors": errors, "warnings": []})

    # -- uploads ----------------------------------------------------------------------------------------------
    def preupload(self, repo_id: str, rev: str, query) -> None:
        req = json.loads(self._body())
        out = []
        for f in req["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = b"\0" in sample or f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False})
        self._json(200, {"files": out, "commitOid": self.server.state.repos[repo_id].head})

    def lfs_batch(self, repo_id: str, query) -> None:
        req = json.loads(self._body())
        objects = []
        for o in req["objects"]:
            obj = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.server.state.lfs:
                obj["actions"] = {
                    "upload": {"href": f"{self._base}/lfs-upload/{o['oid']}", "header": {}},
                    "verify": {"href": f"{self._base}/lfs-verify/{o['oid']}", "header": {}},
                }
            objects.append(obj)
        self._send(
            200, json.dumps({"transfer": "basic", "objects": objects}).encode(), ctype="application/vnd.git-lfs+json"
        )

    def lfs_upload(self, oid: str, query) -> None:
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            self._error(400, "uploaded bytes do not match the LFS oid")
            return
        with self.server.state.lock:
            self.server.state.lfs[oid] = data
        self._send(200)

    def lfs_verify(self, oid: str, query) -> None:
        req = json.loads(self._body())
        data = self.server.state.lfs.get(oid)
        if data is None or len(data) != req["size"]:
            self._error(404, f"LFS object {oid} not found or of another size")
            return
        self._json(200, {"success": True})

    def commit(self, repo_id: str, rev: str, query) -> None:
        lines = [json.loads(x) for x in self._body().splitlines() if x.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        state = self.server.state
        with state.lock:
            repo = state.repos.get(repo_id)
            if repo is None:
                self._error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
                return
            parent = header.get("parentCommit")
            if parent is not None and parent != repo.head:
                self._error(412, "A commit has happened since. Please refresh and try again.")
                return
            files = dict(repo.commits[repo.head])
            for x in lines:
                v = x["value"]
                if x["key"] == "file":
                    files[v["path"]] = _File(base64.b64decode(v["content"]), False)
                elif x["key"] == "lfsFile":
                    data = state.lfs.get(v["oid"])
                    if data is None:
                        self._error(422, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                        return
                    files[v["path"]] = _File(data, True)
                elif x["key"] == "deletedFile":
                    if files.pop(v["path"], None) is None:
                        self._error(404, "A file with this name doesn't exist", {"X-Error-Code": "EntryNotFound"})
                        return
                elif x["key"] != "header":
                    self._error(400, f"unsupported commit operation {x['key']}")
                    return
            sha = state.new_commit(repo, files, header["summary"])
        self._json(
            200, {"success": True, "commitOid": sha, "commitUrl": f"{self._base}/datasets/{repo_id}/commit/{sha}"}
        )

    # -- downloads --------------------------------------------------------------------------------------------
    def _resolve_file(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        state = self.server.state
        with state.lock:
            found = state.resolve(repo_id, rev)
            if found is None:
                self._error(404, f"Invalid rev id: {rev}", {"X-Error-Code": "RevisionNotFound"}, head)
                return
            repo, sha = found
            f = repo.commits[sha].get(path)
        common = {"X-Repo-Commit": sha}
        if f is None:
            self._error(404, "Entry not found", {"X-Error-Code": "EntryNotFound", **common}, head)
            return
        if f.lfs:
            oid = hashlib.sha256(f.data).hexdigest()
            cdn = f"http://localhost:{self.server.server_address[1]}"  # another host name, as the Hub's CDN is
            self._send(
                302,
                b"",
                {
                    **common,
                    "Location": f"{cdn}/lfs-objects/{oid}?path={quote(path)}",
                    "X-Linked-Etag": f'"{oid}"',
                    "X-Linked-Size": str(len(f.data)),
                    "ETag": f'"{git_blob_sha1(f.data)}"',
                },
                head=head,
            )
            return
        self._send(
            200,
            self._maybe_corrupt(path, f.data),
            {**common, "ETag": f'"{git_blob_sha1(f.data)}"'},
            ctype="application/octet-stream",
            head=head,
        )

    def _maybe_corrupt(self, path: str, data: bytes) -> bytes:
        if path in self.server.state.corrupt and data:
            return data[:-1] + bytes([data[-1] ^ 0xFF])
        return data

    def resolve_get(self, repo_id: str, rev: str, path: str, query) -> None:
        self._resolve_file(repo_id, rev, path, head=False)

    def resolve_head(self, repo_id: str, rev: str, path: str, query) -> None:
        self._resolve_file(repo_id, rev, path, head=True)

    def lfs_object(self, oid: str, query, head: bool = False) -> None:
        data = self.server.state.lfs.get(oid)
        if data is None:
            self._error(404, "no such object", head=head)
            return
        path = query.get("path", [""])[0]
        self._send(
            200, self._maybe_corrupt(path, data), {"ETag": f'"{oid}"'}, ctype="application/octet-stream", head=head
        )

    _REPO = r"([^/]+/[^/]+)"
    ROUTES: ClassVar[dict] = {
        "GET": [
            (rf"/api/datasets/{_REPO}", lambda h, r, query: h.repo_info(r, None, query)),
            (rf"/api/datasets/{_REPO}/revision/([^/]+)", repo_info),
            (rf"/api/datasets/{_REPO}/tree/([^/]+)(?:/(.+))?", tree),
            (rf"/datasets/{_REPO}/resolve/([^/]+)/(.+)", resolve_get),
            (r"/lfs-objects/([0-9a-f]{64})", lfs_object),
        ],
        "HEAD": [
            (rf"/datasets/{_REPO}/resolve/([^/]+)/(.+)", resolve_head),
            (r"/lfs-objects/([0-9a-f]{64})", lambda h, oid, query: h.lfs_object(oid, query, head=True)),
        ],
        "POST": [
            (r"/api/repos/create", create_repo),
            (r"/api/validate-yaml", validate_yaml),
            (rf"/api/datasets/{_REPO}/preupload/([^/]+)", preupload),
            (rf"/api/datasets/{_REPO}/commit/([^/]+)", commit),
            (rf"/datasets/{_REPO}\.git/info/lfs/objects/batch", lfs_batch),
            (r"/lfs-verify/([0-9a-f]{64})", lfs_verify),
        ],
        "PUT": [(r"/lfs-upload/([0-9a-f]{64})", lfs_upload)],
    }


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = HubState()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
