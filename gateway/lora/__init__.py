"""LoRA adapters as the gateway serves them (issue 41; the engine side is core/lora):
flags.py reads `--lora-adapters` (TGI) / `--lora-modules` and `--enable-lora` (vLLM) into the
engine's LoraConfig; adapters.py is one engine's adapters by name, as requests select them
(OpenAI `model`, TGI and gRPC `adapter_id`) and as the run-time routes change them; routes.py
is vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`."""
