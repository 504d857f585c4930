"""`switchyard download-weights MODEL_ID`, TGI's subcommand: a model's weights fetched
into the Hugging Face cache, where `switchyard serve --model-id MODEL_ID` then finds them
offline (core/loader/source.py never downloads).

- A safetensors repository: its `*.safetensors`, the index, config, generation config and
  tokenizer files (`snapshot_download` with allow patterns).
- A repository with only `pytorch_model*.bin`: those, then converted to safetensors beside
  them as TGI does (core/loader/convert.py; `--no-convert` keeps the `.bin` only).
- A GGUF file: `--gguf-file FILE`, or `MODEL_ID:FILE` / `MODEL_ID:QUANT` as llama.cpp's
  `-hf` and Ollama's `hf.co/` names write it (`:Q4_K_M` picks the one `.gguf` whose name
  holds that tag; a split GGUF's parts all come).

huggingface_hub does the transfer and reads its own environment: HF_TOKEN, HF_HOME /
HF_HUB_CACHE, HF_ENDPOINT, HF_HUB_OFFLINE (already-cached weights are then reported, and
nothing else is fetched). A dropped connection is resumed with a Range request by
huggingface_hub. Every failure is one line, exit 2 (DownloadError): an id that is not a Hub
repository id is refused before any lookup (`check_repo_id`), online or offline."""
from __future__ import annotations

import argparse
import fnmatch
import os
import re
import sys
from dataclasses import dataclass

# what a model directory needs besides its weights: configs, tokenizers, chat templates
SIDE_FILES = ("*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt", "*.jinja")
SAFETENSORS = ("*.safetensors",)
PYTORCH_BIN = ("pytorch_model*.bin",)
_SPLIT_GGUF = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


class DownloadError(Exception):
    """A download that cannot be done, said in one line."""


@dataclass(frozen=True)
class DownloadPlan:
    """What to fetch of one repository, decided once from the command line and its file list."""
    repo_id: str
    revision: str | None
    patterns: tuple[str, ...] = ()  # snapshot_download's allow patterns (weights and side files)
    gguf_files: tuple[str, ...] = ()  # or these files, with hf_hub_download
    convert: bool = False  # pytorch_model*.bin to safetensors afterwards


def split_model_id(model_id: str, gguf_file: str | None) -> tuple[str, str | None]:
    """(repo id, GGUF file or quant tag): `--gguf-file` or a `:FILE` / `:QUANT` suffix. The
    repo id is checked here, as the Hub spells one, before anything is looked up."""
    repo_id, sep, tail = model_id.partition(":")
    if sep and gguf_file:
        raise DownloadError(f"{model_id!r} names a GGUF file and so does --gguf-file {gguf_file!r}; give one")
    if repo_id.startswith("hf.co/"):  # Ollama's spelling of a Hub GGUF
        repo_id = repo_id[len("hf.co/"):]
    if sep and not tail:
        raise DownloadError(f"{model_id!r}: nothing after ':' (a GGUF file name or a quant such as Q4_K_M)")
    check_repo_id(repo_id)
    return repo_id, gguf_file or tail or None


def check_repo_id(repo_id: str) -> None:
    """DownloadError unless `repo_id` is a Hub repository id (org/name or name), in one line:
    huggingface_hub's own rule, so an id it would refuse never reaches a lookup, online or off."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        local = " (a local directory or file needs no download: give it to serve --model-id)" \
            if os.path.exists(repo_id) else ""
        raise DownloadError(f"invalid model id {repo_id!r}, expected org/name as on the Hub{local}: "
                            f"{_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def choose_gguf(repo_id: str, wanted: str, files: list[str]) -> tuple[str, ...]:
    """The repository's GGUF file(s) that `wanted` names: the file itself, or the one whose
    name holds the quant tag (every part of a split file, `-00001-of-00003.gguf`)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if wanted in ggufs:
        chosen = [wanted]
    elif wanted.lower().endswith(".gguf"):
        raise DownloadError(f"{repo_id} has no file {wanted!r}; its GGUF files: {ggufs or 'none'}")
    else:
        tag = wanted.lower()
        chosen = [f for f in ggufs if re.search(rf"(^|[-_.]){re.escape(tag)}([-_.]|$)",
                                                os.path.basename(f).lower())]
        if not chosen:
            raise DownloadError(f"{repo_id} has no GGUF file for {wanted!r}; its GGUF files: {ggufs or 'none'}")
    first = _SPLIT_GGUF.sub("", chosen[0])
    if any(_SPLIT_GGUF.sub("", f) != first for f in chosen):
        raise DownloadError(f"{wanted!r} names several GGUF files in {repo_id}: {chosen}; name one with --gguf-file")
    return tuple(chosen)


def plan_download(repo_id: str, revision: str | None, gguf: str | None, files: list[str],
                  convert: bool = True) -> DownloadPlan:
    """The one decision of what to fetch, from the repository's file names."""
    if gguf is not None:
        return DownloadPlan(repo_id, revision, gguf_files=choose_gguf(repo_id, gguf, files))

    def matching(patterns):
        return [f for f in files if any(fnmatch.fnmatch(os.path.basename(f), p) for p in patterns)]

    if matching(SAFETENSORS):
        return DownloadPlan(repo_id, revision, patterns=SAFETENSORS + SIDE_FILES)
    if matching(PYTORCH_BIN):
        return DownloadPlan(repo_id, revision, patterns=PYTORCH_BIN + SIDE_FILES, convert=convert)
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if ggufs:
        raise DownloadError(f"{repo_id} holds GGUF files only; name one with --gguf-file or "
                            f"{repo_id}:FILE (or :QUANT such as Q4_K_M): {ggufs}")
    raise DownloadError(f"{repo_id} holds no weights switchyard reads (*.safetensors, pytorch_model*.bin "
                        f"or .gguf); its files: {sorted(files)}")


def download(plan: DownloadPlan) -> str:
    """Fetch what the plan names into the Hugging Face cache; returns the local path
    (the snapshot directory, or the GGUF file: what --model-id takes)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    if plan.gguf_files:
        paths = [hf_hub_download(plan.repo_id, name, revision=plan.revision) for name in plan.gguf_files]
        return paths[0]
    directory = snapshot_download(plan.repo_id, revision=plan.revision, allow_patterns=list(plan.patterns))
    if plan.convert:
        from switchyard.core.loader.convert import convert_directory

        for path in convert_directory(directory):
            print(f"converted {os.path.basename(path)}", file=sys.stderr)
    return directory


def _cached(repo_id: str, revision: str | None, gguf: str | None) -> str:
    """HF_HUB_OFFLINE: what the cache already holds (nothing is fetched)."""
    from huggingface_hub import constants, snapshot_download

    from switchyard.core.loader.source import incomplete_snapshot_errors

    try:
        directory = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except incomplete_snapshot_errors() as partial:  # fetched with allow patterns, as download() does
        directory = partial.snapshot_path
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and its kin: not cached
        raise DownloadError(f"HF_HUB_OFFLINE is set and {repo_id} is not in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}); unset it to download") from exc
    files = [os.path.relpath(os.path.join(root, name), directory)
             for root, _, names in os.walk(directory) for name in names]
    plan = plan_download(repo_id, revision, gguf, files, convert=False)
    if plan.gguf_files:
        return os.path.join(directory, plan.gguf_files[0])
    if not any(fnmatch.fnmatch(os.path.basename(f), "*.safetensors") for f in files):
        raise DownloadError(f"HF_HUB_OFFLINE is set and the cached {repo_id} holds no safetensors; "
                            "unset it to download and convert")
    return directory


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, revision=revision)
    return [sibling.rfilename for sibling in info.siblings or ()]


def _one_line(exc: Exception, repo_id: str, revision: str | None) -> str:
    """huggingface_hub's and the transport's failures, each said in one line."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HFValidationError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = constants.ENDPOINT
    if isinstance(exc, HFValidationError):  # an argument huggingface_hub refuses (a revision, a file name)
        return f"{repo_id}: {_first_line(exc)}"
    if isinstance(exc, GatedRepoError):
        return f"{repo_id} is gated: accept its terms on {where} and set HF_TOKEN"
    if isinstance(exc, RepositoryNotFoundError):
        return f"model {repo_id!r} not found on {where} (a private repository needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id}"
    if isinstance(exc, OfflineModeIsEnabled):
        return "HF_HUB_OFFLINE is set; unset it to download"
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return f"{repo_id}: {_first_line(exc)}"
    cause = exc.__cause__ if isinstance(exc, LocalEntryNotFoundError) and exc.__cause__ else exc
    detail = _first_line(cause) if str(cause).strip() else "no detail"
    return (f"cannot download from {where} ({type(cause).__name__}: {detail}); check the network and "
            "HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use what is cached")


def _transport_error() -> type[Exception]:
    """The connection failures of huggingface_hub's HTTP client (httpx2; httpx before it)."""
    try:
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError
    return TransportError


def run_download(args: argparse.Namespace) -> int:
    from huggingface_hub import constants
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError, OfflineModeIsEnabled

    try:
        repo_id, gguf = split_model_id(args.model_id, args.gguf_file)
        if constants.HF_HUB_OFFLINE:
            path = _cached(repo_id, args.revision, gguf)
        else:
            try:
                plan = plan_download(repo_id, args.revision, gguf, _repo_files(repo_id, args.revision),
                                     convert=not args.no_convert)
                path = download(plan)
            except (HfHubHTTPError, EntryNotFoundError, HFValidationError, OfflineModeIsEnabled,
                    _transport_error()) as exc:
                raise DownloadError(_one_line(exc, repo_id, args.revision)) from exc
    except DownloadError as error:
        print(f"switchyard: error: download-weights: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


def add_download_command(commands, formatter_class=argparse.HelpFormatter) -> None:
    """The `download-weights` subcommand, on `switchyard`'s subparsers (cli.py passes its formatter)."""
    parser = commands.add_parser(
        "download-weights", formatter_class=formatter_class,
        help="fetch a model's weights into the Hugging Face cache (TGI's subcommand)",
        description="Fetch a model's safetensors (a .bin checkpoint is converted to safetensors) or one GGUF "
        "file into the Hugging Face cache, for `switchyard serve --model-id MODEL_ID` to find offline. "
        "huggingface_hub reads HF_TOKEN, HF_HOME, HF_ENDPOINT and HF_HUB_OFFLINE. Prints the local path.")
    parser.add_argument("model_id", metavar="MODEL_ID",
                        help="a Hub repository (org/name); org/name:FILE.gguf or org/name:QUANT (Q4_K_M) for a GGUF")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--gguf-file", default=None,
                        help="fetch this GGUF file of the repository (or a quant tag, Q4_K_M) instead of safetensors")
    parser.add_argument("--no-convert", action="store_true",
                        help="keep a pytorch_model*.bin checkpoint as it is (default: converted to safetensors, "
                        "which serve needs)")
    parser.set_defaults(run=run_download)


__all__ = ["DownloadError", "DownloadPlan", "add_download_command", "check_repo_id", "choose_gguf", "download",
           "plan_download", "run_download", "split_model_id"]
