"""Local HTTP receivers that speak the check-in services' APIs, for tests.

One server answers every service on its own path, so one port serves a whole test:

- Sentry: ``POST /api/<project>/envelope/`` (a real client:
  ``sentry_sdk.init(dsn=f"http://public@127.0.0.1:{port}/1")``); every ``check_in`` item of
  the envelope is recorded (gzip/deflate bodies are opened).
- Healthchecks: ``GET|POST /hc/<ping key>/<slug>[/start|/fail]?rid=..`` (``ping_url`` =
  ``f"{receiver.url}/hc/<ping key>"``).
- Cronitor: ``GET|POST /p/<api key>/<monitor>?state=..&series=..`` (``url`` = ``receiver.url``).
- Webhook: ``POST /webhook[/anything]`` with a JSON body (``url`` = ``f"{receiver.url}/webhook"``).

Each record is a dict: ``service``, ``method``, ``path``, ``query`` (name -> first value),
``headers`` (lower-cased names), ``body`` (text) and, for Sentry, ``item`` (the check-in
item's JSON) and for the webhook ``json``.

A service can be told to fail (answer 500), to redirect (answer 302 to the same path and
query at :attr:`Receiver.redirect_to`, another receiver's URL) or hang (hold the request until
:meth:`Receiver.release`); :attr:`Receiver.holding` is set once a request is held, and
:meth:`Receiver.wait_for` waits for records without sleeping on a guess::

    with Receiver() as receiver:
        receiver.set_mode("healthchecks", "hang")
        ...
        assert receiver.holding.wait(10)
        receiver.release()

In a separate process (for multi-process tests)::

    python -m tests.support.checkin_receivers --port 0 --record /tmp/records.jsonl \\
        [--mode healthchecks=500] [--mode webhook=hang]

prints ``{"port": N, "url": "http://127.0.0.1:N"}`` as its first stdout line, then appends
one JSON record per line to ``--record`` (flushed per line) until SIGTERM/SIGINT.
:func:`read_records` reads such a file.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

SERVICES = ("sentry", "healthchecks", "cronitor", "webhook")
MODES = ("ok", "500", "hang", "302")


def service_of(path: str) -> str | None:
    """The service a request path belongs to, or None."""
    if path.startswith("/api/") and path.rstrip("/").endswith("/envelope"):
        return "sentry"
    if path.startswith("/hc/"):
        return "healthchecks"
    if path.startswith("/p/"):
        return "cronitor"
    if path.startswith("/webhook"):
        return "webhook"
    return None


def envelope_items(raw: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """The (item header, payload) pairs of a Sentry envelope."""
    lines = raw.split(b"\n", 1)
    rest = lines[1] if len(lines) > 1 else b""
    items: list[tuple[dict[str, Any], bytes]] = []
    while rest.strip():
        header_line, _, rest = rest.partition(b"\n")
        if not header_line.strip():
            continue
        header = json.loads(header_line)
        length = header.get("length")
        if length is None:
            payload, _, rest = rest.partition(b"\n")
        else:
            payload, rest = rest[:length], rest[length + 1 :]
        items.append((header, payload))
    return items


def _decoded(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    if encoding == "br":
        import brotli  # type: ignore[import-not-found]  # only when sentry_sdk chose it

        return bytes(brotli.decompress(body))
    return body


class Receiver:
    """A threaded HTTP server on 127.0.0.1 that records check-ins (see the module doc)."""

    def __init__(self, port: int = 0, on_record: Callable[[dict[str, Any]], None] | None = None):
        self.records: list[dict[str, Any]] = []
        self.modes: dict[str, str] = dict.fromkeys(SERVICES, "ok")
        self.redirect_to = ""  # where mode "302" sends requests (another receiver's URL)
        self.holding = threading.Event()
        self._release = threading.Event()
        self._changed = threading.Condition()
        self._on_record = on_record
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def set_mode(self, service: str, mode: str) -> None:
        """Answer ``service``'s requests normally ("ok"), with a 500, with a 302 to
        :attr:`redirect_to` ("302"), or hold them ("hang")."""
        if service not in SERVICES or mode not in MODES:
            raise ValueError(f"unknown service {service!r} or mode {mode!r}")
        self.modes[service] = mode

    def release(self) -> None:
        """Let every held request (and any later one) answer."""
        self._release.set()

    def of(self, service: str) -> list[dict[str, Any]]:
        with self._changed:
            return [r for r in self.records if r["service"] == service]

    def wait_for(
        self, count: int, service: str | None = None, timeout: float = 15
    ) -> list[dict[str, Any]]:
        """Wait until ``count`` records (of ``service``) arrived; return them all."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [r for r in self.records if service in (None, r["service"])]
                left = deadline - time.monotonic()
                if len(found) >= count or left <= 0:
                    return found
                self._changed.wait(left)

    def answer(self, request: BaseHTTPRequestHandler) -> None:
        split = urlsplit(request.path)
        service = service_of(split.path)
        length = int(request.headers.get("Content-Length") or 0)
        raw = request.rfile.read(length) if length else b""
        if service is None:
            request.send_response(404)
            request.end_headers()
            return
        mode = self.modes[service]
        if mode == "hang":
            self.holding.set()
            self._release.wait(120)
        # Recorded before it is answered: a sender that got its answer finds its request here.
        if mode == "302":
            self._add(request, service, split.path, split.query, raw, answered=302)
            request.send_response(302)
            request.send_header("Location", f"{self.redirect_to}{request.path}")
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        if mode == "500":
            self._add(request, service, split.path, split.query, raw, answered=500)
            request.send_response(500)
            request.end_headers()
            request.wfile.write(b"failing on purpose")
            return
        self._add(request, service, split.path, split.query, raw, answered=200)
        request.send_response(200)
        request.send_header("Content-Type", "text/plain")
        request.end_headers()
        request.wfile.write(b"OK")

    def _add(
        self,
        request: BaseHTTPRequestHandler,
        service: str,
        path: str,
        query: str,
        raw: bytes,
        answered: int,
    ) -> None:
        base = {
            "service": service,
            "method": request.command,
            "path": path,
            "query": {k: v[0] for k, v in parse_qs(query).items()},
            "headers": {k.lower(): v for k, v in request.headers.items()},
            "status": answered,
        }
        body = _decoded(raw, request.headers.get("Content-Encoding", ""))
        records: list[dict[str, Any]] = []
        if service == "sentry":
            for header, payload in envelope_items(body):
                if header.get("type") == "check_in":
                    text = payload.decode()
                    records.append({**base, "body": text, "item": json.loads(text)})
        else:
            record = {**base, "body": body.decode("utf-8", "replace")}
            if service == "webhook" and body:
                record["json"] = json.loads(body)
            records.append(record)
        with self._changed:
            self.records.extend(records)
            self._changed.notify_all()
        for record in records:
            if self._on_record is not None:
                self._on_record(record)


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            receiver.answer(self)

        def do_POST(self) -> None:
            receiver.answer(self)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the records are the log."""

    return Handler


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records a ``--record`` file holds so far."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.endswith("}")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (default)")
    parser.add_argument("--record", required=True, help="append JSON lines to this file")
    parser.add_argument("--mode", action="append", default=[], help="SERVICE=ok|500|hang")
    options = parser.parse_args(argv)
    sink: IO[str] = open(options.record, "a")  # noqa: SIM115  (open until the process ends)
    lock = threading.Lock()

    def write(record: dict[str, Any]) -> None:
        with lock:
            sink.write(json.dumps(record) + "\n")
            sink.flush()

    receiver = Receiver(options.port, on_record=write)
    for item in options.mode:
        service, _, mode = item.partition("=")
        receiver.set_mode(service, mode)
    stopped = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    receiver.start()
    print(json.dumps({"port": receiver.port, "url": receiver.url}), flush=True)
    stopped.wait()
    receiver.stop()
    sink.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
