"""The shared-prefix workload of `switchyard bench serve --workload shared-prefix`: requests over
8 distinct system prompts of about 1,000 tokens each (a product's handbook, one per team), each
with its own short question, the case prefix-affinity routing between replicas is for
(deployment.md, "Replicas"). Built from fixed templates: every run sees the same bytes. Request
i's system prompt is drawn from a fixed pseudo-random sequence (a real load's teams do not
take turns: with prompts in turn, round-robin over 2 replicas would send each prompt to one
replica, as prefix affinity does, by accident)."""
from __future__ import annotations

import random

NUM_SYSTEM_PROMPTS = 8
_TEAMS = ("billing", "shipping", "returns", "accounts", "warehouse", "security", "catalogue", "support")
_TOPICS = ("refunds", "invoices", "parcels", "passwords", "pallets", "audits", "listings", "tickets", "vouchers",
           "couriers", "discounts", "renewals")
_QUESTIONS = ("What should I do first?", "Who do I ask about an exception?", "How long does it usually take?",
              "What is the most common mistake?", "Can a customer appeal?", "What do I write in the log?",
              "Which form is needed?", "When is the deadline?")


def system_prompt(k: int, sentences: int = 26) -> str:
    """About 1,000 tokens (SmolLM2's tokenizer) of team k's rules; differs from the others from its first words."""
    team = _TEAMS[k % len(_TEAMS)]
    lines = [f"You are the {team} team's assistant at Northwind Traders (handbook edition {k + 1})."]
    for i in range(sentences):
        topic = _TOPICS[(i * (k + 3)) % len(_TOPICS)]
        lines.append(f"Rule {i + 1} for {team}: when a request about {topic} arrives, check the order number, "
                     f"confirm the customer's name, note the date, and answer within {(i * 7 + k) % 48 + 2} hours.")
    return " ".join(lines)


def prompt_of(index: int) -> int:
    """The system prompt of request `index` (the same in every run)."""
    return random.Random(index).randrange(NUM_SYSTEM_PROMPTS)


def shared_prefix_body(model: str, index: int, output_len: int) -> dict:
    """Request `index`: system prompt prompt_of(index), a question of its own, a forced output length."""
    question = _QUESTIONS[(index // NUM_SYSTEM_PROMPTS) % len(_QUESTIONS)]
    return {
        "model": model,
        "messages": [{"role": "system", "content": system_prompt(prompt_of(index))},
                     {"role": "user", "content": f"(ticket {index}) {question}"}],
        "max_tokens": output_len, "min_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
