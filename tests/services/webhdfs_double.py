"""``WebHdfsDouble``: a WebHDFS *protocol double* for the tests. It is not HDFS.

No HDFS can be installed on the test machines, so the ``webhdfs://`` code path is tested
against this small HTTP server, which answers the REST calls of the WebHDFS API (Hadoop 3,
``/webhdfs/v1/<path>?op=…``) that fsspec's WebHDFS client makes, with the semantics HDFS gives
them, over a local folder:

- ``GETFILESTATUS``, ``LISTSTATUS`` (``FileStatus``/``FileStatuses`` JSON), ``MKDIRS``,
  ``DELETE`` (``recursive``), ``RENAME`` (``{"boolean": false}`` and no change when the target
  exists or the source does not: HDFS's rename never replaces);
- ``CREATE`` (PUT; ``overwrite=false`` over an existing file is ``FileAlreadyExistsException``),
  ``APPEND`` (POST) and ``OPEN`` (GET with ``offset``/``length``) in two steps, as a namenode
  does: a 307 redirect to a "datanode" URL of the same server, which takes or gives the bytes;
- errors as ``{"RemoteException": {"exception", "javaClassName", "message"}}`` with HDFS's
  status codes (404 ``FileNotFoundException``, 403 ``FileAlreadyExistsException``).

Anything else is answered 400 ``UnsupportedOperationException``. ``WebHdfsDouble()`` serves on
127.0.0.1 and a port the OS picks, in a thread of the calling process; ``url`` is its
``webhdfs://`` root; ``stop()`` ends it and removes its folder (idempotent). A real namenode is
used instead when ``RELAY_TEST_HDFS`` names one (tests/integration/test_storage_hdfs.py).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["WebHdfsDouble"]

NAMENODE, DATANODE = "/webhdfs/v1", "/datanode/v1"


class WebHdfsDouble:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="relay-webhdfs-double-"))
        handler = type("Handler", (_Handler,), {"root": self.root})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"webhdfs://127.0.0.1:{self.port}"
        self.requests: list[str] = []  # "OP path", in order: what the client asked
        handler.log = self.requests
        self._thread = threading.Thread(target=self._server.serve_forever, name="webhdfs-double", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


class _Handler(BaseHTTPRequestHandler):
    root: Path
    log: list[str]
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    # ------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        op = query.get("op", "").upper()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        for base, datanode in ((NAMENODE, False), (DATANODE, True)):
            if parts.path.startswith(base):
                hdfs_path = "/" + unquote(parts.path[len(base):]).strip("/")
                break
        else:
            return self._error(400, "IllegalArgumentException", f"not a WebHDFS path: {parts.path}")
        self.log.append(f"{op} {hdfs_path}")
        handler = getattr(self, f"_{op.lower()}", None)
        if handler is None:
            return self._error(400, "UnsupportedOperationException", f"op={op} is not supported by the double")
        handler(method, hdfs_path, query, body, datanode)

    def _local(self, hdfs_path: str) -> Path:
        local = (self.root / hdfs_path.lstrip("/")).resolve()
        if local != self.root and self.root not in local.parents:
            raise PermissionError(hdfs_path)
        return local

    # ------------------------------------------------------------ replies

    def _json(self, status: int, data: dict) -> None:
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, status: int, exception: str, message: str) -> None:
        self._json(status, {"RemoteException": {"exception": exception, "message": message,
                                                "javaClassName": f"java.io.{exception}"}})

    def _redirect(self, hdfs_path: str, query: dict) -> None:
        host, port = self.server.server_address[:2]
        params = "&".join(f"{k}={quote(str(v))}" for k, v in query.items())
        self.send_response(307)
        self.send_header("Location", f"http://{host}:{port}{DATANODE}{quote(hdfs_path)}?{params}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _bytes(self, data: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    @staticmethod
    def _status(local: Path, suffix: str) -> dict:
        stat = local.stat()
        return {"pathSuffix": suffix, "type": "DIRECTORY" if local.is_dir() else "FILE",
                "length": 0 if local.is_dir() else stat.st_size, "modificationTime": int(stat.st_mtime * 1000),
                "accessTime": int(stat.st_atime * 1000), "blockSize": 134217728, "replication": 1,
                "owner": "relay", "group": "relay", "permission": "755"}

    # ------------------------------------------------------------ operations

    def _getfilestatus(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not local.exists():
            return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
        self._json(200, {"FileStatus": self._status(local, "")})

    def _liststatus(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not local.exists():
            return self._error(404, "FileNotFoundException", f"File {path} does not exist.")
        entries = [self._status(local, "")] if local.is_file() else \
            [self._status(child, child.name) for child in sorted(local.iterdir())]
        self._json(200, {"FileStatuses": {"FileStatus": entries}})

    def _mkdirs(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if local.is_file():
            return self._error(403, "FileAlreadyExistsException", f"Path is not a directory: {path}")
        local.mkdir(parents=True, exist_ok=True)
        self._json(200, {"boolean": True})

    def _delete(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not local.exists() or local == self.root:
            return self._json(200, {"boolean": False})
        if local.is_dir():
            if query.get("recursive") != "true" and any(local.iterdir()):
                return self._error(403, "PathIsNotEmptyDirectoryException", f"{path} is non empty")
            shutil.rmtree(local)
        else:
            local.unlink()
        self._json(200, {"boolean": True})

    def _rename(self, method, path, query, body, datanode) -> None:
        source, target = self._local(path), self._local(query.get("destination", ""))
        if not source.exists() or target.exists() or not target.parent.is_dir():
            return self._json(200, {"boolean": False})  # HDFS: no change, no exception
        source.rename(target)
        self._json(200, {"boolean": True})

    def _create(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not datanode:
            if local.exists() and query.get("overwrite", "false") != "true":
                return self._error(403, "FileAlreadyExistsException", f"{path} already exists")
            if local.is_dir():
                return self._error(403, "FileAlreadyExistsException", f"{path} is a directory")
            return self._redirect(path, query)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(body)
        self._bytes(b"", 201)

    def _append(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not local.is_file():
            return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
        if not datanode:
            return self._redirect(path, query)
        with open(local, "ab") as fh:
            fh.write(body)
        self._bytes(b"")

    def _open(self, method, path, query, body, datanode) -> None:
        local = self._local(path)
        if not local.is_file():
            return self._error(404, "FileNotFoundException", f"File does not exist: {path}")
        if not datanode:
            return self._redirect(path, query)
        offset = int(query.get("offset", 0))
        length = query.get("length")
        with open(local, "rb") as fh:
            fh.seek(offset)
            self._bytes(fh.read(int(length)) if length is not None else fh.read())
