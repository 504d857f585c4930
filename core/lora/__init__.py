"""LoRA adapters served over the base model, many in one continuous batch (issue 41).

adapter.py: a PEFT adapter directory, read and checked against the model (LoraAdapterError);
gguf_adapter.py: llama.cpp's LoRA GGUF file, read into the same adapter; sources.py: which of the two;
targets.py: the layers an adapter may change, and PEFT's module names mapped onto our fused ones;
stacks.py: a target's resident adapters stacked by slot; manager.py: the adapters served, their
slots (LRU), load/unload, the prefix-cache salt; layers.py: the wrappers of the targeted layers;
context.py and batch.py: a step's LoraBatch and how it reaches the wrappers; attach.py: LoRA put on
a loaded model; kernel.py: the plain-torch reference of the batched low-rank kernel
(Backend.lora_kernel's contract, core/backend_contract.py LoraKernel) that every backend's kernel
is checked against. docs/architecture.md says how a step uses them.
"""
