"""The gRPC API (gateway/grpc) driven by a client generated from its proto: TGIS's
fmaas.GenerationService through the same pipeline as HTTP, health, reflection, the API key,
errors as status codes, and a cancelled stream freeing its KV blocks.

The gRPC server runs on its own event loop thread over the session's engine, beside the
uvicorn app of the same settings (tests/gateway/conftest.py), whose service and drain it uses."""
from __future__ import annotations

import asyncio
import math
import re
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from switchyard.gateway.drain import Drain
from switchyard.gateway.grpc.proto import generation_pb2 as pb
from switchyard.gateway.grpc.proto import generation_pb2_grpc as pb_grpc
from switchyard.gateway.grpc.server import GrpcServer
from switchyard.gateway.metrics import Metrics
from switchyard.gateway.service import GenerationService
from switchyard.gateway.settings import ServerSettings



MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default model (conftest.py)
PROMPT = "The capital of France is"


class _Loop:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="test-grpc").start()

    def run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="module")
def grpc_loop():
    return _Loop()


@pytest.fixture(scope="module")
def start_grpc(start_server, grpc_loop):
    """start_grpc(**ServerSettings fields) -> (RunningServer, GrpcServer, channel)."""
    opened = []

    def start(**overrides):
        http_server = start_server(**overrides)
        server = GrpcServer(http_server.app.state.service, http_server.app.state.drain, "127.0.0.1", 0)
        grpc_loop.run(server.start())
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        opened.append((server, channel))
        return http_server, server, channel

    yield start
    for server, channel in opened:
        channel.close()
        grpc_loop.run(server.stop())


@pytest.fixture(scope="module")
def grpc_default(start_grpc):
    return start_grpc()


@pytest.fixture()
def stub(grpc_default):
    return pb_grpc.GenerationServiceStub(grpc_default[2])


def greedy(max_new_tokens=8, **response) -> pb.Parameters:
    return pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
                         response=pb.ResponseOptions(**response))


def test_generate_matches_http_generate(stub, grpc_default):
    http_server = grpc_default[0]
    answer = stub.Generate(pb.BatchedGenerationRequest(
        model_id=MODEL_NAME, requests=[pb.GenerationRequest(text=PROMPT), pb.GenerationRequest(text="1, 2, 3,")],
        params=greedy(8)), timeout=120)
    assert len(answer.responses) == 2
    for response, prompt in zip(answer.responses, (PROMPT, "1, 2, 3,")):
        body = httpx.post(http_server.base_url + "/generate", timeout=120, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 8, "do_sample": False, "details": True}}).json()
        assert response.text == body["generated_text"]
        assert response.generated_token_count == body["details"]["generated_tokens"]
        assert response.input_token_count == len(http_server.client.tokenizer.encode(prompt))
        assert response.stop_reason == (pb.MAX_TOKENS if body["details"]["finish_reason"] == "length"
                                        else pb.EOS_TOKEN)
        assert response.seed == 0  # greedy: no seed
    http_server.wait_idle()


def test_generate_stream_tokens_identical_to_generate_stream(stub, grpc_default):
    http_server = grpc_default[0]
    tokenizer = http_server.client.tokenizer
    messages = list(stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPT),
        params=greedy(12, generated_tokens=True, token_logprobs=True, input_text=True)), timeout=120))
    head, steps = messages[0], messages[1:]
    assert head.input_token_count == len(tokenizer.encode(PROMPT)) and head.text == PROMPT and not head.tokens
    grpc_tokens = [(token, step.text if i == len(step.tokens) - 1 else "")
                   for step in steps for i, token in enumerate(step.tokens)]

    events = []
    with httpx.stream("POST", http_server.base_url + "/generate_stream", timeout=120, json={
            "inputs": PROMPT, "parameters": {"max_new_tokens": 12, "do_sample": False, "details": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                import json
                events.append(json.loads(line[5:]))
    assert len(grpc_tokens) == len(events) == 12
    for (token, text), event in zip(grpc_tokens, events):
        assert tokenizer.convert_tokens_to_ids(token.text) == event["token"]["id"]
        if not event["token"]["special"]:
            assert text == event["token"]["text"]
        assert token.logprob == pytest.approx(event["token"]["logprob"], abs=1e-4)
    assert "".join(step.text for step in steps) == events[-1]["generated_text"]
    assert [step.generated_token_count for step in steps] == list(range(1, 13))
    assert steps[-1].stop_reason == pb.MAX_TOKENS
    assert all(step.stop_reason == pb.NOT_FINISHED for step in steps[:-1])
    http_server.wait_idle()


def test_stream_details_ranks_and_input_tokens(stub, grpc_default):
    tokenizer = grpc_default[0].client.tokenizer
    messages = list(stub.GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPT),
        params=greedy(4, generated_tokens=True, token_logprobs=True, token_ranks=True, top_n_tokens=2,
                      input_tokens=True)), timeout=120))
    head = messages[0]
    ids = tokenizer.encode(PROMPT)
    assert [tokenizer.convert_tokens_to_ids(t.text) for t in head.input_tokens] == ids
    assert math.isnan(head.input_tokens[0].logprob) and head.input_tokens[1].logprob < 0
    tokens = [t for m in messages[1:] for t in m.tokens]
    assert len(tokens) == 4
    for token in tokens:  # greedy: every token is the likeliest
        assert token.rank == 1 and len(token.top_tokens) == 2
        assert token.top_tokens[0].text == token.text
        assert token.top_tokens[0].logprob == pytest.approx(token.logprob, abs=1e-4)


def test_stop_sequence_and_seed(stub, grpc_default):
    free = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                     params=greedy(16)), timeout=120).responses[0]
    stop = free.text.strip().split()[1]  # a word of the greedy answer
    for include in (True, False):
        params = greedy(16)
        params.stopping.stop_sequences.append(stop)
        params.stopping.include_stop_sequence = include
        response = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                             params=params), timeout=120).responses[0]
        assert response.stop_reason == pb.STOP_SEQUENCE and response.stop_sequence == stop
        assert response.text.endswith(stop) == include
        assert free.text.startswith(response.text)
    sampled = pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.8, seed=1234),
                            stopping=pb.StoppingCriteria(max_new_tokens=6))
    again = pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=0.8),
                          stopping=pb.StoppingCriteria(max_new_tokens=6))
    first = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                      params=sampled), timeout=120).responses[0]
    drawn = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                      params=again), timeout=120).responses[0]
    assert first.seed == 1234 and drawn.seed != 0
    again.sampling.seed = drawn.seed  # the seed reported reproduces the answer
    assert stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                     params=again), timeout=120).responses[0].text == drawn.text


def test_guided_decoding(stub):
    regex = greedy(12)
    regex.decoding.regex = r"[0-9]{3}"
    response = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="A number: ")],
                                                         params=regex), timeout=120).responses[0]
    assert re.fullmatch(r"[0-9]{3}", response.text) and response.stop_reason == pb.EOS_TOKEN
    choice = greedy(12)
    choice.decoding.choice.choices.extend(["yes", "no"])
    response = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="Is water wet? ")],
                                                         params=choice), timeout=120).responses[0]
    assert response.text in ("yes", "no")


def test_time_limit(stub, grpc_default):
    params = greedy(1000)
    params.stopping.time_limit_millis = 300
    params.stopping.min_new_tokens = 999  # no EOS first: on an idle machine the answer ends within 300 ms
    started = time.monotonic()
    response = stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)],
                                                         params=params), timeout=120).responses[0]
    assert response.stop_reason == pb.TIME_LIMIT and response.generated_token_count < 1000
    assert time.monotonic() - started < 20
    grpc_default[0].wait_idle()


def test_tokenize_and_model_info(stub, grpc_default):
    tokenizer = grpc_default[0].client.tokenizer
    text = "Hello gRPC world"
    response = stub.Tokenize(pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)],
                                                       return_tokens=True, return_offsets=True), timeout=30)
    ids = tokenizer.encode(text)
    entry = response.responses[0]
    assert entry.token_count == len(ids) and list(entry.tokens) == tokenizer.convert_ids_to_tokens(ids)
    assert "".join(text[o.start:o.end] for o in entry.offsets).replace(" ", "") == text.replace(" ", "")
    short = stub.Tokenize(pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=text)],
                                                    truncate_input_tokens=2, return_tokens=True), timeout=30)
    assert list(short.responses[0].tokens) == tokenizer.convert_ids_to_tokens(ids)[-2:]
    info = stub.ModelInfo(pb.ModelInfoRequest(model_id=MODEL_NAME), timeout=30)
    limits = grpc_default[0].app.state.service.limits
    assert info.model_kind == pb.ModelInfoResponse.DECODER_ONLY
    assert info.max_sequence_length == limits.max_total_tokens


@pytest.mark.parametrize(("params", "field"), [
    (pb.Parameters(response=pb.ResponseOptions(top_n_tokens=99)), "top_n_tokens"),
    (pb.Parameters(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=-1.0)), "temperature"),
    (pb.Parameters(decoding=pb.DecodingParameters(regex="(unclosed")), "regex"),
    (pb.Parameters(decoding=pb.DecodingParameters(grammar="root ::= 'a'")), "grammar"),
    (pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=9)), "min_new_tokens"),
    (pb.Parameters(stopping=pb.StoppingCriteria(max_new_tokens=10_000_000)), "max_new_tokens"),
])
def test_bad_parameter_is_invalid_argument(stub, params, field):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=params),
                      timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()


def test_empty_and_too_many_requests(stub):
    for requests in ([], [pb.GenerationRequest(text="a")] * 5, [pb.GenerationRequest(text="")]):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(pb.BatchedGenerationRequest(requests=requests, params=greedy(2)), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_and_reflection(grpc_default):
    channel = grpc_default[2]
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "fmaas.GenerationService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10))
    names = {s.name for s in answer.list_services_response.service}
    assert {"fmaas.GenerationService", "grpc.health.v1.Health"} <= names
    by_symbol = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="fmaas.GenerationService")]), timeout=10))
    assert by_symbol.file_descriptor_response.file_descriptor_proto


def test_api_key(start_grpc):
    _, _, channel = start_grpc(api_key="sekrit")
    stub = pb_grpc.GenerationServiceStub(channel)
    request = pb.ModelInfoRequest()
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfo(request, metadata=metadata, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.ModelInfo(request, metadata=(("authorization", "Bearer sekrit"),), timeout=10).max_sequence_length
    health = health_pb2_grpc.HealthStub(channel)  # health stays open, as /health does
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_overload_is_resource_exhausted(start_grpc):
    _, _, channel = start_grpc(max_concurrent_requests=0)
    with pytest.raises(grpc.RpcError) as caught:
        pb_grpc.GenerationServiceStub(channel).Generate(
            pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PROMPT)], params=greedy(2)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_cancelled_stream_aborts_and_frees_blocks(stub, grpc_default):
    http_server = grpc_default[0]
    metrics = http_server.app.state.metrics
    call = stub.GenerateStream(pb.SingleGenerationRequest(request=pb.GenerationRequest(text=PROMPT),
                                                          params=greedy(400)), timeout=120)
    received = [next(call) for _ in range(3)]
    assert received[-1].generated_token_count >= 1
    assert http_server.kv_blocks_in_use() > 0
    call.cancel()
    http_server.wait_idle(timeout=10)  # aborted: no request and no KV block left
    deadline = time.monotonic() + 5
    while "tgi_request_failure" not in metrics.render() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 'err="incomplete_generation"' in metrics.render()


class _LoadingClient:
    """An engine client that never becomes ready (a model still loading)."""

    ready = False
    failure = None
    tokenizer = None

    async def wait_ready(self, timeout=None):
        await asyncio.Event().wait()

    async def wait_failure(self):
        await asyncio.Event().wait()


def test_not_serving_while_loading_and_when_draining(grpc_loop):
    service = GenerationService(_LoadingClient(), ServerSettings(model_id=MODEL_NAME), Metrics())
    drain = Drain(1.0)
    server = GrpcServer(service, drain, "127.0.0.1", 0)
    grpc_loop.run(server.start())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            stub = pb_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text="hi")]), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in caught.value.details()
            grpc_loop.loop.call_soon_threadsafe(drain.begin)
            time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as caught:
                stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in caught.value.details()
    finally:
        grpc_loop.run(server.stop())


def test_grpc_port_flag_and_checks():
    import argparse
    import socket

    from switchyard.core.params import ValidationError
    from switchyard.gateway.grpc.flags import add_grpc_flags, check_grpc

    parser = argparse.ArgumentParser()
    add_grpc_flags(parser, {})
    assert parser.parse_args([]).grpc_port is None  # off by default
    assert parser.parse_args(["--grpc-port", "50051"]).grpc_port == 50051
    parser = argparse.ArgumentParser()
    add_grpc_flags(parser, {"GRPC_PORT": "50052"})
    assert parser.parse_args([]).grpc_port == 50052
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValidationError, match="--grpc-port"):
            check_grpc("127.0.0.1", taken.getsockname()[1])


def test_stream_open_at_the_drain_deadline_ends_unavailable(start_grpc, grpc_loop):
    http_server, server, channel = start_grpc(graceful_shutdown_s=1.0)
    params = pb.Parameters(method=pb.GREEDY, stopping=pb.StoppingCriteria(max_new_tokens=1000, min_new_tokens=1000))
    call = pb_grpc.GenerationServiceStub(channel).GenerateStream(pb.SingleGenerationRequest(
        request=pb.GenerationRequest(text=PROMPT), params=params), timeout=120)  # still streaming at the deadline
    next(call)
    grpc_loop.loop.call_soon_threadsafe(server.drain.begin)
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "drain deadline" in caught.value.details()
    http_server.wait_idle(timeout=10)  # its request was aborted
