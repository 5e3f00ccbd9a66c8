"""A check-in receiver (tests/support/checkin_receivers.py) that shows what it holds.

Its ``hang`` mode never answers: each held request is recorded when it arrives
(:attr:`HoldingReceiver.held`, with the webhook's JSON body) and stays *in flight* for as long
as its client waits for the answer; once the client gives up (its timeout: it closes the
connection) the request is marked ``gone``. A test reads the ledger, then
:meth:`HoldingReceiver.in_flight`: a run found finished while its own check-in is still in
flight was not held up by that check-in.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import urlsplit

from .checkin_receivers import Receiver, service_of


@dataclass
class Held:
    """One request a hanging service received and did not answer."""

    service: str
    path: str
    json: dict[str, Any] = field(default_factory=dict)
    gone: bool = False  # its client closed the connection (gave up)


class HoldingReceiver(Receiver):
    """:class:`Receiver` whose ``hang`` mode records arrivals and counts waiting clients."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Held] = []
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()
        super().stop()

    def in_flight(self, service: str) -> list[Held]:
        """The held requests of ``service`` whose client still waits for an answer."""
        return [held for held in list(self.held) if held.service == service and not held.gone]

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        path = urlsplit(request.path).path
        service = service_of(path)
        if service is None or self.modes[service] != "hang":
            super().answer(request)
            return
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        held = Held(service, path, json.loads(raw) if service == "webhook" and raw else {})
        self.held.append(held)
        self.holding.set()
        while not self._stopping.is_set():
            if _closed_by_client(request.connection):
                held.gone = True
                return
        # Stopping: no answer either; the handler returns and the connection closes.


def _closed_by_client(connection: socket.socket, wait: float = 0.05) -> bool:
    """Whether the client closed ``connection`` (waits up to ``wait`` seconds to see)."""
    readable, _, _ = select.select([connection], [], [], wait)
    if not readable:
        return False
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True
