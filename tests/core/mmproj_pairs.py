"""What the GGUF + mmproj pair tests of each family share (test_vision_mmproj.py: Idefics3,
test_vision_mmproj_gemma3.py: Gemma 3, test_vision_mmproj_qwen2_vl.py: Qwen2-VL, Qwen2.5-VL):
llama.cpp's converter where it is installed, test images, a refusal's one line, an engine on the
CPU, and the check that a processor made from an mmproj file's metadata prepares images as the
checkpoint's own."""
from __future__ import annotations

import os

import pytest
import torch

from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.loader import choose_model
from switchyard.core.loader.mmproj import MmprojError
from switchyard.core.multimodal.inputs import ImageData
from switchyard.core.multimodal.processor import decode_image
from switchyard.core.testing.tiny_vlm import png_bytes

PEERS = os.path.expanduser("~/.cache/switchyard-peers")
LLAMA_CPP = os.path.join(PEERS, "src", "llama_cpp_python-0.3.36", "vendor", "llama.cpp")
CONVERTER = os.path.join(LLAMA_CPP, "convert_hf_to_gguf.py")
CONVERT_PYTHON = os.path.join(PEERS, "convert-venv", "bin", "python")


def converter_present() -> bool:
    return os.path.isfile(CONVERTER) and os.access(CONVERT_PYTHON, os.X_OK)


def image(width: int, height: int, seed: int) -> ImageData:
    return ImageData.of(png_bytes(width, height, seed), width, height, "PNG")


def refusal(text: str, mmproj: str) -> str:
    """The one-line MmprojError of choosing the pair (text GGUF, mmproj file)."""
    with pytest.raises(MmprojError) as error:
        choose_model(ModelConfig(model=text, mmproj=mmproj, cache_dir=""))
    message = str(error.value)
    assert "\n" not in message
    return message


def engine(model_config: ModelConfig, num_blocks: int = 256):
    from switchyard.core.engine.core import EngineCore

    return EngineCore(EngineConfig(model=model_config, cache=CacheConfig(block_size=4, num_blocks=num_blocks),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=2048), backend="cpu"))


def assert_prepares_alike(made, saved) -> None:
    """Two ImageFamily objects give equal expansions and frames for images of several shapes."""
    for index, size in enumerate([(64, 48), (20, 30), (100, 33), (32, 32)]):
        picture = decode_image(image(*size, seed=index))
        (made_pixels, made_expansion), (saved_pixels, saved_expansion) = (made.prepare(picture, True),
                                                                          saved.prepare(picture, True))
        assert made_expansion == saved_expansion
        if hasattr(made_pixels, "grid"):  # Qwen2-VL's GridPatches: the grid, then the patches
            assert made_pixels.grid == saved_pixels.grid
            made_pixels, saved_pixels = made_pixels.patches, saved_pixels.patches
        torch.testing.assert_close(made_pixels, saved_pixels, atol=0, rtol=0)


def mmproj_writer(path, values: dict):
    """A gguf.GGUFWriter for an mmproj file at `path` with the metadata `values` written as
    llama.cpp's converter types them (a None value left out, as an older converter did); the
    caller adds the tensors and writes the file."""
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, int(value))
    return writer


def require_converter() -> None:
    """Skips the calling test or fixture where llama.cpp's converter is not installed."""
    if not converter_present():
        pytest.skip(f"llama.cpp's converter is not here ({CONVERTER} run by {CONVERT_PYTHON}); "
                    "the mapping is covered by the GGUFWriter tests")


def convert_all(directory: str, jobs: dict[str, tuple[str, ...]]) -> None:
    """Each output file (its flags) converted by llama.cpp's converter, the runs side by side."""
    import subprocess

    runs = {out: subprocess.Popen([CONVERT_PYTHON, CONVERTER, directory, "--outfile", out, *flags],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for out, flags in jobs.items()}
    for out, run in runs.items():
        _, stderr = run.communicate(timeout=600)
        assert run.returncode == 0, stderr[-3000:]


def greedy_answers(engine_core, batch) -> dict[str, tuple[list[int], list[float]]]:
    """Runs the requests `batch` together: {request id: (its tokens, their log-probabilities)}."""
    for request in batch:
        engine_core.add_request(request)
    out = {r.request_id: ([], []) for r in batch}
    while engine_core.has_unfinished_requests():
        for step in engine_core.step():
            out[step.request_id][0].extend(step.new_token_ids)
            out[step.request_id][1].extend(step.logprobs or ())
    return out
