"""One error tree: each error knows its HTTP status and its OpenAI error body.

OpenAI's shape is ``{"error": {"message", "type", "param", "code"}}`` with all four keys present;
the SDKs read ``.code``/``.param``/``.type`` from it, so every 4xx/5xx the gateway produces uses it.
"""

from __future__ import annotations

from typing import Any


class GatewayError(Exception):
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status = 400


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus ``max_output_tokens``) does not fit the model's context window and ``truncation`` is
    ``disabled``: answered by the gateway before the upstream is asked, in OpenAI's shape (``param: input``)."""

    code = "context_length_exceeded"

    def __init__(self, input_tokens: int, reserved: int, window: int) -> None:
        super().__init__(f"Your input exceeds the context window of this model: {input_tokens} input tokens plus "
                         f"{reserved} reserved for output exceed its {window} tokens. Please adjust your input and "
                         "try again, or set truncation to 'auto'.", param="input")


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    code = "not_found"


class PayloadTooLarge(GatewayError):
    status = 413
    code = "request_too_large"


class UnsupportedContentEncoding(GatewayError):
    """A request body in a ``Content-Encoding`` the gateway cannot decode."""

    status = 415
    code = "unsupported_content_encoding"


class InvalidBodyEncoding(InvalidRequest):
    """A request body that does not decode in the coding its ``Content-Encoding`` names."""

    code = "invalid_body_encoding"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamError(GatewayError):
    """The upstream answered with an error status before any stream started."""

    status = 502
    type = "server_error"
    code = "upstream_error"


class UpstreamUnavailable(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_unavailable"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"


class StreamFailure(GatewayError):
    """What ends a response that is already streaming: the client gets ``response.failed`` with this error's
    ``code`` and message, and the request's log line ``upstream_error`` (when set). Each failure carries its own
    code — this is the one mapping from errors to ``response.failed`` codes."""

    status = 502
    type = "server_error"
    code = "upstream_error"
    upstream_error: str | None = None


class UpstreamIdleTimeout(StreamFailure):
    """No upstream bytes for --stream-idle-timeout seconds mid-stream."""

    code = "stream_idle_timeout"
    upstream_error = "idle_timeout"


class UpstreamStreamBroken(StreamFailure):
    """The upstream connection broke mid-stream."""

    code = "upstream_connection_error"
    upstream_error = "stream_broken"


class ServiceUnavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


def error_type_for_status(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "invalid_request_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def normalize_upstream_error(status: int, payload: Any) -> dict[str, Any]:
    """Turn whatever the upstream sent with an error status into OpenAI's error body.

    vLLM puts the integer HTTP status in ``code`` and framework names in ``type``, and with
    ``--api-key`` it answers ``{"error": "Unauthorized"}`` (a string); clients expect strings.
    """
    err: Any = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or "Upstream error")
        param = err.get("param")
        code = err.get("code")
    elif isinstance(err, str):
        message, param, code = err, None, None
    elif isinstance(payload, dict) and isinstance(payload.get("detail"), str):
        message, param, code = payload["detail"], None, None
    else:
        message, param, code = f"Upstream returned HTTP {status}", None, None
    if isinstance(param, str) and param.startswith("body."):
        param = param[len("body.") :]
    return {
        "error": {
            "message": message,
            "type": error_type_for_status(status),
            "param": param if isinstance(param, str) else None,
            "code": code if isinstance(code, str) else None,
        }
    }
