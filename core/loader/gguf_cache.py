"""GGUF files are converted once into an equivalent Hugging Face directory
(config.json, tokenizer files, dequantized float32 safetensors) kept in a cache.

Parsing a GGUF's metadata with the `gguf` package takes ~8 s per pass for a
49k-token vocabulary, and the config, the tokenizer and the weights each need a
pass: ~25 s before every start. The converted directory loads in ~2 s, and its
tensors are bit-identical to the dequantized GGUF ones.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the conversion changes, so stale caches are ignored
_DONE_MARK = ".switchyard-converted"


def default_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "switchyard")


def converted_directory(gguf_path: str, cache_root: str) -> str:
    """The Hugging Face directory equivalent to `gguf_path`, converting it on first use."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
                         .encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    target = os.path.join(cache_root, "gguf", f"{name}-{key}")
    if os.path.isfile(os.path.join(target, _DONE_MARK)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    logger.info("converting %s once into %s", gguf_path, target)
    staging = tempfile.mkdtemp(prefix=f".{name}-", dir=os.path.dirname(target))
    try:
        _convert(gguf_path, staging)
        open(os.path.join(staging, _DONE_MARK), "w").close()
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not os.path.isfile(os.path.join(target, _DONE_MARK)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf_path: str, out_dir: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from .gguf_weights import GGUFWeights, load_gguf_config

    config = load_gguf_config(gguf_path)
    config.save_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    tokenizer.save_pretrained(out_dir)
    tensors = {name: tensor.contiguous() for name, tensor in GGUFWeights(gguf_path, config)}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"source": os.path.basename(gguf_path)})
