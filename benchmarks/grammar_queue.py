"""Does a trivial schema wait behind heavy compiles? (issue 26)

On the default model through the real engine client: the latency of a request with a
trivial JSON schema (its compile, then 8 constrained tokens), alone and while two distinct
heavy schemas (~250 KB enums, seconds each to compile) compile, for

- `spare`: this design, --grammar-workers (default 2 slots) plus a warm spare for small specs,
- `single`: the old queue, one worker and no spare (GrammarConfig(num_compile_workers=1,
  spare_max_spec_bytes=0)).

It also times the answer to a tiny self-recursive `$ref` schema with no finite instance.
The aim: under 2x the alone latency while the heavy ones compile (exit status 1 if `spare`
misses it).

    python benchmarks/grammar_queue.py [--rounds 5] [--modes spare,single]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from switchyard.core.config import GrammarConfig
from switchyard.core.grammar import GrammarError, GrammarSpec
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

from grammar_isolation import heavy_schema, make_client  # noqa: E402  (the same engine and heavy schemas)

HEAVY_SIZE = 10_500  # enum entries of a heavy schema (~250 KB)
MODES = {"spare": GrammarConfig(), "single": GrammarConfig(num_compile_workers=1, spare_max_spec_bytes=0)}
ENDLESS = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}


def trivial_schema(tag: str) -> GrammarSpec:
    return GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"const": tag}},
                                    "required": ["n"]})


async def constrained_request(client, prompt_ids: list[int], spec: GrammarSpec, rid: str) -> float:
    """Seconds from its arrival to its last token: the compile, then 8 constrained tokens."""
    start = time.perf_counter()
    await client.compile_grammar(spec)  # as the gateway does before submitting
    params = SamplingParams(temperature=0.0, max_tokens=8, grammar=spec)
    async for _ in await client.add_request(Request(rid, prompt_ids, params)):
        pass
    return time.perf_counter() - start


async def compile_outcome(client, spec: GrammarSpec) -> str:
    try:
        await client.compile_grammar(spec)
        return "ok"
    except GrammarError as exc:
        return "timeout" if "took longer" in str(exc) else "refused"


async def run_mode(mode: str, rounds: int) -> dict:
    client = make_client(MODES[mode])
    client.start()
    await client.wait_ready(600)
    ids = client.tokenizer.encode("Give me a JSON object with a number.")
    await constrained_request(client, ids, trivial_schema("warm"), "warm")  # workers up, as on a server in use
    await asyncio.sleep(5)  # the spare's worker too
    alone, loaded, outcomes = [], [], []
    for r in range(rounds):
        alone.append(await constrained_request(client, ids, trivial_schema(f"alone-{r}"), f"alone-{r}"))
        heavy = [asyncio.create_task(compile_outcome(client, heavy_schema(2 * r + i, HEAVY_SIZE))) for i in range(2)]
        await asyncio.sleep(0.5)  # both are compiling
        loaded.append(await constrained_request(client, ids, trivial_schema(f"loaded-{r}"), f"loaded-{r}"))
        outcomes += await asyncio.gather(*heavy)
    start = time.perf_counter()
    endless = await compile_outcome(client, GrammarSpec.json_schema(ENDLESS))
    endless_s = time.perf_counter() - start
    await client.shutdown()
    return {"alone": statistics.median(alone), "loaded": statistics.median(loaded), "worst": max(loaded),
            "outcomes": {o: outcomes.count(o) for o in ("ok", "timeout", "refused")},
            "endless": (endless, endless_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", default="spare,single")
    args = parser.parse_args()
    print(f"a trivial-schema request (compile + 8 tokens), alone vs while 2 heavy schemas compile "
          f"(~{len(heavy_schema(0, HEAVY_SIZE).value) // 1024} KB each); medians of {args.rounds} rounds, in seconds\n")
    print(f"{'mode':7} {'alone':>7} {'loaded':>7} {'ratio':>6} {'worst':>7}  heavy outcomes         endless $ref")
    missed = False
    for mode in args.modes.split(","):
        r = asyncio.run(run_mode(mode, args.rounds))
        ratio = r["loaded"] / r["alone"]
        missed |= mode == "spare" and ratio >= 2
        outcome, seconds = r["endless"]
        print(f"{mode:7} {r['alone']:7.3f} {r['loaded']:7.3f} {ratio:6.2f} {r['worst']:7.3f}  "
              f"{str(r['outcomes']):22} {outcome} in {seconds:.3f} s", flush=True)
    print("\naim: ratio under 2 for `spare`:", "missed" if missed else "met")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
