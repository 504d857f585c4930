"""Grammar backends side by side on the default model's tokenizer (SmolLM2, 49152 tokens):

1. compile time per JSON schema, cold and cached (through GrammarCompileService);
2. per-token mask overhead: fill the bitmask + apply it to a logits row, and accept the token;
3. end-to-end output tokens/s at concurrency 8 (offline engine, bfloat16), constrained vs
   unconstrained with the very same per-request token counts (so the batches match step by step).

    python benchmarks/grammar_bench.py [--skip-e2e] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarCompileService, GrammarSpec, make_compiler
from switchyard.core.grammar.base import allocate_bitmask
from switchyard.core.grammar.constrained import GrammarMask, apply_grammar_mask
from switchyard.core.grammar.schema_support import OUTLINES_UNSUPPORTED

BACKENDS = ("xgrammar", "outlines")
NAME = {"type": "string", "maxLength": 16}
INT = {"type": "integer", "minimum": 0, "maximum": 999}
SCHEMAS = {  # name -> (schema, a valid instance in compact JSON)
    "flat": ({"type": "object", "properties": {"name": NAME, "age": INT, "ok": {"type": "boolean"}},
              "required": ["name", "age", "ok"]}, {"name": "Ann", "age": 31, "ok": True}),
    "nested": ({"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": NAME, "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                                         "pattern": "^[0-9]{5}$"}},
                                  "required": ["city", "zip"]}}, "required": ["name", "address"]}},
        "required": ["user"]}, {"user": {"name": "Bo", "address": {"city": "Oslo", "zip": "01234"}}}),
    "array": ({"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 4}},
               "required": ["tags"]}, {"tags": ["a", "bb", "ccc"]}),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
             {"color": "green"}),
    "any_of": ({"type": "object", "properties": {"id": {"anyOf": [INT, NAME]}}, "required": ["id"]}, {"id": "x7"}),
    "one_of": ({"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": INT}, "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "s": INT}, "required": ["kind", "s"]}]}},
        "required": ["shape"]}, {"shape": {"kind": "square", "s": 4}}),
    "refs": ({"$defs": {"p": {"type": "object", "properties": {"x": INT, "y": INT}, "required": ["x", "y"]}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}},
              "required": ["a", "b"]}, {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}),
    "formats": ({"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                  "id": {"type": "string", "format": "uuid"}},
                 "required": ["day", "id"]}, {"day": "2024-05-06", "id": "123e4567-e89b-12d3-a456-426614174000"}),
    "numbers": ({"type": "object", "properties": {"score": {"type": "number", "minimum": -5, "maximum": 5},
                                                  "n": {"type": "integer", "minimum": 10, "maximum": 20}},
                 "required": ["score", "n"]}, {"score": 1.5, "n": 12}),
    "optional": ({"type": "object", "properties": {"title": NAME, "sub": NAME, "pages": INT}, "required": ["title"],
                  "additionalProperties": False}, {"title": "T", "pages": 3}),
    "objects": ({"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": INT}, "required": ["sku", "qty"]}}},
        "required": ["items"]}, {"items": [{"sku": "a1", "qty": 2}, {"sku": "b2", "qty": 5}]}),
    "nullable": ({"type": "object", "properties": {"nick": {"type": ["string", "null"]}}, "required": ["nick"]},
                 {"nick": None}),
}


def compile_times(backend: str, tokenizer, vocab_size: int, eos: tuple[int, ...]):
    """{schema: (cold ms, cached ms)} and the service, after building the tokenizer tables."""
    config = GrammarConfig(backend=backend)
    start = time.perf_counter()
    compiler = make_compiler(config, tokenizer, vocab_size, eos)
    setup_ms = (time.perf_counter() - start) * 1e3
    service = GrammarCompileService(lambda: compiler, config)
    times = {}
    for name, (schema, _) in SCHEMAS.items():
        spec = spec_for(backend, schema)
        start = time.perf_counter()
        service.compile(spec).result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        service.compile(spec).result()
        times[name] = (cold * 1e3, (time.perf_counter() - start) * 1e3)
    return setup_ms, times, service


def spec_for(backend: str, schema: dict) -> GrammarSpec:
    """outlines-core ignores numeric bounds, so serving refuses them with that backend;
    its figures are for the same schema without those keywords."""
    if backend != "outlines":
        return GrammarSpec.json_schema(schema)

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if not (k in OUTLINES_UNSUPPORTED and not isinstance(v, dict))}
        return [strip(v) for v in node] if isinstance(node, list) else node
    return GrammarSpec.json_schema(strip(schema))


def mask_overhead(backend: str, service, tokenizer, vocab_size: int):
    """Mean microseconds per token: (fill bitmask, apply it to one logits row, accept)."""
    logits = torch.randn(1, vocab_size)
    fills, applies, accepts = [], [], []
    for name, (schema, instance) in SCHEMAS.items():
        matcher = service.compile(spec_for(backend, schema)).result().new_matcher()
        bitmask = allocate_bitmask(1, vocab_size)
        for token_id in tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False):
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            filled = time.perf_counter()
            apply_grammar_mask(logits, GrammarMask((0,), bitmask))
            applied = time.perf_counter()
            assert matcher.accept_token(token_id), (name, token_id)
            fills.append(filled - start)
            applies.append(applied - filled)
            accepts.append(time.perf_counter() - applied)
    return tuple(statistics.mean(x) * 1e6 for x in (fills, applies, accepts))


def end_to_end(llm, backend: str, max_tokens: int, num_requests: int = 24, repeats: int = 3):
    """Best (constrained tok/s, unconstrained tok/s) and the token count: `num_requests`
    through max_num_seqs=8, the unconstrained run given each request's constrained token
    count (ignore_eos) so both runs have the same batches; runs interleaved against drift."""
    from switchyard.core import SamplingParams

    engine = llm.engine
    config = GrammarConfig(backend=backend)
    engine.grammar_service = GrammarCompileService(
        lambda: make_compiler(config, llm.tokenizer, engine.loaded.vocab_size, engine.info.eos_token_ids), config)
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(num_requests)]
    prompts = [[{"role": "user", "content": f"Reply with JSON ({', '.join(SCHEMAS[n][0]['properties'])})."}]
               for n in names]
    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens,
                                  grammar=spec_for(backend, SCHEMAS[n][0])) for i, n in enumerate(names)]
    for p in constrained:  # compiled up front: we measure decoding, not compiling
        engine.grammar_service.compile(p.grammar).result()
    best_constrained = best_free = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        results = llm.chat(prompts, constrained)
        constrained_s = time.perf_counter() - start
        counts = [len(r.token_ids) for r in results]
        free = [SamplingParams(temperature=0.8, seed=i, max_tokens=c, ignore_eos=True) for i, c in enumerate(counts)]
        start = time.perf_counter()
        llm.chat(prompts, free)
        free_s = time.perf_counter() - start
        best_constrained = max(best_constrained, sum(counts) / constrained_s)
        best_free = max(best_free, sum(counts) / free_s)
    return best_constrained, best_free, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs per backend (best is kept)")
    parser.add_argument("--num-requests", type=int, default=24, help="end-to-end requests (8 run at once)")
    args = parser.parse_args()
    from switchyard.core import LLM

    llm = LLM(dtype="bfloat16", num_kv_blocks=512, max_num_seqs=8)
    vocab_size, eos = llm.engine.loaded.vocab_size, llm.engine.info.eos_token_ids
    services = {}
    print(f"tokenizer: {len(llm.tokenizer)} tokens, logits width {vocab_size}; torch threads {torch.get_num_threads()}")
    for backend in BACKENDS:
        setup_ms, times, services[backend] = compile_times(backend, llm.tokenizer, vocab_size, eos)
        print(f"\n[{backend}] tokenizer tables: {setup_ms:.0f} ms")
        print(f"{'schema':<10} {'cold ms':>10} {'cached ms':>10}")
        for name, (cold, cached) in times.items():
            print(f"{name:<10} {cold:>10.1f} {cached:>10.3f}")
        colds = [c for c, _ in times.values()]
        print(f"{'median':<10} {statistics.median(colds):>10.1f}   max {max(colds):.1f}")
        fill_us, apply_us, accept_us = mask_overhead(backend, services[backend], llm.tokenizer, vocab_size)
        print(f"per token (first pass over each instance): fill bitmask {fill_us:.0f} us, "
              f"apply to a logits row {apply_us:.0f} us, accept {accept_us:.0f} us")
    if args.skip_e2e:
        return
    print(f"\nend to end: {args.num_requests} requests, 8 at once, bfloat16, max_tokens {args.max_tokens}, "
          f"best of {args.repeats} interleaved runs:")
    for backend in BACKENDS:
        constrained, free, tokens = end_to_end(llm, backend, args.max_tokens, args.num_requests, args.repeats)
        print(f"[{backend}] {tokens} tokens: constrained {constrained:.1f} tok/s, unconstrained {free:.1f} tok/s, "
              f"ratio {constrained / free:.3f}")


if __name__ == "__main__":
    main()
