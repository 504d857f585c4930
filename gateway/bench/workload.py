"""What a benchmark sends: the fixed prompt set, the servers and the request bodies.

The prompts are a constant list, taken in order (request i sends prompt i modulo the
list), so that every server and every run sees the same requests. The output length is
forced three ways at once, because peers honour different fields: `max_tokens` caps it,
`ignore_eos` keeps generating past the end-of-sequence token (Switchyard, vLLM and
llama.cpp's llama-server honour it) and `min_tokens` forbids stopping earlier (Switchyard
and vLLM honour it; llama-server ignores the field)."""
from __future__ import annotations

from dataclasses import dataclass

PROMPTS: tuple[str, ...] = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short story about a lighthouse keeper who finds a map.",
    "List five uses for a paperclip that are not holding paper.",
    "What is the difference between a virus and a bacterium?",
    "Describe how a bicycle gear system works.",
    "Give me a recipe for a simple tomato soup.",
    "Why do cats purr? Give a few possible reasons.",
    "Summarize the plot of a detective novel you invent on the spot.",
    "How does a rainbow form after a storm?",
    "Write a polite email asking a neighbour to trim a hedge.",
    "What are the main parts of a plant cell?",
    "Explain compound interest with a small example.",
    "Describe a busy market in the morning.",
    "Why is the ocean salty?",
    "Give three tips for learning a new language.",
    "How do bees make honey?",
    "Write a limerick about a forgetful robot.",
    "What does a librarian do all day?",
    "Explain how a train stays on its tracks.",
    "Describe the smell of rain on dry earth.",
    "What is the tallest mountain on Earth, and how was it measured?",
    "Give a short history of the printing press.",
    "How do you keep a sourdough starter alive?",
    "Explain what a prime number is to a ten-year-old.",
    "Write a haiku about snow on a city street.",
    "Why do we yawn?",
    "Describe how to plant a tree properly.",
    "What makes a good team captain?",
    "Explain how sound travels through air.",
    "Write a dialogue between a kettle and a teapot.",
    "What are the benefits of walking every day?",
    "How do submarines dive and surface?",
)


@dataclass(frozen=True)
class Server:
    """One server to drive: a label for the tables and its base URL (without /v1)."""

    label: str
    url: str

    @classmethod
    def parse(cls, spec: str) -> "Server":
        """`label=URL` or a bare `URL` (then labelled by its host and port)."""
        label, sep, url = spec.partition("=")
        if not sep or label.startswith(("http://", "https://")):
            url, label = spec, spec.split("://", 1)[-1].rstrip("/")
        url = url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"not an http(s) URL: {spec!r}")
        return cls(label=label, url=url)


@dataclass(frozen=True)
class Workload:
    """How hard to drive each server: the concurrencies, the forced output length, the
    requests per concurrency (None: 4 x concurrency, at least 8) and the warm-up."""

    concurrencies: tuple[int, ...] = (1, 8, 32, 64)
    output_len: int = 128
    num_prompts: int | None = None
    warmup: int = 2
    warmup_len: int = 16
    timeout_s: float = 600.0
    api_key: str | None = None
    kind: str = "chat"  # "chat": the fixed prompts, forced lengths; "grounded": bench/grounded.py

    def requests_at(self, concurrency: int) -> int:
        return self.num_prompts if self.num_prompts is not None else max(8, 4 * concurrency)


def chat_body(model: str, prompt: str, output_len: int) -> dict:
    """A greedy streaming chat request forced to `output_len` tokens, usage asked for."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_bodies(model: str, count: int, output_len: int, start: int = 0, kind: str = "chat") -> list[dict]:
    """`count` bodies over the fixed prompts of the workload `kind`, from prompt `start` on."""
    if kind == "grounded":
        from .grounded import PROMPTS as GROUNDED, grounded_body

        return [grounded_body(model, GROUNDED[(start + i) % len(GROUNDED)], output_len) for i in range(count)]
    if kind == "shared-prefix":
        from .shared_prefix import shared_prefix_body

        return [shared_prefix_body(model, start + i, output_len) for i in range(count)]
    return [chat_body(model, PROMPTS[(start + i) % len(PROMPTS)], output_len) for i in range(count)]
