"""A TCP proxy on 127.0.0.1 whose open connections a test can cut, as a flaky network would.

``with CuttableProxy(upstream_port) as proxy:`` listens on ``proxy.port`` (the OS picks it) and
forwards every connection to ``upstream_port``; ``proxy.cut()`` resets every connection open
now (new ones are still accepted) and returns how many it cut. Threads only; all are ended
on exit.
"""
from __future__ import annotations

import socket
import struct
import threading


class CuttableProxy:
    def __init__(self, upstream_port: int, upstream_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._threads: list[threading.Thread] = []
        self._closed = False

    def __enter__(self) -> "CuttableProxy":
        self._spawn(self._accept_loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._listener.close()
        self.cut()
        for t in self._threads:
            t.join(timeout=5)

    def cut(self) -> int:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                try:  # linger 0: the close sends RST, so the peer sees the connection break, not end
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the pump threads blocked on it
                except OSError:
                    pass
                sock.close()
        return len(pairs)

    def _spawn(self, target, *args) -> None:  # noqa: ANN001
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
