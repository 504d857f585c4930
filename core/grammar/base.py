"""The compiler interface both grammar backends implement, and token bitmask helpers.

A compiler turns a `GrammarSpec` into a `CompiledGrammar` (immutable, shared by every
request with that spec); each request gets its own `GrammarMatcher` from it. Bitmasks
are int32 tensors of shape [rows, ceil(vocab_size / 32)] on the host: bit j of word w
allows token 32 * w + j. `vocab_size` is the model's logits width, which may exceed the
tokenizer's length; ids past the tokenizer are never allowed.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch

from .spec import GrammarError, GrammarSpec


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.zeros(num_rows, bitmask_words(vocab_size), dtype=torch.int32)


def token_words(token_ids, vocab_size: int) -> torch.Tensor:
    """A bitmask row [words] with the given tokens' bits set."""
    words = [0] * bitmask_words(vocab_size)
    for token_id in token_ids:
        if 0 <= token_id < vocab_size:
            words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


_BYTE_BIAS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def mask_bias(bitmask: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] additive mask: 0 allowed, -inf disallowed.
    One row gather of an 8-wide table per byte: a single cheap op (masked_fill with a bool
    mask measured several times slower on CPU)."""
    key = (bitmask.device, dtype)
    table = _BYTE_BIAS.get(key)
    if table is None:
        bits = torch.tensor([[(value >> j) & 1 for j in range(8)] for value in range(256)], dtype=torch.bool)
        table = _BYTE_BIAS[key] = torch.where(bits, 0.0, float("-inf")).to(bitmask.device, dtype)
    index = bitmask.contiguous().view(torch.uint8).view(-1).long()
    return table.index_select(0, index).view(bitmask.shape[0], -1)[:, :vocab_size]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool, True = allowed (through the same
    table the engine masks logits with)."""
    return mask_bias(bitmask, vocab_size, torch.float32) == 0


class GrammarMatcher(ABC):
    """One request's position in a compiled grammar.

    Speculative decoding (core/spec) advances a matcher through a request's proposed tokens to
    mask each verified position, then rolls it back; a matcher keeps at least the last
    `max_rollback_tokens` steps (CompiledGrammar.new_matcher) for that."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (EOS only in accepting states)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (an accepted EOS included); at most the
        `max_rollback_tokens` the matcher was made with. ValueError past what it keeps."""

    @property
    @abstractmethod
    def can_terminate(self) -> bool:
        """In an accepting state: the output so far is a complete match, EOS may follow."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """An end-of-sequence token was accepted."""


class CompiledGrammar(ABC):
    nbytes: int = 0  # its serialized size: what the compile cache counts against its byte bound

    @abstractmethod
    def new_matcher(self, max_rollback_tokens: int = 0) -> GrammarMatcher:
        """A matcher at the grammar's start that can roll back its last `max_rollback_tokens`
        tokens (GrammarMatcher.rollback)."""


class GrammarCompiler(ABC):
    """Compiles specs for one tokenizer and logits width. Thread-safe `compile`.

    A `portable` compiler can compile in a worker process: it pickles (its tokenizer
    tables go over once per worker), `dump` turns what it compiled into bytes there and
    `load` turns those bytes back into a CompiledGrammar here."""

    name: str
    portable: bool = False

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Raises GrammarError for an invalid or unsupported spec."""

    def dump(self, compiled: CompiledGrammar) -> bytes:
        raise NotImplementedError(f"the {self.name} grammar compiler cannot compile in a worker process")

    def load(self, data: bytes) -> CompiledGrammar:
        raise NotImplementedError(f"the {self.name} grammar compiler cannot compile in a worker process")


_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s*\S+:\d+:\s*")  # "[14:48:29] /project/cpp/x.cc:94: "


def grammar_error(spec: GrammarSpec, exc: BaseException) -> GrammarError:
    """A compiler's exception as a GrammarError naming the problem and the parameter."""
    if isinstance(exc, GrammarError):  # already says what is wrong (structural.py)
        return exc
    message = _NATIVE_PREFIX.sub("", str(exc).strip()).strip() or type(exc).__name__
    what = {"json_schema": "invalid or unsupported JSON schema", "json_object": "JSON object grammar",
            "regex": "invalid or unsupported regular expression",
            "structural": "invalid or unsupported tool-call grammar"}[spec.kind]
    return GrammarError(f"{what}: {message}", param_of(spec))


def check_size(spec: GrammarSpec, nbytes: int, limit: int) -> None:
    """Refuse a compiled grammar larger than `limit` bytes."""
    if nbytes > limit:
        raise GrammarError(f"the compiled grammar takes {nbytes / (1 << 20):.1f} MiB, more than this server's limit "
                           f"of {limit / (1 << 20):.1f} MiB (--grammar-max-compiled-bytes)", param_of(spec))


def param_of(spec: GrammarSpec) -> str:
    """The request parameter a spec most likely came from (the gateway may rename it)."""
    return {"regex": "grammar", "structural": "tools"}.get(spec.kind, "response_format")
