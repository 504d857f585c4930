"""The input-grounded workload of `switchyard bench serve --workload grounded`: tasks whose answer
repeats long runs of a 300-800-token input (rename a variable in code, return a document as
JSON, copy a text with one change), the case speculative decoding with n-gram lookup is for.
The inputs are built from fixed templates, so every run and every server sees the same bytes.
Outputs are not forced: each request asks for up to `output_len` tokens, ends where the model
ends it, and throughput is counted from the server's usage."""
from __future__ import annotations

_FIELDS = ("customer_id", "order_total", "shipping_cost", "discount_rate", "tax_amount", "item_count",
           "loyalty_points", "warehouse_code")


def _code(variable: str, num_functions: int) -> str:
    parts = []
    for i, field in enumerate(_FIELDS[:num_functions]):
        parts.append(
            f"def update_{field}(record, {variable}, limit={10 * (i + 1)}):\n"
            f"    \"\"\"Sets record.{field} from {variable}, capped at limit.\"\"\"\n"
            f"    if {variable} is None:\n"
            f"        raise ValueError(\"{field} needs a value\")\n"
            f"    value = min({variable}, limit)\n"
            f"    record.{field} = value\n"
            f"    record.history.append((\"{field}\", {variable}, value))\n"
            f"    return value\n")
    return "\n\n".join(parts)


def _document(num_people: int) -> str:
    cities = ("Lisbon", "Tromso", "Valparaiso", "Nagoya", "Accra", "Winnipeg", "Tbilisi", "Perth")
    roles = ("harbour pilot", "glassblower", "seismologist", "bookbinder", "tram driver", "cartographer",
             "beekeeper", "organ tuner")
    lines = []
    for i in range(num_people):
        lines.append(f"Person {i + 1}: {roles[i % len(roles)].title()} Nr. {100 + 7 * i}, lives in "
                     f"{cities[i % len(cities)]}, works as a {roles[i % len(roles)]} since {1990 + 3 * i}, "
                     f"speaks {2 + i % 3} languages and keeps {i % 4} cats.")
    return "\n".join(lines)


PROMPTS: tuple[str, ...] = (
    f"Rewrite this code with the variable `amount` renamed to `new_value`. Output only the code.\n\n{_code('amount', 6)}",
    "Return this document as a JSON list of objects with the keys name, city, job, since, languages and cats. "
    f"Output only the JSON.\n\n{_document(8)}",
    f"Rewrite this code with the variable `qty` renamed to `quantity`. Output only the code.\n\n{_code('qty', 8)}",
    "Return this document as a JSON list of objects with the keys name, city, job, since, languages and cats. "
    f"Output only the JSON.\n\n{_document(11)}",
)


def grounded_body(model: str, prompt: str, output_len: int) -> dict:
    """A greedy streaming chat request of up to `output_len` tokens (not forced), usage asked for."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
