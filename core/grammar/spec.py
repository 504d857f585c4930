"""What a request asks to be constrained to (gateway -> core), validated at the edge.

A `GrammarSpec` is frozen and hashable: together with the tokenizer it keys the
compile cache, and it rides in `SamplingParams.grammar` so that the n sequences of
one request each get their own matcher over one compiled grammar. Its `gate` (gate.py)
says where in the output the grammar starts to apply (after a reasoning model's thinking):
the compilers ignore it and each request's matcher follows it (constrained.py). It is part of
the cache key, so a grammar is compiled once per gate (a served model has one).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Literal

from ..errors import ValidationError
from .gate import GrammarGate

GrammarKind = Literal["json_schema", "json_object", "regex", "structural"]


class GrammarError(ValidationError):
    """A grammar that cannot be compiled (invalid, unsupported, or too slow to compile).
    The gateway renders it as a 400 (OpenAI) / 422 (TGI) naming `param`."""


class GrammarUnavailable(GrammarError):
    """A compile that could not run, through no fault of the spec: no compile worker started
    in time, one ended under it, the busy server starved it of CPU past its time limit
    (service.timeout_error), or the compiler is shut down. Confined to its request like
    any GrammarError, never cached (a retry compiles afresh); the gateway renders it as a
    503 with Retry-After, not as a 4xx blaming the request."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    # json_schema: the schema as compact JSON text (no spaces, keys in the caller's order:
    # the order of "properties" is the order the model writes them in, so it is kept);
    # regex: the pattern; json_object: ""; structural: the tree of structural.py as compact JSON.
    value: str = ""
    gate: GrammarGate | None = None  # None: the grammar applies from the output's first token

    @classmethod
    def json_schema(cls, schema: dict | bool) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def any_text(cls) -> GrammarSpec:
        """Any text: what a gate (a thinking budget) constrains an answer that has no grammar to."""
        return cls("regex", r"[\s\S]*")

    @classmethod
    def structural(cls, tree: dict) -> GrammarSpec:
        """Fixed text, special tokens, JSON values and regexes composed (structural.py)."""
        return cls("structural", json.dumps(tree, separators=(",", ":")))

    def gated(self, gate: GrammarGate | None) -> GrammarSpec:
        """This grammar, applying only from where `gate` opens."""
        return replace(self, gate=gate)

    @property
    def schema(self) -> dict | bool | None:
        return json.loads(self.value) if self.kind == "json_schema" else None

    @property
    def structure(self) -> dict | None:
        return json.loads(self.value) if self.kind == "structural" else None
