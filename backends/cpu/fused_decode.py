"""Steps through csrc/decode_layers.cpp: every decoder layer in C++, with no Python and no small
torch op between the embedding and the LM head.

A model that declares the Llama decoder shape (core/models/layout.py: `decoder_layout()`)
is turned, after prepare_model, into one `DecodeLayers` object holding each layer's norms and
linear kernels (`linear_operands`: the modules prepare_model left in place, which the C++
calls the same way their forward does). `FusedDecodeRunner` then runs a step as embedding ->
rotary tables -> DecodeLayers.forward -> LM head: every step of a model with block-format weights
(prompt chunks and mixed steps too, each token a decode row: runner.py), and the decode-only
steps of a float model, whose other steps (prompt chunks, mixed steps, prompt logprobs) run
through the model's forward. `fused_program` says why
a model cannot run this way (its layout, a linear kind, a dtype, a missing kernel); the
backend then falls back to the compiled graphs or to eager steps, with the reason logged.

The C++ rounds as the eager layers do (see the source's header): greedy output agrees with
the eager engine's token for token in the tests, and logits agree within float rounding.

LoRA adapters (core/lora): once the loader wraps the targeted layers and sets the runner's
`lora`, `lora_program` gives the program each wrapped linear's stacks (the tensors the
LoraManager writes adapters into, so loads and evictions need nothing more), and a step with
adapter rows runs in C++ too, its LoraBatch's token slots passed to `forward`: each linear's
deltas through csrc/lora.h, the arithmetic of the wrappers' kernel calls. The output head's
adapter is the wrapped lm_head's, as on every path; only an adapter of the embedding (which the
program's caller embeds with the base layer) sends steps with adapter rows to the model's layers.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
from torch import nn

from switchyard.core.layers import Linear
from switchyard.core.lora.layers import LoraEmbedding, LoraLinear
from switchyard.core.models.layout import DecoderLayout

from .extension import DECODE_LAYERS_SOURCE, ExtensionBuild, build_extension
from .linear import PackedLinear
from .quant import BlockLinear, Int4Linear, Int8Linear, QuantizedLinear
from .runner import CpuModelRunner

DENSE, ONEDNN, BLOCKS, INT8, INT4, ROWS = range(6)  # csrc/decode_layers.cpp's linear kinds
_NONE = torch.empty(0)

logger = logging.getLogger(__name__)


def describe() -> str:
    """For `switchyard backends`: what a server start does with decode steps of Llama-layout models."""
    return ("decode-only steps of Llama-layout models (llama, mistral, qwen2, qwen3, phi3): every layer in C++ "
            "(fused decode layers, built at first start; no compiling at start); other models")


def load_decode_layers(cache_root: str, isa: str = "auto") -> ExtensionBuild:
    """The extension, unavailable (with the reason) when it did not build or registered no
    DecodeLayers class (a binary built against another torch's ABI loads without it)."""
    build = build_extension(cache_root, DECODE_LAYERS_SOURCE, "CPU fused decode layers",
                            "decode steps run the model's layers", (), isa)
    if build.available:
        try:
            getattr(torch.classes, build.name).DecodeLayers
        except (AttributeError, RuntimeError) as error:
            return replace(build, ops=None, reason=f"the binary has no DecodeLayers class ({error})"[:300])
    return build


def linear_operands(module: nn.Module, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | str:
    """(tensors [weight, aux, bias, batch, order], ints [kind, out_features, mode (blocks: activation
    passes), batch_rows, single_row_matvec]) of one linear module, as the C++ Linear takes them; or why it has none.
    order: an act-order weight's input columns (QuantizedLinear.input_order), else empty."""
    operands = _kernel_operands(module, dtype)
    if isinstance(operands, str):
        return operands
    order = module.input_order if isinstance(module, QuantizedLinear) else None
    tensors, ints = operands
    return tensors + [_NONE if order is None else order], ints


def _kernel_operands(module: nn.Module, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]] | str:
    bias = getattr(module, "bias", None)  # every kind below has a `bias` (None or a tensor)
    bias = _NONE if bias is None else bias.detach()
    if isinstance(module, PackedLinear) and module.rows_ops is not None:
        weight, batch = module._rows_weight, module._packed_batch
        return [weight, _NONE, bias, batch], [ROWS, module.out_features, 0, module.rows_limit, 0]
    if isinstance(module, PackedLinear):
        batch = module._packed_batch
        return [module._packed_one_row, _NONE, bias, batch], [ONEDNN, module.out_features, 0, 1, 0]
    if isinstance(module, QuantizedLinear):
        batch = _NONE if module.batch is None else module.batch._packed_batch
        rows = -1 if module.batch is None else module.batch_rows
        if isinstance(module, BlockLinear):  # the integer kernel for any number of rows
            return [module.packed, module.segments, bias, _NONE], [BLOCKS, module.out_features, module.passes, -1, 0]
        if isinstance(module, Int8Linear):
            return [module.qweight, module.scales, bias, batch], [INT8, module.out_features, 0, rows, 0]
        if isinstance(module, Int4Linear):
            return [module.packed, module.scales_and_zeros, bias, batch], [INT4, module.out_features, 0, rows, 0]
    if isinstance(module, Linear) and module.quantized is None and module.weight.dtype == dtype:
        matvec = module.single_row_matvec
        matvec = dtype in (torch.bfloat16, torch.float16) if matvec is None else matvec
        return [module.weight.detach(), _NONE, bias, _NONE], [DENSE, module.out_features, 0, -1, int(matvec)]
    return f"no fused path for {type(module).__name__}"


def fused_program(layout: DecoderLayout | None, build: ExtensionBuild, dtype: torch.dtype):
    """The DecodeLayers object of a model, or a string saying why it has none."""
    if layout is None:
        return "the model does not declare the Llama decoder layout"
    if not build.available:
        return f"the fused decode kernel is unavailable ({build.reason})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"no fused path in {dtype}"
    program = getattr(torch.classes, build.name).DecodeLayers(
        layout.hidden_size, layout.num_heads, layout.num_kv_heads, layout.head_dim, layout.rotary_dim, layout.eps, layout.scale,
        layout.soft_cap or 0.0, layout.norm.weight.detach())
    for parts in layout.layers:
        tensors, ints = [], []
        for module in (parts.qkv, parts.o, parts.gate_up, parts.down):
            operands = linear_operands(module, dtype)
            if isinstance(operands, str):
                return operands
            tensors += operands[0]
            ints += operands[1]
        norms = [parts.input_norm.weight, parts.post_norm.weight,
                 _NONE if parts.q_norm is None else parts.q_norm.weight,
                 _NONE if parts.k_norm is None else parts.k_norm.weight]
        program.add_layer([n.detach() for n in norms], tensors, ints + [parts.sliding_window or 0])
    return program


def lora_program(program, layout: DecoderLayout, model: nn.Module) -> str | None:
    """Gives `program` the stacks of every wrapped linear of the layout (core/lora/layers.py
    LoraLinear, wrapping the very modules the program multiplies); None, or why steps with adapter
    rows must run the model's layers instead."""
    if any(isinstance(m, LoraEmbedding) for m in model.modules()):
        return "an adapter of the embedding"
    wrappers = {id(m.base): m for m in model.modules() if isinstance(m, LoraLinear)}
    for index, parts in enumerate(layout.layers):
        for linear, module in enumerate((parts.qkv, parts.o, parts.gate_up, parts.down)):
            wrapper = wrappers.get(id(module))
            if wrapper is None:
                continue
            stacks = wrapper.stacks
            shared = stacks[0].shared_a
            program.add_lora(index, linear, _NONE if shared is None else shared, [s.a for s in stacks],
                             [s.b for s in stacks], [s.scales for s in stacks],
                             [n for s in stacks for n in (s.target.part, s.target.start, s.target.stop)])
    return None


class FusedDecodeRunner(CpuModelRunner):
    """ModelRunner whose steps run the model's DecodeLayers program (see above): every step where
    the model multiplies block-format weights (each token a decode row, runner.py), and decode-only
    steps otherwise; the rest run the model's forward."""

    def __init__(self, model: nn.Module, backend, kv_caches: list[torch.Tensor], block_size: int,
                 layout: DecoderLayout, program) -> None:
        self.layout, self.program = layout, program
        self.lora_fallback: str | None = None  # why steps with adapter rows run the model's layers
        super().__init__(model, backend, kv_caches, block_size)
        self.num_fused_steps = 0

    @property
    def lora(self):
        return self._lora

    @lora.setter
    def lora(self, manager) -> None:
        """The LoraManager (core/lora), set once the layers are wrapped: their stacks join the program."""
        self._lora = manager
        if manager is not None:
            self.lora_fallback = lora_program(self.program, self.layout, self.model)
            logger.info("CPU fused decode layers: %s", "LoRA deltas in C++ too" if self.lora_fallback is None else
                        f"steps with LoRA adapter rows run the model's layers ({self.lora_fallback})")

    def forward(self, step) -> torch.Tensor:
        # a float model's step with prompt tokens or prompt logprobs runs the model's forward
        decode_rows = step.meta.num_decodes == step.input_ids.shape[0] and not step.prompt_logits_spans
        if (not (self.by_row or decode_rows) or (step.lora is not None and self.lora_fallback is not None)
                or step.meta.window_anchors is not None):  # the C++ layers' windows end at seq_len - 1
            return super().forward(step)
        meta = step.meta  # one decode row per query token (core/execution/runner.py build_step_input)
        hidden = self.layout.embed(step.input_ids).contiguous()
        cos, sin = self.layout.rotary(step.positions, hidden.dtype)
        self.num_fused_steps += 1
        return self.program.forward(hidden, cos, sin, self.kv_caches, meta.slot_mapping, meta.block_table,
                                    meta.seq_lens, _NONE if step.lora is None else step.lora.token_slots)
