"""The client half of vLLM's tests/utils.py RemoteOpenAIServer, over a running `tokenloom serve` (`self.server`, a
ServerProcess of tests/test_server_harness.py): shared by the pooling and OpenAI-server shims, which differ in how
they start and stop servers."""

from __future__ import annotations

from typing import Any, Self

import openai

from tests.test_server_harness import ServerProcess


class RemoteOpenAIClients:
    DUMMY_API_KEY = "token-abc123"
    server: ServerProcess

    @property
    def url_root(self) -> str:
        return self.server.url

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        # openai's default transport closes itself when garbage-collected, by a task on the loop then running: a
        # client a test never closes (test_online_dimensions.py's) would then close in a later test's event loop
        # (anyio's plugin gives each test its own) and fail there. This transport is closed by close() only.
        kwargs.setdefault("http_client", openai.DefaultAsyncHttpxClient())
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0,
                                  **kwargs)

    def __enter__(self) -> Self:
        return self
