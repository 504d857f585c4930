"""A GPTQ 4-bit checkpoint of a benchmark model (issue 25's "GPTQ 4-bit on the CPU against the same
weights as GGUF Q4_0"), made from the float checkpoint that `gguf_models.py --keep` leaves:

    python benchmarks/gptq_models.py [--shape smollm2-1.7b] [--group 128] [--act-order]
                                     [--models DIR] [--seed 0]

Reads DIR/<shape>-random/ (bf16 safetensors, config, tokenizer) one tensor at a time and writes
DIR/<shape>-random-GPTQ-g<group>[-act]/: every decoder linear (q, k, v, o, gate, up, down) in
GPTQ's layout, checkpoint_format "gptq" (gptqmodel's default v1 zero points), symmetric 4-bit,
rounded to nearest per group by core/testing/hub_layers.py (random weights have no calibration
data to make GPTQ's error feedback worth anything; the layout, and so the serving cost, is the
same); embeddings, norms and the head stay bf16, as GPTQ checkpoints keep them (lm_head: False).
--act-order writes a random desc_act g_idx (groups not contiguous), the act-order case.
The same float weights give llama-quantize's Q4_0 file (gguf_models.py), so the two serve the
same model at 4 bits; gguf_side_by_side.sh serves either (SERVERS=switchyard for the GPTQ one).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from gguf_models import PEERS, SHARD_BYTES

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-1.7b")
    p.add_argument("--models", default=os.path.join(PEERS, "models"))
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--act-order", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from safetensors import safe_open
    from safetensors.torch import save_file

    from switchyard.core.testing.hub_layers import gptq_config, gptq_pack

    source = os.path.join(args.models, f"{args.shape}-random")
    out = f"{source}-GPTQ-g{args.group}{'-act' if args.act_order else ''}"
    with open(os.path.join(source, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    os.makedirs(out, exist_ok=True)
    began, shard, size, files, index = time.time(), {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
            index.update({key: name for key in shard})
            files.append(name)
            print(f"  {name}: {len(shard)} tensors, {size / 1e9:.2f} GB ({time.time() - began:.0f} s)", flush=True)
        shard, size = {}, 0

    inputs: dict[str, int] = {}  # the linears of one input share GPTQ's act-order (one Hessian)
    for name, file in sorted(weight_map.items(), key=lambda kv: kv[1]):
        with safe_open(os.path.join(source, file), "pt") as f:
            tensor = f.get_tensor(name)
        prefix = name[: -len(".weight")]
        if prefix.rsplit(".", 1)[-1] in LINEARS:
            shared = prefix.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            seed = args.seed * 100003 + inputs.setdefault(shared, len(inputs))
            tensors, _ = gptq_pack(tensor.float(), 4, args.group, args.act_order, sym=True, v1=True, seed=seed)
            parts = {f"{prefix}.{suffix}": t.contiguous() for suffix, t in tensors.items()}
        else:
            parts = {name: tensor.contiguous()}
        for key, value in parts.items():
            shard[key] = value
            size += value.numel() * value.element_size()
        if size > SHARD_BYTES:
            flush()
    flush()
    # the file names are only known once all are written: name them k-of-n now
    renamed = {old: f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k, old in enumerate(files)}
    for old, new in renamed.items():
        os.rename(os.path.join(out, old), os.path.join(out, new))
    total = sum(os.path.getsize(os.path.join(out, new)) for new in renamed.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in index.items()}}, f,
                  indent=2)
    for name in os.listdir(source):
        if not name.endswith(".safetensors") and name not in ("model.safetensors.index.json", "config.json"):
            shutil.copy(os.path.join(source, name), os.path.join(out, name))
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = gptq_config(4, args.group, args.act_order, sym=True, v1=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{out}: {total / 2**30:.2f} GiB in {len(files)} files ({time.time() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
