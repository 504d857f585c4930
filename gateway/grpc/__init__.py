"""The gRPC API: TGIS's `fmaas.GenerationService` (Generate, GenerateStream, Tokenize,
ModelInfo), gRPC health checking and reflection, on `--grpc-port`, served on the HTTP
server's own event loop through the same request pipeline as the HTTP routes.

Only `flags.py` is imported without the `grpc` extra; the rest needs grpcio."""
