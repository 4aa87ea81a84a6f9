"""`tokenloom explore`: a local page to move scheduler knobs and watch the real scheduler's steps.

stdlib http.server on 127.0.0.1 only; three routes:

    GET  /             the page (index.html, no external resources)
    GET  /api/presets  the worked examples (presets.py)
    POST /api/run      knobs (JSON) -> steps, from tokenloom's Scheduler (scenario.py)

An invalid configuration is an answer, not a failure: 422 with the ConfigError's message, which the
page shows as is.
"""

from __future__ import annotations

import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from tokenloom.explore.presets import DEFAULT_PRESET, PRESETS
from tokenloom.explore.scenario import run_scenario

logger = logging.getLogger(__name__)
HOST = "127.0.0.1"
MAX_BODY = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    server_version = "tokenloom-explore"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path in ("/", "/index.html"):
            page = resources.files("tokenloom.explore").joinpath("index.html").read_bytes()
            self._send(HTTPStatus.OK, page, "text/html; charset=utf-8")
        elif self.path == "/api/presets":
            self._json(HTTPStatus.OK, {"default": DEFAULT_PRESET, "presets": PRESETS})
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page: {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/api/run":
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "request body too large"})
            return
        try:
            knobs = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(knobs, dict):
                raise ValueError("the body must be a JSON object of knobs")
            result = run_scenario(knobs)
        except (ValueError, TypeError) as exc:  # ConfigError is a ValueError; so is bad JSON
            self._json(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc), "kind": type(exc).__name__})
            return
        except Exception as exc:  # a bug: still say what happened on the page
            logger.exception("explorer scenario failed")
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(exc).__name__}: {exc}", "kind": "bug"})
            return
        self._json(HTTPStatus.OK, result)

    def _json(self, status: HTTPStatus, obj: Any) -> None:
        self._send(status, json.dumps(obj, separators=(",", ":")).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("%s " + format, self.address_string(), *args)


def make_server(port: int = 0) -> ThreadingHTTPServer:
    """Bound to 127.0.0.1:port (0: any free port; read it from server.server_address)."""
    server = ThreadingHTTPServer((HOST, port), _Handler)
    server.daemon_threads = True
    return server


def start_in_thread(port: int = 0) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """For tests and notebooks: serve in a daemon thread; call server.shutdown() to stop."""
    server = make_server(port)
    thread = threading.Thread(target=server.serve_forever, name="tokenloom-explore", daemon=True)
    thread.start()
    return server, thread


def serve(port: int = 8765) -> None:
    server = make_server(port)
    host, bound = server.server_address[:2]
    print(f"tokenloom explore: http://{host}:{bound}/  (Ctrl-C to stop)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
