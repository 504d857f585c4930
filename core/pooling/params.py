"""What one pooling (embedding) request asks beyond its prompt; validated once, torch-free."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ValidationError


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's PoolingParams, the fields an embeddings request sets.

    `dimensions`: keep the first n values of the embedding (Matryoshka), then normalise
    again; None: all of them. Whether the model may be cut is the model's to say
    (PoolingSpec.check_dimensions). `normalize`: L2-normalise; None: as the model says."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValidationError("dimensions must be a positive integer", "dimensions")
