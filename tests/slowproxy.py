"""A slow network on 127.0.0.1: a TCP proxy that forwards bytes at a bounded rate.

Point a client at ``proxy.endpoint`` instead of the server (``AWS_ENDPOINT_URL`` for S3)
and every connection's bytes, both ways, move at most ``rate`` bytes per second: what a
congested link to an object store looks like to TensorStore, with nothing of ours mocked.

>>> with SlowProxy(("127.0.0.1", moto_port), rate=64 << 10) as proxy:
...     env = {"AWS_ENDPOINT_URL": proxy.endpoint}
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

_CHUNK = 4096


class SlowProxy:
    """Forwards each accepted connection to ``target``, ``rate`` bytes/s each way."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target, self.rate = target, rate
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="slowproxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.target)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Copies ``src`` to ``dst`` in chunks, each after the time it takes at ``rate``."""
        with contextlib.suppress(OSError):
            while data := src.recv(_CHUNK):
                time.sleep(len(data) / self.rate)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()

    def __enter__(self) -> SlowProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
