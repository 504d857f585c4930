"""Window anchors (AttentionMetadata.window_anchors, core/multimodal/image_rows.py): which steps
carry them (image rows of a model whose image tokens attend both ways, on a backend that declares
Capabilities.window_anchors), what each row's anchor is, and the one line a backend without them
logs. The kernels' side: tests/backends/test_cpu_attention.py, test_triton_kernels.py,
test_cuda_backend.py; the engine's: tests/core/test_vision_gemma3.py."""
from __future__ import annotations

import logging
import types

import torch

from switchyard.core.backend import AttentionSpec, Capabilities
from switchyard.core.execution.runner import build_step_input
from switchyard.core.multimodal.image_rows import window_anchors_wanted
from switchyard.core.multimodal.inputs import ImageSpan
from switchyard.core.scheduling.output import ScheduledRequest, SchedulerOutput
from switchyard.core.testing.reference_backend import ReferenceBackend

SPAN = ImageSpan(offset=10, length=8, content_hash="x", embed_offsets=(2, 3, 4, 5))  # image tokens 12-15


def step(*scheduled: ScheduledRequest) -> SchedulerOutput:
    return SchedulerOutput(scheduled=scheduled)


def request(request_id: str, start: int, count: int, images: tuple = ()) -> ScheduledRequest:
    return ScheduledRequest(request_id, tuple(range(1, count + 1)), start, tuple(range(1, 9)), samples=True,
                            images=images)


def test_image_rows_carry_their_own_positions_as_anchors():
    """A decode, a chunk with an image (rows; its image's rows see up to 15), a text chunk."""
    scheduled = step(request("text", 0, 5), request("image", 8, 10, (SPAN,)), request("decode", 20, 1))
    meta = build_step_input(scheduled, 4, torch.device("cpu"), bidirectional_images=True, window_anchors=True).meta
    assert meta.seq_lens_cpu == (9, 10, 11, 12, 16, 16, 16, 16, 17, 18, 21, 5)
    assert meta.window_anchors_cpu == (8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 4)
    assert meta.window_anchors.dtype == torch.int32
    assert meta.window_anchors.tolist() == list(meta.window_anchors_cpu)


def test_no_anchors_where_not_wanted_or_not_needed():
    """Not asked (the backend does not honour them), not a both-ways model, or no image in the step."""
    with_image = step(request("image", 8, 10, (SPAN,)), request("decode", 20, 1))
    for meta in (build_step_input(with_image, 4, torch.device("cpu"), bidirectional_images=True).meta,
                 build_step_input(with_image, 4, torch.device("cpu"), window_anchors=True).meta,
                 build_step_input(step(request("text", 0, 5), request("decode", 20, 1)), 4, torch.device("cpu"),
                                  bidirectional_images=True, window_anchors=True).meta):
        assert meta.window_anchors is None and meta.window_anchors_cpu is None


class Backend:
    name = "fake"

    def __init__(self, anchors: bool, vision: bool = True):
        self.anchors, self.vision, self.asked = anchors, vision, 0

    def capabilities(self) -> Capabilities:
        self.asked += 1
        return Capabilities(dtypes=("float32",), block_sizes=(4,), window_anchors=self.anchors,
                            vision_encoders=self.vision)


def model(bidirectional: bool, windows: tuple) -> types.SimpleNamespace:
    specs = [AttentionSpec(num_heads=2, num_kv_heads=1, head_dim=4, block_size=4, scale=1.0, sliding_window=w)
             for w in windows]
    return types.SimpleNamespace(bidirectional_images=bidirectional, attention_specs=specs)


def test_wanted_only_for_both_ways_images_with_sliding_layers_on_a_declaring_backend(caplog):
    caplog.set_level(logging.WARNING, logger="switchyard.core.multimodal.image_rows")
    text_model = Backend(False)
    assert not window_anchors_wanted(model(False, (4, None)), text_model) and text_model.asked == 0
    assert not window_anchors_wanted(model(True, (None, None)), Backend(False))
    assert not window_anchors_wanted(model(True, (4, None)), Backend(False, vision=False))  # images refused
    assert not caplog.records  # nothing is approximate there
    assert window_anchors_wanted(model(True, (4, None)), Backend(True))
    assert window_anchors_wanted(model(True, (4, None)), ReferenceBackend())  # its attention honours them
    assert not caplog.records
    assert not window_anchors_wanted(model(True, (4, None)), Backend(False))
    assert len(caplog.records) == 1
    assert "backend fake" in caplog.records[0].getMessage()
    assert "image tokens past the sliding window are attended approximately" in caplog.records[0].getMessage()
