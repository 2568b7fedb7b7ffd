"""The OpenAI request bodies ``ray-moe serve`` accepts (completions, chat completions, tokenize, detokenize).

Unknown fields are accepted and ignored, as the OpenAI API does: ``ignored_fields`` names them (the server sends
them back in ``X-Ray-MoE-Ignored-Fields``). The shard's sampler honours ``logprobs`` (completions: 0..20
alternatives; chat: ``logprobs`` true with ``top_logprobs`` 0..20), ``presence_penalty`` / ``frequency_penalty``
([-2, 2], over the generated tokens), ``repetition_penalty`` (> 0, over prompt and generated tokens),
``min_tokens``, ``ignore_eos`` and ``logit_bias`` (OpenAI's: {token id as a string: bias in [-100, 100]} added
to the logits before sampling; the logprobs stay the raw ones, before it; a key that is not a token id, an id
outside the vocabulary or a bias out of range is a 400 naming the field and the key). ``ray_moe`` holds ray-moe's own fields (no
OpenAI server has them; ``RayMoEOptions``): ``{"expert_stats": true}`` returns, per choice, the experts its
tokens were routed to per MoE layer and the placement generations that served it; an unknown key in it is a
400 naming it.

Every refusal names the client's field: a validation error carries the field's JSON path (``messages[0].content``)
and, where a check spans fields, ``FieldError`` says which one is at fault (``top_logprobs`` without
``logprobs``; a content part of a type the served models cannot read: ``messages[0].content[1].type``).
"""

# no ``from __future__ import annotations``: the models are rebuilt inside Serve's replica process
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IGNORED_HEADER = "X-Ray-MoE-Ignored-Fields"
UNSUPPORTED_HEADER = "X-Ray-MoE-Unsupported-Fields"
MAX_LOGPROBS = 20  # alternatives per token (vLLM's bound; OpenAI's is 20 for chat, 5 for completions)
MAX_N = 16  # choices per prompt
MAX_STOPS = 16  # stop strings per request
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's bound)
CHAT_DEFAULT_MAX_TOKENS = 1024  # a chat request without max_tokens: this many, or what fits the context and KV budget


class FieldError(ValueError):
    """A refused value that names the client's field: ``param`` (the whole path), or ``suffix`` appended to the
    path of the value being validated (``[1].type`` under ``messages[0].content``)."""

    def __init__(self, message: str, *, param: str | None = None, suffix: str = "") -> None:
        super().__init__(message)
        self.param, self.suffix = param, suffix


def field_path(loc: tuple | list) -> str | None:
    """A pydantic location as the JSON path a client writes: ``("messages", 0, "content")`` ->
    ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_param(err: dict) -> tuple[str | None, str]:
    """(the field at fault, the message without pydantic's ``Value error, ``) of one pydantic error."""
    msg = str(err.get("msg", ""))
    msg = msg.removeprefix("Value error, ")
    cause = (err.get("ctx") or {}).get("error")
    path = field_path(err.get("loc", ()))
    if isinstance(cause, FieldError):
        return (cause.param or ((path or "") + cause.suffix) or None), str(cause)
    return path, msg


class Role(str, Enum):
    """Who wrote a chat message."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    DEVELOPER = "developer"  # OpenAI's newer name for system
    TOOL = "tool"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class RayMoEOptions(BaseModel):
    """The request's ``ray_moe`` object. expert_stats: each choice carries ``ray_moe.expert_stats`` (counts of
    routed (token, expert) pairs per MoE layer, prompt and generated apart, and the placement generations its
    steps ran on; ``choices.expert_stats_field``). Unknown keys are refused, all of them named."""

    model_config = ConfigDict(extra="forbid")

    expert_stats: bool = Field(default=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, v: Any) -> Any:
        if isinstance(v, dict):
            unknown = sorted(str(k) for k in v if k not in cls.model_fields)
            if unknown:
                raise ValueError(f"unknown ray_moe field(s) {', '.join(unknown)} (known: "
                                 f"{', '.join(cls.model_fields)})")
        return v


class TextPart(BaseModel):
    """One part of a message's content (only text parts: the served models read text)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A string, None or a list of text parts; another part type (``image_url``, ``input_audio``, ``file``)
        is refused naming the part: the served models read text only."""
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise FieldError("must be a string or a list of content parts")
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise FieldError(f"content part type {kind!r} is not supported: the served model reads text only "
                                 f"(send a string, or parts {{\"type\": \"text\", \"text\": ...}})",
                                 suffix=f"[{i}].type")
            if not isinstance(part.get("text"), str):
                raise FieldError("a text part needs a string \"text\"", suffix=f"[{i}].text")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Generation(BaseModel):
    """The fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=1 << 62)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    user: str | None = None
    return_token_ids: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=1 << 16)
    presence_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # {token id: bias}; ids checked against the vocabulary on submit
    ray_moe: RayMoEOptions | None = None  # ray-moe's own fields

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(v)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer as a string)")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{key!r}]={bias!r} is outside [-100, 100]")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def sampler_logprobs(self) -> int | None:
        """Alternatives per sampled token for ``SamplingParams.logprobs`` (None: no logprobs)."""
        raise NotImplementedError

    def sampling(self, max_new_tokens: int, sample: int, stop_token_ids: tuple[int, ...]) -> dict[str, Any]:
        """The ``SamplingParams`` fields of choice ``sample`` (seed + sample)."""
        return dict(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                    seed=None if self.seed is None else self.seed + sample, stop_token_ids=stop_token_ids,
                    ignore_eos=self.ignore_eos, min_tokens=min(self.min_tokens, max_new_tokens),
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logprobs=self.sampler_logprobs(), expert_stats=self.wants_expert_stats,
                    logit_bias={int(k): b for k, b in (self.logit_bias or {}).items()})

    @property
    def wants_expert_stats(self) -> bool:
        """Whether each choice carries its expert statistics (``ray_moe.expert_stats``)."""
        return self.ray_moe is not None and self.ray_moe.expert_stats

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one choice per prompt and
    sample, indexed prompt-major)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1, le=1 << 16)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: Any) -> Any:
        if len(v) == 0:
            raise ValueError("empty prompt")
        if isinstance(v, list) and isinstance(v[0], (str, list)) and any(len(p) == 0 for p in v):
            raise ValueError("empty prompt in the list")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [list(self.prompt)]
        return list(self.prompt)

    def sampler_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: ``messages`` through the model's chat template (``add_generation_prompt``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise FieldError(f"top_logprobs={self.top_logprobs} needs logprobs=true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise FieldError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             f"disagree: send one", param="max_completion_tokens")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role.value, "content": m.text()} for m in self.messages]

    def sampler_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` text, or chat ``messages`` through the chat template."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("send exactly one of prompt or messages", param="prompt")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = True


__all__ = [
    "CHAT_DEFAULT_MAX_TOKENS",
    "IGNORED_HEADER",
    "MAX_LOGPROBS",
    "MAX_N",
    "UNSUPPORTED_HEADER",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "FieldError",
    "RayMoEOptions",
    "Role",
    "TokenizeRequest",
    "field_path",
    "validation_param",
]
