"""OpenAI-shaped errors: one exception type the whole front raises, one JSON body for every status.

Body, as vLLM's `ErrorResponse`/`ErrorInfo` writes it (vllm-project/vllm
`vllm/entrypoints/serve/engine/protocol.py`, and SGLang 0.5.23's `ErrorResponse` in
`python/sglang/srt/entrypoints/openai/protocol.py`): `{"error": {"message", "type", "param",
"code"}}`, `code` the HTTP status and `type` the name of the exception the `openai` client raises
for it, so a client's log line says what went wrong without the status table.
"""
from __future__ import annotations

from .contract import InvalidRequest, Overloaded, RequestTooLong, Unavailable

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


class ApiError(Exception):
    """An answer other than 200: status, one-sentence message, and the request field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.retry_after_s = int(status), message, param, retry_after_s

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)

    def headers(self) -> dict:
        """Retry-After (whole seconds, at least 1) for 429 and 503 answers that know when to retry."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, int(-(-self.retry_after_s // 1))))}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "APIError"), "param": param,
                      "code": int(status)}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def from_engine(exc: Exception) -> ApiError:
    """The engine's refusals (contract.py) as the status the issue assigns them."""
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc) or "the server's queue is full; retry later", retry_after_s=exc.retry_after_s)
    if isinstance(exc, RequestTooLong):
        return ApiError(400, str(exc), "max_tokens")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc) or "the engine cannot run this request as given")
    if isinstance(exc, Unavailable):
        return ApiError(503, str(exc) or "the service is unavailable", retry_after_s=1.0)
    raise TypeError(f"not an engine refusal: {exc!r}")
