"""Incremental detokenization and stop strings."""
from __future__ import annotations

# How many prompt tokens seed the decode window, so that the first output token
# is decoded after real context (tokenizers strip or merge spaces at the start).
# Afterwards the window is the previous token plus the unread ones.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Text is released only when it no longer ends in an incomplete UTF-8
    sequence (U+FFFD), so a multi-byte character is never split; with stop
    strings, the last len(longest stop) - 1 characters are held back until
    they can no longer begin a stop string.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self.text = ""  # all output text so far (after any stop-string trim)
        self._num_emitted = 0  # characters of self.text already returned
        self.stop_string_hit: str | None = None
        # tokens of the last update() that were read: fewer than given when a stop string ended
        # the text before the last of them (several tokens in one step: speculative decoding)
        self.num_read = 0

    def update(self, new_token_ids: list[int] | tuple[int, ...], finished: bool = False) -> str:
        """Add tokens; return the text delta that is safe to show now."""
        self.num_read = 0
        if self.stop_string_hit is None:
            for token_id in new_token_ids:
                self._token_ids.append(token_id)
                self.num_read += 1
                start = len(self.text)
                self.text += self._decode_next()
                if self._stop and self._find_stop(start):
                    break
        return self._release(finished or self.stop_string_hit is not None)

    def _decode_next(self) -> str:
        decode = self._tokenizer.decode
        prefix = decode(self._token_ids[self._prefix_offset:self._read_offset],
                        skip_special_tokens=self._skip_special)
        full = decode(self._token_ids[self._prefix_offset:], skip_special_tokens=self._skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # wait for the rest of a multi-byte character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full[len(prefix):]

    def _find_stop(self, new_text_start: int) -> bool:
        search_from = max(0, new_text_start - self._hold_back)
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        self.text = self.text[:index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_string_hit = stop
        return True

    def _release(self, finished: bool) -> str:
        end = len(self.text) if finished else max(self._num_emitted, len(self.text) - self._hold_back)
        delta = self.text[self._num_emitted:end]
        self._num_emitted = end
        return delta
