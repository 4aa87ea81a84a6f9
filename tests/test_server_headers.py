"""Request headers vLLM 0.32 reads, unit by unit (no server): X-Vllm-Priority, and Authorization with several
API keys (`--api-key k1 k2`)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.testclient import TestClient

from tokenloom.server.app import APIKeyMiddleware
from tokenloom.server.errors import APIError
from tokenloom.server.headers import request_priority


def _raw(headers: dict[str, str]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/completions",
                    "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})


@pytest.mark.parametrize(("headers", "want"), [
    ({}, 7),  # no header: the body's priority
    ({"X-Vllm-Priority": "-3"}, -3),  # an integer overrides it
    ({"x-vllm-priority": " 12 "}, 12),  # as Python's int() reads it, like vLLM's
    ({"X-Vllm-Priority": "high"}, 7),  # not an integer: ignored, as vLLM ignores it
    ({"X-Vllm-Priority": "1.5"}, 7),
])
def test_x_vllm_priority_overrides_the_body_priority_as_vllm(headers, want) -> None:
    assert request_priority(_raw(headers), 7) == want


def test_x_vllm_priority_outside_64_bits_is_a_400_naming_it() -> None:
    with pytest.raises(APIError) as err:
        request_priority(_raw({"X-Vllm-Priority": str(1 << 63)}), 0)
    assert err.value.status == 400 and err.value.param == "X-Vllm-Priority"
    assert request_priority(_raw({"X-Vllm-Priority": str(-(1 << 63))}), 0) == -(1 << 63)


def test_any_of_several_api_keys_is_accepted_and_preflights_need_none() -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"data": []}

    app.add_middleware(APIKeyMiddleware, api_key=["k1", "k2"])
    client = TestClient(app)
    for key in ("k1", "k2"):
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer k3"}).status_code == 401
    assert client.get("/v1/models").status_code == 401
    assert client.options("/v1/models").status_code == 405  # past the key check: the route's own answer
