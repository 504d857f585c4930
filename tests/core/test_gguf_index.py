"""A GGUF's tensor table and names are worked out once and kept with its converted metadata
(core/loader/gguf_index.py): a cached start maps the file and parses nothing, and gets the same
names, types, shapes and bytes as a parse; a changed file, or a cache that cannot be written,
falls back to parsing it. A first conversion of the metadata says so and shows its progress."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from switchyard.core.config import ModelConfig
from switchyard.core.loader import choose_model, gguf_index, gguf_weights
from switchyard.core.loader.gguf_packed import GGUFPackedWeights
from switchyard.core.loader.gguf_weights import GGUFWeights


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory, default_gguf_path):
    """A copy of the default model's GGUF (its mtime is the test's to change), its config and an
    empty folder for the index (as the converted metadata's directory would be)."""
    folder = tmp_path_factory.mktemp("gguf")
    path = str(folder / "model.gguf")
    shutil.copyfile(default_gguf_path, path)
    (folder / "metadata").mkdir()
    return path, choose_model(ModelConfig())[1], str(folder / "metadata")


def _table(weights) -> list:
    return [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data.dtype, t.data.shape)
            for t in weights.tensors]


def _no_parsing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf_weights, "gguf_to_hf_names", refuse)


def test_a_second_load_reads_the_index_and_parses_nothing(default_gguf, monkeypatch):
    path, hf_config, metadata = default_gguf
    parsed = GGUFPackedWeights(path, hf_config, metadata)
    plain = GGUFWeights(path, hf_config)  # no index: parsed
    assert os.path.isfile(os.path.join(metadata, gguf_index.INDEX_FILE))
    _no_parsing(monkeypatch)
    cached = GGUFPackedWeights(path, hf_config, metadata)
    assert cached.architecture == parsed.architecture == "llama" and cached.names == parsed.names
    assert _table(cached) == _table(parsed) and len(cached) == len(parsed) == 272
    for a, b in zip(cached.tensors, parsed.tensors):
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    got, want = dict(iter(cached)), dict(iter(parsed))
    assert got.keys() == want.keys()
    for name, value in want.items():
        if hasattr(value, "data") and not hasattr(value, "dtype"):  # a QuantizedWeight: its blocks
            assert value.format == got[name].format and value.data.equal(got[name].data), name
        else:
            assert value.equal(got[name]), name
    dequantizing = GGUFWeights(path, hf_config, metadata)
    assert dequantizing.names == plain.names and _table(dequantizing) == _table(plain)


def test_a_changed_file_is_parsed_again(default_gguf, monkeypatch):
    path, hf_config, metadata = default_gguf
    GGUFWeights(path, hf_config, metadata)
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert gguf_index.read_index(metadata, path) is None  # stale: stamped with the old mtime
    parses = []
    original = GGUFWeights._parse
    monkeypatch.setattr(GGUFWeights, "_parse", staticmethod(lambda *a: parses.append(1) or original(*a)))
    GGUFWeights(path, hf_config, metadata)
    assert parses == [1] and gguf_index.read_index(metadata, path) is not None  # and kept again


def test_a_cache_that_cannot_be_written_only_costs_the_parse(default_gguf, tmp_path, caplog):
    path, hf_config, _ = default_gguf
    missing = str(tmp_path / "gone")  # writing into it fails as a read-only cache would
    with caplog.at_level("INFO", logger=gguf_index.__name__):
        weights = GGUFWeights(path, hf_config, missing)
    assert len(weights) == 272 and any("is not kept" in m for m in caplog.messages)


def test_a_first_conversion_says_so_and_shows_progress(tmp_path, monkeypatch, caplog):
    """The conversion is the first start's long silent step (~30 s on 2 busy cores) before the kernels."""
    import time

    from switchyard.core.engine import heartbeat
    from switchyard.core.loader import gguf_cache

    def slow(gguf_path, out_dir):
        time.sleep(0.5)
        open(os.path.join(out_dir, "config.json"), "w").close()

    monkeypatch.setattr(gguf_cache, "_convert", slow)
    monkeypatch.setattr(heartbeat, "EVERY_S", 0.1)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    with caplog.at_level("INFO", logger=gguf_cache.__name__):
        gguf_cache.converted_directory(str(path), str(tmp_path / "cache"))
    assert caplog.messages[0].startswith("first start of this GGUF: reading its config and tokenizer once into")
    assert "cached afterwards" in caplog.messages[0]
    progress = [m for m in caplog.messages if m.startswith("still reading the config and tokenizer of model (")]
    assert len(progress) >= 2
    caplog.clear()
    gguf_cache.converted_directory(str(path), str(tmp_path / "cache"))  # cached: nothing to say
    assert caplog.messages == []
