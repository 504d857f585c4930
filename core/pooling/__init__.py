"""Pooling models: a prompt in, one vector out (embeddings), served by the same engine and
scheduler as generation.

- params.py: `PoolingParams`, what one request asks (dimensions, normalisation); torch-free.
- spec.py: `PoolingSpec`, how a model pools (last token, mean, CLS; normalised or not;
  Matryoshka sizes), decided once per model; torch-free, it crosses to the gateway.
- sentence_transformers.py, gguf_pooling.py: what a model's files say (modules.json and
  1_Pooling/config.json; a GGUF's `pooling_type`).
- decide.py: the one decision of how a model is served (`--task generate|embed|auto`) and how it pools.
- pooler.py: the hidden states of each request's prompt chunks into its embedding (torch).
- serving.py: what an engine that pools turns off (chunked prompts and compiled decode steps
  for encoders).

This package's __init__ imports nothing, so that its torch-free modules are imported alone."""
