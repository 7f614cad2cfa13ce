"""A faulty network on 127.0.0.1: an HTTP/1.1 proxy that fails some requests on purpose.

Point a client at ``proxy.endpoint`` instead of the server (``AWS_ENDPOINT_URL`` for S3)
and, request by request (keep-alive connections carry several), with a seeded
``random.Random``:

* ``p_503``: the request is answered ``503 SlowDown`` with S3's XML error body, and never
  reaches the server (what S3 does to a prefix taking too many requests);
* ``p_drop``: the client's connection is reset (RST): before the request is forwarded, or
  after it was (the server acted on it) with the response cut short, half-way through its
  head or body (a dead load balancer, a lost link);
* ``p_slow``: the response is held back for up to ``slow_s`` seconds (a congested link);
* ``"stall"`` (only through ``decide``): the request is never answered, its connection
  held open until the proxy closes (an object store or load balancer that hangs);
* else the request is forwarded and its response relayed as it comes.

TensorStore retries 503s and broken connections itself, so a client that works through
this proxy is one that survives those faults, with nothing of ours mocked. ``injected``
counts the faults by kind (``"503"``, ``"drop_before"``, ``"drop_midway"``, ``"slow"``),
``requests`` the requests seen, ``log`` the last ones (request line, ``If-*`` headers,
fault). A conditional write (``If-Match`` / ``If-None-Match``) whose answer is lost after
the server applied it cannot be retried blindly: ``midway_conditional=False`` drops such
requests only before they are forwarded. ``decide`` injects a chosen fault into chosen
requests (deterministic tests).

``Expect: 100-continue`` (libcurl sends it before larger uploads) is answered by the proxy
itself and stripped from the forwarded request, so that a request's body is always read
whole before its fate is decided. Bounded: at most ``max_connections`` connections at
once, every socket times out after ``idle_s`` of silence, and the proxy closes itself
after ``lifetime_s`` (or on ``close`` / leaving its ``with``).

>>> with FaultProxy(("127.0.0.1", moto_port), p_503=0.1, p_drop=0.03, seed=1) as proxy:
...     env = {"AWS_ENDPOINT_URL": proxy.endpoint}
...     ...
...     assert proxy.injected["503"] > 0
"""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable

_CHUNK = 64 << 10
_MAX_HEAD = 64 << 10  # a request or response head longer than this is refused


class _Closed(Exception):
    """The peer closed the connection (between requests: the normal end)."""


class _Reader:
    """Buffered reads from a socket: lines, exact counts, HTTP bodies."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        data = self.sock.recv(_CHUNK)
        if not data:
            raise _Closed
        self.buf += data

    def head(self) -> bytes:
        """Up to and including the blank line that ends a request or response head."""
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD:
                raise ValueError("HTTP head too long")
            self._fill()
        out, self.buf = self.buf[: end + 4], self.buf[end + 4 :]
        return out

    def line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > _MAX_HEAD:
                raise ValueError("HTTP line too long")
            self._fill()
        out, self.buf = self.buf[: end + 2], self.buf[end + 2 :]
        return out

    def exactly(self, n: int):
        """Yields the next ``n`` bytes in pieces as they come."""
        while n > 0:
            if not self.buf:
                self._fill()
            piece, self.buf = self.buf[:n], self.buf[n:]
            n -= len(piece)
            yield piece

    def chunked(self):
        """Yields a chunked body's raw bytes (sizes, data, trailers) as they come."""
        while True:
            size_line = self.line()
            yield size_line
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (trailer := self.line()) != b"\r\n":
                    yield trailer
                yield b"\r\n"
                return
            yield from self.exactly(size + 2)  # the data and its CRLF

    def until_closed(self):
        while True:
            if self.buf:
                piece, self.buf = self.buf, b""
                yield piece
            try:
                self._fill()
            except _Closed:
                return


class _Message:
    """A parsed request or response head: first line, headers (in order), raw form."""

    def __init__(self, raw: bytes) -> None:
        lines = raw[:-4].decode("latin-1").split("\r\n")
        self.first = lines[0]
        self.headers = [
            (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
        ]

    def get(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def without(self, name: str) -> bytes:
        """The raw head without the header ``name``."""
        keep = [f"{k}: {v}" for k, v in self.headers if k.lower() != name.lower()]
        return ("\r\n".join([self.first, *keep]) + "\r\n\r\n").encode("latin-1")

    def body(self, reader: _Reader, *, request: bool, head_request: bool = False):
        """The message's body, raw, as pieces (request: framing by its headers only)."""
        if not request and (head_request or self.status in (204, 304) or self.status < 200):
            return iter(())
        if (self.get("transfer-encoding") or "").lower().endswith("chunked"):
            return reader.chunked()
        length = self.get("content-length")
        if length is not None:
            return reader.exactly(int(length))
        return iter(()) if request else reader.until_closed()

    @property
    def status(self) -> int:
        """A response's status code."""
        return int(self.first.split()[1])

    def framed(self, request: _Message) -> bool:
        """Whether a response's end is known without the connection's close."""
        if request.first.upper().startswith("HEAD ") or self.status in (204, 304):
            return True
        return self.get("content-length") is not None or bool(self.get("transfer-encoding"))

    def keeps_alive(self) -> bool:
        conn = (self.get("connection") or "").lower()
        http10 = self.first.upper().startswith("HTTP/1.0") or self.first.upper().endswith(
            "HTTP/1.0"
        )
        return "close" not in conn and (not http10 or "keep-alive" in conn)


def slow_down(request_id: str, resource: str) -> bytes:
    """S3's 503 SlowDown response (head and XML body)."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        "<Error><Code>SlowDown</Code>"
        "<Message>Please reduce your request rate.</Message>"
        f"<Resource>{resource}</Resource><RequestId>{request_id}</RequestId></Error>"
    ).encode()
    head = (
        "HTTP/1.1 503 Slow Down\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        "Connection: keep-alive\r\n\r\n"
    ).encode()
    return head + body


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with a TCP RST (no FIN): an abrupt end, as a dead peer gives."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class FaultProxy:
    """Forwards HTTP/1.1 requests to ``target``, failing some of them (see the module).

    ``midway_conditional=False`` drops a conditional request (``If-Match``,
    ``If-None-Match``) only before it is forwarded, never after the server acted on it:
    what a client can retry blindly. ``decide(method, path, headers)``, if given, is asked
    first for every request and may return a fault kind ("503", "drop_before",
    "drop_midway", "slow", "stall") to inject that fault on purpose (None: the dice decide).
    """

    KINDS = ("503", "drop_before", "drop_midway", "slow", "stall")

    def __init__(
        self,
        target: tuple[str, int],
        *,
        p_503: float = 0.0,
        p_drop: float = 0.0,
        p_slow: float = 0.0,
        slow_s: float = 0.5,
        seed: int = 0,
        midway_conditional: bool = True,
        decide: Callable[[str, str, dict[str, str]], str | None] | None = None,
        max_connections: int = 64,
        idle_s: float = 60.0,
        lifetime_s: float = 900.0,
    ) -> None:
        if not 0 <= p_503 + p_drop + p_slow <= 1:
            raise ValueError("p_503 + p_drop + p_slow must be within [0, 1]")
        self.target = target
        self.p_503, self.p_drop, self.p_slow, self.slow_s = p_503, p_drop, p_slow, slow_s
        self.midway_conditional, self.decide = midway_conditional, decide
        self.idle_s = idle_s
        self.injected: Counter[str] = Counter(dict.fromkeys(self.KINDS, 0))
        self.requests = 0
        # the last requests: (request line, its If-* headers, the fault injected or None)
        self.log: deque[tuple[str, str, str | None]] = deque(maxlen=10_000)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sockets: set[socket.socket] = set()
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.5)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._deadline = time.monotonic() + lifetime_s
        self._acceptor = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        self._acceptor.start()

    # --- connections ---------------------------------------------------------------------

    def _accept(self) -> None:
        try:
            while not self._closed.is_set() and time.monotonic() < self._deadline:
                if not self._slots.acquire(timeout=0.5):
                    continue
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    self._slots.release()
                    continue
                except OSError:
                    self._slots.release()
                    return  # closed
                client.settimeout(self.idle_s)
                with self._lock:
                    self._sockets.add(client)
                threading.Thread(
                    target=self._serve, args=(client,), name="faultproxy-conn", daemon=True
                ).start()
        finally:
            self.close()  # the lifetime is over (or it was closed): stop everything

    def _track(self, sock: socket.socket | None, keep: bool) -> None:
        if sock is None:
            return
        with self._lock:
            if keep:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)
        if not keep:
            with contextlib.suppress(OSError):
                sock.close()

    def _serve(self, client: socket.socket) -> None:
        reader = _Reader(client)
        upstream: _Upstream | None = None
        try:
            while not self._closed.is_set():
                try:
                    request = _Message(reader.head())
                except _Closed:
                    return
                if (request.get("expect") or "").lower() == "100-continue":
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # body first, then fate
                body = b"".join(request.body(reader, request=True))
                fault = self._fate(request)
                if fault == "503":
                    resource = request.first.split(" ")[1] if " " in request.first else "/"
                    client.sendall(slow_down(uuid.uuid4().hex[:16].upper(), resource))
                    if not request.keeps_alive():
                        return
                    continue
                if fault == "drop_before":
                    _reset(client)
                    return
                if fault == "stall":  # no answer, the connection open, until the end
                    self._closed.wait()
                    return
                if upstream is None:
                    upstream = _Upstream(self)
                head_raw, response, pieces = upstream.exchange(request, body)
                if fault == "slow":
                    time.sleep(self._delay())
                if fault == "drop_midway":  # the server acted; its answer is cut short
                    whole = head_raw + b"".join(pieces)
                    client.sendall(whole[: self._cut(len(head_raw), len(whole))])
                    _reset(client)
                    return
                client.sendall(head_raw)
                for piece in pieces:
                    client.sendall(piece)
                if not (request.keeps_alive() and response.keeps_alive()):
                    return
                if not response.framed(request):
                    return  # a body delimited by the close: the connection is spent
        except (OSError, ValueError, _Closed):
            return  # a peer went away or spoke nonsense: this connection ends
        finally:
            if upstream is not None:
                upstream.close()
            self._track(client, keep=False)
            self._slots.release()

    # --- the dice ------------------------------------------------------------------------

    def _fate(self, request: _Message) -> str | None:
        """This request's fault (one of ``KINDS``) or None; counted and logged."""
        method, _, rest = request.first.partition(" ")
        path = rest.rpartition(" ")[0]
        conditions = {k.lower(): v for k, v in request.headers if k.lower().startswith("if-")}
        fault = self.decide(method, path, dict(request.headers)) if self.decide else None
        with self._lock:
            self.requests += 1
            x, midway = self._rng.random(), self._rng.random() < 0.5
            if fault is None:
                if x < self.p_503:
                    fault = "503"
                elif x < self.p_503 + self.p_drop:
                    fault = "drop_midway" if midway else "drop_before"
                    if conditions and not self.midway_conditional:
                        fault = "drop_before"
                elif x < self.p_503 + self.p_drop + self.p_slow:
                    fault = "slow"
            if fault is not None:
                self.injected[fault] += 1
            self.log.append(
                (request.first, " ".join(f"{k}: {v}" for k, v in conditions.items()), fault)
            )
        return fault

    def _delay(self) -> float:
        with self._lock:
            return self._rng.uniform(0, self.slow_s)

    def _cut(self, head_len: int, total: int) -> int:
        """Where a response is cut: inside its head, or inside its body when it has one."""
        with self._lock:
            if total > head_len and self._rng.random() < 0.5:
                return self._rng.randrange(head_len, total)
            return self._rng.randrange(1, head_len)

    # --- lifetime ------------------------------------------------------------------------

    @property
    def faults(self) -> int:
        """Requests failed so far (503s and drops; slow ones succeed)."""
        return self.injected["503"] + self.injected["drop_before"] + self.injected["drop_midway"]

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.close()
        if threading.current_thread() is not self._acceptor:
            self._acceptor.join(timeout=2)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Upstream:
    """One client connection's keep-alive connection to the target."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self.sock: socket.socket | None = None
        self.reader: _Reader | None = None
        self.used = False

    def exchange(self, request: _Message, body: bytes):
        """Sends ``request`` (``Expect`` stripped) and reads the response's head: (raw head,
        parsed head, the body's pieces to read). A reused connection the server closed
        meanwhile (its keep-alive ran out) is replaced once, before any byte came back."""
        for attempt in (0, 1):
            if self.sock is None:
                self.sock = socket.create_connection(self.proxy.target, timeout=self.proxy.idle_s)
                self.proxy._track(self.sock, keep=True)
                self.reader, self.used = _Reader(self.sock), False
            assert self.reader is not None
            try:
                self.sock.sendall(request.without("expect") + body)
                head_raw = self.reader.head()
            except (_Closed, ConnectionError):
                if not self.used or attempt:
                    raise
                self.close()
                continue
            self.used = True
            response = _Message(head_raw)
            while response.status // 100 == 1:  # 1xx: none asked for; not for the client
                head_raw = self.reader.head()
                response = _Message(head_raw)
            is_head = request.first.upper().startswith("HEAD ")
            return (
                head_raw,
                response,
                response.body(self.reader, request=False, head_request=is_head),
            )
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.proxy._track(self.sock, keep=False)
        self.sock = self.reader = None
