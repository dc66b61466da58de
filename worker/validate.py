"""Producer-side prompt checks: count a request's prompt tokens with the model's tokenizer
(no weights loaded) so prompts over the context fail at validation, naming the line, rather
than as a wasted job. The worker's engine applies the same rule again at submission."""

from __future__ import annotations

import threading
from functools import lru_cache

from .formats import Request


class TokenCounter:
    def __init__(self, model: str) -> None:
        from engine.loader import load_tokenizer
        from engine.model_hub import resolve_model
        from transformers import AutoConfig

        path = resolve_model(model)
        self.tokenizer = load_tokenizer(path)
        config = AutoConfig.from_pretrained(path).get_text_config()
        self.max_model_len: int = getattr(config, "max_position_embeddings", None) or 2048
        self.vocab_size: int = config.vocab_size
        self._lock = threading.Lock()

    def __call__(self, req: Request) -> int:
        with self._lock:
            if req.messages is not None:
                ids = self.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                return len(ids)
            if req.prompt_token_ids is not None:
                bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt token ids out of the vocabulary [0, {self.vocab_size}): {bad[:5]}")
                return len(req.prompt_token_ids)
            return len(self.tokenizer.encode(req.prompt or ""))


@lru_cache(maxsize=4)
def token_counter(model: str) -> TokenCounter:
    return TokenCounter(model)
