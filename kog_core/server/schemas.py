"""Request bodies of the OpenAI-compatible API (pydantic).

Unknown fields are accepted and ignored (as vLLM and most OpenAI-compatible servers do), because
agent clients routinely send parameters a local model has no use for (`user`, `store`,
`metadata`, `parallel_tool_calls`, `reasoning_effort`, ...). Known parameters that kog cannot
honour (n > 1, logprobs, tools, echo, best_of, suffix, non-text content) are rejected with a
400 `invalid_request_error` rather than silently ignored, so a client never gets an answer it
did not ask for. Out-of-range values are rejected with 400 too (OpenAI's status, not 422).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 16


class UnsupportedParameter(ValueError):
    """A known OpenAI parameter kog does not implement (set to a non-default value)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")   # unknown params: accepted, ignored (see module doc)

    def ignored_params(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingRequest(_Lenient):
    model: Optional[str] = Field(None, max_length=512)
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)              # extension (vLLM / llama.cpp); 0 = off
    ignore_eos: bool = False                              # extension (vLLM): run to max_tokens
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Optional[Union[str, list[str]]] = None
    n: Optional[int] = Field(1, ge=1, le=128)
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)   # accepted; not applied
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)  # accepted; not applied
    logprobs: Optional[Any] = None
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v):
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else list(v)
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > 256 for s in stops):
            raise ValueError("a stop string is longer than 256 characters")
        return [s for s in stops if s]

    def check_supported(self) -> None:
        if (self.n or 1) != 1:
            raise UnsupportedParameter("n", "only n=1 is supported (kog decodes one sequence at batch 1)")
        if self.logprobs not in (None, False, 0):
            raise UnsupportedParameter("logprobs", "logprobs are not supported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(_Lenient):
    type: str
    text: Optional[str] = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text" or p.text is None:
                raise UnsupportedParameter("messages", f"content parts of type {p.type!r} are not supported "
                                                       f"(text only)")
            parts.append(p.text)
        return "".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    tools: Optional[list[Any]] = None
    functions: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    @property
    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.functions:
            raise UnsupportedParameter("tools", "tool / function calling is not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedParameter("tool_choice", "tool calling is not supported by this server")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise UnsupportedParameter("response_format", "only response_format type 'text' is supported")
        if self.top_logprobs:
            raise UnsupportedParameter("top_logprobs", "logprobs are not supported")

    def chat_messages(self) -> list[dict]:
        out = []
        for m in self.messages:
            if m.role in ("tool", "function"):
                raise UnsupportedParameter("messages", f"messages with role {m.role!r} are not supported "
                                                       f"(no tool calling)")
            role = "system" if m.role == "developer" else m.role
            out.append({"role": role, "content": m.text()})
        return out


class CompletionRequest(_SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise UnsupportedParameter("echo", "echo is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedParameter("best_of", "only best_of=1 is supported")
        if self.suffix:
            raise UnsupportedParameter("suffix", "suffix (fill-in-the-middle) is not supported")

    def single_prompt(self) -> Union[str, list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise UnsupportedParameter("prompt", "the prompt is empty")
        if all(isinstance(x, int) for x in p):
            return list(p)
        if len(p) != 1:
            raise UnsupportedParameter("prompt", "only one prompt per request is supported (no batches)")
        return p[0] if isinstance(p[0], str) else list(p[0])
