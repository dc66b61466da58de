"""Producer-side prompt checks: count a request's prompt tokens with the model's tokenizer
(no weights loaded) so prompts over the context fail at validation, naming the line, rather
than as a wasted job. The worker's engine applies the same rule again at submission.

``tokenize_many`` tokenizes a chunk at once: chat templates rendered by substitution where exact
(``worker.request.chat_render``), then one batched
``encode_batch_fast`` (no offsets computed) of the tokenizers library (Rust, on every core)
instead of a Python call per line; counts equal ``__call__``'s
(``apply_chat_template(tokenize=True)`` is render + encode without special tokens; ``encode``
of a prompt adds them)."""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from worker.request.chat_render import ChatRenderer
from worker.request.formats import Request
from worker.request.token_bound import byte_bounded, surely_fits


#: Tokenizer classes saved by the tokenizers library's generic backend: loaded as
#: ``PreTrainedTokenizerFast`` itself, without ``AutoTokenizer`` (whose import pulls torch,
#: 3-4 s of every ``specbatch run``'s start).
GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


class TokenCounter:
    def __init__(self, model: str) -> None:
        from engine.model_hub import resolve_model

        self.model = model  # what ``worker.ingest.parse_process`` builds its own counter from
        path = Path(resolve_model(model))
        self.tokenizer = load_tokenizer(path)
        config = json.loads((path / "config.json").read_text())
        config = config.get("text_config") or config  # a multimodal model's language model, as get_text_config()
        self.max_model_len: int = config.get("max_position_embeddings") or 2048  # as engine.llm_engine
        self.vocab_size: int = config["vocab_size"]
        self.renderer = ChatRenderer(self.tokenizer)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.byte_bounded = backend is not None and byte_bounded(backend)
        self._specials = self.tokenizer.num_special_tokens_to_add(pair=False)  # what ``encode`` adds to a prompt
        self._lock = threading.Lock()

    def lengths(self, reqs: Sequence[Request], limit: int) -> list[int | Exception]:
        """Each request's prompt tokens, except that a prompt proven to have fewer than ``limit``
        (``worker.request.token_bound``) may be given as a bound under ``limit`` instead of counted:
        what checking prompts against a context of ``limit`` needs, at a fraction of the cost."""
        return [token_count(m) for m in self.measure(reqs, limit)]

    def measure(self, reqs: Sequence[Request], limit: int) -> list[Measure]:
        """``lengths``, keeping the ids of every prompt it had to tokenize: a bound (an int under
        ``limit``) for a prompt proven to fit, else its token ids, else the error counting it.
        The ids are the engine's own (``LLMEngine.make_request``): the job carries them, so the
        prompt is never tokenized twice."""
        if not self.byte_bounded:
            return self.tokenize_many(reqs)
        out: list[Measure | None] = [None] * len(reqs)
        chats = [i for i, r in enumerate(reqs) if r.messages is not None]
        if chats:
            with self._lock:
                try:
                    rendered = self.renderer.render_many([reqs[i].messages for i in chats])
                except Exception:  # a conversation the template refuses: counting names it
                    rendered = None
            if rendered is not None:
                for i, text in zip(chats, rendered):
                    if surely_fits(text, limit):
                        out[i] = limit - 1
        for i, r in enumerate(reqs):
            if r.messages is None and r.prompt_token_ids is None and surely_fits(r.prompt or "", limit, self._specials):
                out[i] = limit - 1
        rest = [i for i, n in enumerate(out) if n is None]
        for i, n in zip(rest, self.tokenize_many([reqs[i] for i in rest]) if rest else []):
            out[i] = n
        return out  # type: ignore[return-value]

    def count_many(self, reqs: Sequence[Request]) -> list[int | Exception]:
        """Each request's prompt tokens, or the error counting it (one bad line fails alone)."""
        return [token_count(m) for m in self.tokenize_many(reqs)]

    def tokenize_many(self, reqs: Sequence[Request]) -> list[list[int] | Exception]:
        """Each request's prompt token ids, or the error tokenizing it (one bad line fails alone)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer: one at a time
            return [self._one(r) for r in reqs]
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers < 0.21: no fast form
        out: list[list[int] | Exception | None] = [None] * len(reqs)
        chats = [i for i, r in enumerate(reqs) if r.messages is not None]
        texts = [i for i, r in enumerate(reqs) if r.messages is None and r.prompt_token_ids is None]
        for i, r in enumerate(reqs):
            if r.messages is None and r.prompt_token_ids is not None:
                out[i] = self._one(r)
        with self._lock:
            if chats:
                try:
                    rendered = self.renderer.render_many([reqs[i].messages for i in chats])
                except Exception:  # one conversation the template refuses: find it, count the rest
                    rendered = None
                if rendered is not None:
                    for i, enc in zip(chats, encode(rendered, add_special_tokens=False)):
                        out[i] = enc.ids
            if texts:
                for i, enc in zip(texts, encode([reqs[i].prompt or "" for i in texts],
                                                              add_special_tokens=True)):
                    out[i] = enc.ids
        return [self._one(reqs[i]) if n is None else n for i, n in enumerate(out)]

    def _one(self, req: Request) -> list[int] | Exception:
        try:
            return self.tokenize(req)
        except Exception as exc:
            return exc

    def __call__(self, req: Request) -> int:
        return len(self.tokenize(req))

    def tokenize(self, req: Request) -> list[int]:
        """One request's prompt token ids, as the engine makes them (``LLMEngine.make_request``)."""
        with self._lock:
            if req.messages is not None:
                ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                return list(ids)
            if req.prompt_token_ids is not None:
                bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
                return list(req.prompt_token_ids)
            return self.tokenizer.encode(req.prompt or "")


#: What ``TokenCounter.measure`` gives per request: a bound under the limit (proven to fit), the
#: prompt's token ids, or the error tokenizing it.
Measure = int | list[int] | Exception


def token_count(measure: Measure) -> int | Exception:
    """A measure as a token count (a bound stays a bound; an error stays the error)."""
    return len(measure) if isinstance(measure, list) else measure


def is_generic_tokenizer(path: Path) -> bool:
    """Whether the model at ``path`` saved the generic fast tokenizer (loaded without torch)."""
    config_file = path / "tokenizer_config.json"
    saved = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    return saved in GENERIC_TOKENIZERS and (path / "tokenizer.json").exists()


def load_tokenizer(path: Path) -> Any:
    """The model's tokenizer as ``AutoTokenizer`` loads it: the generic fast tokenizer when that
    is what was saved (no torch import), else through ``AutoTokenizer`` (a model's own class)."""
    if is_generic_tokenizer(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer  # as engine.loader, without its model code

    return AutoTokenizer.from_pretrained(str(path))


@lru_cache(maxsize=4)
def token_counter(model: str) -> TokenCounter:
    return TokenCounter(model)


def torch_free_counter(model: str) -> TokenCounter | None:
    """The model's ``TokenCounter`` when its tokenizer loads without torch (what a worker
    process may hold: it never imports torch), else None; the model must be resolved already
    (the worker's engine fetched and converted it)."""
    from engine.model_hub import resolve_model

    return TokenCounter(model) if is_generic_tokenizer(Path(resolve_model(model))) else None
