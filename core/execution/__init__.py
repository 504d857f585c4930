"""Running one step: the model runner, decode-only static batches, sampling."""
