"""Errors as the client sees them: vLLM's OpenAI-shaped body and the right HTTP status.

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

`type` is the name of the exception class the official `openai` client raises for that status, and
`code` repeats the status, as vLLM does; the client reads `message`, `type`, `param` and `code` from
under "error". Streams that fail after their headers were sent carry the same object as one SSE
`data:` event before `data: [DONE]`.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from tokenloom.core.structured_output import is_grammar_dead_end
from tokenloom.server.responses import JSONResponse

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers

    @property
    def parameter(self) -> str | None:
        """The field at fault under vLLM's name for it (VLLMValidationError.parameter), for code written for
        vLLM."""
        return self.param


def generation_error_status(error: str | None) -> int:
    """The status of a request the engine ended with an error: 400 when its own grammar could not be completed
    (the request's input is at fault), else 500."""
    return 400 if is_grammar_dead_end(error) else 500


def generation_error(error: str | None, default: str = "generation failed") -> APIError:
    return APIError(generation_error_status(error), error or default)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    # A message quoting the client's input may carry a lone surrogate, which UTF-8 cannot encode.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.param), status_code=exc.status, headers=exc.headers)


def sse_error(status: int, message: str) -> str:
    return f"data: {json.dumps(error_body(status, message))}\n\n"
