"""Single tokens as text and bytes, cached once per tokenizer for both dialects
(OpenAI logprobs and TGI's token details)."""
from __future__ import annotations

from switchyard.core.grammar.vocabulary import is_byte_level, unicode_to_bytes


class TokenStrings:
    """The text and the UTF-8 bytes of single tokens, cached. Byte-level BPE tokens
    (GPT-2 style) give their exact bytes even when they split a character."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_decoder = unicode_to_bytes() if is_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            entry = (text, self._bytes(token_id, text))
            self._cache[token_id] = entry
        return entry

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if self._byte_decoder is not None:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in self._byte_decoder for c in piece):
                return [self._byte_decoder[c] for c in piece]
        return list(text.encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]


_strings_by_tokenizer: dict[int, tuple[object, TokenStrings]] = {}


def token_strings(tokenizer) -> TokenStrings:
    """One cache per tokenizer."""
    held = _strings_by_tokenizer.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = (tokenizer, TokenStrings(tokenizer))
        _strings_by_tokenizer[id(tokenizer)] = held
    return held[1]
