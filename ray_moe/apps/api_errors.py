"""Every refusal of ``ray-moe serve`` in OpenAI's error object, with the client's field name in ``param``.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

``error_response`` builds one (4xx: ``invalid_request_error``; a missing or wrong key: code ``invalid_api_key``;
an unknown model: code ``model_not_found``); ``install_error_handlers`` gives FastAPI's own answers the same shape
(an unknown route: 404, a known route with another method: 405 naming the allowed one, a path parameter it could
not read: 400), so no answer is FastAPI's ``{"detail": ...}``. ``client_param`` / ``client_message`` translate
the engine's names into the request's (``max_new_tokens`` -> ``max_tokens``; the prompt of a chat request is its
``messages``).
"""

from __future__ import annotations

from typing import Any

INVALID = "invalid_request_error"
SERVER = "server_error"
# the engine's names (``SamplingParams``, the scheduler's messages) for the fields a client sends
CLIENT_NAMES = {"max_new_tokens": "max_tokens"}
ROUTES_HINT = ("POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize, POST /detokenize, "
               "GET /health, GET /metrics")


def error_response(status: int, message: str, param: str | None = None, kind: str = INVALID,
                   headers: dict[str, str] | None = None, code: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def client_param(name: str | None, *, chat: bool = False) -> str | None:
    """The request field an engine-side name stands for."""
    if name is None:
        return None
    name = CLIENT_NAMES.get(name, name)
    if chat and name == "logprobs":
        return "top_logprobs"
    return name


def client_message(text: str, prompt_field: str = "prompt") -> str:
    """An engine message in the request's terms (``max_new_tokens=`` -> ``max_tokens=``; a leading ``prompt:``
    is the chat request's ``messages:``)."""
    for engine, client in CLIENT_NAMES.items():
        text = text.replace(f"{engine}=", f"{client}=").replace(f"{engine}:", f"{client}:")
    if prompt_field != "prompt" and text.startswith("prompt:"):
        text = prompt_field + text[len("prompt"):]
    return text


def install_error_handlers(app: Any) -> None:
    """FastAPI's HTTP errors (unknown route 404, wrong method 405) and path-parameter errors (400) in OpenAI's
    error object."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def http_error(request: Any, exc: HTTPException) -> Any:
        path = request.url.path
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            allowed = headers.get("Allow") or headers.get("allow") or ""
            message = f"{request.method} {path}: method not allowed" + (f" (use {allowed})" if allowed else "")
        elif exc.status_code == 404:
            message = f"{request.method} {path}: no such route (this server answers {ROUTES_HINT})"
        else:
            message = f"{request.method} {path}: {exc.detail}"
        return error_response(exc.status_code, message, None, INVALID if exc.status_code < 500 else SERVER,
                              headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Any, exc: RequestValidationError) -> Any:
        from ray_moe.apps.openai_protocol import validation_param

        errs = exc.errors()
        param, msg = validation_param(errs[0]) if errs else (None, "invalid request")
        return error_response(400, f"{param or 'request'}: {msg}", param)


__all__ = ["CLIENT_NAMES", "INVALID", "SERVER", "client_message", "client_param", "error_response",
           "install_error_handlers"]
