"""``ray-moe serve``: an OpenAI-compatible API (Ray Serve) over a ray-moe deployment.

    ray-moe serve MODEL [--data-parallel-size 2] [--device cuda] [--host 127.0.0.1] [--port 8000] [--api-key-file F]

    POST /v1/completions        {"model", "prompt": text | token ids | a list of either, "max_tokens", "temperature",
                                 "top_p", "seed", "n", "stop", "stop_token_ids", "echo", "stream", "stream_options",
                                 "return_token_ids", "skip_special_tokens", "user", "logprobs" (0..20),
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                                 "ignore_eos", "logit_bias", "ray_moe": {"expert_stats"}} -> choices with "text" (when the folder
                                 has a tokenizer), "token_ids", "logprobs" ({"tokens", "token_logprobs",
                                 "top_logprobs", "text_offset"}) and, when asked, "ray_moe" ({"expert_stats"})
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "logprobs": true, "top_logprobs", ...}
                                 through the folder's chat template; logprobs as {"content": [{"token", "logprob",
                                 "bytes", "top_logprobs"}]}
    POST /tokenize              {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize            {"tokens"} -> {"prompt"}
    GET  /v1/models, /v1/models/{id}, /health
    GET  /metrics               Prometheus text (``apps.metrics``): requests, tokens, TTFT / TPOT, queue, KV usage and
                                 the deployment's ``ray_moe_*`` telemetry; no API key needed (as vLLM serves it)

Text is exact: streamed pieces concatenate to the non-streamed text (``detokenize.IncrementalDetokenizer``), special
tokens are skipped unless ``skip_special_tokens`` is false, text prompts get BOS as the tokenizer adds it. ``stop``
strings are matched on that text across token boundaries and cut (the request is cancelled there). ``n`` samples
use seeds ``seed + i``. Unknown fields are ignored and named in ``X-Ray-MoE-Ignored-Fields``; ``logit_bias`` is
added to the logits before sampling. Logprobs are the raw ones (log-softmax of the model's logits, before the
bias, penalties and temperature; ``model.sampling``), for the generated tokens (not the prompt's, with ``echo``);
a token's text is its id decoded alone (``token_id:<id>`` without a tokenizer), its ``text_offset`` where the
completion's text stood when it arrived. Ids beyond the tokenizer's vocabulary (a padded ``lm_head``) are handled
as vLLM handles them (``apps/vocab.py``): valid ids, empty text, ``token_id:<id>`` in logprobs, one entry per id.
``--max-model-len``: a prompt plus its ``max_tokens`` beyond it is refused here, before it is submitted (the
scheduler keeps the model's own positions as its limit); ``max_model_len`` in ``/v1/models`` and ``/tokenize``.

The Serve replica attaches to the deployment by name (``Runtime.connect``) and owns its generation loop; the
process that ran ``ray-moe serve`` owns the shard actors (``apps/serve_run.py``: its checks, its start, Ctrl-C or
SIGTERM tear both down). Every refusal is OpenAI's error object (``apps/api_errors.py``) with the request's field
in ``param``: bad requests 400, a missing or wrong API key 401 (``Authorization: Bearer <key>``, the scheme in any
case, the key compared in constant time), an unknown model or route 404, a wrong method 405, an overloaded loop
503 (``Retry-After``): nothing hangs.
"""

# no ``from __future__ import annotations``: Serve pickles the endpoint class to its replica, and FastAPI must
# see the parameters' real annotation objects (``Request``), not strings to resolve against lost globals
import asyncio
import contextlib
import hmac
import json
import os
import threading
import time
import uuid
from enum import Enum
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ray_moe.apps.api_errors import client_message, client_param, error_response, install_error_handlers
from ray_moe.apps.choices import Choice, FinishReason, chat_logprobs, completion_logprobs, expert_stats_field
from ray_moe.apps.metrics import CountRequests, RequestTimer, ServerMetrics
from ray_moe.apps.openai_protocol import (
    CHAT_DEFAULT_MAX_TOKENS,
    IGNORED_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_param,
)
from ray_moe.apps.serve_run import read_api_key, serve_http_conflict, serve_main
from ray_moe.apps.vocab import PaddedVocabTokenizer
from ray_moe.core.errors import RayMoEError


class Endpoint(str, Enum):
    """Which response shape a generation takes (the OpenAI ``object`` of a whole response)."""

    COMPLETION = "text_completion"
    CHAT = "chat.completion"


def bearer_ok(header: str, key: str) -> bool:
    """``Authorization: Bearer <key>`` (the scheme in any case), the key compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


class GenerationFailed(RayMoEError):
    """The generation loop reported an error for a request."""


_error = error_response


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(c.prompt) for c in choices if c.sample == 0)  # each prompt counted once, whatever n
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _replica_metrics() -> ServerMetrics | None:
    """The ``ServerMetrics`` of the Serve replica this runs in (None outside one, or before it started)."""
    from ray import serve

    try:
        m = getattr(serve.get_replica_context().servable_object, "metrics", None)
    except Exception:  # noqa: BLE001 - not in a replica: nothing to count into
        return None
    return m if isinstance(m, ServerMetrics) else None


def build_app(model_name: str, deployment: str, *, api_key: str | None, tokenizer_folder: str | None,
              serving: dict[str, Any], max_model_len: int | None = None):
    """The FastAPI app and the Serve deployment class bound to it. ``max_model_len``: prompt + max_tokens
    beyond it (or the model's positions, when smaller) are refused before submitting."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from ray import serve

    app = FastAPI(title="ray-moe", docs_url=None, redoc_url=None)
    app.add_middleware(CountRequests, metrics=_replica_metrics)  # ray_moe_server_requests_total
    install_error_handlers(app)  # unknown routes (404), wrong methods (405): OpenAI's error object too
    folder_name = os.path.basename(os.path.normpath(tokenizer_folder)) if tokenizer_folder else None

    @serve.deployment(max_ongoing_requests=2048)
    @serve.ingress(app)
    class CompletionServer:
        def __init__(self) -> None:
            from ray_moe.runtime import Runtime

            self.rt = Runtime.connect(deployment)
            self.engine = self.rt.serving(**serving)
            self.metrics = ServerMetrics(lambda: self.engine, self.rt.telemetry_snapshot)
            self.tokenizer = None
            if tokenizer_folder is not None:
                from transformers import AutoTokenizer

                self.tokenizer = PaddedVocabTokenizer(AutoTokenizer.from_pretrained(tokenizer_folder,
                                                                                     local_files_only=True))
            # the context a request must fit: the model's positions, or --max-model-len when smaller
            self.context = min(self.engine.max_context, max_model_len or self.engine.max_context)
            # the ids a request may hold: the model's vocabulary, or the tokenizer's when larger (vLLM's bound)
            self.vocab = max(self.engine.vocab_size, len(self.tokenizer) if self.tokenizer is not None else 0)

        # ------------------------------------------------------------ request checks
        def _auth(self, request: Request):
            if api_key is None or bearer_ok(request.headers.get("authorization", ""), api_key):
                return None
            return _error(401, "missing or wrong API key (Authorization: Bearer <key>)", None, code="invalid_api_key")

        async def _parse(self, request: Request, cls: type):
            """(the validated body, None) or (None, the error response)."""
            denied = self._auth(request)
            if denied is not None:
                return None, denied
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None, _error(400, "malformed JSON body", None)
            try:
                req = cls.model_validate(body)
            except ValidationError as exc:
                field, msg = validation_param(exc.errors()[0])
                return None, _error(400, f"{field or 'request'}: {msg}", field)
            if getattr(req, "model", None) not in (None, model_name):
                return None, _error(404, f"model: {req.model!r} is not served here (serving {model_name!r})",
                                    "model", code="model_not_found")
            if hasattr(req, "stops") and req.stops() and self.tokenizer is None:
                return None, _error(400, "stop: stop strings need a tokenizer in the checkpoint folder "
                                         "(use stop_token_ids)", "stop")
            return req, None

        def _chat_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True):
            """(prompt token ids, None) through the chat template, or (None, the error response)."""
            if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
                return None, _error(400, f"messages: model {model_name!r} has no chat template (folder "
                                         f"{folder_name or '(none)'} has {'no tokenizer' if self.tokenizer is None else 'no chat_template.jinja or tokenizer_config.json chat_template'}); "
                                         f"use /v1/completions", "messages")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=False)
            except Exception as exc:  # noqa: BLE001 - a template may raise on the messages (jinja's raise_exception)
                return None, _error(400, f"messages: the chat template refused them: {exc}", "messages")
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None

        @staticmethod
        def _headers(req: Any) -> dict[str, str]:
            out = {}
            if req.ignored_fields():
                out[IGNORED_HEADER] = ",".join(req.ignored_fields())
            return out

        def start_notes(self) -> dict[str, Any]:
            """What the engine's start says (a Serve handle call, no route): its KV cache against the running limit,
            the path each step kind takes on the first rank (``status``'s), and every start warning (a slow path, a
            cache re-made smaller, a cache the running limit outruns); ``ray-moe serve`` prints them, since the
            replica's own log does not reach its terminal."""
            report = self.engine.steps_report
            return {"capacity": self.engine.capacity.note(), "warnings": [str(w) for w in self.engine.warnings],
                    "paths": dict((report[0].get("paths") or {}) if report else {})}

        # ------------------------------------------------------------ endpoints
        @app.get("/health")
        async def health(self) -> Any:
            if self.engine.failed is not None:
                return _error(503, f"generation loop stopped: {self.engine.failed}", None, "server_error")
            return {"status": "ok", "steps": self.engine.steps}

        @app.get("/metrics")
        async def prometheus_metrics(self) -> Any:
            """Prometheus text; no API key (as vLLM): it names no request content. Read off the event loop (the
            deployment's telemetry is one coordinator call)."""
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            body = await asyncio.to_thread(generate_latest, self.metrics.registry)
            return Response(content=body, media_type=CONTENT_TYPE_LATEST)

        def _model_card(self) -> dict:
            return {"id": model_name, "object": "model", "owned_by": "ray-moe", "created": 0,
                    "max_model_len": self.context}

        @app.get("/v1/models")
        async def models(self, request: Request) -> Any:
            denied = self._auth(request)
            return denied if denied is not None else {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(self, model_id: str, request: Request) -> Any:
            denied = self._auth(request)
            if denied is not None:
                return denied
            if model_id != model_name:
                return _error(404, f"model: {model_id!r} is not served here (serving {model_name!r})", "model",
                              code="model_not_found")
            return self._model_card()

        @app.post("/tokenize")
        async def tokenize(self, request: Request) -> Any:
            req, err = await self._parse(request, TokenizeRequest)
            if err is not None:
                return err
            if req.messages is not None:
                ids, err = self._chat_ids([{"role": m.role.value, "content": m.text()} for m in req.messages],
                                          req.add_generation_prompt)
                if err is not None:
                    return err
            elif self.tokenizer is None:
                return _error(400, "prompt: tokenizing needs a tokenizer in the checkpoint folder", "prompt")
            else:
                ids = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
            return {"tokens": ids, "count": len(ids), "max_model_len": self.context}

        @app.post("/detokenize")
        async def detokenize(self, request: Request) -> Any:
            req, err = await self._parse(request, DetokenizeRequest)
            if err is not None:
                return err
            if self.tokenizer is None:
                return _error(400, "tokens: detokenizing needs a tokenizer in the checkpoint folder", "tokens")
            bad = [t for t in req.tokens if not 0 <= t < self.vocab]  # ids the tokenizer lacks decode to ''
            if bad:
                return _error(400, f"tokens: {bad[0]} is outside the vocabulary [0, {self.vocab})", "tokens")
            return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=req.skip_special_tokens)}

        @app.post("/v1/completions")
        async def completions(self, request: Request) -> Any:
            arrived = time.perf_counter()
            req, err = await self._parse(request, CompletionRequest)
            if err is not None:
                return err
            choices = []
            for i, p in enumerate(req.prompts()):
                if isinstance(p, str):
                    if self.tokenizer is None:
                        return _error(400, "prompt: text needs a tokenizer in the checkpoint folder; send token ids",
                                      "prompt")
                    ids = list(self.tokenizer(p, add_special_tokens=True)["input_ids"])
                    echo = p
                else:
                    ids = list(p)
                    echo = "" if self.tokenizer is None or not req.echo else self._decode_prompt(ids, req)
                choices += [self._choice(i * req.n + s, s, ids, req.max_tokens, req, echo if req.echo else "")
                            for s in range(req.n)]
            return await self._generate(Endpoint.COMPLETION, req, choices, "prompt", arrived)

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request) -> Any:
            arrived = time.perf_counter()
            req, err = await self._parse(request, ChatCompletionRequest)
            if err is not None:
                return err
            ids, err = self._chat_ids(req.template_messages())
            if err is not None:
                return err
            # without max_tokens: CHAT_DEFAULT_MAX_TOKENS, or what fits the context and one rank's KV budget
            room = min(self.context, self.engine.rank_kv_tokens)
            limit = req.limit() or max(1, min(CHAT_DEFAULT_MAX_TOKENS, room - len(ids)))
            choices = [self._choice(s, s, ids, limit, req) for s in range(req.n)]
            return await self._generate(Endpoint.CHAT, req, choices, "messages", arrived)

        # ------------------------------------------------------------ generation
        def _decode_prompt(self, ids: list[int], req: Any) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)

        def _context_error(self, c: Choice, prompt_field: str, headers: dict[str, str]) -> Any:
            """A choice whose prompt + max_tokens exceeds the context (``--max-model-len`` or the model's
            positions): the 400, naming the prompt when it alone leaves no room, else ``max_tokens``."""
            n, limit = len(c.prompt), self.context
            if n + c.max_tokens <= limit:
                return None
            if n >= limit:
                return _error(400, f"{prompt_field}: {n} tokens leave no room to generate within the context of "
                                   f"{limit} tokens (max_model_len)", prompt_field, headers=headers)
            return _error(400, f"max_tokens: {n} prompt tokens + max_tokens={c.max_tokens} = {n + c.max_tokens} "
                               f"exceeds the context of {limit} tokens (max_model_len): at most {limit - n}",
                          "max_tokens", headers=headers)

        def _choice(self, index: int, sample: int, ids: list[int], max_tokens: int, req: Any, echo: str = "") -> Choice:
            c = Choice(index, sample, ids, max_tokens, tokenizer=self.tokenizer, stops=req.stops(),
                       stop_ids=tuple(req.stop_token_ids or ()), skip_special_tokens=req.skip_special_tokens,
                       echo=echo)
            c.wants_logprobs = req.sampler_logprobs() is not None
            c.wants_expert_stats = req.wants_expert_stats
            return c

        def _ray_moe(self, c: Choice) -> dict:
            """The choice's ``ray_moe`` field, when the request asked (its handle's counts so far)."""
            return {"ray_moe": expert_stats_field(c.handle.expert_stats())} if c.wants_expert_stats else {}

        def _cancel(self, choices: list[Choice]) -> None:
            """Stop generating for choices that need no more tokens (a stop string, a gone client)."""
            cancel = getattr(self.engine, "cancel", None)
            for c in choices:
                if cancel is not None and c.handle is not None and not c.handle.done.is_set():
                    cancel(c.handle.request_id)

        async def _generate(self, kind: Endpoint, req: Any, choices: list[Choice], prompt_field: str,
                            arrived: float) -> Any:
            """Submit every choice and answer (streamed or whole); ``arrived``: the request's arrival
            (``time.perf_counter``), where its time to first token starts."""
            from ray_moe.driver.loop import OverloadedError
            from ray_moe.model.sampling import SamplingParams

            headers = self._headers(req)
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            chat = kind is Endpoint.CHAT
            for c in choices:
                refused = self._context_error(c, prompt_field, headers)
                if refused is not None:
                    self._cancel(choices)
                    return refused
                try:
                    params = SamplingParams(**req.sampling(c.max_tokens, c.sample, tuple(req.stop_token_ids or ())))
                except ValidationError as exc:
                    self._cancel(choices)
                    err = exc.errors()[0]
                    engine_field, msg = validation_param(err)
                    field = client_param(engine_field, chat=chat)
                    return _error(400, f"{field or 'request'}: {client_message(msg)} (got {err.get('input')!r})",
                                  field, headers=headers)
                try:
                    c.handle = self.engine.submit(c.prompt, params, on_event=lambda item, i=c.index: (
                        loop.call_soon_threadsafe(events.put_nowait, (i, item))))
                except OverloadedError as exc:
                    self._cancel(choices)
                    return JSONResponse(status_code=503, headers={**headers, "Retry-After": "1"},
                                        content={"error": {"message": str(exc), "type": "overloaded", "param": None,
                                                           "code": None}})
                except ValueError as exc:  # too long for the context or the KV budget, bad token ids
                    self._cancel(choices)
                    msg = client_message(str(exc), prompt_field)
                    if str(exc).startswith("logit_bias"):
                        param = "logit_bias"
                    elif "max_new_tokens" in str(exc):  # the prompt fits alone: it is max_tokens that does not
                        alone = len(c.prompt) < min(self.context, self.engine.rank_kv_tokens)
                        param = "max_tokens" if alone else prompt_field
                    else:
                        param = prompt_field if "prompt" in str(exc) else None
                    return _error(400, msg, param, headers=headers)
                except RayMoEError as exc:
                    self._cancel(choices)
                    return _error(503, str(exc), None, "server_error", headers=headers)
            rid = f"{'cmpl' if kind is Endpoint.COMPLETION else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
            created = int(time.time())
            timer = self.metrics.timer(arrived)
            if req.stream:
                return StreamingResponse(self._stream(kind, rid, created, req, choices, events, timer),
                                         media_type="text/event-stream", headers=headers)
            try:
                async with contextlib.aclosing(self._events(choices, events, timer)) as stream:
                    async for _ in stream:
                        pass
            except GenerationFailed as exc:
                return _error(500, str(exc), None, "server_error", headers=headers)
            return JSONResponse(self._body(kind, rid, created, req, choices), headers=headers)

        async def _events(self, choices: list[Choice], events: asyncio.Queue, timer: RequestTimer):
            """(choice, text it adds, token or None at its end, whether it finished) until every choice finished;
            what is still generating is cancelled when this ends early (an error, a client gone). Token times go
            to ``timer``; the request's usage to the token counters at the end."""
            by_index = {c.index: c for c in choices}
            want_logprobs = bool(choices) and choices[0].wants_logprobs
            try:
                while any(c.finish is None for c in choices):
                    i, item = await events.get()
                    c = by_index[i]
                    if c.finish is not None:
                        continue  # tokens in flight after a stop string
                    if item is None:
                        text = c.on_end()
                        timer.ended(c.index)
                        yield c, text, None, True
                    elif isinstance(item, BaseException):
                        raise GenerationFailed(str(item))
                    else:
                        lp = None
                        if want_logprobs:  # appended by the loop before the token was emitted
                            lp = c.handle.logprobs[len(c.tokens)]
                        timer.token(c.index)
                        text = c.on_token(item, lp)
                        if c.finish is not None:
                            self._cancel([c])
                            timer.ended(c.index)
                        yield c, text, item, c.finish is not None
            finally:
                self._cancel(choices)
                self.metrics.tokens(_usage(choices)["prompt_tokens"], sum(len(c.tokens) for c in choices))

        def _body(self, kind: Endpoint, rid: str, created: int, req: Any, choices: list[Choice]) -> dict:
            out: dict[str, Any] = {"id": rid, "object": kind.value, "created": created, "model": model_name}
            if kind is Endpoint.COMPLETION:
                out["choices"] = [{"index": c.index, "text": c.echo + c.text, "token_ids": c.tokens,
                                   "logprobs": self._logprobs(kind, c, c.tokens, c.logprobs, c.offsets),
                                   "finish_reason": c.finish.value, "stop_reason": c.stop_reason, **self._ray_moe(c),
                                   **({"prompt_token_ids": c.prompt} if req.return_token_ids else {})}
                                  for c in choices]
            else:
                out["choices"] = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                                   "logprobs": self._logprobs(kind, c, c.tokens, c.logprobs),
                                   "finish_reason": c.finish.value, "stop_reason": c.stop_reason, **self._ray_moe(c),
                                   **({"token_ids": c.tokens} if req.return_token_ids else {})} for c in choices]
                if req.return_token_ids:
                    out["prompt_token_ids"] = choices[0].prompt
            out["usage"] = _usage(choices)
            return out

        def _logprobs(self, kind: Endpoint, c: Choice, tokens: list[int], logprobs: list[Any],
                      offsets: list[int] = ()) -> dict | None:
            """The choice's logprobs in the endpoint's form for ``tokens`` (None: the request did not ask)."""
            if not c.wants_logprobs:
                return None
            if kind is Endpoint.COMPLETION:
                return completion_logprobs(self.tokenizer, tokens, logprobs, offsets)
            return chat_logprobs(self.tokenizer, tokens, logprobs)

        async def _stream(self, kind: Endpoint, rid: str, created: int, req: Any, choices: list[Choice],
                          events: asyncio.Queue, timer: RequestTimer):
            obj = "text_completion" if kind is Endpoint.COMPLETION else "chat.completion.chunk"

            def chunk(c: Choice, text: str, toks: list[int], finish: FinishReason | None = None,
                      first: bool = False) -> str:
                # a token's chunk carries its logprobs (the last ones the choice recorded)
                lps = self._logprobs(kind, c, toks, c.logprobs[-1:], c.offsets[-1:]) if toks else None
                if kind is Endpoint.COMPLETION:
                    ch = {"index": c.index, "text": text, "token_ids": toks, "logprobs": lps,
                          "finish_reason": None if finish is None else finish.value}
                else:
                    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                    ch = {"index": c.index, "delta": delta, "logprobs": lps,
                          "finish_reason": None if finish is None else finish.value,
                          **({"token_ids": toks} if req.return_token_ids else {})}
                if finish is not None:  # the final chunk: the choice's expert statistics, when asked
                    ch.update({"stop_reason": c.stop_reason, **self._ray_moe(c)})
                return _sse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [ch]})

            for c in choices:
                if kind is Endpoint.CHAT:
                    yield chunk(c, "", [], first=True)
                elif c.echo:
                    yield chunk(c, c.echo, [])
            try:  # aclosing: a client that goes away cancels what still generates for it
                async with contextlib.aclosing(self._events(choices, events, timer)) as stream:
                    async for c, text, tok, ended in stream:
                        toks = [] if tok is None else [tok]
                        if text or (toks and (kind is Endpoint.COMPLETION or req.return_token_ids
                                              or c.wants_logprobs)):
                            yield chunk(c, text, toks)
                        if ended:
                            yield chunk(c, "", [], c.finish)
            except GenerationFailed as exc:
                yield _sse({"error": {"message": str(exc), "type": "server_error"}})
                return
            if req.include_usage:
                yield _sse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                            "usage": _usage(choices)})
            yield "data: [DONE]\n\n"

    return CompletionServer


def run_server(args: Any, *, ready: threading.Event | None = None, stop: threading.Event | None = None,
               config_fields: dict | None = None) -> int:
    """Check the options and the API address, start (or join) Ray, start the deployment from the checkpoint,
    serve until Ctrl-C / SIGTERM (or ``stop``), then tear everything down (``apps/serve_run.py``). A bad option,
    an address something already listens on, an impossible device, or a Serve instance on the cluster that would
    not listen at ``--host``/``--port`` raise ``ConfigError`` before any shard starts. ``config_fields``: more
    RuntimeConfig fields (the CLI's elasticity flags: ``serve_config_fields``); else ``--eplb`` alone."""
    return serve_main(args, build_app, ready=ready, stop=stop, config_fields=config_fields)


__all__ = [
    "ChatCompletionRequest",
    "Choice",
    "CompletionRequest",
    "Endpoint",
    "FinishReason",
    "bearer_ok",
    "build_app",
    "chat_logprobs",
    "completion_logprobs",
    "read_api_key",
    "run_server",
    "serve_http_conflict",
]
