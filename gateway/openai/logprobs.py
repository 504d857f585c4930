"""Log-probabilities in OpenAI's two shapes: chat (`logprobs.content[]` of
{token, logprob, bytes, top_logprobs}) and legacy completions ({tokens,
token_logprobs, top_logprobs, text_offset}). Values are always finite."""
from __future__ import annotations

from collections.abc import Sequence

from ..streaming import finite

TopLogprobs = Sequence[tuple[int, float]]


class TokenStrings:
    """The text and the UTF-8 bytes of single tokens, cached. Byte-level BPE tokens
    (GPT-2 style) give their exact bytes even when they split a character."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_decoder = _byte_decoder(tokenizer)
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


def _byte_decoder(tokenizer) -> dict[str, int] | None:
    """GPT-2's byte <-> printable character table, if the tokenizer decodes byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or "ByteLevel" not in repr(decoder):
        return None
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_strings_by_tokenizer: dict[int, tuple[object, TokenStrings]] = {}


def token_strings(tokenizer) -> TokenStrings:
    """One cache per tokenizer."""
    held = _strings_by_tokenizer.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        held = (tokenizer, TokenStrings(tokenizer))
        _strings_by_tokenizer[id(tokenizer)] = held
    return held[1]


# -- chat ---------------------------------------------------------------------------------------------
def chat_logprob_entries(strings: TokenStrings, token_ids: Sequence[int], logprobs: Sequence[float],
                         top: Sequence[TopLogprobs] | None) -> list[dict]:
    entries = []
    for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        alternatives = top[i] if top is not None and i < len(top) else ()
        entries.append({"token": strings.text(token_id), "logprob": finite(logprob),
                        "bytes": strings.bytes(token_id),
                        "top_logprobs": [{"token": strings.text(t), "logprob": finite(lp),
                                          "bytes": strings.bytes(t)} for t, lp in alternatives]})
    return entries


# -- completions --------------------------------------------------------------------------------------
class CompletionLogprobs:
    """Legacy completion log-probabilities, built piece by piece (text offsets run on)."""

    def __init__(self, strings: TokenStrings, text_offset: int = 0):
        self._strings = strings
        self._offset = text_offset

    def prompt(self, prompt_logprobs) -> dict:
        """The prompt's tokens (echo): the first has no log-probability."""
        return self._fragment([(token_id, logprob, top if logprob is not None else None)
                               for token_id, logprob, top in prompt_logprobs])

    def generated(self, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[TopLogprobs] | None) -> dict:
        return self._fragment([(t, lp, top[i] if top is not None and i < len(top) else ())
                               for i, (t, lp) in enumerate(zip(token_ids, logprobs))])

    def _fragment(self, items) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, logprob, top in items:
            text = self._strings.text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else finite(logprob))
            out["top_logprobs"].append(None if top is None else self._top_dict(top))
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def _top_dict(self, top: TopLogprobs) -> dict[str, float]:
        result: dict[str, float] = {}
        for token_id, logprob in top:
            result.setdefault(self._strings.text(token_id), finite(logprob))
        return result


def merge_fragments(fragments: list[dict]) -> dict:
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for fragment in fragments:
        for key in merged:
            merged[key].extend(fragment[key])
    return merged
