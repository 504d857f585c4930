"""The one decision of how a model is served (core/pooling/decide.py): --task, --pooling, the
sentence-transformers files (both formats), a GGUF's pooling_type, the defaults; and the refusals."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from switchyard.core.models import UnsupportedModelError
from switchyard.core.pooling.decide import decide_pooling
from switchyard.core.pooling.gguf_pooling import gguf_pooling_type
from switchyard.core.pooling.params import PoolingParams
from switchyard.core.pooling.spec import PoolingSpec
from switchyard.core.params import ValidationError

DECODER = SimpleNamespace(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=32)
ENCODER = SimpleNamespace(model_type="bert", architectures=["BertModel"], hidden_size=32)


def st_dir(path, pooling: dict | None, modules=("Transformer", "Pooling", "Normalize")):
    """A sentence-transformers directory's modules.json and Pooling config (old-style type names)."""
    entries = [{"idx": i, "name": str(i), "path": "" if kind == "Transformer" else f"{i}_{kind}",
                "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "modules.json").write_text(json.dumps(entries))
    for entry in entries:
        if entry["type"].endswith("Pooling"):
            (path / entry["path"]).mkdir()
            (path / entry["path"] / "config.json").write_text(json.dumps(pooling))
    return str(path)


def write_gguf(path, pooling_type: int | None, vocab: int = 3000) -> str:
    """A GGUF header with a vocabulary (the arrays the reader skips) and, maybe, a pooling type."""
    from gguf import GGUFWriter, PoolingType

    writer = GGUFWriter(str(path), "qwen2")
    writer.add_block_count(1)
    writer.add_token_list([f"token-{i}" for i in range(vocab)])
    writer.add_token_scores([0.5] * vocab)
    if pooling_type is not None:
        writer.add_pooling_type(PoolingType(pooling_type))
    writer.add_string("general.note", "after the pooling type")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


OLD_CLS = {"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
           "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}


def test_sentence_transformers_files_decide_pooling_and_normalisation(tmp_path):
    spec = decide_pooling("auto", None, ENCODER, True, directory=st_dir(tmp_path / "old", OLD_CLS))
    assert (spec.method, spec.normalize, spec.size, spec.origin) == ("cls", True, 32, "sentence-transformers config")
    new = st_dir(tmp_path / "new", {"embedding_dimension": 32, "pooling_mode": ["mean"]}, ("Transformer", "Pooling"))
    spec = decide_pooling("auto", None, DECODER, False, directory=new)
    assert (spec.method, spec.normalize) == ("mean", False)  # no Normalize module: raw vectors
    assert decide_pooling("auto", "last", DECODER, False, directory=new).method == "last"  # --pooling wins
    assert decide_pooling("generate", None, DECODER, False, directory=new) is None


@pytest.mark.parametrize("pooling, modules, words", [
    ({"pooling_mode": "max"}, ("Transformer", "Pooling"), r"pooling \['max'\] .* is not served"),
    ({"pooling_mode": ["mean", "max"]}, ("Transformer", "Pooling"), "is not served"),
    (OLD_CLS, ("Transformer", "Pooling", "Dense", "Normalize"), r"modules Switchyard does not compute \(Dense\)"),
])
def test_a_module_chain_computed_otherwise_is_refused(tmp_path, pooling, modules, words):
    with pytest.raises(UnsupportedModelError, match=words):
        decide_pooling("auto", None, DECODER, False, directory=st_dir(tmp_path, pooling, modules))


def test_defaults_without_files_and_the_encoder_rule():
    assert decide_pooling("auto", None, DECODER, False) is None  # a plain decoder generates
    spec = decide_pooling("embed", None, DECODER, False)
    assert (spec.method, spec.normalize, spec.origin) == ("last", True, "decoder default")
    spec = decide_pooling("auto", None, ENCODER, True)  # an encoder embeds under auto
    assert (spec.method, spec.origin) == ("cls", "encoder default")
    with pytest.raises(UnsupportedModelError, match=r"BertModel \(bert\) is an encoder-only model: it serves "
                                                    "embeddings"):
        decide_pooling("generate", None, ENCODER, True)
    with pytest.raises(ValueError, match="task 'pool' is not one of auto, generate, embed"):
        decide_pooling("pool", None, DECODER, False)
    with pytest.raises(ValueError, match="pooling 'max' is not one of last, mean, cls"):
        decide_pooling("embed", "max", DECODER, False)


def test_an_encoder_config_classifier_pooling_is_the_default_files_and_flags_override(tmp_path):
    """ModernBERT's config says how its classification head pools: the default without
    sentence-transformers files; --pooling and a Pooling module come first."""
    modernbert = SimpleNamespace(model_type="modernbert", architectures=["ModernBertModel"], hidden_size=32,
                                 classifier_pooling="mean")
    spec = decide_pooling("auto", None, modernbert, True)
    assert (spec.method, spec.normalize, spec.origin) == ("mean", True, "config classifier_pooling")
    assert decide_pooling("auto", "cls", modernbert, True).origin == "--pooling"
    spec = decide_pooling("auto", None, modernbert, True, directory=st_dir(tmp_path / "st", OLD_CLS))
    assert (spec.method, spec.origin) == ("cls", "sentence-transformers config")


def test_matryoshka_comes_from_the_config_keys_vllm_reads():
    sizes = SimpleNamespace(**vars(DECODER), matryoshka_dimensions=[8, 16])
    assert decide_pooling("embed", None, sizes, False).matryoshka_dimensions == (8, 16)
    flag = SimpleNamespace(**vars(DECODER), is_matryoshka=True)
    spec = decide_pooling("embed", None, flag, False)
    assert spec.matryoshka and spec.matryoshka_dimensions == ()
    assert not decide_pooling("embed", None, DECODER, False).matryoshka


@pytest.mark.parametrize("pooling_type, expected", [(None, None), (0, "none"), (1, "mean"), (2, "cls"), (3, "last"),
                                                    (4, "rank")])
def test_the_gguf_header_reader_finds_the_pooling_type(tmp_path, pooling_type, expected):
    from gguf import GGUFReader

    path = write_gguf(tmp_path / "m.gguf", pooling_type)
    assert gguf_pooling_type(path) == expected
    field = GGUFReader(path).get_field("qwen2.pooling_type")
    assert (field is None) == (pooling_type is None) and (field is None or field.contents() == pooling_type)


def test_a_gguf_pooling_type_decides_auto_and_a_reranker_is_refused(tmp_path):
    last = decide_pooling("auto", None, DECODER, False, gguf_file=write_gguf(tmp_path / "last.gguf", 3))
    assert (last.method, last.normalize, last.origin) == ("last", True, "GGUF pooling_type")
    assert decide_pooling("auto", None, DECODER, False, gguf_file=write_gguf(tmp_path / "none.gguf", 0)) is None
    assert decide_pooling("embed", "mean", DECODER, False,
                          gguf_file=write_gguf(tmp_path / "cls.gguf", 2)).method == "mean"
    with pytest.raises(UnsupportedModelError, match="is a reranker"):
        decide_pooling("auto", None, DECODER, False, gguf_file=write_gguf(tmp_path / "rank.gguf", 4))


def test_the_spec_checks_dimensions_once_for_every_caller():
    plain, sizes = PoolingSpec("last", True, 64), PoolingSpec("last", True, 64, True, (16, 32))
    plain.check(PoolingParams(dimensions=64))  # the whole size is no cut
    with pytest.raises(ValidationError, match="does not support Matryoshka") as error:
        plain.check(PoolingParams(dimensions=16))
    assert error.value.param == "dimensions"
    with pytest.raises(ValidationError, match="exceeds the model's embedding size"):
        PoolingSpec("last", True, 64, True).check(PoolingParams(dimensions=65))
    sizes.check(PoolingParams(dimensions=32))
    with pytest.raises(ValidationError, match="16, 32"):
        sizes.check(PoolingParams(dimensions=24))
    with pytest.raises(ValidationError, match="positive integer"):
        PoolingParams(dimensions=0)
