"""The transformers fallback: any `AutoModelForCausalLM` architecture with no native
code runs transformers' own modules, with attention routed through our paged KV cache
and the backend's kernels.

transformers' attention modules call the function registered under
`config._attn_implementation` with (module, query, key, value, mask, **kwargs). We
register one, `switchyard_paged`, and a mask function that builds no mask (the
kernel knows the per-request layout from AttentionMetadata). The whole step is one
flat token batch of batch size 1: every scheduled token of every request, positions
passed as position_ids; the attention function writes the new keys/values into the
layer's paged cache with the kernel's `write_kv` and attends with its `forward`.

The per-step state (kv caches, metadata) lives on the wrapper instance, set for the
duration of one forward; each attention module holds a small `_Site` pointing at its
layer, its kernel and that state, so two engines never share anything.

Per-layer attention specs are not guessed from the config: one discovery pass of a
single token records what each attention module hands to the attention function
(head counts and size from the tensors, `scaling`, `sliding_window`, `softcap` from
the kwargs, as transformers' own attention functions read them). The same pass checks
that every layer routes its attention through the interface.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from ..backend_contract import AttentionKernel, AttentionMetadata, AttentionSpec
from ..layers import Linear, PagedAttention
from ..layers.parallel import NO_TP, TensorParallel
from ..params import ValidationError
from .base import CausalLM
from .errors import UnsupportedModelError
from .plain_config import transformers_config

ATTENTION_NAME = "switchyard_paged"
_SITE_ATTR = "_switchyard_site"
# Checkpoint tensors that are buffers recomputed at construction, never parameters.
_IGNORED_PATTERNS = (r"rotary_emb\.inv_freq$", r"\.attn\.(masked_)?bias$", r"\.attention\.(masked_)?bias$")


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query [1, H, T, D], key/value
    [1, Hkv, T, D] -> ([1, T, H, D], no weights)."""
    site = module.__dict__.get(_SITE_ATTR)
    if site is None:
        raise RuntimeError(f"{type(module).__name__} was not prepared by TransformersForCausalLM")
    return site(module, query, key, value, kwargs), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_attention() -> None:
    """Registers `switchyard_paged` with transformers' attention and mask interfaces
    (idempotent; the registered functions are stateless)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


@dataclass
class _Step:
    """What one forward attends with; set by TransformersForCausalLM.forward only."""
    kv_caches: list[torch.Tensor] | None = None
    meta: AttentionMetadata | None = None


class _Site:
    """One attention module's layer index and call site (PagedAttention: write_kv, then
    the kernel's forward), and the owning model's step."""

    def __init__(self, layer: int, attention: PagedAttention, step: _Step):
        self.layer, self.attention, self.step = layer, attention, step

    def __call__(self, module, query, key, value, kwargs) -> torch.Tensor:
        def flat(x: torch.Tensor) -> torch.Tensor:  # [1, heads, T, D] -> [T, heads, D]
            return x[0].transpose(0, 1).contiguous()

        out = self.attention(flat(query), flat(key), flat(value), self.step.kv_caches[self.layer], self.step.meta)
        return out.unsqueeze(0)


@dataclass
class _Discovery:
    """Records, in call order, what each attention module passes in a one-token pass."""
    block_size: int
    dtype: torch.dtype
    modules: list[nn.Module] = field(default_factory=list)
    specs: list[AttentionSpec] = field(default_factory=list)

    def __call__(self, module, query, key, value, kwargs) -> torch.Tensor:
        if any(module is seen for seen in self.modules):
            raise UnsupportedModelError(f"{type(module).__name__} runs attention twice in one forward; "
                                        "the transformers fallback cannot page its KV cache")
        if getattr(module, "is_causal", True) is False:
            raise UnsupportedModelError(f"{type(module).__name__} attends bidirectionally; Switchyard runs "
                                        "causal language models only")
        if kwargs.get("s_aux") is not None:
            raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks, which the paged "
                                        "kernels do not implement")
        head_dim = query.shape[-1]
        scaling = kwargs.get("scaling")
        self.modules.append(module)
        self.specs.append(AttentionSpec(
            num_heads=query.shape[1], num_kv_heads=key.shape[1], head_dim=head_dim, block_size=self.block_size,
            scale=float(scaling) if scaling is not None else head_dim ** -0.5, dtype=self.dtype,
            sliding_window=kwargs.get("sliding_window"), soft_cap=kwargs.get("softcap")))
        return torch.zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1],
                           dtype=query.dtype, device=query.device)


def build_hf_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """transformers' model for `config`, on the current torch.device, parameters
    allocated but not initialised (they are loaded next); ties shared weights."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from . import needs_remote_code

    register_attention()
    # selection (models/__init__.py) refused remote code unless the user trusted it
    trust = needs_remote_code(config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION_NAME, dtype=dtype,
                                                 trust_remote_code=trust)
    model.tie_weights()
    adopt_linears(model)
    return model.eval()


def adopt_linears(model: nn.Module) -> int:
    """Swaps every plain nn.Linear for our Linear holding the same parameters (tied ones
    stay tied), so a backend treats them as it treats native models' projections (the
    CPU backend packs them for oneDNN). Returns how many were swapped."""
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, module in targets:
        with torch.device("meta"):
            ours = Linear(module.in_features, module.out_features, bias=module.bias is not None)
        ours.weight = module.weight
        ours.bias = module.bias
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, ours)
    return len(targets)


def _logit_transform(config: Any):
    """The scaling a CausalLM head applies after lm_head (outside the base model)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    divisor = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling

    def transform(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * scale
        if divisor is not None:
            logits = logits / divisor
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        return logits

    return transform


class TransformersForCausalLM(CausalLM):
    """The interface of models/llama.py's LlamaForCausalLM around transformers' modules.
    Build it under `with torch.device(device):`; weights are loaded afterwards."""

    def __init__(self, config: Any, make_kernel, block_size: int, dtype: torch.dtype,
                 tp: TensorParallel = NO_TP):
        super().__init__()
        if tp.sharded:
            raise ValidationError(f"model {getattr(config, 'model_type', '?')} runs through the transformers "
                                  f"fallback, which cannot be sharded: use --num-shard 1 (not {tp.world_size})",
                                  "num_shard")
        self.config = config = transformers_config(config)
        self.hf = build_hf_model(config, dtype)
        self._step = _Step()
        modules, specs = self._discover(block_size, dtype)
        self.attention_specs = specs
        kernels: dict[AttentionSpec, AttentionKernel] = {}
        for spec in specs:
            if spec not in kernels:
                kernels[spec] = make_kernel(spec)
        # the call sites, one per layer, registered here so backends find them as in native models
        self.attention = nn.ModuleList(PagedAttention(kernels[spec]) for spec in specs)
        for layer, module in enumerate(modules):
            setattr(module, _SITE_ATTR, _Site(layer, self.attention[layer], self._step))
        self._transform_logits = _logit_transform(config)

    @torch.no_grad()
    def _discover(self, block_size: int, dtype: torch.dtype) -> tuple[list[nn.Module], list[AttentionSpec]]:
        discovery = _Discovery(block_size, dtype)
        everything = list(self.hf.modules())
        for module in everything:
            setattr(module, _SITE_ATTR, discovery)
        try:
            device = self.hf.get_input_embeddings().weight.device
            one = torch.zeros((1, 1), dtype=torch.long, device=device)
            self.hf.base_model(input_ids=one, position_ids=one, use_cache=False)
        finally:
            for module in everything:
                module.__dict__.pop(_SITE_ATTR, None)
        expected = getattr(self.config, "num_hidden_layers", None)
        name = type(self.hf).__name__
        if not discovery.modules or (expected is not None and len(discovery.modules) != expected):
            raise UnsupportedModelError(
                f"{name} routes {len(discovery.modules)} of {expected} layers' attention through transformers' "
                "AttentionInterface; the transformers fallback needs all of them")
        first = discovery.specs[0]
        if any((s.num_kv_heads, s.head_dim) != (first.num_kv_heads, first.head_dim) for s in discovery.specs):
            raise UnsupportedModelError(f"{name} has layers of different key/value shapes; the paged KV cache "
                                        "holds one shape")
        return discovery.modules, discovery.specs

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden] (the base model's output)."""
        self._step.kv_caches, self._step.meta = kv_caches, meta
        try:
            out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            self._step.kv_caches = self._step.meta = None
        return out[0][0]

    def decoder_layout(self) -> None:
        """Not the Llama decoder shape of core/models/layout.py: backends run its layers as written."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 [N, vocab], as the CausalLM head computes them."""
        return self._transform_logits(self.hf.get_output_embeddings()(hidden)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (checkpoint name, tensor) pairs into transformers' parameters (and
        persistent buffers). Names go through transformers' own checkpoint renamings
        (legacy names, a missing or extra base-model prefix); returns the loaded names as
        this wrapper's named_parameters() spells them. Unknown names raise."""
        targets = dict(self.hf.named_parameters())
        targets.update(dict(self.hf.named_buffers()))
        tied = set(getattr(self.hf, "all_tied_weights_keys", None) or {}) - set(targets)
        rename = _checkpoint_renamer(self.hf, targets)
        ignored = [re.compile(p) for p in (*_IGNORED_PATTERNS, *(self.hf._keys_to_ignore_on_load_unexpected or ()))]
        loaded: set[str] = set()
        for name, tensor in weights:
            key = rename(name)
            if key in tied or (key not in targets and any(p.search(name) for p in ignored)):
                continue
            if key not in targets:
                raise ValueError(f"checkpoint weight {name!r} has no matching parameter in {type(self.hf).__name__}")
            target = targets[key]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.data.copy_(tensor)
            loaded.add(f"hf.{key}")
        return loaded


def _checkpoint_renamer(model: nn.Module, targets: dict[str, Any]):
    """checkpoint name -> parameter name, with transformers' renamings of this model. A
    name that needs one of its tensor-merging converters (e.g. per-expert weights into
    fused experts) raises: the fallback loads tensors one by one."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def rename(name: str) -> str:
        key, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, targets)
        if converter is not None and name not in targets:
            raise UnsupportedModelError(f"checkpoint weight {name!r} needs transformers' conversion {converter!r}, "
                                        "which the transformers fallback does not apply")
        return key

    return rename
