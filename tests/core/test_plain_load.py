"""A cached start of a GGUF imports no transformers (issue 26: the import holds ~100 MiB of an
engine's resident memory for its whole life): the converted metadata keeps the config as plain
attributes and the tokenizer as a ServingTokenizer, and the tensor index says how tensors are
processed, with our processors in place of transformers'. Each piece is checked against
transformers' own; the logits are checked per architecture in test_gguf_architectures.py."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MixtralConfig, Phi3Config
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

from switchyard.core.config import ModelConfig
from switchyard.core.loader import choose_model, load_hf_tokenizer, load_tokenizer, resolve_source
from switchyard.core.loader.gguf_processors import (IDENTITY, LLAMA, NORM_OFFSET, TRANSFORMERS, make_processor,
                                                    processor_kind)
from switchyard.core.models.plain_config import PlainConfig, read_plain_config, transformers_config, \
    write_plain_config
from switchyard.core.text.serving_tokenizer import ServingTokenizer


def test_processor_kinds_follow_transformers_table():
    assert processor_kind("llama") == LLAMA
    assert [processor_kind(a) for a in ("gemma2", "gemma3", "nemotron")] == [NORM_OFFSET] * 3
    assert [processor_kind(a) for a in ("qwen2", "qwen3", "phi3", "mistral", None)] == [IDENTITY] * 5
    others = set(TENSOR_PROCESSORS) - {"llama", "gemma2", "gemma3", "nemotron"}
    assert others and all(processor_kind(a) == TRANSFORMERS for a in others)


@pytest.mark.parametrize("architecture,names", [
    ("llama", ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight", "blk.0.ffn_norm.weight"]),
    ("gemma3", ["blk.0.attn_norm.weight", "output_norm.weight", "blk.0.attn_q.weight", "token_embd.weight"]),
    ("nemotron", ["blk.1.ffn_norm.weight", "blk.1.ffn_up.weight"]),
    ("qwen2", ["blk.0.attn_q.weight", "blk.0.attn_norm.weight"]),
])
def test_our_processors_give_what_transformers_processors_give(architecture, names):
    config = PlainConfig({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48})
    ours = make_processor(processor_kind(architecture), architecture, config)
    theirs = TENSOR_PROCESSORS.get(architecture, type(None))
    rng = np.random.default_rng(0)
    for name in names:
        rows = 16 if ".attn_k." in name else 48
        weights = rng.standard_normal((rows, 48) if ".weight" in name and "norm" not in name else (48,))
        expected = theirs(config=config.to_dict()).process(weights=weights, name=name) if theirs is not type(None) \
            else None
        got = ours.process(weights=weights, name=name)
        assert got.name == name
        assert np.array_equal(got.weights, weights if expected is None else expected.weights), name
    assert type(ours).__module__.startswith("switchyard")


@pytest.mark.parametrize("config", [LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48),
                                    Gemma3TextConfig(sliding_window=5), Phi3Config(),
                                    MixtralConfig(num_local_experts=4)], ids=lambda c: c.model_type)
def test_a_plain_config_reads_as_transformers_class_does(config, tmp_path):
    write_plain_config(config, str(tmp_path))
    plain = read_plain_config(str(tmp_path))
    full = config.to_dict()
    for key, value in full.items():
        if key not in ("id2label", "label2id", "dtype", "_name_or_path"):  # JSON keys are strings; dtype its name
            assert getattr(plain, key) == value, key
    for alias, name in type(config).attribute_map.items():  # e.g. Mixtral's num_experts
        assert getattr(plain, alias) == getattr(config, name)
    assert getattr(plain, "surely_not_an_attribute", "default") == "default"
    back = transformers_config(plain)
    assert type(back) is type(config)
    assert {k: v for k, v in back.to_dict().items() if k != "_name_or_path"} == \
        {k: v for k, v in full.items() if k != "_name_or_path"}
    assert read_plain_config(str(tmp_path / "none")) is None


def test_the_kept_tokenizer_is_the_one_made_from_transformers(gemma3_gguf_path):
    for model in (ModelConfig(), ModelConfig(model=gemma3_gguf_path)):
        kept = load_tokenizer(model)
        assert type(kept) is ServingTokenizer
        made = ServingTokenizer.from_transformers(load_hf_tokenizer(model))
        assert kept.__getstate__() == made.__getstate__()
    config = choose_model(ModelConfig())[1]  # named after its directory, as from_pretrained names it
    assert type(config) is PlainConfig and config._name_or_path == resolve_source(ModelConfig()).metadata


@pytest.mark.slow  # a fresh interpreter loads the default model (~10 s)
def test_a_cached_start_of_the_default_model_imports_no_transformers():
    choose_model(ModelConfig())  # the conversion (this process has transformers anyway)
    script = textwrap.dedent("""
        import sys
        from switchyard.core.config import CacheConfig, EngineConfig
        from switchyard.core.engine.process import build_engine
        from switchyard.core.params import SamplingParams
        from switchyard.core.scheduling.request import Request
        engine, tokenizer = build_engine(EngineConfig(cache=CacheConfig(num_blocks=64)))
        engine.add_request(Request("a", tokenizer.encode("Hello"), SamplingParams(max_tokens=4, temperature=0)))
        ids = []
        while engine.has_unfinished_requests():
            ids += [t for out in engine.step() for t in out.new_token_ids]
        engine.shutdown()
        print(len(ids), type(tokenizer).__name__, bool(tokenizer.decode(ids)),
              sorted(m for m in ("transformers", "sympy", "accelerate") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "4 ServingTokenizer True []"
