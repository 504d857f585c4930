"""Images in, text out (docs/vision.md).

inputs.py (torch-free, ground floor: the gateway and the scheduler import it): an image as the
gateway hands it over (`ImageData`: the validated bytes and their content hash) and where it sits
in a prompt once the engine has expanded its placeholder (`ImageSpan`). The engine side:
processor.py (the model's image processor and its placeholder expansion, at add_request, memoised
by image), pixels.py (an image's frames, made only when the vision tower needs them),
encoder_cache.py (image embeddings by content hash, so a chunked prompt encodes an image once)
and splice.py (a step's image embeddings written over its placeholder tokens' input embeddings).
"""
