"""Log-probabilities in OpenAI's two shapes: chat (`logprobs.content[]` of
{token, logprob, bytes, top_logprobs}) and legacy completions ({tokens,
token_logprobs, top_logprobs, text_offset}). Values are always finite."""
from __future__ import annotations

from collections.abc import Sequence

from ..streaming import finite
from ..tokens import TokenStrings

TopLogprobs = Sequence[tuple[int, float]]


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
