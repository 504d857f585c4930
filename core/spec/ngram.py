"""N-gram prompt lookup (TGI's and vLLM's model-free proposer).

The request's last n tokens (n from `max_n` down to `min_n`) are looked up earlier in its own
tokens, prompt and output; the tokens that followed the most recent, longest match are proposed.
Input-grounded work (editing code, extracting JSON, quoting sources) repeats long runs of the
prompt, so these proposals are often accepted.

Each request keeps an index token -> positions, extended with its new tokens at every call, so
a lookup reads a few candidate positions rather than scanning the whole sequence.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..scheduling.request import Request
from .proposer import ProposalSlot

_MAX_CANDIDATES = 64  # most recent occurrences of the last token that are compared


class _Index:
    __slots__ = ("positions", "num_indexed")

    def __init__(self) -> None:
        self.positions: dict[int, list[int]] = {}
        self.num_indexed = 0


class NgramProposer:
    def __init__(self, min_n: int = 1, max_n: int = 4, window: int = 0):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        if window < 0:
            raise ValueError(f"the n-gram window must be >= 0, got {window}")
        self.min_n, self.max_n, self.window = min_n, max_n, window
        self._indexes: dict[str, _Index] = {}

    def propose(self, slots: Sequence[ProposalSlot]) -> list[list[int]]:
        return [self.lookup(request, max_tokens) for request, max_tokens in slots]

    def lookup(self, request: Request, max_tokens: int) -> list[int]:
        """One request's proposals: what followed the latest, longest match of its last tokens."""
        tokens = request.all_token_ids
        last = len(tokens) - 1
        if last < self.min_n or max_tokens < 1:
            return []
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = _Index()
        for position in range(index.num_indexed, last):  # every position but the last has a follower
            index.positions.setdefault(tokens[position], []).append(position)
        index.num_indexed = max(index.num_indexed, last)
        candidates = index.positions.get(tokens[last])
        if not candidates:
            return []
        lowest = last - self.window if self.window else 0
        best_len, best_pos = 0, -1
        for position in reversed(candidates[-_MAX_CANDIDATES:]):
            if position < lowest:
                break
            length = 1
            while (length < self.max_n and position - length >= 0
                   and tokens[position - length] == tokens[last - length]):
                length += 1
            if length > best_len:
                best_len, best_pos = length, position
                if length == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return tokens[best_pos + 1:best_pos + 1 + max_tokens]

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
