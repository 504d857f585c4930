"""The backend contract as tests: any backend, in this tree or out of it, runs them.

    import pytest
    from switchyard.core.testing import BackendContract

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend(self):
            return MyBackend()

pytest collects the inherited tests for the subclass. They check what the engine relies on:
probe() never raises, capabilities() are well formed, the KV cache layout, the attention
kernel against the plain-torch reference on ragged batches (decodes first, then prompt
chunks with cached prefixes; GQA; two declared block sizes; each tested dtype), write_kv
touching exactly the slots of slot_mapping, each declared quantized KV cache (--kv-cache-dtype)
allocated as the contract lays it out and round-tripping through write_kv and attention, declared
window anchors (image rows' sliding windows) against the reference, a graph_safe kernel not reading the metadata's host tuples, the LoRA kernel where declared
(against the plain-torch one on mixed adapter slots, and a token's output the same alone as in its
batch), greedy engine output (prepare_model, profile_run, make_runner and all) equal
to the reference backend's, with speculative verify steps too where declared, and with images where
vision encoders are declared, KV sizing, and the sharding hooks when unsharded.
Class attributes narrow or widen what runs (dtypes, block sizes, groups, tolerances).
"""
from __future__ import annotations

import functools
import random
import zlib
from dataclasses import replace
from typing import ClassVar

import pytest
import torch

from ..backend import KV_CACHE_FORMATS, AttentionSpec, Backend, Capabilities, LoraKernel, ProbeResult
from ..capabilities import DTYPE_NAMES
from ..config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from ..engine.core import EngineCore
from ..kv.quantized import dequantize_cache
from ..loader import torch_dtype
from ..params import SamplingParams
from ..scheduling.request import Request
from ..execution.runner import ModelRunner
from .batches import AttentionStep, image_rows_step, random_step, ragged_lens
from .lora_batches import random_lora_step
from .reference_backend import ReferenceBackend

# LoRA deltas (lora_batches.py: values about 1): float32 sums in another order, then bf16/fp16 roundings of
# h and of the delta
LORA_TOLERANCES = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2),
                   "float16": dict(atol=4e-3, rtol=4e-3)}
TOLERANCES = {"float32": dict(atol=2e-5, rtol=1e-4), "bfloat16": dict(atol=3e-2, rtol=3e-2),
              "float16": dict(atol=4e-3, rtol=4e-3)}
PROMPTS = ([5, 9, 13, 17, 21, 25, 29], [7, 3], list(range(40, 80)), [11, 12, 13])
# How far a quantized KV cache's value may lie from the value written, as a share of its row's
# largest magnitude: half an int8 step; float8's half unit in the last place (e4m3fn keeps 3
# mantissa bits, e5m2 2), a float32 rounding of slack on each.
KV_ROUNDING = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3fn": 2.0**-4 + 1e-6, "fp8_e5m2": 2.0**-3 + 1e-6}


class BackendContract:
    """Override the `backend` fixture; set the class attributes to narrow what runs."""

    dtypes_to_test: ClassVar[tuple[str, ...] | None] = None  # None: declared ones (no float16 on a CPU device)
    kv_cache_dtypes_to_test: ClassVar[tuple[str, ...] | None] = None  # None: the declared quantized KV caches
    block_sizes_to_test: ClassVar[tuple[int, ...] | None] = None  # None: the two smallest declared >= 8
    gqa_groups: ClassVar[tuple[int, ...]] = (1, 3)  # query heads per KV head
    num_kv_heads: ClassVar[int] = 2
    head_dim: ClassVar[int] = 16
    tolerances: ClassVar[dict[str, dict]] = TOLERANCES
    generated_tokens: ClassVar[int] = 8

    @pytest.fixture
    def backend(self) -> Backend:
        pytest.fail(f"{type(self).__name__} must override the `backend` fixture with an instance of its backend")

    # -- what is tested -----------------------------------------------------------------
    def dtypes(self, backend: Backend) -> tuple[str, ...]:
        declared = backend.capabilities().dtypes
        if self.dtypes_to_test is not None:
            return tuple(d for d in self.dtypes_to_test if d in declared)
        return tuple(d for d in declared if not (backend.device.type == "cpu" and d == "float16"))

    def kv_cache_dtypes(self, backend: Backend) -> tuple[str, ...]:
        declared = backend.capabilities().kv_cache_dtypes
        if self.kv_cache_dtypes_to_test is not None:
            return tuple(d for d in self.kv_cache_dtypes_to_test if d in declared)
        return declared

    def block_sizes(self, backend: Backend) -> tuple[int, ...]:
        if self.block_sizes_to_test is not None:
            return self.block_sizes_to_test
        declared = sorted(backend.capabilities().block_sizes)
        return tuple(([b for b in declared if b >= 8] or declared)[:2])

    def spec(self, dtype: str, block_size: int, group: int) -> AttentionSpec:
        return AttentionSpec(num_heads=self.num_kv_heads * group, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, block_size=block_size, scale=self.head_dim ** -0.5,
                             dtype=torch_dtype(dtype))

    def steps(self, backend: Backend):
        """(case name, AttentionStep) for every tested dtype x block size x GQA group."""
        for dtype in self.dtypes(backend):
            for block_size in self.block_sizes(backend):
                for group in self.gqa_groups:
                    case = f"dtype={dtype} block_size={block_size} group={group}"
                    seed = zlib.crc32(case.encode()) % 10_000
                    lens, num_decodes = ragged_lens(random.Random(seed), block_size)
                    yield case, _in_backend_cache(backend, random_step(self.spec(dtype, block_size, group), lens,
                                                                       num_decodes, seed, backend.device))

    # -- probe, capabilities, device ------------------------------------------------------
    def test_probe_returns_a_probe_result_and_never_raises(self, backend):
        try:
            result = type(backend).probe()
        except Exception as error:  # an unusable backend is a ProbeResult, never an exception
            raise AssertionError(f"probe() raised {type(error).__name__}: {error}") from error
        assert isinstance(result, ProbeResult) and isinstance(result.usable, bool)
        assert isinstance(result.reason, str) and result.reason

    def test_capabilities_are_well_formed(self, backend):
        caps = backend.capabilities()
        assert isinstance(caps, Capabilities)
        assert caps.dtypes and set(caps.dtypes) <= set(DTYPE_NAMES), caps.dtypes
        assert caps.block_sizes and all(isinstance(b, int) and b > 0 for b in caps.block_sizes), caps.block_sizes
        assert isinstance(caps.attention_impl, str) and caps.attention_impl.strip()
        assert isinstance(caps.unshardable_reason, str)
        assert set(caps.kv_cache_dtypes) <= set(KV_CACHE_FORMATS), caps.kv_cache_dtypes
        flags = (caps.mixed_prefill_decode, caps.prefix_caching, caps.graph_mode, caps.static_shapes)
        assert all(isinstance(flag, bool) for flag in flags)

    def test_device_holds_tensors(self, backend):
        assert isinstance(backend.device, torch.device)
        assert torch.ones(2, device=backend.device).sum().item() == 2

    def test_allocate_kv_cache_layout(self, backend):
        for dtype in self.dtypes(backend):
            for block_size in self.block_sizes(backend):
                spec = self.spec(dtype, block_size, 1)
                caches = backend.allocate_kv_cache(3, 5, spec)
                assert len(caches) == 3
                for cache in caches:
                    assert cache.shape == (2, 5, block_size, spec.num_kv_heads, spec.head_dim)
                    assert cache.dtype == spec.dtype and cache.device.type == backend.device.type
                    assert not cache.any(), "a new KV cache must be zeros (masked slots are read)"
                caches[0].fill_(1)
                assert not caches[1].any(), "each layer needs its own storage"

    # -- the attention kernel --------------------------------------------------------------
    def test_write_kv_writes_exactly_the_slots_of_slot_mapping(self, backend):
        for case, step in self.steps(backend):
            expected_cache, _ = step.reference()
            cache = step.cache.clone()
            backend.attention(step.spec).write_kv(step.key, step.value, cache, step.meta)
            assert torch.equal(cache.cpu(), expected_cache), case

    def test_attention_matches_the_reference_on_ragged_batches(self, backend):
        for case, step in self.steps(backend):
            _, expected = step.reference()
            kernel = backend.attention(step.spec)
            cache = step.cache.clone()
            kernel.write_kv(step.key, step.value, cache, step.meta)
            out = kernel.forward(step.query, cache, step.meta)
            assert out.shape == step.query.shape and out.dtype == step.spec.dtype, case
            dtype = str(step.spec.dtype).removeprefix("torch.")
            torch.testing.assert_close(out.cpu(), expected, **self.tolerances[dtype], msg=lambda m, case=case: f"{case}: {m}")

    def test_declared_kv_cache_dtypes_round_trip_through_write_kv_and_attention(self, backend):
        """Each declared quantized KV cache (Capabilities.kv_cache_dtypes): allocated as the contract
        lays it out (zeros, [2, blocks, block_size, kv_heads, head_dim + 4] of the code's dtype);
        the kernel's write_kv stores values that read back within the format's rounding of those
        written, and its attention over what it wrote gives the reference's output over the
        reference's write (core/kv/quantized.py's rows, read as code * scale)."""
        formats = self.kv_cache_dtypes(backend)
        if not formats:
            pytest.skip("the backend declares no quantized KV cache (Capabilities.kv_cache_dtypes)")
        for kv_cache_dtype in formats:
            for case, step in self.steps(backend):
                case = f"{case} kv_cache_dtype={kv_cache_dtype}"
                quantized = step.quantized(kv_cache_dtype)
                cache = backend.allocate_kv_cache(1, step.cache.shape[1], quantized.spec)[0]
                assert cache.shape == quantized.spec.cache_shape(step.cache.shape[1]), case
                assert cache.dtype == quantized.spec.cache_dtype and not cache.view(torch.uint8).any(), case
                cache.view(torch.uint8).copy_(quantized.cache.view(torch.uint8))
                kernel = backend.attention(quantized.spec)
                kernel.write_kv(step.key, step.value, cache, step.meta)
                written = dequantize_cache(cache.cpu()).flatten(1, 2)[:, step.meta.slot_mapping.cpu()]
                values = torch.stack([step.key.cpu(), step.value.cpu()]).float()
                bound = KV_ROUNDING[kv_cache_dtype] * values.abs().amax(dim=-1, keepdim=True)
                assert ((written - values).abs() <= bound).all(), f"{case}: the cache does not hold the values written"
                out = kernel.forward(step.query, cache, step.meta)
                assert out.shape == step.query.shape and out.dtype == step.spec.dtype, case
                _, expected = quantized.reference()
                dtype = str(step.spec.dtype).removeprefix("torch.")
                torch.testing.assert_close(out.cpu(), expected, **self.tolerances[dtype],
                                           msg=lambda m, case=case: f"{case}: {m}")

    def test_declared_window_anchors_move_sliding_windows_as_the_reference(self, backend):
        """A backend that declares Capabilities.window_anchors: in a sliding-window layer each row's
        window counts back from its AttentionMetadata.window_anchors entry (image rows,
        core/multimodal/image_rows.py): keys in (anchor - window, seq_len), as the reference."""
        if not backend.capabilities().window_anchors:
            pytest.skip("the backend declares no window anchors (Capabilities.window_anchors)")
        for dtype in self.dtypes(backend):
            for block_size in self.block_sizes(backend):
                case = f"dtype={dtype} block_size={block_size} window=5"
                spec = replace(self.spec(dtype, block_size, self.gqa_groups[-1]), sliding_window=5)
                step = _in_backend_cache(backend, image_rows_step(spec, zlib.crc32(case.encode()) % 10_000,
                                                                  backend.device))
                _, expected = step.reference()
                out = self._run(backend.attention(spec), step, step.meta)
                torch.testing.assert_close(out, expected, **self.tolerances[dtype],
                                           msg=lambda m, case=case: f"{case}: {m}")

    def test_a_graph_safe_kernel_reads_no_host_tuples_on_decode_batches(self, backend):
        dtype, block_size = self.dtypes(backend)[0], self.block_sizes(backend)[0]
        kernel = backend.attention(self.spec(dtype, block_size, 2))
        if not kernel.graph_safe:
            pytest.skip(f"{type(kernel).__name__} does not declare graph_safe")
        lens = [(1, 1), (1, block_size + 3), (1, 3 * block_size)]
        step = _in_backend_cache(backend, random_step(kernel.spec, lens, len(lens), seed=5, device=backend.device))
        garbage = replace(step.meta, query_start_loc_cpu=(7, 3), seq_lens_cpu=(1,) * 9,
                          max_seq_len=4 * block_size)  # a graph captures worst-case host values
        name = type(kernel).__name__
        try:
            replayed = self._run(kernel, step, garbage)
        except Exception as error:  # a kernel that reads the host values may crash on them: the same breach
            raise AssertionError(f"{name} declares graph_safe but fails when the metadata's host tuples change "
                                 f"({type(error).__name__}: {error})") from error
        assert torch.equal(replayed, self._run(kernel, step, step.meta)), \
            f"{name} declares graph_safe but its output depends on the metadata's host tuples"

    @staticmethod
    def _run(kernel, step: AttentionStep, meta) -> torch.Tensor:
        cache = step.cache.clone()
        kernel.write_kv(step.key, step.value, cache, meta)
        return kernel.forward(step.query, cache, meta).cpu()

    # -- the LoRA kernel ---------------------------------------------------------------------
    def test_lora_is_declared_exactly_when_there_is_a_lora_kernel(self, backend):
        declared, kernel = backend.capabilities().lora, backend.lora_kernel()
        assert declared == (kernel is not None), (
            f"Capabilities.lora is {declared} but lora_kernel() returns {type(kernel).__name__}")
        assert kernel is None or isinstance(kernel, LoraKernel), type(kernel)

    def declared_lora_kernel(self, backend: Backend) -> LoraKernel:
        if not backend.capabilities().lora or backend.lora_kernel() is None:
            pytest.skip("the backend declares no LoRA kernel (Capabilities.lora)")
        return backend.lora_kernel()

    def lora_steps(self, backend: Backend):
        """(case name, LoraStep): per tested dtype, a random step (mixed slots, -1 among them;
        ranks 1..16 padded to 16; y a column slice), one with a rank of 24 (not a multiple of 16),
        one with no adapter, one with no token."""
        for dtype in self.dtypes(backend):
            torch_type = torch_dtype(dtype)
            yield f"dtype={dtype}", random_lora_step(11, torch_type, backend.device)
            yield f"dtype={dtype} rank=24", random_lora_step(12, torch_type, backend.device, tokens=9, rank=24,
                                                             in_features=40, out_features=19)
            yield f"dtype={dtype} no adapter", random_lora_step(13, torch_type, backend.device, runs=[(5, -1)])
            yield f"dtype={dtype} no token", random_lora_step(14, torch_type, backend.device, runs=[])

    def test_lora_kernel_matches_the_reference(self, backend):
        """shrink then expand of the declared kernel against TorchLoraKernel: h of every token with
        an adapter; y of every token within the dtype's tolerance, the base model's tokens and the
        columns beside the slice untouched."""
        kernel = self.declared_lora_kernel(backend)
        for case, step in self.lora_steps(backend):
            expected_h, expected = step.reference()
            h, got = step.run(kernel)
            assert h.shape == expected_h.shape and h.dtype == expected_h.dtype, f"{case}: h {h.shape} {h.dtype}"
            assert got.shape == expected.shape and got.dtype == expected.dtype, case
            tolerance = LORA_TOLERANCES[str(step.x.dtype).removeprefix("torch.")]
            adapted = step.batch.token_slots.cpu() >= 0
            torch.testing.assert_close(h[adapted], expected_h[adapted], **tolerance,
                                       msg=lambda m, case=case: f"{case}: shrink: {m}")
            torch.testing.assert_close(got, expected, **tolerance, msg=lambda m, case=case: f"{case}: expand: {m}")
            before = step.wide.cpu()
            assert torch.equal(got[~adapted], before[~adapted]), f"{case}: expand changed tokens of slot -1"
            inside = slice(step.margin, step.margin + step.out_features)
            outside = torch.ones(before.shape[1], dtype=torch.bool)
            outside[inside] = False
            assert torch.equal(got[:, outside], before[:, outside]), f"{case}: expand wrote outside y's columns"

    def test_lora_kernel_gives_a_token_the_same_output_alone_as_in_the_batch(self, backend):
        """Batch invariance, bit for bit: each token's h and y are those of a step of that token alone."""
        kernel = self.declared_lora_kernel(backend)
        for case, step in self.lora_steps(backend):
            h, got = step.run(kernel)
            for t in range(step.x.shape[0]):
                alone_h, alone = step.token(t).run(kernel)
                if int(step.batch.token_slots[t]) >= 0:
                    assert torch.equal(alone_h[0], h[t]), f"{case}: token {t}'s h depends on the batch"
                assert torch.equal(alone[0], got[t]), f"{case}: token {t}'s output depends on the batch"

    # -- the whole engine ------------------------------------------------------------------
    def test_engine_greedy_output_equals_the_reference_backend(self, backend):
        """prepare_model, profile_run, num_kv_blocks, make_runner and the kernel, end to end."""
        if "float32" not in backend.capabilities().dtypes:
            pytest.skip("greedy tokens are compared in float32, which this backend does not declare")
        block_size = self.block_sizes(backend)[0]
        engine = EngineCore(_engine_config(block_size), backend=backend)
        assert isinstance(engine.runner, ModelRunner)
        assert engine.info.num_kv_blocks >= 2
        got = _generate(engine, self.generated_tokens)
        assert got == _reference_tokens(block_size, self.generated_tokens)

    def test_speculative_verify_steps_give_the_plain_greedy_tokens(self, backend):
        """A backend that declares multi-token decode queries (Capabilities.multi_token_decode)
        runs verify steps (a decode and the tokens proposed after it, core/spec) whose logits
        give the tokens of plain greedy decoding: a verify here accepts one proposal and rejects
        the next."""
        caps = backend.capabilities()
        if not caps.multi_token_decode:
            pytest.skip("the backend does not declare multi-token decode queries (speculation is turned off)")
        if "float32" not in caps.dtypes:
            pytest.skip("greedy tokens are compared in float32, which this backend does not declare")
        block_size = self.block_sizes(backend)[0]
        expected = _reference_tokens(block_size, self.generated_tokens)
        config = replace(_engine_config(block_size),
                         speculative=SpeculativeConfig(num_speculative_tokens=3, adaptive=False))
        engine = EngineCore(config, backend=backend)
        speculator = engine.scheduler.speculator
        speculator.proposer = _OracleProposer(expected)
        assert _generate(engine, self.generated_tokens) == expected
        assert speculator.stats.num_verify_steps > 0
        assert 0 < speculator.stats.num_accepted < speculator.stats.num_proposed

    def test_declared_vision_encoders_answer_images_as_the_reference_backend(self, backend):
        """A backend that declares vision encoders (Capabilities.vision_encoders) serves a tiny
        random-weight vision-language model (tiny_vlm.py): the greedy tokens of two image prompts,
        their images' placeholders cut across steps, equal the reference backend's."""
        caps = backend.capabilities()
        if not caps.vision_encoders:
            pytest.skip("the backend declares no vision encoders (a request with images is refused)")
        if "float32" not in caps.dtypes:
            pytest.skip("greedy tokens are compared in float32, which this backend does not declare")
        answers, expected = image_answers(backend, self.block_sizes(backend)[0])
        assert answers == expected

    def test_num_kv_blocks_is_at_least_two(self, backend):
        assert backend.num_kv_blocks(4096, CacheConfig()) >= 2

    # -- sharding hooks, unsharded -----------------------------------------------------------
    def test_no_communicator_when_unsharded(self, backend):
        assert backend.communicator() is None

    def test_a_shard_launcher_exactly_when_there_is_a_dist_backend(self, backend):
        dist_backend = type(backend).dist_backend
        assert dist_backend is None or (isinstance(dist_backend, str) and dist_backend)
        assert (backend.shard_launcher() is None) == (dist_backend is None)


class _OracleProposer:
    """Proposes the next token of the expected greedy output, then a wrong one."""

    def __init__(self, expected: dict[str, list[int]]):
        self.expected = expected

    def propose(self, slots):
        proposals = []
        for request, most in slots:
            expected, done = self.expected[request.request_id], len(request.output_token_ids)
            wrong = (expected[done + 1] + 1) % 64 if done + 1 < len(expected) else 0
            proposals.append((expected[done:done + 1] + [wrong])[:most])
        return proposals

    def forget(self, request_id: str) -> None:
        pass


def _in_backend_cache(backend: Backend, step: AttentionStep) -> AttentionStep:
    """The step with its cache copied into one the backend allocated: a backend's cache has
    core's index order but may lay it out in memory as its kernels want (strides)."""
    cache = backend.allocate_kv_cache(1, step.cache.shape[1], step.spec)[0]
    cache.copy_(step.cache)
    return replace(step, cache=cache)


def _engine_config(block_size: int) -> EngineConfig:
    # the KV cache is sized by the backend (num_blocks None), like a server's
    return EngineConfig(model=ModelConfig(model="llama-tiny", load_format="dummy", seed=3, max_model_len=128),
                        cache=CacheConfig(block_size=block_size, max_auto_blocks=64),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32))


@functools.cache
def _reference_tokens(block_size: int, max_tokens: int) -> dict[str, list[int]]:
    return _generate(EngineCore(_engine_config(block_size), backend=ReferenceBackend(block_size)), max_tokens)


def image_answers(backend, block_size: int) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(the backend's, the reference backend's) greedy tokens of two image prompts to a tiny
    random-weight vision-language model (tiny_vlm.py), float32; also run on a GPU by
    benchmarks/gpu/bench.py."""
    import tempfile

    from .tiny_vlm import tiny_idefics3

    with tempfile.TemporaryDirectory() as path:
        _, processor = tiny_idefics3(path)
        config = _vlm_config(path, block_size)
        expected = _image_answers(EngineCore(config, backend=ReferenceBackend(block_size)), processor)
        return _image_answers(EngineCore(config, backend=backend), processor), expected


def _vlm_config(path: str, block_size: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=path),
                        cache=CacheConfig(block_size=block_size, num_blocks=512 // block_size),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24))


def _image_answers(engine: EngineCore, processor) -> dict[str, list[int]]:
    """Greedy tokens of two prompts with images (tiny_vlm.py's model), in one batch."""
    from .tiny_vlm import png_bytes
    from ..multimodal.inputs import ImageData

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    images = [ImageData.of(png_bytes(w, h, seed), w, h, "PNG") for w, h, seed in ((64, 48, 1), (20, 30, 2))]
    prompts = {"one": [{"type": "image"}, {"type": "text", "text": "what is it?"}],
               "two": [{"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}]}
    out = {key: [] for key in prompts}
    try:
        for key, content in prompts.items():
            text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
            ids = processor.tokenizer.encode(text, add_special_tokens=False)
            engine.add_request(Request(key, ids, params, images=tuple(images[:1] if key == "one" else images)))
        while engine.has_unfinished_requests():
            for output in engine.step():
                out[output.request_id].extend(output.new_token_ids)
    finally:
        engine.shutdown()
    return out


def _generate(engine: EngineCore, max_tokens: int) -> dict[str, list[int]]:
    """Greedy tokens of PROMPTS (one of them chunked: the step budget is 32 tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {f"r{i}": [] for i in range(len(PROMPTS))}
    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(Request(f"r{i}", list(prompt), params))
        while engine.has_unfinished_requests():
            for output in engine.step():
                out[output.request_id].extend(output.new_token_ids)
    finally:
        engine.shutdown()
    return out

