"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every typed error of :mod:`fastdeploy_core.errors` keeps its own status; pydantic validation
problems and malformed JSON are 400; only an unexpected exception is a 500 (and is logged with
its traceback, because it is a bug).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_core.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from fastdeploy_core.errors import FastDeployError, InvalidRequestError

logger = logging.getLogger("fastdeploy.serve")


class APIError(FastDeployError):
    """An HTTP-level refusal that is not about the request's content (auth, limits, routing)."""

    def __init__(self, message: str, *, status: int, error_type: str, code: str | None = None, param: str | None = None):
        super().__init__(message, param=param, code=code)
        self.http_status = status
        self.error_type = error_type


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


def too_many_requests(limit: int) -> APIError:
    return APIError(
        f"too many concurrent requests: this server takes at most {limit} at once (--max-concurrency); retry later",
        status=429,
        error_type="rate_limit_error",
        code="rate_limit_exceeded",
    )


def queue_timeout(seconds: float) -> APIError:
    return APIError(
        f"request waited more than {seconds:g} s (--max-waiting-time) for a free engine slot; retry later",
        status=503,
        error_type="service_unavailable",
        code="queue_timeout",
    )


def error_body(message: str, error_type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code)).model_dump()


def error_response(exc: FastDeployError) -> JSONResponse:
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.param, exc.code),
        status_code=exc.http_status,
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


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Decode a JSON body and validate it; every failure is a 400 InvalidRequestError."""
    try:
        data = json.loads(raw) if raw else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_to_error(exc) from None


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

    from fastdeploy_core.entrypoints.openai.serving_engine import ClientDisconnected

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
