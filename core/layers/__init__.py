"""Model building blocks: the attention call site, linears, rotary, norms."""
from .activation import SiluAndMul
from .attention import PagedAttention
from .linear import Embedding, Linear, MergedLinear
from .norm import RMSNorm
from .rotary import RotaryEmbedding, apply_rotary, rope_parameters

__all__ = ["Embedding", "Linear", "MergedLinear", "PagedAttention", "RMSNorm", "RotaryEmbedding",
           "SiluAndMul", "apply_rotary", "rope_parameters"]
