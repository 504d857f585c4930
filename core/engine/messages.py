"""What crosses between the engine's owner (the gateway, or an offline caller) and the
engine loop: commands one way, events the other. Torch-free and picklable: the same
messages go through a queue (engine in a thread) or a pipe (engine in its own process).

Outputs are batched per step: one `StepDone` carries every request's output of a step,
the engine's load after it and the step's stats."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ..errors import EngineDeadError
from ..pooling.spec import PoolingSpec
from ..scheduling.request import Request, RequestOutput

if TYPE_CHECKING:
    from ..grammar.spec import GrammarSpec


@dataclass(frozen=True)
class EngineInfo:
    backend: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    speculate: int = 0  # proposed tokens a decode may verify per step (0: no speculative decoding)
    isa: str = ""  # the instruction-set level the backend's kernels run at (Backend.kernel_isa)
    activations: str = ""  # how its integer kernels round activations (Backend.quantized_activations)
    # served for embeddings: how the model pools (core/pooling/spec.py); None: it generates
    pooling: PoolingSpec | None = None
    # LoRA adapters (core/lora): the names served at start; None: adapters are off
    lora_adapters: tuple[str, ...] | None = None
    # images in (core/multimodal): the placeholder text a prompt carries for each image (the
    # model's image token, e.g. "<image>"); None: the model (or its backend) reads text only
    image_token: str | None = None

    @property
    def max_batch_total_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now: published after every step and every command it applies
    (an abort frees blocks with no step after it), so metrics are true when idle."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, reported to the gateway's metrics."""

    load: EngineLoad  # after the step
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decodes: int
    duration_s: float
    # prefix cache, over this step's admissions: prompt tokens looked up, and found cached
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # speculative decoding, in this step: proposed tokens verified, and of them accepted
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0


# -- commands (owner -> engine loop) ------------------------------------------------------
@dataclass(frozen=True)
class AddRequests:
    """Add all or none, before the next step; answered by `Settled(token, error)`."""

    token: int
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class CompileGrammar:
    """Compile on the engine's grammar workers; answered by `Settled(token, error)`."""

    token: int
    spec: GrammarSpec


@dataclass(frozen=True)
class LoadLora:
    """Load the PEFT adapter at `path` as `name` (core/lora); answered by `Settled(token, error)`."""

    token: int
    name: str
    path: str


@dataclass(frozen=True)
class UnloadLora:
    """Stop serving adapter `name` to new requests; answered by `Settled(token, error)`."""

    token: int
    name: str


@dataclass(frozen=True)
class Stop:
    pass


Command = Union[AddRequests, Abort, CompileGrammar, LoadLora, UnloadLora, Stop]


# -- events (engine loop -> owner) ---------------------------------------------------------
@dataclass(frozen=True)
class ModelChecked:
    """The engine process found the model and the path it takes (before loading it)."""

    description: str


@dataclass(frozen=True)
class Ready:
    """Loaded and warmed up. `tokenizer` is the engine's, as the gateway holds it
    (core/text/serving_tokenizer.py; pickled across a process)."""

    info: EngineInfo
    tokenizer: object
    load: EngineLoad


@dataclass(frozen=True)
class StartupFailed:
    error: BaseException


@dataclass(frozen=True)
class Settled:
    """The answer to a command with a token: None, or the error to raise to its caller."""

    token: int
    error: BaseException | None


@dataclass(frozen=True)
class StepDone:
    outputs: tuple[RequestOutput, ...]
    load: EngineLoad
    stats: StepStats


@dataclass(frozen=True)
class StepFailed:
    """One step raised: these requests are failed, the engine keeps serving."""

    request_ids: tuple[str, ...]
    error: BaseException
    load: EngineLoad


@dataclass(frozen=True)
class LoadChanged:
    load: EngineLoad


@dataclass(frozen=True)
class Dead:
    """The engine cannot go on (a shard ended, its loop failed); its last event."""

    error: BaseException


Event = Union[ModelChecked, Ready, StartupFailed, Settled, StepDone, StepFailed, LoadChanged, Dead]


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling (same type, same message on the other side), else an
    EngineDeadError that names it: an exception is never lost for not pickling."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return EngineDeadError(f"{type(error).__name__}: {error}")
