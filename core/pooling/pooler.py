"""Each pooling request's hidden states, chunk by chunk, into its embedding.

The runner hands back the final hidden states of every pooling request's tokens in a step
(ModelRunner.last_pooling_hidden); a prompt may come in several chunks (decoders: chunked
prefill), so what pooling needs is kept between steps: the running sum for mean pooling, the
first token's state for CLS; the last token's is in the final chunk. In the step that computes
a prompt's last token the request's embedding is made: pooled in float32, cut to its
`dimensions` (Matryoshka) and L2-normalised when the model or the request says so (after the
cut, so a cut embedding has unit length too), as vLLM and sentence-transformers compute it."""
from __future__ import annotations

from array import array
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..scheduling.output import ScheduledRequest
from ..scheduling.request import EngineCoreOutput, FinishReason, Request
from .spec import PoolingSpec


class Pooler:
    def __init__(self, spec: PoolingSpec):
        self.spec = spec
        self._partial: dict[str, torch.Tensor] = {}  # request id -> mean: the running sum; cls: the first state

    def step(self, scheduled: tuple[ScheduledRequest, ...], hidden: dict[str, torch.Tensor],
             get_request: Callable[[str], Request | None]) -> list[EngineCoreOutput]:
        """The outputs of the pooling requests whose last prompt token this step computed (call it
        before the scheduler's update, which forgets them); the others' chunks are kept."""
        outputs = []
        for s in scheduled:
            rows = hidden.get(s.request_id)
            request = get_request(s.request_id)
            if rows is None or request is None:
                continue
            if s.num_computed_tokens == 0:  # a first chunk, or a recompute after preemption: start over
                self._partial.pop(s.request_id, None)
            pooled = self._add_chunk(s.request_id, rows)
            if s.seq_len == request.num_prompt_tokens:
                vector = self._finish(s.request_id, pooled, request.num_prompt_tokens)
                outputs.append(EngineCoreOutput(s.request_id, (), FinishReason.POOLED,
                                                embedding=self.embedding(vector, request)))
        return outputs

    def forget(self, request_id: str) -> None:
        """An aborted request's partial state."""
        self._partial.pop(request_id, None)

    def _add_chunk(self, request_id: str, rows: torch.Tensor) -> torch.Tensor | None:
        """Folds a chunk's states [n, hidden] in; returns the pooled state when the method can tell now."""
        method = self.spec.method
        if method == "last":
            return rows[-1].float()
        if method == "cls":
            if request_id not in self._partial:
                self._partial[request_id] = rows[0].float()
            return self._partial[request_id]
        total = rows.float().sum(dim=0)
        if request_id in self._partial:
            total += self._partial[request_id]
        self._partial[request_id] = total
        return total

    def _finish(self, request_id: str, pooled: torch.Tensor, num_tokens: int) -> torch.Tensor:
        self._partial.pop(request_id, None)
        return pooled / num_tokens if self.spec.method == "mean" else pooled

    def embedding(self, vector: torch.Tensor, request: Request) -> array:
        """The request's embedding of a pooled state: cut to its dimensions, normalised as asked."""
        params = request.pooling
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        if self.spec.normalizes(params):
            vector = F.normalize(vector, p=2.0, dim=0)
        return array("f", vector.cpu().numpy().tobytes())
