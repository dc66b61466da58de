"""Incremental detokenisation and the stopping rules applied to every new token."""

from __future__ import annotations

from engine.sequence import Sequence


class StopChecker:
    """Decides, token by token, whether a sample has finished and why.

    Stop strings are matched on the incrementally decoded text, so a stop string split across
    token boundaries is still found; text is decoded only for requests that have stop strings.
    """

    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def _decode_delta(self, seq: Sequence) -> str:
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        if seq.read_offset == 0:
            seq.prefix_offset = seq.read_offset = seq.num_prompt_tokens
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 character: wait for the next token
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return full[len(prefix) :]

    def append(self, seq: Sequence, token: int) -> bool:
        """Append one sampled token to ``seq``; return True when the sample is finished."""
        seq.token_ids.append(token)
        params = seq.params
        num_out = seq.num_output_tokens
        if token in self.eos_ids and not params.ignore_eos and num_out >= params.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", None
            return True
        if token in params.stop_token_ids and num_out >= params.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", token
            return True
        if params.stop:
            delta = self._decode_delta(seq)
            if delta:
                start = max(0, len(seq.text) - max(len(s) for s in params.stop) + 1)
                seq.text += delta
                if num_out >= params.min_tokens:
                    hit = self._find_stop(seq.text, params.stop, start)
                    if hit is not None:
                        pos, stop = hit
                        end = pos + len(stop) if params.include_stop_str_in_output else pos
                        seq.text = seq.text[:end]
                        seq.finish_reason, seq.stop_reason = "stop", stop
                        return True
        if num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    @staticmethod
    def _find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in stops:
            pos = text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def final_text(self, seq: Sequence) -> str:
        if seq.params.stop:
            if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
                return seq.text
            # Flush whatever an incomplete character held back.
            return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
