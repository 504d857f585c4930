"""Reasoning models: their thinking told from their answer (vLLM's and SGLang's
`--reasoning-parser`, llama.cpp's `--reasoning-format`).

    formats.py   the formats (deepseek_r1, qwen3, mistral, gpt_oss): markers, start, gate
    select.py    --reasoning-parser (auto: from the chat template) -> a format
    plan.py      one request: its engine params (the grammar's gate) and its output split
    think.py     <think>...</think> / [THINK]...[/THINK], split incrementally
    harmony.py   gpt-oss's channels, split incrementally
    history.py   earlier assistant turns: thinking apart from the answer, for the template
    flags.py     the CLI flag

The dialects name the pieces: gateway/openai/reasoning.py (chat's `reasoning_content`,
Responses' reasoning items) and gateway/anthropic/ (thinking blocks)."""
from .plan import ReasoningPlan, ReasoningStream, Split, plan_reasoning, served_format, split_output

__all__ = ["ReasoningPlan", "ReasoningStream", "Split", "plan_reasoning", "served_format", "split_output"]
