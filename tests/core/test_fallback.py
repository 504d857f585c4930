"""The transformers fallback against transformers itself, on tiny random models of
architectures with no native code: logits of a ragged, chunked flat batch, and greedy
tokens through the engine (CPU backend, paged KV cache, prefix caching)."""
from __future__ import annotations

import pytest
import torch
from model_helpers import ReferenceBackend, randomize, run_two_steps, save_tiny
from transformers import (AutoModelForCausalLM, CohereConfig, Gemma2Config, GPT2Config, GPTNeoXConfig, GraniteConfig,
                          LlamaConfig, OPTConfig)

from switchyard.backends.cpu.linear import PackedLinear, packing_supported
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.engine.core import EngineCore
from switchyard.core.layers import Linear
from switchyard.core.loader import UnsupportedModelError, load_model
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import Request

BLOCK_SIZE = 4
VOCAB = 128
IDS = dict(vocab_size=VOCAB, max_position_embeddings=96, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LAYERS = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4)


def tiny_configs() -> dict:
    return {
        # learned absolute positions, Conv1D projections, tied head
        "gpt2": GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=96, vocab_size=VOCAB, bos_token_id=1,
                           eos_token_id=2),
        # partial rotary, parallel residual, untied head under a legacy name (embed_out)
        "gpt_neox": GPTNeoXConfig(**LAYERS, **IDS, intermediate_size=96, rotary_pct=0.5, tie_word_embeddings=False),
        # learned positions with an offset, projections in and out of a narrower embedding
        "opt": OPTConfig(**LAYERS, **IDS, ffn_dim=96, word_embed_proj_dim=32),
        # the module's own attention scaling, embedding/residual multipliers, logits divided by logits_scaling
        "granite": GraniteConfig(**LAYERS, **IDS, num_key_value_heads=2, intermediate_size=96, attention_multiplier=0.3,
                                 embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0),
        # parallel attention and MLP, logits multiplied by logit_scale, tied head
        "cohere": CohereConfig(**LAYERS, **IDS, num_key_value_heads=2, intermediate_size=96, logit_scale=0.5),
        # forced onto the fallback: sliding window on layer 0, attention and final soft caps
        "gemma2": Gemma2Config(**LAYERS, **IDS, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                               sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    }


@pytest.fixture(scope="module", params=sorted(tiny_configs()))
def saved_model(request, tmp_path_factory):
    config = tiny_configs()[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(config, path, max_shard_size="100KB" if request.param == "opt" else "1GB")
    return request.param, str(path), hf


def prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(7)
    return {key: torch.randint(3, VOCAB, (n,), generator=generator).tolist() for key, n in
            (("A", 7), ("B", 10), ("C", 3))}


def test_fallback_matches_transformers_on_a_ragged_chunked_batch(saved_model):
    arch, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path, model_impl="transformers"), ReferenceBackend(), BLOCK_SIZE)
    assert loaded.model_impl == "transformers"
    ours = run_two_steps(loaded, prompts(), 11, BLOCK_SIZE)
    for key, ids in prompts().items():
        ids = ids + [11] if key == "A" else ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(ours[key], expected, atol=1e-4, rtol=1e-4, msg=f"{arch} request {key}")


def test_attention_specs_come_from_the_modules(saved_model):
    arch, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path, model_impl="transformers"), ReferenceBackend(), BLOCK_SIZE)
    specs = loaded.attention_specs
    assert len(specs) == 2 and all(s.block_size == BLOCK_SIZE and s.num_heads == 4 for s in specs)
    expected = {"gemma2": ([4, None], 5.0, 256 ** -0.5), "granite": ([None, None], None, 0.3),
                "opt": ([None, None], None, 1.0)}  # OPT scales the query itself
    windows, soft_cap, scale = expected.get(arch, ([None, None], None, 16 ** -0.5))
    assert [s.sliding_window for s in specs] == windows
    assert all(s.soft_cap == soft_cap and s.scale == pytest.approx(scale) for s in specs)
    assert specs[0].num_kv_heads == (2 if arch in ("granite", "cohere", "gemma2") else 4)
    # one PagedAttention call site per layer, with the backend's kernel for its spec
    assert [site.spec for site in loaded.model.attention] == list(specs)


def test_weights_are_loaded_not_left_uninitialised(saved_model):
    _, path, hf = saved_model
    loaded = load_model(ModelConfig(model=path, model_impl="transformers"), ReferenceBackend(), BLOCK_SIZE)
    ours = dict(loaded.model.hf.named_parameters())
    for name, param in hf.named_parameters():
        assert torch.equal(ours[name], param), name
    # plain nn.Linear projections became our Linear (same parameters), which backends pack
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    assert any(isinstance(m, Linear) for m in loaded.model.modules())
    tied = getattr(hf.config, "tie_word_embeddings", False)
    head = loaded.model.hf.get_output_embeddings().weight
    assert (head is loaded.model.hf.get_input_embeddings().weight) == tied


def greedy_reference(hf, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox"])
def test_greedy_tokens_through_the_engine_match_transformers(arch, tmp_path):
    hf = save_tiny(tiny_configs()[arch], tmp_path)
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(tmp_path)),
                                     cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=96),
                                     scheduler=SchedulerConfig(max_num_batched_tokens=8), backend="cpu"))
    assert engine.loaded.model_impl == "transformers"
    if arch == "gpt_neox" and packing_supported():  # its projections were packed by the CPU backend
        assert any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    batch = list(prompts().values())
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for round_ in range(2):  # the second round reuses the first one's cached prompt blocks
        requests = [Request(f"{round_}-{i}", prompt, params) for i, prompt in enumerate(batch)]
        for request in requests:
            engine.add_request(request)
        outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id].extend(out.new_token_ids)
        for request, prompt in zip(requests, batch):
            assert outputs[request.request_id] == greedy_reference(hf, prompt, 32), f"{arch} {request.request_id}"
        assert (sum(r.num_cached_tokens for r in requests) > 0) == (round_ == 1)


def test_forced_fallback_on_a_llama_matches_the_native_path(tmp_path):
    config = LlamaConfig(**LAYERS, **IDS, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=False)
    save_tiny(config, tmp_path)
    native = load_model(ModelConfig(model=str(tmp_path)), ReferenceBackend(), BLOCK_SIZE)
    fallback = load_model(ModelConfig(model=str(tmp_path), model_impl="transformers"), ReferenceBackend(), BLOCK_SIZE)
    assert (native.model_impl, fallback.model_impl) == ("native", "transformers")
    assert native.attention_specs == fallback.attention_specs
    ours, theirs = (run_two_steps(m, prompts(), 11, BLOCK_SIZE) for m in (native, fallback))
    for key in ours:
        torch.testing.assert_close(theirs[key], ours[key], atol=1e-4, rtol=1e-4, msg=f"request {key}")


def test_bfloat16_fallback_gives_float32_logits(tmp_path):
    hf = AutoModelForCausalLM.from_config(tiny_configs()["gpt_neox"], dtype=torch.float32)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    loaded = load_model(ModelConfig(model=str(tmp_path), dtype="bfloat16"), ReferenceBackend(), BLOCK_SIZE)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.attention_spec.dtype == torch.bfloat16
    ours = run_two_steps(loaded, prompts(), 11, BLOCK_SIZE)
    assert all(v.dtype == torch.float32 and torch.isfinite(v).all() for v in ours.values())


def test_a_config_the_native_code_cannot_run_falls_back_under_auto(tmp_path):
    """A GELU Llama MLP: the native Llama raises NotImplementedError (it runs SiLU only);
    auto hands the model to the fallback (which runs transformers' own MLP), native
    refuses in one line."""
    config = LlamaConfig(**LAYERS, **IDS, num_key_value_heads=2, intermediate_size=96, hidden_act="gelu")
    hf = save_tiny(config, tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path)), ReferenceBackend(), BLOCK_SIZE)
    assert loaded.model_impl == "transformers"
    ours = run_two_steps(loaded, prompts(), 11, BLOCK_SIZE)
    with torch.no_grad():
        expected = hf(torch.tensor([prompts()["B"]])).logits[0]
    torch.testing.assert_close(ours["B"], expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(UnsupportedModelError, match=r"native code does not implement this config: .*gelu"):
        load_model(ModelConfig(model=str(tmp_path), model_impl="native"), ReferenceBackend(), BLOCK_SIZE)
