"""Progress of one run on stderr: a tqdm bar when tqdm is installed (huggingface-hub
brings it), else one plain line rewritten in place."""
from __future__ import annotations

import importlib
import sys
from typing import TextIO


class Progress:
    """Counts finished requests of one run (`advance` per request, `close` at the end)."""

    def __init__(self, description: str, total: int, stream: TextIO | None = None):
        self._description, self._total, self._done, self._errors = description, total, 0, 0
        self._stream = stream or sys.stderr
        self._bar = _tqdm_bar(description, total, self._stream)
        if self._bar is None:
            self._line()

    @property
    def uses_tqdm(self) -> bool:
        return self._bar is not None

    def advance(self, ok: bool = True) -> None:
        self._done += 1
        self._errors += 0 if ok else 1
        if self._bar is not None:
            self._bar.update(1)
            if self._errors:
                self._bar.set_postfix(errors=self._errors, refresh=False)
        else:
            self._line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._stream.write("\n")
            self._stream.flush()

    def _line(self) -> None:
        errors = f", {self._errors} errors" if self._errors else ""
        self._stream.write(f"\r{self._description}: {self._done}/{self._total} requests{errors}")
        self._stream.flush()


def _tqdm_bar(description: str, total: int, stream: TextIO):
    try:
        tqdm = importlib.import_module("tqdm").tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="req", file=stream, leave=True, dynamic_ncols=True)
