"""The OpenAI request bodies ``ray-moe serve`` accepts (completions, chat completions, tokenize, detokenize).

Unknown fields are accepted and ignored, as the OpenAI API does: ``ignored_fields`` names them (the server sends
them back in ``X-Ray-MoE-Ignored-Fields``). Fields that need the shard's sampler (``logprobs``,
``top_logprobs``, the penalties, ``logit_bias``) are accepted at their default values; another value is a 400
naming the field (``unsupported_sampler_field``), never a silent ignore. ``ignore_eos`` and ``min_tokens`` are
accepted but not honoured by the generation loop yet (``unhonoured_fields``: ``X-Ray-MoE-Unsupported-Fields``).
"""

# no ``from __future__ import annotations``: the models are rebuilt inside Serve's replica process
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IGNORED_HEADER = "X-Ray-MoE-Ignored-Fields"
UNSUPPORTED_HEADER = "X-Ray-MoE-Unsupported-Fields"
MAX_N = 16  # choices per prompt
MAX_STOPS = 16  # stop strings per request
CHAT_DEFAULT_MAX_TOKENS = 1024  # a chat request without max_tokens: this many, or what fits the context and KV budget


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
    min_tokens: int = Field(default=0, ge=0)
    # the shard's sampler does not compute these yet: accepted at their defaults only (``unsupported_sampler_field``)
    top_logprobs: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(v)}")
        return v

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unhonoured_fields(self) -> list[str]:
        return [f for f, default in (("ignore_eos", False), ("min_tokens", 0)) if getattr(self, f) != default]

    def _sampler_fields(self) -> tuple[tuple[str, Any], ...]:
        return (("top_logprobs", (None, 0)), ("presence_penalty", (None, 0.0)), ("frequency_penalty", (None, 0.0)),
                ("repetition_penalty", (None, 1.0)), ("logit_bias", (None, {})))

    def unsupported_sampler_field(self) -> str | None:
        """The first field set to a value only the shard's sampler could honour (not supported yet), or None."""
        for name, defaults in self._sampler_fields():
            if getattr(self, name) not in defaults:
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Generation):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one choice per prompt and
    sample, indexed prompt-major)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1, le=1 << 16)
    echo: bool = False
    logprobs: int | None = None

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

    def _sampler_fields(self) -> tuple[tuple[str, Any], ...]:
        return (("logprobs", (None, 0)), *super()._sampler_fields())


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: ``messages`` through the model's chat template (``add_generation_prompt``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=1 << 16)
    logprobs: bool | None = False

    @model_validator(mode="after")
    def _one_limit(self) -> "ChatCompletionRequest":
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             f"disagree: send one")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role.value, "content": m.text()} for m in self.messages]

    def _sampler_fields(self) -> tuple[tuple[str, Any], ...]:
        return (("logprobs", (None, False)), *super()._sampler_fields())


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
            raise ValueError("send exactly one of prompt or messages")
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
    "MAX_N",
    "UNSUPPORTED_HEADER",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "Role",
    "TokenizeRequest",
]
