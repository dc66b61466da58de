"""Bulk-file formats: OpenAI Batch API JSONL in and out, plus plain ``{"prompt": …}`` /
``{"messages": …}`` lines. Parsing never raises for a bad line: it becomes a ``BadLine``
that names the line number and the cause, so the rest of the file still runs and every
input line ends as exactly one output line."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator, model_validator

from engine.sampling_params import SamplingParams

from worker.common.config import serves
from worker.request.priority import parse_priority
from worker.request.logprobs import chat_logprobs, completion_logprobs
from worker.request.openai_fields import RULES, Endpoint, FieldError, sampling_fields
from worker.request.convert import line_sampling_params
from worker.store.sqltypes import stored_length

MAX_CUSTOM_ID = 255  # the jobs.custom_id column
MAX_USER = 255  # the jobs.user column
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]]
    name: StrictStr | None = None

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


class _Body(BaseModel):
    """What every body may carry besides its prompt; every other field arrives as an extra and
    is classified by ``openai_fields`` (honoured sampling fields go to ``SamplingParams``, the
    one place that checks them; ignored ones are dropped; refused and unknown ones fail the line)."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    # vLLM's request priority (lower is more urgent) or a lane name; None: the batch's.
    priority: StrictInt | StrictStr | None = None

    def sampling_params(self, endpoint: Endpoint) -> SamplingParams:
        fields = sampling_fields(self.model_extra or {}, endpoint)
        return line_sampling_params(fields, endpoint)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


class CompletionBody(_Body):
    prompt: StrictStr | list[StrictInt]

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if not v:
            raise ValueError("prompt must not be empty")
        return v


class BatchLine(BaseModel):
    """One OpenAI Batch API input line."""

    model_config = ConfigDict(extra="forbid")
    custom_id: StrictStr = Field(min_length=1, max_length=MAX_CUSTOM_ID)
    method: Literal["POST"] = "POST"
    url: Literal["/v1/chat/completions", "/v1/completions"]
    body: dict[str, Any]


class PlainLine(_Body):
    """A plain line: ``{"prompt": …}`` or ``{"messages": …}`` plus optional sampling fields."""

    custom_id: StrictStr | None = Field(default=None, min_length=1, max_length=MAX_CUSTOM_ID)
    prompt: StrictStr | list[StrictInt] | None = None
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


class _FieldError(ValueError):
    """A line's own error, already phrased as ``field: cause``."""


@dataclass(slots=True)
class Request:
    """One good input line, ready to become a job."""

    line_no: int
    custom_id: str
    endpoint: Literal["chat", "completions"]
    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    model: str | None = None
    priority: int | None = None  # None: the batch's priority
    user: str | None = None  # OpenAI's end-user id: stored with the job, returned in the output
    cache_salt: str | None = None  # vLLM's: tenants with different salts share no cached work


@dataclass(slots=True)
class BadLine:
    line_no: int
    error: str
    custom_id: str | None = None
    unit: str = "line"  # "row" for a table's rows (1-based, the header not counted)

    @property
    def message(self) -> str:
        return f"{self.unit} {self.line_no}: {self.error}"


def _pydantic_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p)[:40] for p in err["loc"]) or "line"
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def _decode(raw: str | bytes, line_no: int) -> str | BadLine:
    """A line as text; bytes that are not UTF-8 make this line bad, not the whole file."""
    if isinstance(raw, bytes):
        try:
            return raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            # The column an editor shows: characters before the bad byte, counted from 1 (the
            # offset is into ``exc.object``: after the BOM, which utf-8-sig has stripped).
            data = exc.object
            column = len(data[: exc.start].decode("utf-8", errors="replace")) + 1
            return BadLine(line_no, f"not UTF-8 text: byte 0x{data[exc.start]:02x} at column {column}")
    return raw


def _has_lone_surrogate(text: str, data: Any) -> bool:
    """True when the line holds text that is not Unicode (a lone UTF-16 surrogate): no
    database or UTF-8 file can store it, so it must fail here, for this line only."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    if not _SURROGATE_ESCAPE.search(text):
        return False
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _json_message(msg: str) -> str:
    """json's message without its trailing "at" ("Invalid control character at")."""
    return msg[: -len(" at")] if msg.endswith(" at") else msg


_CUSTOM_ID = re.compile(r'"custom_id"\s*:\s*"((?:[^"\\]|\\.){1,255})"')


def _bad_json(text: str, line_no: int, exc: json.JSONDecodeError) -> BadLine:
    """A line json cannot read. One that ends before its value does (a file cut mid-line, a
    line split in two) says so, and a custom_id readable in it names the line: "malformed JSON
    at column 1" with custom_id None told nobody which request was lost, or why."""
    found = _CUSTOM_ID.search(text)
    custom_id = None
    if found is not None:
        try:
            custom_id = json.loads(f'"{found.group(1)}"')
        except ValueError:
            custom_id = None
    message = f"{_json_message(exc.msg)} at column {exc.colno}"
    truncated = exc.pos >= len(text.rstrip()) or exc.msg.startswith("Unterminated")
    if truncated and text.lstrip().startswith(("{", "[")):
        return BadLine(line_no, f"truncated JSON: the line ends before its object does ({message})", custom_id)
    return BadLine(line_no, f"malformed JSON: {message}", custom_id)


def parse_line(raw: str | bytes, line_no: int, *, model: str | None = None,
               served: Sequence[str] = ()) -> Request | BadLine:
    """One line -> a ``Request`` or a ``BadLine`` naming the line and the field; never raises.

    With ``model`` (the batch's), a line naming another model is bad: it is never silently
    served by this one, unless that name is one of ``served`` (vLLM's ``--served-model-name``:
    an OpenAI file naming ``gpt-4o-mini`` runs on this model when the user says so). Names
    match by ``model_slug`` (``org/Name`` == ``name``).
    """
    text = _decode(raw, line_no)
    if isinstance(text, BadLine):
        return text
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return _bad_json(text, line_no, exc)
    except RecursionError:
        return BadLine(line_no, "malformed JSON: nested too deeply")
    except ValueError as exc:  # e.g. an integer longer than Python's 4300-digit limit
        return BadLine(line_no, f"malformed JSON: {exc}"[:200])
    if not isinstance(data, dict):
        return BadLine(line_no, f"expected a JSON object, got {type(data).__name__}")
    custom_id = data.get("custom_id") if isinstance(data.get("custom_id"), str) else None
    if custom_id is not None and not 0 < stored_length(custom_id) <= MAX_CUSTOM_ID:
        custom_id = None  # the bad line's own error says why; it cannot keep this id
    if custom_id is None and "body" not in data and "url" not in data:
        custom_id = f"line-{line_no}"  # what a good plain line would have been called
    if _has_lone_surrogate(text, data):
        if custom_id is not None and _has_lone_surrogate(custom_id, None):
            custom_id = None
        return BadLine(line_no, "text holds a lone UTF-16 surrogate (not valid Unicode)", custom_id)
    try:
        if "body" in data or "url" in data:
            line = BatchLine.model_validate(data)
            cid = line.custom_id
            if line.url == "/v1/chat/completions":
                body = ChatBody.model_validate(line.body)
                req = Request(line_no, cid, "chat", body.sampling_params("chat"),
                              messages=[m.model_dump(exclude_none=True) for m in body.messages], model=body.model)
            else:
                body = CompletionBody.model_validate(line.body)
                req = _completion(line_no, cid, body.prompt, body.sampling_params("completions"), body.model)
        else:
            plain = PlainLine.model_validate(data)
            cid = plain.custom_id or f"line-{line_no}"
            if plain.messages is not None:
                req = Request(line_no, cid, "chat", plain.sampling_params("chat"),
                              messages=[m.model_dump(exclude_none=True) for m in plain.messages], model=plain.model)
            else:
                req = _completion(line_no, cid, plain.prompt, plain.sampling_params("completions"), plain.model)
        parsed_body = body if "body" in data or "url" in data else plain
        user = (parsed_body.model_extra or {}).get("user")
        if user is not None:
            if not isinstance(user, str) or not 0 < stored_length(user) <= MAX_USER:
                raise _FieldError(f"user: must be a string of 1 to {MAX_USER} characters")
            req.user = user
        salt = (parsed_body.model_extra or {}).get("cache_salt")
        if salt is not None:
            if not isinstance(salt, str) or not 0 < stored_length(salt) <= MAX_USER:
                raise _FieldError(f"cache_salt: must be a string of 1 to {MAX_USER} characters")
            req.cache_salt = salt
        given = parsed_body.priority
        if given is not None:
            try:
                req.priority = parse_priority(given)
            except ValueError as exc:
                raise _FieldError(f"priority: {exc}") from None
        if stored_length(cid) > MAX_CUSTOM_ID:
            raise _FieldError(f"custom_id: longer than {MAX_CUSTOM_ID} characters as stored "
                              "(each NUL or backslash in an id with a NUL counts twice)")
        if model is not None and req.model is not None and not serves(model, served, req.model):
            raise _FieldError(f"model: {req.model[:80]!r} is not this batch's model {model!r} (to run it on "
                              f"{model!r}, pass --served-model-name {req.model[:80]})")
    except ValidationError as exc:
        return BadLine(line_no, _pydantic_error(exc), custom_id)
    except (_FieldError, FieldError) as exc:
        return BadLine(line_no, str(exc), custom_id)
    except ValueError as exc:
        return BadLine(line_no, f"invalid params: {exc}", custom_id)
    return req


def _completion(line_no: int, cid: str, prompt: str | list[int], params: SamplingParams, model: str | None) -> Request:
    if isinstance(prompt, list):
        return Request(line_no, cid, "completions", params, prompt_token_ids=list(prompt), model=model)
    return Request(line_no, cid, "completions", params, prompt=prompt, model=model)


def length_error(n: int | Exception, max_model_len: int) -> str | None:
    """Why a prompt of ``n`` tokens (or the error counting it) cannot run, or None: the same
    rule the engine applies at submission, checked up front so no job is wasted. A
    ``max_tokens`` beyond the room left is fine: generation stops there with ``length``."""
    if isinstance(n, Exception):  # e.g. a token id outside the vocabulary
        return f"invalid prompt: {n}"
    if n >= max_model_len:
        return (f"prompt is {n} tokens, over the model's context of {max_model_len} "
                "(it must leave room for at least one output token)")
    return None


# ---- output lines ----------------------------------------------------------------------

def _metrics(job) -> dict[str, Any]:
    acc = None
    if job.num_draft_tokens:
        acc = (job.num_accepted_tokens or 0) / job.num_draft_tokens
    return {
        "job_id": job.id,
        "line": job.line_no,
        "user": job.user,
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
        # Answered from the result cache (``cached_timings``: the run that computed it), or by the
        # run of an earlier job of the batch asking the same (rows read before migration 0008: neither).
        "cached": bool(getattr(job, "cached", False)),
        "duplicate_of": getattr(job, "duplicate_of", None),
    }


#: error types of a request that was wrong (HTTP 400 in OpenAI's error file), not a failure
INVALID_ERROR_TYPES = frozenset({"invalid_input", "invalid_request"})
_PARAM = re.compile(r"^(?:invalid params: |invalid prompt: )?([A-Za-z_][\w.\[\]]*)(?::| must| and )")


def error_param(message: str) -> str | None:
    """The request field an error names (``"line 3: top_p must be ..."`` -> ``top_p``), or None.

    Errors are phrased ``field: cause`` (or ``field must ...``) throughout, so the field is read
    back from the message instead of being stored twice; only names a body may carry count.
    """
    text = re.sub(r"^line \d+: ", "", message)
    match = _PARAM.match(text)
    if match is None:
        return None
    param = match.group(1)
    head = re.split(r"[.\[]", param, maxsplit=1)[0]
    known = head in RULES or head in _LINE_FIELDS or text[match.end():].startswith(" unknown field")
    return param if known else None


_LINE_FIELDS = frozenset({"custom_id", "method", "url", "body", "messages", "prompt", "model"})


def _error_lines(job, base: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error-file shapes: an invalid request is a 400 response with an ``error``
    body; anything else (generation failed, cancelled, attempts exhausted) is ``error``."""
    code = job.error_type or job.status
    message = job.error or job.status
    if job.line_no is not None and not message.startswith(("line ", "row ")):
        message = f"line {job.line_no}: {message}"
    if job.error_type in INVALID_ERROR_TYPES:
        body = {"error": {"message": message, "type": "invalid_request_error", "param": error_param(message),
                          "code": code}}
        response = {"status_code": 400, "request_id": job.id, "body": body}
        return {**base, "response": response, "error": None, "specbatch": _metrics(job)}
    metrics = _metrics(job)
    if job.output_text:  # e.g. a structured job cut at max_tokens: what it generated before the cut
        metrics["partial_text"] = job.output_text
    return {**base, "response": None, "error": {"code": code, "message": message}, "specbatch": metrics}


def output_line(job) -> dict[str, Any]:
    """The OpenAI Batch output line for a finished job (a ``Job`` row)."""
    base = {"id": f"batch_req_{job.id}", "custom_id": job.custom_id}
    if job.status != "succeeded":
        return _error_lines(job, base)
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
                 "finish_reason": _finish(s.get("finish_reason")), "logprobs": chat_logprobs(s)}
                for i, s in enumerate(samples)
            ],
            "usage": usage,
        }
    else:
        body = {
            "id": f"cmpl-{job.id}", "object": "text_completion", "created": created, "model": job.model,
            "choices": [
                {"index": i, "text": s["text"], "finish_reason": _finish(s.get("finish_reason")),
                 "logprobs": completion_logprobs(s)}
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
