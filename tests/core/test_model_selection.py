"""Which path a model takes (native, transformers fallback, refused), and how a refusal
reaches the user: one line and exit status 2 from `switchyard generate`/`serve`/`models`."""
from __future__ import annotations

import json
import textwrap

import pytest
import torch
from model_helpers import ReferenceBackend, randomize, run_two_steps
from transformers import (BertConfig, FalconConfig, GPT2Config, LlamaConfig, LlamaForCausalLM, T5Config,
                          ViTConfig)

from switchyard.core.config import ModelConfig
from switchyard.core.loader import choose_model, load_model
from switchyard.core.models import LlamaForCausalLM as NativeLlama
from switchyard.core.models import MODEL_TYPES, UnsupportedModelError, select_model
from switchyard.core.models.transformers_fallback import TransformersForCausalLM
from switchyard.gateway.cli import main

TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)


def test_auto_picks_native_code_where_it_exists_else_the_fallback():
    llama, gpt2 = LlamaConfig(**TINY_LLAMA), GPT2Config(vocab_size=64, bos_token_id=1, eos_token_id=2)
    assert (select_model(llama).impl, select_model(llama).model_class) == ("native", NativeLlama)
    assert select_model(llama, "transformers").model_class is TransformersForCausalLM
    assert (select_model(gpt2).impl, select_model(gpt2).model_class) == ("transformers", TransformersForCausalLM)
    assert "transformers fallback" in select_model(gpt2).describe()
    assert "native (LlamaForCausalLM)" in select_model(llama).describe()
    with pytest.raises(UnsupportedModelError, match=r"gpt2.*no native code.*--model-impl auto or transformers"):
        select_model(gpt2, "native")
    with pytest.raises(ValueError, match="model_impl 'fast' is not one of auto, native, transformers"):
        select_model(llama, "fast")


@pytest.mark.parametrize("config, reason", [
    (BertConfig(architectures=["BertForMaskedLM"]), r"BertForMaskedLM \(bert\) is an encoder-only model"),
    (T5Config(), r"t5\) is an encoder-decoder model"),
    (ViTConfig(), r"vit\) is not a causal language model transformers knows"),
    (FalconConfig(), r"falcon\) has a transformers class that does not support custom attention functions"),
])
def test_refusals_name_the_model_and_what_is_supported(config, reason):
    for impl in ("auto", "transformers"):
        with pytest.raises(UnsupportedModelError, match=reason) as error:
            select_model(config, impl)
        message = str(error.value)
        assert "\n" not in message and "native: " in message and "llama" in message
        assert "transformers fallback" in message


def write_model_dir(path, config_dict: dict, files: dict[str, str] | None = None) -> str:
    """config.json, dummy weights (refusals happen before they are read) and extra files."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict))
    save_file({"dummy": torch.zeros(1)}, str(path / "model.safetensors"))
    for name, text in (files or {}).items():
        (path / name).write_text(textwrap.dedent(text))
    return str(path)


REMOTE_CODE = {
    "configuration_custom.py": """
        from transformers import LlamaConfig

        class CustomLlamaConfig(LlamaConfig):
            model_type = "custom_llama"
        """,
    "modeling_custom.py": """
        from transformers import LlamaForCausalLM
        from .configuration_custom import CustomLlamaConfig

        class CustomLlamaForCausalLM(LlamaForCausalLM):
            config_class = CustomLlamaConfig
        """,
}
AUTO_MAP = {"AutoConfig": "configuration_custom.CustomLlamaConfig",
            "AutoModelForCausalLM": "modeling_custom.CustomLlamaForCausalLM"}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=48, architectures=["BertForMaskedLM"]).to_dict()
    vit = ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48).to_dict()
    gpt2 = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=1, eos_token_id=2,
                      architectures=["GPT2LMHeadModel"]).to_dict()
    remote = {**LlamaConfig(**TINY_LLAMA).to_dict(), "model_type": "custom_llama", "auto_map": AUTO_MAP,
              "architectures": ["CustomLlamaForCausalLM"]}
    return {
        "bert": write_model_dir(root / "bert", bert),
        "vit": write_model_dir(root / "vit", vit),
        "gpt2": write_model_dir(root / "gpt2", gpt2),
        "unknown": write_model_dir(root / "unknown", {"model_type": "frobnicator", "architectures": ["FrobLM"]}),
        "remote": write_model_dir(root / "remote", remote, REMOTE_CODE),
    }


def test_unknown_and_remote_code_model_types_are_refused_at_config_load(model_dirs):
    with pytest.raises(UnsupportedModelError, match=r"model FrobLM \(frobnicator\) is an architecture neither"):
        choose_model(ModelConfig(model=model_dirs["unknown"]))
    with pytest.raises(UnsupportedModelError, match=r"CustomLlamaForCausalLM \(custom_llama\) needs the checkpoint's "
                                                    r"own code \(config.auto_map\); pass --trust-remote-code"):
        choose_model(ModelConfig(model=model_dirs["remote"]))


def test_trusted_remote_code_runs_through_the_fallback(tmp_path):
    hf = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).eval()
    randomize(hf)
    hf.save_pretrained(tmp_path / "weights", safe_serialization=True)
    path = write_model_dir(tmp_path / "remote", {**hf.config.to_dict(), "model_type": "custom_llama",
                                                 "auto_map": AUTO_MAP}, REMOTE_CODE)
    (tmp_path / "weights" / "model.safetensors").replace(tmp_path / "remote" / "model.safetensors")
    loaded = load_model(ModelConfig(model=path, trust_remote_code=True), ReferenceBackend(), 4)
    assert loaded.model_impl == "transformers" and type(loaded.model.hf).__name__ == "CustomLlamaForCausalLM"
    prompt = {"A": [5, 9, 3, 7, 11, 13, 17], "B": [4, 8, 15, 16, 23, 42, 8, 9, 10, 11], "C": [3, 6, 9]}
    ours = run_two_steps(loaded, prompt, 11, 4)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt["B"]])).logits[0]
    torch.testing.assert_close(ours["B"], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("argv, words", [
    (["generate", "hi", "--model-id", "{bert}"], r"model BertForMaskedLM (bert) is an encoder-only model"),
    (["serve", "--model-id", "{vit}", "--port", "1"], "(vit) is not a causal language model"),
    (["generate", "hi", "--model-id", "{gpt2}", "--model-impl", "native"], "(gpt2) has no native code"),
    (["models", "--model-id", "{unknown}"], "(frobnicator) is an architecture neither"),
    (["serve", "--model-id", "{remote}", "--port", "1"], "pass --trust-remote-code"),
])
def test_cli_refusals_are_one_line_and_exit_2(model_dirs, capsys, argv, words):
    assert main([arg.format(**model_dirs) for arg in argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("switchyard: error:")]
    assert len(errors) == 1 and words in errors[0] and "Traceback" not in err


def test_cli_models_says_which_path_a_model_takes(model_dirs, capsys):
    assert main(["models", "--model-id", model_dirs["gpt2"]]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"supported: native: {', '.join(sorted(MODEL_TYPES))}; through the transformers fallback")
    assert out[1] == f"{model_dirs['gpt2']}: GPT2LMHeadModel (gpt2): transformers fallback " \
                     "(transformers' modules, our paged attention)"


@pytest.mark.parametrize("cache", ["", "tmp"])
def test_a_gguf_architecture_transformers_cannot_read_is_refused(tmp_path, cache):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(tmp_path / "encoder.gguf"), arch="bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = ModelConfig(model=str(tmp_path / "encoder.gguf"), cache_dir="" if cache == "" else str(tmp_path / "c"))
    with pytest.raises(UnsupportedModelError, match=r"'encoder.gguf' holds architecture 'bert', which transformers"):
        choose_model(config)


def test_serve_logs_the_path_at_start(model_dirs, capsys, monkeypatch):
    """The start log names the path before the engine is built (the engine process checks it; the server
    is stubbed)."""
    import logging
    from types import SimpleNamespace

    import switchyard.gateway.app as app
    import switchyard.gateway.serve as serve

    monkeypatch.setattr(app, "create_app", lambda settings, client: SimpleNamespace(state=SimpleNamespace(drain=None)))
    # the server listens before the engine starts: the stub serves until the engine has checked the model
    monkeypatch.setattr(serve, "DrainingServer", lambda config, drain, engine, **_: SimpleNamespace(
        run=lambda **_: engine.wait_model_checked(120)))
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        assert main(["serve", "--model-id", model_dirs["gpt2"], "--port", "1"]) == 0
    finally:
        root.handlers[:], root.level = handlers, level
    assert "model GPT2LMHeadModel (gpt2): transformers fallback" in capsys.readouterr().err
