"""A model hub on localhost for tests without the internet: the real `huggingface_hub` client
(HF_ENDPOINT pointed here) downloads from a directory laid out as ROOT/ORG/NAME/COMMIT/FILES, with
ROOT/ORG/NAME/refs/BRANCH holding a commit hash.

Served as the hub serves them: ``HEAD|GET /ORG/NAME/resolve/REVISION/FILE`` (ETag, X-Repo-Commit,
Content-Length, range requests answered 206), ``GET /api/models/ORG/NAME[/revision/REVISION]`` (the
commit and its files with their sizes); a missing repository, revision or file is a 404 with the
hub's X-Error-Code. `rate` (bytes per second) slows file bodies down, so that a test can kill a
download half way.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def publish(root: Path, repo: str, src: Path, branch: str = "main") -> str:
    """Copy the files of directory `src` into the hub at `root` as a new commit of `repo` on `branch`;
    returns the commit hash (of the files' names and bytes)."""
    digest = hashlib.sha1()
    for f in sorted(p for p in src.iterdir() if p.is_file()):
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    commit = digest.hexdigest()
    shutil.copytree(src, root / repo / commit, dirs_exist_ok=True)
    (root / repo / "refs").mkdir(parents=True, exist_ok=True)
    (root / repo / "refs" / branch).write_text(commit)
    return commit


def shard(src: Path, out: Path, n: int) -> Path:
    """`src`'s checkpoint written into `out` as `n` shards (tensors in name order, as many in each)
    with model.safetensors.index.json; its other files copied."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    names = sorted(tensors)
    groups = [names[i * len(names) // n:(i + 1) * len(names) // n] for i in range(n)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file({k: np.ascontiguousarray(tensors[k]) for k in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                                                                  "weight_map": weight_map}, indent=2))
    return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """Quiet about a client gone (a pull killed mid-request by the kill trials); loud about the rest."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class HubServer:
    """The hub at `root`, served on a free localhost port from a thread; `url` is HF_ENDPOINT."""

    def __init__(self, root: Path, rate: float | None = None):
        self.root, self.rate = Path(root), rate
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body: bool):
                try:
                    hub._answer(self, body)
                except (BrokenPipeError, ConnectionResetError):  # the client was killed mid-answer
                    self.close_connection = True

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _commit(self, repo: str, revision: str) -> str | None:
        ref = self.root / repo / "refs" / revision
        if ref.is_file():
            return ref.read_text().strip()
        return revision if re.fullmatch(r"[0-9a-f]{40}", revision) and (self.root / repo / revision).is_dir() else None

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range")))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        if m:
            return self._info(h, m[1], m[2] or "main", body)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self._file(h, m[1], m[2], m[3], body)
        self._error(h, 404, "EntryNotFound", body)

    def _error(self, h, status: int, code: str, body: bool) -> None:
        data = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _info(self, h, repo: str, revision: str, body: bool) -> None:
        if not (self.root / repo).is_dir():
            return self._error(h, 404, "RepoNotFound", body)
        commit = self._commit(repo, revision)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", body)
        files = sorted(p for p in (self.root / repo / commit).rglob("*") if p.is_file())
        data = json.dumps({"id": repo, "modelId": repo, "sha": commit, "private": False, "tags": [],
                           "siblings": [{"rfilename": f.relative_to(self.root / repo / commit).as_posix(),
                                         "size": f.stat().st_size} for f in files]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _file(self, h, repo: str, revision: str, name: str, body: bool) -> None:
        if not (self.root / repo).is_dir():
            return self._error(h, 404, "RepoNotFound", body)
        commit = self._commit(repo, revision)
        if commit is None:
            return self._error(h, 404, "RevisionNotFound", body)
        f = self.root / repo / commit / name
        if not f.is_file():
            return self._error(h, 404, "EntryNotFound", body)
        size = f.stat().st_size
        first, last = 0, size - 1
        rng = re.fullmatch(r"bytes=(\d*)-(\d*)", h.headers.get("Range") or "")
        if rng:
            if rng[1]:
                first, last = int(rng[1]), min(size - 1, int(rng[2])) if rng[2] else size - 1
            else:  # the last N bytes
                first = max(0, size - int(rng[2]))
        h.send_response(206 if rng else 200)
        h.send_header("ETag", f'"{hashlib.sha256(f.read_bytes()).hexdigest()}"')
        h.send_header("X-Repo-Commit", commit)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(last - first + 1))
        if rng:
            h.send_header("Content-Range", f"bytes {first}-{last}/{size}")
        h.end_headers()
        if not body:
            return
        with open(f, "rb") as src:
            src.seek(first)
            left = last - first + 1
            while left > 0:
                chunk = src.read(min(left, 1 << 16))
                h.wfile.write(chunk)
                left -= len(chunk)
                if self.rate:
                    time.sleep(len(chunk) / self.rate)


if __name__ == "__main__":
    # tools/check_dist.sh: python hubserver.py ROOT ORG/NAME CHECKPOINT publishes the checkpoint (in
    # 2 shards) as ORG/NAME into the hub at ROOT, prints the hub's URL, then serves until killed
    root, repo, checkpoint = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    publish(root, repo, shard(checkpoint, root.parent / "sharded", 2))
    with HubServer(root) as server:
        print(server.url, flush=True)
        threading.Event().wait()
