"""Bad adapters are refused in one clear error that names what is wrong, and change nothing;
what the engine refuses at start; the step's LoraBatch and its rows."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
from lora_helpers import (make_adapter, make_engine, prompts, reference_greedy, run, save_base,
                          tiny_llama_config)
from safetensors.torch import load_file, save_file

from switchyard.core.backend_contract import Capabilities
from switchyard.core.capabilities import check_capabilities
from switchyard.core.config import EngineConfig, LoraConfig, ParallelConfig
from switchyard.core.errors import BackendCapabilityError
from switchyard.core.lora.adapter import LoraAdapterError
from switchyard.core.lora.batch import lora_batch, slice_batch


@pytest.fixture(scope="module")
def served(llama_dir, tmp_path_factory):
    """An engine serving one good adapter, and its reference."""
    path = tmp_path_factory.mktemp("good")
    merged = make_adapter(llama_dir, path, seed=1)
    return make_engine(llama_dir, adapters=[("good", path)], max_lora_rank=8), merged


def _other_base(tmp_path, default_tokenizer, **config):
    return save_base(tiny_llama_config(**config), tmp_path / "other-base", default_tokenizer)


def _rename_keys(path, old: str, new: str):
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    save_file({k.replace(old, new): v for k, v in tensors.items()}, file)


def _edit_config(path, **values):
    file = os.path.join(path, "adapter_config.json")
    with open(file) as f:
        config = json.load(f)
    config.update(values)
    with open(file, "w") as f:
        json.dump(config, f)


def bad_adapters(llama_dir, tmp_path, default_tokenizer):
    """name -> (path, what the error says)."""
    cases = {}
    wrong = tmp_path / "wrong-shapes"
    make_adapter(_other_base(tmp_path, default_tokenizer, hidden_size=32), wrong, seed=2)
    cases["wrong shapes"] = (wrong, r"has A \(4, 128\) and B \(32, 4\); this model needs A \[r, 128\] and B \[64, r\]")
    big = tmp_path / "rank-too-big"
    make_adapter(llama_dir, big, seed=2, r=16)
    cases["rank too big"] = (big, "rank 16, more than the largest rank served, 8")
    cases["missing"] = (tmp_path / "nowhere", "does not exist")
    afile = tmp_path / "a-file"
    afile.write_text("not an adapter")
    cases["a file"] = (afile, "is not a directory")
    no_config = tmp_path / "no-config"
    make_adapter(llama_dir, no_config, seed=2)
    os.remove(no_config / "adapter_config.json")
    cases["no config"] = (no_config, "no adapter_config.json")
    pickled = tmp_path / "pickled"
    make_adapter(llama_dir, pickled, seed=2)
    os.rename(pickled / "adapter_model.safetensors", pickled / "adapter_model.bin")
    cases["bin only"] = (pickled, "adapter_model.bin \\(a pickle\\)")
    dora = tmp_path / "dora"
    make_adapter(llama_dir, dora, seed=2, use_dora=True)
    cases["dora"] = (dora, "DoRA")
    unsupported = tmp_path / "unsupported"
    make_adapter(llama_dir, unsupported, seed=2)
    _rename_keys(unsupported, "self_attn.q_proj", "self_attn.rotary_proj")
    cases["unsupported module"] = (unsupported, "target module model.layers.0.self_attn.rotary_proj is not supported")
    bias = tmp_path / "bias"
    make_adapter(llama_dir, bias, seed=2)
    _edit_config(bias, bias="all")
    cases["trained bias"] = (bias, "trained biases")
    half = tmp_path / "half"
    make_adapter(llama_dir, half, seed=2)
    _rename_keys(half, "layers.1.mlp.down_proj.lora_B", "layers.1.mlp.down_proj.lora_C")
    cases["only lora_A"] = (half, "is not a LoRA A or B matrix")
    embedding = tmp_path / "embedding"
    make_adapter(llama_dir, embedding, seed=2, targets=["embed_tokens", "q_proj"])
    cases["embedding at run time"] = (embedding, "only adapters named at start")
    return cases


def test_bad_adapters_are_refused_clearly_and_change_nothing(served, llama_dir, tmp_path, default_tokenizer):
    engine, merged = served
    prompt = prompts(count=1)[0]
    before = run(engine, [("before", prompt, "good")])["before"]
    for case, (path, message) in bad_adapters(llama_dir, tmp_path, default_tokenizer).items():
        with pytest.raises(LoraAdapterError, match=message) as error:
            engine.load_lora("bad", str(path))
        assert "'bad'" in str(error.value) and "\n" not in str(error.value), case
        assert engine.lora.names == ("good",), case
    with pytest.raises(LoraAdapterError, match="already loaded"):
        engine.load_lora("good", str(tmp_path / "rank-too-big"))
    assert run(engine, [("after", prompt, "good")])["after"] == before == reference_greedy(merged, prompt, len(before))


def test_a_bad_adapter_named_at_start_stops_the_start(llama_dir, tmp_path):
    make_adapter(llama_dir, tmp_path / "big", seed=2, r=16)
    with pytest.raises(LoraAdapterError, match="rank 16"):
        make_engine(llama_dir, adapters=[("big", tmp_path / "big")], max_lora_rank=8)


def test_lora_is_refused_where_the_backend_cannot_or_with_shards():
    lora = LoraConfig(enable=True)
    caps = Capabilities(dtypes=("float32",), block_sizes=(16,))
    with pytest.raises(BackendCapabilityError, match="does not serve LoRA adapters"):
        check_capabilities("plain", caps, EngineConfig(lora=lora))
    with pytest.raises(BackendCapabilityError, match="--num-shard 2"):
        check_capabilities("plain", replace(caps, lora=True),
                           EngineConfig(lora=lora, parallel=ParallelConfig(tensor_parallel_size=2)))
    check_capabilities("plain", caps, EngineConfig())  # LoRA off: nothing asked


def test_the_step_lora_batch_and_its_rows():
    assert lora_batch([-1, -1, -1], torch.device("cpu")) is None
    batch = lora_batch([0, 0, -1, 2, 2, 2, 0], torch.device("cpu"))
    assert batch.segments == ((0, 2, 0), (3, 6, 2), (6, 7, 0))
    assert batch.token_slots.tolist() == [0, 0, -1, 2, 2, 2, 0]
    rows = slice_batch(batch, 1, 4)  # tokens 1..4
    assert rows.segments == ((0, 1, 0), (2, 4, 2)) and rows.token_slots.tolist() == [0, -1, 2, 2]
    assert slice_batch(batch, 2, 1) is None


def test_the_stacks_bytes_come_off_the_kv_cache_memory_budget(llama_dir):
    from switchyard.core.config import CacheConfig
    from switchyard.core.kv.sizing import without_bytes

    assert without_bytes(CacheConfig(kv_cache_memory=10_000), 4_000).kv_cache_memory == 6_000
    assert without_bytes(CacheConfig(), 4_000).kv_cache_memory is None  # the token rule stays
    budget = 2_000_000
    engines = {on: make_engine(llama_dir, num_blocks=None, enable=on, kv_cache_memory=budget) for on in (False, True)}
    stacks = engines[True].lora.nbytes
    assert stacks > 0 and engines[False].lora is None
    block = engines[False].loaded.num_layers * engines[False].loaded.attention_spec.cache_block_bytes
    assert engines[True].info.num_kv_blocks == (budget - stacks) // block
    assert engines[False].info.num_kv_blocks == budget // block


def test_decode_graphs_leave_steps_with_adapter_rows_to_the_eager_path():
    from switchyard.core.execution.decode_batch import BucketedDecodeRunner
    from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput

    class Graphs(BucketedDecodeRunner):
        def __init__(self):
            pass

        def ready_sizes(self):
            return (1, 2, 4)

    def step(lora_name):
        return SchedulerOutput((ScheduledRequest("r", (5,), 3, (1,), True, lora_name=lora_name),))

    assert Graphs().graph_batch_size(step(None)) == 1
    assert Graphs().graph_batch_size(step("a")) is None
