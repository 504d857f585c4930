"""An engine client that writes what a script says, for tests of what the routes make of a
model's output (nothing can be downloaded here): the real app (starlette's TestClient, no
socket), pipeline and dialects over the default model's tokenizer with another chat template.

Each script piece is encoded into its tokens and decoded back as the engine's detokenizer
would (special tokens skipped unless the request keeps them), so token counts, special-token
markers and the end-of-sequence text behave as they do with a real model. The client keeps
what it was asked: the requests (prompt ids, sampling params) and the grammars compiled."""
from __future__ import annotations

from collections.abc import Callable

from switchyard.core.engine.client_base import EngineClient, RequestStream
from switchyard.core.engine.messages import EngineInfo
from switchyard.core.scheduling.request import FinishReason, RequestOutput
from switchyard.core.text.serving_tokenizer import ServingTokenizer

EOS_TEXT = "<|im_end|>"  # the default model's end of sequence
MODEL = "reasoner"


def reasoning_tokenizer(template: str, special: tuple[str, ...] = (), added: tuple[str, ...] = ()) -> ServingTokenizer:
    """The default model's tokenizer as the gateway holds it, with `template` as its chat
    template, `special` added as special tokens and `added` as plain added tokens (Qwen3's
    <think> is one, Magistral's [THINK] the other)."""
    from tokenizers import AddedToken, Tokenizer

    from switchyard.core.config import ModelConfig
    from switchyard.core.loader import load_hf_tokenizer

    hf = load_hf_tokenizer(ModelConfig())
    backend = Tokenizer.from_str(ServingTokenizer.from_transformers(hf).tokenizer_json)
    if added:
        backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    if special:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special])
    special_ids = list(hf.all_special_ids) + [backend.token_to_id(token) for token in special]
    return ServingTokenizer(backend.to_str(), template, hf.special_tokens_map, special_ids).build()


class ScriptedEngineClient(EngineClient):
    """`script(request)` gives each request's output as text pieces, one engine output each;
    the last ends with `finish_reason`."""

    def __init__(self, tokenizer, script: Callable[[object], list[str]],
                 finish_reason: FinishReason = FinishReason.EOS, max_model_len: int = 8192):
        self.tokenizer = tokenizer
        self.script = script
        self.finish_reason = finish_reason
        eos = tokenizer.convert_tokens_to_ids(EOS_TEXT)
        self.info = EngineInfo(backend="scripted", num_kv_blocks=4096, block_size=16, max_model_len=max_model_len,
                               eos_token_ids=(eos,))
        self.requests: list = []
        self.grammars: list = []

    async def add_requests(self, requests):
        streams = []
        for request in requests:
            self.requests.append(request)
            stream = RequestStream(request, self.abort)
            skip = request.sampling_params.skip_special_tokens
            pieces = list(self.script(request)) or [""]
            num_output_tokens = 0
            for i, piece in enumerate(pieces):
                ids = tuple(self.tokenizer.encode(piece, add_special_tokens=False))
                num_output_tokens += len(ids)
                last = i == len(pieces) - 1
                stream.put(RequestOutput(request.request_id, ids, self.tokenizer.decode(list(ids), skip),
                                         last, self.finish_reason if last else None, request.num_prompt_tokens,
                                         num_output_tokens))
            streams.append(stream)
        return streams

    def abort(self, request_id: str) -> None:
        pass

    async def compile_grammar(self, spec) -> None:
        self.grammars.append(spec)

    @property
    def ready(self) -> bool:
        return True

    def prompt_text(self) -> str:
        """The last request's prompt, special tokens and all."""
        return self.tokenizer.decode(list(self.requests[-1].prompt_token_ids), skip_special_tokens=False)


def scripted_app(engine: EngineClient, **settings):
    """A TestClient of the app over `engine` (use it as a context manager); `settings`:
    ServerSettings fields."""
    from starlette.testclient import TestClient

    from switchyard.gateway.app import create_app
    from switchyard.gateway.settings import ServerSettings

    return TestClient(create_app(ServerSettings(model_id=MODEL, **settings), engine))
