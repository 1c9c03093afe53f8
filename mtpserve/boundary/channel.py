"""The per-step control channel between the engine (driver) and its workers: TCP, length-framed pickle.

A Ray actor call costs about 1 ms round trip; a message on an open socket costs tens of microseconds.
Ray only exchanges the driver's address at start-up; afterwards each step is one framed message out
to every worker and one back from target rank 0. Standard library only, so nothing extra has to be
installed on the GPU hosts.
"""

from __future__ import annotations

import hmac
import pickle
import secrets
import select
import socket
import struct
import time
from typing import Any

_HEADER = struct.Struct("!Q")
TOKEN_BYTES = 32  # a worker proves it was started by this driver before anything is unpickled
_SMALL = 1 << 16  # below this, header and payload go out in one write (one segment with TCP_NODELAY)


class ChannelClosed(ConnectionError):
    """The peer closed the connection (or its process died)."""


class Channel:
    def __init__(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        self.sock = sock

    @staticmethod
    def connect(address: tuple[str, int], timeout: float, token: bytes = b"") -> "Channel":
        sock = socket.create_connection(address, timeout=timeout)
        sock.sendall(token)
        return Channel(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, obj: Any) -> None:
        self.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def send_bytes(self, payload: bytes) -> None:
        header = _HEADER.pack(len(payload))
        if len(payload) < _SMALL:
            self.sock.sendall(header + payload)
        else:
            self.sock.sendall(header)
            self.sock.sendall(payload)

    def recv(self) -> Any:
        (size,) = _HEADER.unpack(self._exactly(_HEADER.size))
        return pickle.loads(self._exactly(size))

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ChannelClosed("the peer closed the control channel")
            got += k
        return buf

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """The driver's listening socket; a worker connects, sends the start-up token (raw bytes, checked
    before any unpickling: the port is open to the network) and then ("hello", rank)."""

    def __init__(self) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]

    def accept(self, count: int, deadline: float) -> dict[int, Channel]:
        """Accept `count` workers by their rank; raises TimeoutError past the (monotonic) deadline."""
        channels: dict[int, Channel] = {}
        while len(channels) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise TimeoutError(f"{len(channels)} of {count} workers connected to the control channel")
            conn, _ = self.sock.accept()
            ch = Channel(conn)
            conn.settimeout(max(deadline - time.monotonic(), 0.001))  # a silent peer must not stall start-up
            try:
                if not hmac.compare_digest(bytes(ch._exactly(TOKEN_BYTES)), self.token):
                    raise ConnectionError("bad token")
            except (OSError, ConnectionError):
                ch.close()  # not one of ours (or it died mid-handshake): keep waiting for the workers
                continue
            kind, rank = ch.recv()
            if kind != "hello":
                raise ConnectionError(f"unexpected first message {kind!r} on the control channel")
            conn.settimeout(None)
            channels[rank] = ch
        return channels

    def close(self) -> None:
        self.sock.close()
