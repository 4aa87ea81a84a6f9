"""vLLM's fallbacks for exceptions a handler raises on bad input: 400 (501 for NotImplementedError), in the
OpenAI error shape, with the connection kept (a 500 would also be re-raised into the ASGI server)."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tokenloom.server.app import _add_error_handlers


def _app(exc: Exception) -> FastAPI:
    app = FastAPI()
    _add_error_handlers(app)

    @app.post("/boom")
    async def boom() -> None:
        raise exc

    return app


@pytest.mark.parametrize(("exc", "status"), [
    (ValueError("bad value \ud800"), 400), (TypeError("bad type"), 400), (OverflowError("too big"), 400),
    (RecursionError("too deep"), 400), (NotImplementedError("later"), 501),
])  # fmt: skip
def test_bad_input_exceptions_are_client_errors(exc, status, caplog):
    caplog.set_level(logging.INFO, logger="tokenloom.server.app")
    with TestClient(_app(exc), raise_server_exceptions=True) as client:
        r = client.post("/boom")
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and set(err) == {"message", "type", "param", "code"}
    assert type(exc).__name__ in caplog.text  # logged: a server bug must not pass unseen for a client error


def test_anything_else_is_a_500():
    with TestClient(_app(KeyError("x")), raise_server_exceptions=False) as client:
        r = client.post("/boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
