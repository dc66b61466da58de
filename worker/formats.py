"""Bulk-file formats: OpenAI Batch API JSONL in and out, plus plain ``{"prompt": …}`` /
``{"messages": …}`` lines. Parsing never raises for a bad line: it becomes a ``BadLine``
that names the line number and the cause, so the rest of the file still runs and every
input line ends as exactly one output line."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_MAX_TOKENS = 256  # OpenAI leaves it to the model's context; we pick a bounded default

# OpenAI body fields -> SamplingParams names (n, seed, stop, top_p, ... keep their name).
_RENAMES = {"max_completion_tokens": "max_tokens"}
_SAMPLING_FIELDS = (
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens",
    "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, v):
        if isinstance(v, list):
            texts = []
            for i, part in enumerate(v):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{i}]: only text parts are supported")
                texts.append(part["text"])
            return "".join(texts)
        return v


class _Sampling(BaseModel):
    """The sampling fields every body may carry (vLLM extensions included)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    user: str | None = None  # accepted and ignored, as OpenAI does for batch lines
    stream: Literal[False] | None = None

    def sampling_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {}
        for name in _SAMPLING_FIELDS:
            value = getattr(self, name)
            if value is not None:
                params[_RENAMES.get(name, name)] = value
        params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        return params


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Sampling):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class BatchLine(BaseModel):
    """One OpenAI Batch API input line."""

    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=255)
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class PlainLine(_Sampling):
    """A plain line: ``{"prompt": …}`` or ``{"messages": …}`` plus optional sampling fields."""

    custom_id: str | None = Field(default=None, min_length=1, max_length=255)
    prompt: str | list[int] | None = None
    messages: list[Message] | None = None

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


@dataclass(slots=True)
class Request:
    """One good input line, ready to become a job."""

    line_no: int
    custom_id: str
    endpoint: Literal["chat", "completions"]
    params: dict[str, Any]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None


@dataclass(slots=True)
class BadLine:
    line_no: int
    error: str
    custom_id: str | None = None

    @property
    def message(self) -> str:
        return f"line {self.line_no}: {self.error}"


@dataclass(slots=True)
class Parsed:
    requests: list[Request] = field(default_factory=list)
    bad: list[BadLine] = field(default_factory=list)

    @property
    def num_lines(self) -> int:
        return len(self.requests) + len(self.bad)


def _pydantic_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"]) or "line"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def _check_params(params: dict[str, Any]) -> None:
    """The engine's own checks (names the field), without loading a model."""
    from engine.sampling_params import SamplingParams

    SamplingParams.from_dict(params)


def parse_line(text: str, line_no: int) -> Request | BadLine:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(line_no, f"malformed JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(data, dict):
        return BadLine(line_no, f"expected a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) else None
    if custom_id is None and "body" not in data and "url" not in data:
        custom_id = f"line-{line_no}"  # what a good plain line would have been called
    try:
        if "body" in data or "url" in data:
            line = BatchLine.model_validate(data)
            if line.url == "/v1/chat/completions":
                body = ChatBody.model_validate(line.body)
                req = Request(line_no, line.custom_id, "chat", body.sampling_params(),
                              messages=[m.model_dump(exclude_none=True) for m in body.messages], model=body.model)
            else:
                body = CompletionBody.model_validate(line.body)
                req = _completion(line_no, line.custom_id, body.prompt, body.sampling_params(), body.model)
        else:
            plain = PlainLine.model_validate(data)
            cid = plain.custom_id or f"line-{line_no}"
            if plain.messages is not None:
                req = Request(line_no, cid, "chat", plain.sampling_params(),
                              messages=[m.model_dump(exclude_none=True) for m in plain.messages], model=plain.model)
            else:
                req = _completion(line_no, cid, plain.prompt, plain.sampling_params(), plain.model)
        _check_params(req.params)
    except ValidationError as exc:
        return BadLine(line_no, _pydantic_error(exc), custom_id)
    except ValueError as exc:
        return BadLine(line_no, f"invalid params: {exc}", custom_id)
    return req


def _completion(line_no: int, cid: str, prompt: str | list[int], params: dict[str, Any], model: str | None) -> Request:
    if isinstance(prompt, list):
        return Request(line_no, cid, "completions", params, prompt_token_ids=list(prompt), model=model)
    return Request(line_no, cid, "completions", params, prompt=prompt, model=model)


def parse_lines(lines: Iterable[str], *, start: int = 1) -> Parsed:
    """Parse every line; blank lines are skipped; duplicate custom_ids are bad lines."""
    parsed = Parsed()
    seen: dict[str, int] = {}
    for line_no, text in enumerate(lines, start=start):
        if not text.strip():
            continue
        item = parse_line(text, line_no)
        if isinstance(item, Request):
            first = seen.get(item.custom_id)
            if first is not None:
                parsed.bad.append(BadLine(line_no, f"duplicate custom_id {item.custom_id!r} (first on line {first})"))
                continue
            seen[item.custom_id] = line_no
            parsed.requests.append(item)
        else:
            if item.custom_id is not None and item.custom_id in seen:
                item.custom_id = None  # keep (batch_id, custom_id) unique in the store
            elif item.custom_id is not None:
                seen[item.custom_id] = line_no
            parsed.bad.append(item)
    return parsed


def parse_file(path: str | Path) -> Parsed:
    with open(path, encoding="utf-8") as fh:
        return parse_lines(fh)


def check_lengths(parsed: Parsed, count_tokens: Callable[[Request], int], max_model_len: int) -> None:
    """Move requests whose prompt leaves no room in the context to the bad lines (the same
    rule the engine applies at submission, checked up front so no job is wasted)."""
    keep = []
    for req in parsed.requests:
        try:
            n = count_tokens(req)
        except Exception as exc:  # e.g. a token id outside the vocabulary
            parsed.bad.append(BadLine(req.line_no, f"invalid prompt: {exc}", req.custom_id))
            continue
        if n >= max_model_len:
            parsed.bad.append(BadLine(
                req.line_no,
                f"prompt is {n} tokens, over the model's context of {max_model_len} "
                "(it must leave room for at least one output token)",
                req.custom_id,
            ))
        else:
            keep.append(req)
    parsed.requests = keep
    parsed.bad.sort(key=lambda b: b.line_no)


# ---- output lines ----------------------------------------------------------------------

def _metrics(job) -> dict[str, Any]:
    acc = None
    if job.num_draft_tokens:
        acc = (job.num_accepted_tokens or 0) / job.num_draft_tokens
    return {
        "job_id": job.id,
        "line": job.line_no,
        "status": job.status,
        "attempts": job.attempts,
        "worker": job.worker,
        "device": job.device,
        "queue_wait_s": job.queue_wait_s,
        "ttft_s": job.ttft_s,
        "tpot_s": job.tpot_s,
        "tokens_per_s": job.tokens_per_s,
        "enqueued_at": job.enqueued_at,
        "started_at": job.started_at,
        "first_token_at": job.first_token_at,
        "finished_at": job.finished_at,
        "num_cached_tokens": job.num_cached_tokens,
        "num_draft_tokens": job.num_draft_tokens,
        "num_accepted_tokens": job.num_accepted_tokens,
        "acceptance_rate": acc,
        "max_batch_size": job.max_batch_size,
    }


def output_line(job) -> dict[str, Any]:
    """The OpenAI Batch output line for a finished job (a ``Job`` row)."""
    base = {"id": f"batch_req_{job.id}", "custom_id": job.custom_id}
    if job.status != "succeeded":
        code = job.error_type or job.status
        message = job.error or job.status
        if job.line_no is not None and not message.startswith("line "):
            message = f"line {job.line_no}: {message}"
        return {**base, "response": None, "error": {"code": code, "message": message}, "specbatch": _metrics(job)}
    created = int(job.finished_at or time.time())
    samples = job.outputs or [{"text": job.output_text or "", "finish_reason": job.finish_reason}]
    usage = {
        "prompt_tokens": job.num_prompt_tokens or 0,
        "completion_tokens": job.num_output_tokens or 0,
        "total_tokens": (job.num_prompt_tokens or 0) + (job.num_output_tokens or 0),
        "prompt_tokens_details": {"cached_tokens": job.num_cached_tokens or 0},
    }
    if job.endpoint == "chat":
        body = {
            "id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": created, "model": job.model,
            "choices": [
                {"index": i, "message": {"role": "assistant", "content": s["text"]},
                 "finish_reason": _finish(s.get("finish_reason")), "logprobs": None}
                for i, s in enumerate(samples)
            ],
            "usage": usage,
        }
    else:
        body = {
            "id": f"cmpl-{job.id}", "object": "text_completion", "created": created, "model": job.model,
            "choices": [
                {"index": i, "text": s["text"], "finish_reason": _finish(s.get("finish_reason")), "logprobs": None}
                for i, s in enumerate(samples)
            ],
            "usage": usage,
        }
    return {**base, "response": {"status_code": 200, "request_id": job.id, "body": body}, "error": None,
            "specbatch": _metrics(job)}


def _finish(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else (reason or "stop")


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> int:
    n = 0
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    tmp.replace(path)
    return n
