"""The reasoning formats `--reasoning-parser` names, each in one place: its markers, how a
prompt's end tells where the output starts, the grammar gate, the splitter, and the sign in a
chat template that names it (select.py).

| parser | thinking | the output starts, when the prompt does not say |
|---|---|---|
| deepseek_r1 | `<think>...</think>` | thinking (no end marker: all reasoning) |
| qwen3 | `<think>...</think>` | as the model opens it (or not) |
| mistral | `[THINK]...[/THINK]` | as the model opens it (or not) |
| gpt_oss | harmony's `analysis` channel, then `final` | reading harmony headers |

A prompt that ends with the start marker (DeepSeek-R1's and Qwen3-Thinking's templates write it
there) starts the output in thinking; one that ends with the end marker (Qwen3's
`enable_thinking: false` writes an empty block) starts it in the answer: nothing to split, no
gate."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from switchyard.core.grammar.gate import GrammarGate

from .harmony import ANALYSIS_HEADER, CHANNEL, FINAL_HEADER, HarmonySplitter
from .pieces import Splitter
from .think import ThinkSplitter

Start = Literal["thinking", "maybe", "answer"]  # where an output starts


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str  # the marker that opens the thinking
    end: str  # the marker that ends it: the grammar applies after it
    unprompted: Start  # where the output starts when the prompt ends with neither marker
    sign: Callable[[str], bool]  # a chat template of this format
    harmony: bool = False

    @property
    def markers(self) -> tuple[str, ...]:
        """The text whose tokens must survive detokenizing (special tokens are kept if one of these is one)."""
        return (CHANNEL,) if self.harmony else (self.start, self.end)

    def start_of(self, prompt: str) -> Start:
        """Where the output of `prompt` starts."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return "answer"
        if tail.endswith(self.start):
            return "thinking"
        return self.unprompted

    def gate(self, start: Start, encode: Callable[[str], list[int]]) -> GrammarGate | None:
        """Where a grammar starts in an output that starts at `start`, in tokens: after the end
        marker; with `maybe` (and a start marker of its own), only if the output opens with it."""
        if start == "answer":
            return None
        opener = encode(self.start) if start == "maybe" and not self.harmony else ()
        return GrammarGate(tuple(encode(self.end)), tuple(opener))

    def splitter(self, start: Start, drops: tuple[str, ...] = ()) -> Splitter:
        if self.harmony:
            return HarmonySplitter(start, drops)
        return ThinkSplitter(self.start, self.end, start, drops)


def _deepseek(template: str) -> bool:
    return "<think>" in template and "<｜Assistant｜>" in template  # DeepSeek's full-width bars


FORMATS: dict[str, ReasoningFormat] = {f.name: f for f in (
    ReasoningFormat("deepseek_r1", "<think>", "</think>", "thinking", _deepseek),
    ReasoningFormat("qwen3", "<think>", "</think>", "maybe", lambda t: "<think>" in t and not _deepseek(t)),
    ReasoningFormat("mistral", "[THINK]", "[/THINK]", "maybe", lambda t: "[THINK]" in t),
    ReasoningFormat("gpt_oss", ANALYSIS_HEADER, FINAL_HEADER, "maybe", lambda t: CHANNEL in t, harmony=True),
)}
