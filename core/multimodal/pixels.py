"""An image's frames (the image processor's output), made at most once and only when the
vision tower has to run on them.

At add_request the engine needs an image's placeholder expansion, not its pixels; when the
expansion is already known (ImagePrompts' memo, by ImageData.key) the image processor does not
run there, and the span carries a `Pixels` that makes its frames when first asked
(`frames()`: the encoder-cache miss in splice.py, the one place pixels are consumed). Where
the prefix cache covers the image's tokens, or the encoder cache holds its embeddings, that
never happens. Torch-free (it holds what the engine's processor returns).

Crossing a process (a step's SchedulerOutput broadcast to the shard workers, core/shards), a
`Pixels` pickles as its frames: made then, in the engine's process, and kept."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Pixels:
    """An image's frames: given (`ready`) or made by `make` when first asked for (`later`)."""

    __slots__ = ("_frames", "_make")

    def __init__(self, frames: Any = None, make: Callable[[], Any] | None = None):
        if (frames is None) == (make is None):
            raise ValueError("Pixels takes frames or a way to make them, not both")
        self._frames = frames
        self._make = make

    @classmethod
    def ready(cls, frames: Any) -> Pixels:
        return cls(frames=frames)

    @classmethod
    def later(cls, make: Callable[[], Any]) -> Pixels:
        return cls(make=make)

    @property
    def made(self) -> bool:
        return self._frames is not None

    def frames(self) -> Any:
        if self._frames is None:
            self._frames = self._make()
            self._make = None
        return self._frames

    def __reduce__(self):
        return Pixels.ready, (self.frames(),)
