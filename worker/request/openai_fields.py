"""Every field of OpenAI's and vLLM's ``/v1/chat/completions`` and ``/v1/completions`` request
bodies, classified: honoured, accepted and ignored (and why), or refused with a per-line error.

This table is the one place that decides what a body field does: the batch reader checks
bodies against it (``check_body``), README's "OpenAI and vLLM batch fields" section is its
rendering (``render_table``), and a test walks the ``openai`` SDK's request types and vLLM's
field list so a new upstream field fails until it is classified here.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping

Endpoint = Literal["chat", "completions"]
Status = Literal["honoured", "ignored", "refused"]
CHAT: tuple[Endpoint, ...] = ("chat",)
COMPLETIONS: tuple[Endpoint, ...] = ("completions",)
BOTH: tuple[Endpoint, ...] = ("chat", "completions")

#: Fields the body models read themselves (not sampling parameters).
BODY_FIELDS = frozenset({"messages", "prompt", "model"})
#: Honoured fields that belong to the job, not to ``SamplingParams`` (the batch reader keeps them).
JOB_FIELDS = frozenset({"user", "priority", "cache_salt"})


def _absent(value: Any, _endpoint: Endpoint) -> bool:
    return value is None or (isinstance(value, (list, dict, str)) and not value)


def _only(*allowed: Any) -> Callable[[Any, Endpoint], bool]:
    """Values that are harmless (ignored): null, or one of ``allowed`` of the same type."""

    def check(value: Any, _endpoint: Endpoint) -> bool:
        return value is None or any(type(value) is type(a) and value == a for a in allowed)

    return check


def _text_only(value: Any, _endpoint: Endpoint) -> bool:
    return value is None or value == ["text"]


def _no_tool_choice(value: Any, _endpoint: Endpoint) -> bool:
    return value is None or value == "none"


def _endpoint_default_special_tokens(value: Any, endpoint: Endpoint) -> bool:
    return value is None or value is (endpoint == "completions")


def _one(value: Any, _endpoint: Endpoint) -> bool:
    return value is None or (type(value) in (int, float) and value == 1)


@dataclass(frozen=True, slots=True)
class FieldRule:
    name: str
    endpoints: tuple[Endpoint, ...]
    source: str  # "OpenAI", "vLLM" or "OpenAI, vLLM": whose request model has it
    status: Status
    note: str  # how it is honoured, or why it is ignored or refused
    # ignored/refused: the values accepted (and ignored); any other value refuses the line.
    # None means: every value (ignored) / only an absent one (refused).
    harmless: Callable[[Any, Endpoint], bool] | None = None

    def error(self, value: Any, endpoint: Endpoint) -> str | None:
        """The line's error for this value, or None when it is accepted."""
        if self.status == "honoured":
            return None
        ok = self.harmless or (_absent if self.status == "refused" else None)
        if ok is None or ok(value, endpoint):
            return None
        return f"{self.name}: refused ({self.note})"


O, V, OV = "OpenAI", "vLLM", "OpenAI, vLLM"
_GUIDED_OLD = "vLLM's older name of structured_outputs.{} (constrains the output; see response_format)"
_RULES = [
    # -- the prompt ---------------------------------------------------------------------
    FieldRule("messages", CHAT, OV, "honoured", "rendered by the model's chat template; text content parts only (image, audio and file parts refuse the line)"),
    FieldRule("prompt", COMPLETIONS, OV, "honoured", "a string or a list of token ids; several prompts in one line (a list of strings or of id lists) refuse it: one line is one job"),
    FieldRule("model", BOTH, OV, "honoured", "must name the batch's model (compared by its last path part, case-insensitively), else the line is refused"),
    # -- sampling and stopping ----------------------------------------------------------
    FieldRule("max_tokens", BOTH, OV, "honoured", "clamped to the context left after the prompt; absent means 1024 (OpenAI's and vLLM's /v1/completions default is 16)"),
    FieldRule("max_completion_tokens", BOTH, OV, "honoured", "the newer name of max_tokens (taken on /v1/completions too); when both are given it wins, as in vLLM"),
    FieldRule("temperature", BOTH, OV, "honoured", "[0, 2]; 0 is greedy"),
    FieldRule("top_p", BOTH, OV, "honoured", "(0, 1]"),
    FieldRule("n", BOTH, OV, "honoured", "1 to 128 samples, returned as that many choices"),
    FieldRule("seed", BOTH, OV, "honoured", "int64; the same seed gives the same text on any worker, batch or retry; unseeded lines get a recorded seed"),
    FieldRule("stop", BOTH, OV, "honoured", "a string or a list of strings; matched on the decoded text"),
    FieldRule("frequency_penalty", BOTH, OV, "honoured", "[-2, 2]"),
    FieldRule("presence_penalty", BOTH, OV, "honoured", "[-2, 2]"),
    FieldRule("logit_bias", BOTH, OV, "honoured", "token id (string keys) -> bias in [-100, 100], added to the logits before sampling and in speculative verification; -100 bans a token, +100 makes the +100 tokens the only candidates; ids outside the vocabulary, or -100 on every token, fail the line at validation"),
    FieldRule("logprobs", BOTH, OV, "honoured", "chat: true returns choices[].logprobs.content[] (token, bytes, logprob, top_logprobs); completions: an integer 0-20 returns the completions logprobs object. Values are the model's raw log-softmax (before penalties, bias and temperature), as vLLM returns by default"),
    FieldRule("top_logprobs", CHAT, OV, "honoured", "0-20 alternatives per position; needs logprobs: true"),
    FieldRule("top_k", BOTH, V, "honoured", "0 or -1 is off"),
    FieldRule("min_p", BOTH, V, "honoured", "[0, 1]"),
    FieldRule("repetition_penalty", BOTH, V, "honoured", "> 0; 1 is off"),
    FieldRule("stop_token_ids", BOTH, V, "honoured", "token ids that end a sample"),
    FieldRule("include_stop_str_in_output", BOTH, V, "honoured", "keep the matched stop string in the text"),
    FieldRule("ignore_eos", BOTH, V, "honoured", "generate past EOS up to max_tokens"),
    FieldRule("min_tokens", BOTH, V, "honoured", "EOS and stop tokens are banned until a sample has this many tokens"),
    FieldRule("skip_special_tokens", BOTH, V, "honoured", "drop special tokens from the text"),
    FieldRule("user", BOTH, OV, "honoured", "OpenAI's end-user id (1-255 characters): stored with the job and returned as specbatch.user in its output line; it does not change caching or routing"),
    FieldRule("cache_salt", BOTH, V, "honoured", "vLLM's tenant salt (1-255 characters): requests with different salts share neither prefix-cache blocks nor cached results"),
    # -- accepted and ignored -----------------------------------------------------------
    FieldRule("safety_identifier", CHAT, O, "ignored", "OpenAI's abuse-monitoring id; there is no monitoring here"),
    FieldRule("metadata", CHAT, O, "ignored", "tags for OpenAI's stored completions; results are kept in specbatch's store by job"),
    FieldRule("store", CHAT, O, "ignored", "OpenAI's stored completions; every result is kept in specbatch's store anyway"),
    FieldRule("service_tier", CHAT, O, "ignored", "OpenAI's capacity tier; a batch runs on the workers it has"),
    FieldRule("prompt_cache_key", CHAT, O, "ignored", "prefix caching is automatic for every line"),
    FieldRule("prompt_cache_retention", CHAT, O, "ignored", "prefix caching is automatic; cached blocks live until evicted (LRU)"),
    FieldRule("prompt_cache_options", CHAT, O, "ignored", "prefix caching is automatic for every line"),
    FieldRule("reasoning_effort", CHAT, OV, "ignored", "for OpenAI's reasoning models; the chat template is not given it, so it has no effect"),
    FieldRule("verbosity", CHAT, O, "ignored", "a hint to OpenAI's GPT-5 models; no effect on these models"),
    FieldRule("parallel_tool_calls", CHAT, OV, "ignored", "meaningful only with tools, which are refused"),
    FieldRule("request_id", BOTH, V, "ignored", "lines are named by custom_id and their job id"),
    FieldRule("stream", BOTH, OV, "ignored", "false is accepted; true is refused: a batch line has no stream to write to", _only(False)),
    FieldRule("modalities", CHAT, O, "ignored", '["text"] is accepted; audio output is refused', _text_only),
    FieldRule("tool_choice", CHAT, OV, "ignored", '"none" is accepted; any other choice is refused until tool calling is supported', _no_tool_choice),
    FieldRule("include_reasoning", CHAT, V, "ignored", "true is accepted (no reasoning parser: reasoning stays in the content); false is refused", _only(True)),
    FieldRule("add_generation_prompt", CHAT, V, "ignored", "true is accepted (always added); false is refused", _only(True)),
    FieldRule("continue_final_message", CHAT, V, "ignored", "false is accepted; true (prefilling the reply) is refused", _only(False)),
    FieldRule("add_special_tokens", BOTH, V, "ignored", "the endpoint's default is accepted (chat false, completions true); the other value is refused", _endpoint_default_special_tokens),
    FieldRule("spaces_between_special_tokens", BOTH, V, "ignored", "true is accepted (the tokenizer's decoding); false is refused", _only(True)),
    FieldRule("echo", BOTH, OV, "ignored", "false is accepted; true (prompt echoed into the text) is refused", _only(False)),
    FieldRule("use_beam_search", BOTH, V, "ignored", "false is accepted; beam search is refused", _only(False)),
    FieldRule("length_penalty", BOTH, V, "ignored", "1 is accepted (it applies to beam search only); other values are refused", _one),
    FieldRule("best_of", BOTH, OV, "ignored", "1 is accepted; more is refused (ranking samples by logprob is not supported; use n)", _one),
    FieldRule("return_tokens_as_token_ids", BOTH, V, "ignored", "false is accepted; true is refused (logprobs give text and bytes)", _only(False)),
    FieldRule("response_format", BOTH, OV, "honoured", '{"type": "json_schema", "json_schema": {"schema": ...}} constrains the output to the schema (xgrammar; compact JSON) and validates the result again (jsonschema) before the job succeeds; {"type": "json_object"}: any JSON object; {"type": "text"}: unconstrained. A schema that does not compile (or not within the worker\'s time limit) fails its job; output cut by max_tokens fails it as structured_output_incomplete (finish_reason length, text kept in the store)'),
    FieldRule("guided_json", BOTH, V, "honoured", _GUIDED_OLD.format("json") + "; validated again like response_format"),
    FieldRule("guided_regex", BOTH, V, "honoured", _GUIDED_OLD.format("regex") + "; the whole output must match it"),
    FieldRule("guided_choice", BOTH, V, "honoured", _GUIDED_OLD.format("choice") + "; the output is one of the strings"),
    FieldRule("guided_grammar", BOTH, V, "honoured", _GUIDED_OLD.format("grammar") + "; EBNF in xgrammar's dialect (GBNF-like), not Lark"),
    FieldRule("priority", BOTH, V, "honoured", "vLLM's request priority (lower is served first) or a lane name, interactive (0) or bulk (1); <= 0 rides the interactive lane; absent: the batch's (bulk unless --priority says otherwise)"),
    # -- refused (an absent, null or empty value is accepted) ---------------------------
    FieldRule("tools", CHAT, OV, "refused", "tool calling is not supported yet"),
    FieldRule("functions", CHAT, O, "refused", "function calling is not supported yet"),
    FieldRule("function_call", CHAT, O, "refused", "function calling is not supported yet"),
    FieldRule("audio", CHAT, O, "refused", "audio output is not supported"),
    FieldRule("prediction", CHAT, O, "refused", "predicted outputs are not supported yet"),
    FieldRule("web_search_options", CHAT, O, "refused", "web search is not available"),
    FieldRule("moderation", CHAT, O, "refused", "no moderation model runs here"),
    FieldRule("stream_options", BOTH, OV, "refused", "streaming is refused, so its options are too"),
    FieldRule("suffix", COMPLETIONS, OV, "refused", "insertion (fill in the middle) is not supported"),
    FieldRule("prompt_embeds", COMPLETIONS, V, "refused", "prompts are text or token ids"),
    FieldRule("truncate_prompt_tokens", BOTH, V, "refused", "prompts are never truncated: one over the context fails its line"),
    FieldRule("prompt_logprobs", BOTH, V, "refused", "prompt logprobs are not computed (only the sampled positions' logits are)"),
    FieldRule("allowed_token_ids", BOTH, V, "refused", "not supported yet (logit_bias +100 on each allowed token does the same)"),
    FieldRule("bad_words", CHAT, V, "refused", "not supported yet (logit_bias -100 bans single tokens)"),
    FieldRule("documents", CHAT, V, "refused", "chat-template documents are not passed to the template"),
    FieldRule("chat_template", CHAT, V, "refused", "the model's own chat template is always used"),
    FieldRule("chat_template_kwargs", CHAT, V, "refused", "the chat template is not given extra arguments"),
    FieldRule("mm_processor_kwargs", CHAT, V, "refused", "multimodal input is not supported"),
    FieldRule("structural_tag", CHAT, V, "refused", "structural tags (tool-call formats) are not supported; response_format and guided_* are"),
    FieldRule("guided_decoding_backend", BOTH, V, "refused", "the grammar backend is always xgrammar"),
    FieldRule("guided_whitespace_pattern", BOTH, V, "refused", "JSON is generated compact (json.dumps separators); a custom whitespace pattern is not supported"),
    FieldRule("logits_processors", BOTH, V, "refused", "no user code runs in the workers"),
    FieldRule("kv_transfer_params", BOTH, V, "refused", "disaggregated serving is not supported"),
    FieldRule("vllm_xargs", BOTH, V, "refused", "no custom extensions run here"),
]
RULES: dict[str, FieldRule] = {rule.name: rule for rule in _RULES}
assert len(RULES) == len(_RULES), "a field is classified twice"


def fields_for(endpoint: Endpoint) -> Mapping[str, FieldRule]:
    """The rules of ``endpoint``'s fields (read-only, built once: it is asked for every line)."""
    return _FIELDS_FOR[endpoint]


_FIELDS_FOR: dict[str, Mapping[str, FieldRule]] = {
    endpoint: MappingProxyType({name: rule for name, rule in RULES.items() if endpoint in rule.endpoints})
    for endpoint in BOTH
}


class FieldError(ValueError):
    """A body field refused: the message starts with the field's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def sampling_fields(extra: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """The honoured sampling fields of a body's other fields (``BODY_FIELDS`` excluded);
    an unknown or refused field raises ``FieldError`` naming it."""
    rules = fields_for(endpoint)
    unknown = [k for k in extra if k not in rules]
    if unknown:
        unknown = sorted(str(k)[:40] for k in unknown)
        others = [k for k in unknown if k in RULES]
        if others:
            raise FieldError(others[0], f"{others[0]}: not a field of {_URL[endpoint]}")
        raise FieldError(unknown[0], f"{', '.join(unknown)}: unknown field")
    honoured: dict[str, Any] = {}
    for name, value in extra.items():
        rule = rules[name]
        error = rule.error(value, endpoint)
        if error is not None:
            raise FieldError(name, error)
        if rule.status == "honoured" and name not in JOB_FIELDS:
            honoured[name] = value
    return honoured


_URL = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def render_table() -> str:
    """README's field table (markdown), in the order of ``_RULES``."""
    mark = {"chat": "chat", "completions": "completions"}
    lines = [
        "| field | endpoints | in | status | what specbatch does |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in _RULES:
        where = ", ".join(mark[e] for e in rule.endpoints)
        note = rule.note.replace("|", "\\|")
        lines.append(f"| `{rule.name}` | {where} | {rule.source} | {rule.status} | {note} |")
    return "\n".join(lines)
