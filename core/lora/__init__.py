"""LoRA adapters served over the base model, many in one continuous batch (issue 41).

kernel.py: the plain-torch reference of the batched low-rank kernel (Backend.lora_kernel's
contract, core/backend_contract.py LoraKernel) that every backend's kernel is checked against.
"""
