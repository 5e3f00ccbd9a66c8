"""A TCP proxy in front of a real server that can lose a reply on purpose.

The lock client talks to the proxy; the proxy forwards every byte to the real
``redis-server`` and back. ``lose_reply(marker)`` arms it: the next client
command that contains ``marker`` (say ``b"EVALSHA"``) is forwarded and *runs*
on the server, its reply is read and thrown away, and the client's connection
is closed: the client cannot know whether its command ran. ``drop_command``
does the same without forwarding (the command never ran). Nothing is mocked:
the server and the client are real, only the wire between them is cut.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from typing import Any

from .redis_server import free_port


class TcpProxy:
    """Forward ``127.0.0.1:port`` to ``127.0.0.1:target``, a thread per connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.lock = threading.Lock()
        self.armed: list[tuple[bytes, bool]] = []  # (marker, forward it first)
        self.lost: list[bytes] = []  # the commands whose reply (or whole run) was lost
        self.stopped = threading.Event()
        self.refusing = threading.Event()  # cut(): the far side is gone
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []
        self._serve = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    @property
    def url(self) -> str:  # (for a proxied redis-server)
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> TcpProxy:
        self._serve.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stopped.set()
        self.listener.close()
        self._serve.join(5)
        for thread in self.threads:
            thread.join(5)

    def lose_reply(self, marker: bytes) -> None:
        """The next command containing ``marker`` runs on the server; its reply is lost."""
        with self.lock:
            self.armed.append((marker, True))

    def drop_command(self, marker: bytes) -> None:
        """The next command containing ``marker`` never reaches the server."""
        with self.lock:
            self.armed.append((marker, False))

    def cut(self) -> None:
        """The server is gone: drop every open connection and refuse new ones."""
        self.refusing.set()
        with self.lock:
            open_sockets = list(self.sockets)
        for sock in open_sockets:  # at once, not when a pipe next looks
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                ready, _, _ = select.select([self.listener], [], [], 0.1)
                if not ready:
                    continue
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            with self.lock:
                self.sockets += [client, server]
            thread = threading.Thread(target=self._pipe, args=(client, server), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _trigger(self, data: bytes) -> tuple[bytes, bool] | None:
        with self.lock:
            for index, (marker, forward) in enumerate(self.armed):
                if marker in data:
                    del self.armed[index]
                    return marker, forward
        return None

    def _pipe(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while not self.stopped.is_set() and not self.refusing.is_set():
                ready, _, _ = select.select([client, server], [], [], 0.1)
                if client in ready:
                    data = client.recv(65536)
                    if not data:
                        return
                    armed = self._trigger(data)
                    if armed is not None:
                        marker, forward = armed
                        if forward:
                            server.sendall(data)
                            server.recv(65536)  # it ran: the reply comes, and is lost
                        self.lost.append(marker)
                        return  # cut the client off: its command's fate is unknown to it
                    server.sendall(data)
                if server in ready:
                    data = server.recv(65536)
                    if not data:
                        return
                    client.sendall(data)
        except OSError:
            return
        finally:
            for sock in (client, server):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
