"""Every error leaves the service in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, whatever raised it."""

from __future__ import annotations

import logging

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

_TYPES = {401: "authentication_error", 429: "rate_limit_error", 503: "service_unavailable_error"}
_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


class APIError(Exception):
    """An error a handler raises on purpose; rendered as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict:
    type_ = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
):
    response = jsonify(error_body(status, message, code, param))
    response.status_code = status
    response.headers.update(headers or {})
    return response


def register(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        status = exc.code or 500
        headers = {k: v for k, v in exc.get_headers() if k.lower() == "allow"}
        return error_response(status, exc.description or exc.name, _CODES.get(status), None, headers)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal server error", "internal_error")
