"""The disaggregated-serving proxy: a prefill engine, then a decode engine, one client request (vLLM's
`disagg_proxy` request flow over `kv_transfer_params`; docs/kv_offload.md).

For /v1/completions and /v1/chat/completions the proxy sends the request to the prefill engine with
max_tokens 1, no streaming and kv_transfer_params {"do_remote_decode": true}; the prefill engine's
response carries its KV connector's kv_transfer_params (where the prompt's blocks are); the proxy then
sends the original request with those kv_transfer_params to the decode engine and returns (or streams)
the decode engine's answer. An engine that cannot be reached or fails answers this request only, with
502 and which engine it was.

    tokenloom serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "SharedStorageConnector",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": "/dev/shm/kv"}}'
    tokenloom serve MODEL --port 8200 --kv-transfer-config '{... "kv_role": "kv_consumer" ...}'
    tokenloom pd-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from tokenloom.server.responses import JSONResponse


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadGateway", "code": status}}, status_code=status)


def make_pd_proxy_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    app = FastAPI(title="tokenloom prefill/decode proxy")

    def new_client() -> httpx.AsyncClient:
        # One per client request: a client belongs to the event loop it was made in.
        return httpx.AsyncClient(timeout=timeout_s)

    async def prefill(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      headers: dict[str, str]) -> dict[str, Any] | JSONResponse:
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        first.pop("stream_options", None)
        if "max_completion_tokens" in first:
            first["max_completion_tokens"] = 1
        try:
            r = await client.post(prefill_url + path, json=first, headers=headers)
        except httpx.HTTPError as exc:
            return _error(502, f"prefill engine {prefill_url} unreachable: {exc!r}")
        if r.status_code != 200:
            return JSONResponse(r.json() if r.headers.get("content-type", "").startswith("application/json")
                                else {"error": {"message": r.text}}, status_code=r.status_code)
        return r.json().get("kv_transfer_params") or {}

    async def relay(path: str, raw: Request) -> Response:
        body = await raw.json()
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        client = new_client()
        streaming = False
        try:
            params = await prefill(client, path, body, headers)
            if isinstance(params, JSONResponse):
                return params
            second = dict(body, kv_transfer_params=params)
            if body.get("stream"):
                request = client.build_request("POST", decode_url + path, json=second, headers=headers)
                try:
                    upstream = await client.send(request, stream=True)
                except httpx.HTTPError as exc:
                    return _error(502, f"decode engine {decode_url} unreachable: {exc!r}")

                async def chunks() -> Any:
                    try:
                        async for chunk in upstream.aiter_raw():
                            yield chunk
                    except httpx.HTTPError as exc:  # the decode engine died mid-stream: say so in the stream
                        yield f'data: {{"error": {{"message": "decode engine failed: {exc!r}"}}}}\n\n'.encode()
                    finally:
                        await upstream.aclose()
                        await client.aclose()

                streaming = True
                return StreamingResponse(chunks(), status_code=upstream.status_code,
                                         media_type=upstream.headers.get("content-type"))
            try:
                r = await client.post(decode_url + path, json=second, headers=headers)
            except httpx.HTTPError as exc:
                return _error(502, f"decode engine {decode_url} unreachable: {exc!r}")
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        finally:
            if not streaming:
                await client.aclose()

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await relay("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await relay("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        headers = {k: v for k, v in raw.headers.items() if k.lower() == "authorization"}
        async with new_client() as client:
            try:
                r = await client.get(decode_url + "/v1/models", headers=headers)
            except httpx.HTTPError as exc:
                return _error(502, f"decode engine {decode_url} unreachable: {exc!r}")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health() -> Response:
        async with new_client() as client:
            for url in (prefill_url, decode_url):
                try:
                    if (await client.get(url + "/health")).status_code != 200:
                        return _error(503, f"{url} is not healthy")
                except httpx.HTTPError as exc:
                    return _error(503, f"{url} unreachable: {exc!r}")
        return Response(status_code=200)

    return app


def run(prefill_url: str, decode_url: str, host: str, port: int) -> None:
    """`tokenloom pd-proxy` (registered in server/cli.py)."""
    import uvicorn

    uvicorn.run(make_pd_proxy_app(prefill_url.rstrip("/"), decode_url.rstrip("/")), host=host, port=port)
