"""A GGUF file's metadata is converted once into a small Hugging Face directory (config.json
and the tokenizer files) kept in a cache; the weights are always read from the GGUF file itself
(mapped, core/loader/gguf_packed.py), never copied.

Parsing a GGUF's metadata with transformers takes ~8 s per pass for a 49k-token vocabulary,
and the config and the tokenizer each need a pass; the converted directory loads in ~1 s. The
conversion says so up front and every few seconds while it runs. The first load also keeps the
file's tensor table and names there (gguf_index.py).

Beside transformers' own files (config.json, the tokenizer's), the directory keeps the config as
plain attributes (core/models/plain_config.py) and the tokenizer as a ServingTokenizer
(core/text/serving_tokenizer.py): what a cached start's engine reads, with no transformers import.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import tempfile
import threading

from ..config import default_cache_root  # noqa: F401 - where callers have found it
from ..engine.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

FORMAT_VERSION = 3  # bump when the conversion changes, so stale caches are ignored (3: plain config, tokenizer)
_DONE_MARK = ".switchyard-converted"




def converted_directory(gguf_path: str, cache_root: str) -> str:
    """The config-and-tokenizer directory of `gguf_path`, converted on first use."""
    stat = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
                         .encode()).hexdigest()[:16]
    name = os.path.splitext(os.path.basename(gguf_path))[0]
    target = os.path.join(cache_root, "gguf", f"{name}-{key}")
    if os.path.isfile(os.path.join(target, _DONE_MARK)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    sweep_stale_staging(os.path.dirname(target))
    logger.info("first start of this GGUF: reading its config and tokenizer once into %s (about half a minute, "
                "cached afterwards)", target)
    with _staging_folder(os.path.dirname(target), name) as staging, \
            Heartbeat(lambda s: logger.info("still reading the config and tokenizer of %s (%.0f s)", name, s)):
        _convert(gguf_path, staging)
        open(os.path.join(staging, _DONE_MARK), "w").close()
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not os.path.isfile(os.path.join(target, _DONE_MARK)):
                raise
    return target


# -- staging: a half-written conversion never survives its process ---------------------
_STAGING = re.compile(r"^\..+\.staging-(\d+)-")
_live_staging: set[str] = set()  # removed at exit, if a daemon thread was killed mid-conversion


@contextlib.contextmanager
def _staging_folder(parent: str, name: str):
    """A temporary folder named after this process, removed on any exception, on SIGTERM
    (when converting on the main thread, SIGTERM becomes SystemExit for the duration) and
    at interpreter exit; a folder a SIGKILL left behind is swept by the next start."""
    staging = tempfile.mkdtemp(prefix=f".{name}.staging-{os.getpid()}-", dir=parent)
    _live_staging.add(staging)
    previous = _exit_on_sigterm()
    try:
        yield staging
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _live_staging.discard(staging)
        shutil.rmtree(staging, ignore_errors=True)


def _exit_on_sigterm():
    """On the main thread, make SIGTERM raise SystemExit (so `finally` runs); returns the
    handler to restore, or None where signals cannot be handled (other threads)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise)


@atexit.register
def _remove_live_staging() -> None:
    for staging in list(_live_staging):
        shutil.rmtree(staging, ignore_errors=True)


def sweep_stale_staging(parent: str) -> list[str]:
    """Remove the staging folders in `parent` whose process is gone; returns them."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(parent):
            match = _STAGING.match(entry)
            if match and not _process_alive(int(match.group(1))):
                shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
                removed.append(entry)
    if removed:
        logger.info("removed %d staging folder(s) of interrupted conversions in %s", len(removed), parent)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _convert(gguf_path: str, out_dir: str) -> None:
    from ..text.serving_tokenizer import ServingTokenizer
    from .gguf_weights import load_gguf_config, load_gguf_tokenizer
    from ..models.plain_config import write_plain_config

    config = load_gguf_config(gguf_path)
    config.save_pretrained(out_dir)
    write_plain_config(config, out_dir)
    tokenizer = load_gguf_tokenizer(os.path.dirname(gguf_path), os.path.basename(gguf_path), config)
    tokenizer.save_pretrained(out_dir)
    if tokenizer.is_fast:
        ServingTokenizer.from_transformers(tokenizer).save(out_dir)
