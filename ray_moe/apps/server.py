"""``ray-moe serve``: an OpenAI-compatible completions endpoint (Ray Serve) over a ray-moe deployment.

    ray-moe serve --checkpoint DIR --ranks 2 [--device cuda] [--host 127.0.0.1] [--port 8000] [--api-key KEY]

    POST /v1/completions   {"model", "prompt": "text" | [token ids], "max_tokens", "temperature", "top_p",
                            "seed", "stream"}  -> choices with "text" (when the folder has a tokenizer) and
                            "token_ids"; "stream": true sends server-sent events, then "data: [DONE]"
    GET  /v1/models        the served model
    GET  /health           200 while the generation loop runs

The Serve replica attaches to the deployment by name (``Runtime.connect``) and owns its generation loop; the
process that ran ``ray-moe serve`` owns the shard actors (Ctrl-C tears both down). Bad requests get 400 with
the field named, a missing or wrong API key 401, an overloaded loop 503 (``Retry-After``): nothing hangs.
"""

# no ``from __future__ import annotations``: Serve pickles the endpoint class to its replica, and FastAPI must
# see the parameters' real annotation objects (``Request``), not strings to resolve against lost globals
import asyncio
import json
import os
import signal
import threading
import time
import uuid
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ray_moe.core.errors import RayMoEError


class CompletionRequest(BaseModel):
    """The OpenAI completions fields ray-moe serves (unknown fields are refused, by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    prompt: str | list[int]
    max_tokens: int = Field(default=16, ge=1, le=1 << 16)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if isinstance(v, (str, list)) and len(v) == 0:
            raise ValueError("empty prompt")
        return v


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind, "param": param,
                                                               "code": None}})


def build_app(model_name: str, deployment: str, *, api_key: str | None, tokenizer_folder: str | None,
              serving: dict[str, Any]):
    """The FastAPI app and the Serve deployment class bound to it."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    app = FastAPI(title="ray-moe", docs_url=None, redoc_url=None)

    @serve.deployment(max_ongoing_requests=2048)
    @serve.ingress(app)
    class CompletionServer:
        def __init__(self) -> None:
            from ray_moe.runtime import Runtime

            self.rt = Runtime.connect(deployment)
            self.engine = self.rt.serving(**serving)
            self.tokenizer = None
            if tokenizer_folder is not None:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)

        def _auth(self, request: Request):
            if api_key is None:
                return None
            got = request.headers.get("authorization", "")
            if got != f"Bearer {api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", None,
                              "authentication_error")
            return None

        @app.get("/health")
        async def health(self) -> Any:
            if self.engine.failed is not None:
                return _error(503, f"generation loop stopped: {self.engine.failed}", None, "server_error")
            return {"status": "ok", "steps": self.engine.steps}

        @app.get("/v1/models")
        async def models(self, request: Request) -> Any:
            denied = self._auth(request)
            if denied is not None:
                return denied
            return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "ray-moe",
                                                "created": 0}]}

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Any:
            denied = self._auth(request)
            if denied is not None:
                return denied
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return _error(400, "malformed JSON body", None)
            try:
                req = CompletionRequest.model_validate(body)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(x) for x in err.get("loc", ())) or None
                return _error(400, f"{field}: {err.get('msg')}", field)
            if req.model != model_name:
                return _error(404, f"model: {req.model!r} is not served here (serving {model_name!r})", "model",
                              "model_not_found")
            if isinstance(req.prompt, str):
                if self.tokenizer is None:
                    return _error(400, "prompt: text needs a tokenizer in the checkpoint folder; send token ids",
                                  "prompt")
                ids = self.tokenizer(req.prompt, add_special_tokens=False)["input_ids"]
            else:
                ids = list(req.prompt)
            from ray_moe.driver.loop import OverloadedError
            from ray_moe.model.sampling import SamplingParams

            params = SamplingParams(max_new_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    seed=req.seed)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            try:
                handle = self.engine.submit(ids, params, on_event=lambda item: loop.call_soon_threadsafe(
                    events.put_nowait, item))
            except OverloadedError as exc:
                return JSONResponse(status_code=503, headers={"Retry-After": "1"},
                                    content={"error": {"message": str(exc), "type": "overloaded", "param": None,
                                                       "code": None}})
            except ValueError as exc:  # too long for the context or the KV budget, bad token ids
                return _error(400, str(exc), "prompt" if "prompt" in str(exc) else None)
            except RayMoEError as exc:
                return _error(503, str(exc), None, "server_error")
            rid = f"cmpl-{uuid.uuid4().hex[:24]}"
            created = int(time.time())
            if req.stream:
                return StreamingResponse(self._sse(rid, created, len(ids), events, handle),
                                         media_type="text/event-stream")
            tokens, error = await _drain(events)
            if error is not None:
                return _error(500, str(error), None, "server_error")
            return self._body(rid, created, len(ids), tokens, finish="length" if len(tokens) >= req.max_tokens
                              else "stop")

        def _text(self, tokens: list[int]) -> str:
            return "" if self.tokenizer is None else self.tokenizer.decode(tokens)

        def _body(self, rid: str, created: int, n_prompt: int, tokens: list[int], finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": self._text(tokens), "token_ids": tokens, "logprobs": None,
                                 "finish_reason": finish}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": len(tokens),
                              "total_tokens": n_prompt + len(tokens)}}

        async def _sse(self, rid, created, n_prompt, events, handle):
            count = 0
            while True:
                item = await events.get()
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
                    return
                count += 1
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                         "choices": [{"index": 0, "text": self._text([item]), "token_ids": [item], "logprobs": None,
                                      "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            final = self._body(rid, created, n_prompt, [], "length" if count >= handle.max_new_tokens else "stop")
            final["choices"][0]["text"] = ""
            final["usage"]["completion_tokens"] = count
            final["usage"]["total_tokens"] = n_prompt + count
            yield f"data: {json.dumps(final)}\n\n"
            yield "data: [DONE]\n\n"

    return CompletionServer


_END = None  # the engine's end-of-request marker on the asyncio queue


async def _drain(events: asyncio.Queue) -> tuple[list[int], BaseException | None]:
    tokens: list[int] = []
    while True:
        item = await events.get()
        if item is _END:
            return tokens, None
        if isinstance(item, BaseException):
            return tokens, item
        tokens.append(item)


def run_server(args: Any, *, ready: threading.Event | None = None, stop: threading.Event | None = None) -> int:
    """Start (or join) Ray, start the deployment from the checkpoint, run the Serve app until Ctrl-C / SIGTERM
    (or ``stop``), then tear everything down."""
    import ray
    from ray import serve

    from ray_moe.model.config import RuntimeConfig
    from ray_moe.core.env import read_env
    from ray_moe.runtime import Runtime

    decode_steps = getattr(args, "decode_steps", None)
    if decode_steps is not None and not 1 <= decode_steps <= 64:  # before Ray or any shard starts
        raise ValueError(f"--decode-steps={decode_steps}: must be in [1, 64]")
    env = read_env()
    api_key = args.api_key or env.api_key
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    cfg = RuntimeConfig.from_pretrained(args.checkpoint, num_ranks=args.ranks, device=args.device, dtype=dtype,
                                        name=args.name)
    address = getattr(args, "address", None)
    if not ray.is_initialized() and address == "local":
        ray.init(address="local", include_dashboard=False, log_to_driver=False, namespace=env.namespace)
    rt = Runtime.start(cfg, address=None if address == "local" else address)
    model_name = args.model_name or os.path.basename(os.path.normpath(args.checkpoint))
    has_tok = any(os.path.exists(os.path.join(args.checkpoint, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    serving = dict(kv_tokens=args.kv_tokens, block_size=args.block_size, step_tokens=args.step_tokens,
                   max_running=args.max_running, max_queued=args.max_queued,
                   decode_steps=decode_steps, fused_kernels=getattr(args, "fused_kernels", True))
    app_name = f"ray-moe-{args.name}"
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        server = build_app(model_name, cfg.name, api_key=api_key, tokenizer_folder=args.checkpoint if has_tok else None,
                           serving=serving)
        serve.run(server.bind(), name=app_name, route_prefix="/", blocking=False)
        print(f"ray-moe serve: {model_name!r} on http://{args.host}:{args.port}/v1 ({args.ranks} ranks, "
              f"deployment {cfg.name!r}{', API key required' if api_key else ''}); Ctrl-C stops", flush=True)
        if ready is not None:
            ready.set()
        done = stop or threading.Event()
        if stop is None and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: done.set())
        while not done.wait(0.5):
            pass
    finally:
        try:
            serve.delete(app_name)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        rt.shutdown()
        if stop is None and ray.is_initialized() and rt._owns_ray:
            ray.shutdown()
    print("ray-moe serve: stopped", flush=True)
    return 0


__all__ = ["build_app", "run_server", "CompletionRequest"]
