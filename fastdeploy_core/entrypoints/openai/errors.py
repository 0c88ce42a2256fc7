"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every typed error of :mod:`fastdeploy_core.errors` keeps its own status; pydantic validation
problems and malformed JSON are 400; only an unexpected exception is a 500 (and is logged with
its traceback, because it is a bug).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_core.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from fastdeploy_core.errors import FastDeployError, InvalidRequestError

logger = logging.getLogger("fastdeploy.serve")


class ClientDisconnected(Exception):
    """The HTTP client went away; the request has been aborted in the engine."""


class APIError(FastDeployError):
    """An HTTP-level refusal that is not about the request's content (auth, limits, routing).

    ``headers`` go out with the answer (``Retry-After`` on 429, ``WWW-Authenticate`` on 401).
    """

    def __init__(self, message: str, *, status: int, error_type: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message, param=param, code=code)
        self.http_status = status
        self.error_type = error_type
        self.headers = headers or {}


def unauthorized(message: str) -> APIError:
    return APIError(message, status=401, error_type="authentication_error", code="invalid_api_key")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        f"The model `{name}` does not exist; this server serves `{served}`",
        status=404,
        error_type="not_found_error",
        code="model_not_found",
        param="model",
    )


#: Seconds a 429 asks the client to wait: about one short generation; clients back off from there.
RETRY_AFTER_SECONDS = 1


def too_many_requests(limit: int) -> APIError:
    return APIError(
        f"too many concurrent requests: this server takes at most {limit} at once (--max-concurrency); "
        f"retry after {RETRY_AFTER_SECONDS} s",
        status=429,
        error_type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        f"request body is larger than {limit} bytes; send a smaller request or start the server with a "
        "higher --max-request-body-bytes",
        status=413,
        error_type="invalid_request_error",
        code="request_too_large",
    )


def unsupported_media_type(content_type: str | None) -> APIError:
    given = f"`{content_type}`" if content_type else "no Content-Type"
    return APIError(
        f"request body must be JSON, got {given}; send the header `Content-Type: application/json`",
        status=415,
        error_type="invalid_request_error",
        code="unsupported_media_type",
    )


def queue_timeout(seconds: float) -> APIError:
    return APIError(
        f"request waited more than {seconds:g} s (--max-waiting-time) for a free engine slot; retry later",
        status=503,
        error_type="service_unavailable",
        code="queue_timeout",
    )


def _printable(text: str | None) -> str | None:
    # A message may quote client input; a lone surrogate in it cannot be encoded as UTF-8.
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    code = _printable(code) if isinstance(code, str) else code
    info = ErrorInfo(message=_printable(message), type=error_type, param=_printable(param), code=code)
    return ErrorResponse(error=info).model_dump()


def error_response(exc: FastDeployError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code),
        status_code=exc.http_status,
        headers=getattr(exc, "headers", None) or None,
    )


def validation_to_error(exc: ValidationError | RequestValidationError) -> FastDeployError:
    """One InvalidRequestError for every problem pydantic found; a typed error raised inside a
    validator is passed through with its own message, parameter and code."""
    messages: list[str] = []
    param: str | None = None
    for err in exc.errors():
        original = (err.get("ctx") or {}).get("error")
        if isinstance(original, FastDeployError):
            return original
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        field = ".".join(loc) or "(request)"
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") in ("missing",):
            messages.append(f"{field}: field required")
        else:
            given = err.get("input")
            shown = repr(given)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            messages.append(f"{field}: {msg} (got {shown})")
    return InvalidRequestError("; ".join(messages[:10]) or "invalid request", param=param)


def install_exception_handlers(app: FastAPI) -> None:
    """Map every exception to OpenAI's error shape with the right status."""

    @app.exception_handler(FastDeployError)
    async def _typed(_: Request, exc: FastDeployError) -> JSONResponse:
        if exc.http_status >= 500 and exc.http_status != 503:
            logger.error("request failed: %s", exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_to_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 405: "invalid_request_error"}
        return JSONResponse(
            error_body(str(exc.detail), kinds.get(exc.status_code, "invalid_request_error")),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> JSONResponse:
        # Nobody reads this answer; 499 (client closed request) keeps it out of the 5xx counts.
        return JSONResponse(error_body("client disconnected; request aborted", "client_disconnected"), status_code=499)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}: {exc}", "internal_error"),
            status_code=500,
        )
