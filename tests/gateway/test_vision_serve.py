"""Images in, text out, served (gateway/media, core/multimodal): a tiny random-weight Idefics3
behind the real gateway, driven by the OpenAI SDK, Anthropic's and TGI's bodies over HTTP.

In-process: one engine thread and several uvicorn apps on it, each with its own MediaPolicy.
As a user runs it: `switchyard serve` with the engine in its own process (the images cross its
pipe), the flags that allow a URL fetch from a local http server."""
from __future__ import annotations

import asyncio
import base64
import http.server
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from served_engine import start_engine, stop_engine
from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from switchyard.core.testing.serving import free_port, serve_on_loop, wait_healthy
from switchyard.core.testing.tiny_vlm import png_bytes, tiny_idefics3
from switchyard.gateway.app import create_app
from switchyard.gateway.media import MediaPolicy
from switchyard.gateway.settings import ServerSettings

MODEL = "tiny-idefics3"


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A valid PNG header claiming width x height, with almost no data behind it."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-idefics3")
    tiny_idefics3(path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    config = EngineConfig(model=ModelConfig(model=str(model_dir)), cache=CacheConfig(num_blocks=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=512))
    client = start_engine(config)
    yield client
    stop_engine(client)


@pytest.fixture(scope="module")
def serve(engine):
    """serve(MediaPolicy) -> base URL of a uvicorn app over the module's engine."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    servers = []

    def start(media: MediaPolicy = MediaPolicy()) -> str:
        app = create_app(ServerSettings(model_id=MODEL, media=media), engine)
        server, url = serve_on_loop(app, loop)
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.should_exit = True
    time.sleep(0.3)


@pytest.fixture(scope="module")
def image_host():
    """A local http server: /img.png (an image), /redirect (to /img.png on `localhost`)."""
    image = png_bytes(48, 40, seed=3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            if self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_port}/img.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def image_chat(url: str, text: str = "what is this?", count: int = 1) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for _ in range(count)]
    return {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]}


def test_openai_sdk_sends_a_data_url_and_gets_an_answer(serve):
    from openai import OpenAI

    client = OpenAI(base_url=serve() + "/v1", api_key="unused")
    url = data_url(png_bytes(64, 48, seed=1))
    reply = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "describe it"}]}])
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 6
    text_only = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "user", "content": [{"type": "text", "text": "describe it"}]}]).usage.prompt_tokens
    assert reply.usage.prompt_tokens >= text_only + 20  # 4 tiles and a global view of 4 image tokens each
    again = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": "describe it"}]}])
    assert again.choices[0].message.content == reply.choices[0].message.content
    other = data_url(png_bytes(64, 48, seed=2))
    answers = {client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}},
                                     {"type": "text", "text": "describe it"}]}]).choices[0].message.content
        for u in (url, other)}
    assert len(answers) == 2  # the image decides the answer



def test_langchain_and_llamaindex_send_images_and_get_the_sdks_answer(serve):
    """LangChain's ChatOpenAI (OpenAI's image_url part and langchain-core's own image block) and
    LlamaIndex's OpenAILike (an ImageBlock of bytes) send the same picture as the OpenAI SDK, and
    get its greedy answer; another picture changes the answer, so the image did reach the model."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage, ImageBlock, TextBlock
    from llama_index.llms.openai_like import OpenAILike
    from openai import OpenAI

    base = serve() + "/v1"
    picture, other = png_bytes(64, 48, seed=5), png_bytes(64, 48, seed=6)

    def sdk(data: bytes) -> str:
        return OpenAI(base_url=base, api_key="unused").chat.completions.create(
            model=MODEL, max_tokens=6, temperature=0, messages=[{"role": "user", "content": [
                {"type": "text", "text": "describe it"},
                {"type": "image_url", "image_url": {"url": data_url(data)}}]}]).choices[0].message.content

    expected = sdk(picture)
    text_only = OpenAI(base_url=base, api_key="unused").chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "describe it"}]).choices[0].message.content
    assert expected and expected != sdk(other) and expected != text_only

    chat = ChatOpenAI(base_url=base, api_key="unused", model=MODEL, temperature=0, max_tokens=6, max_retries=0)
    openai_part = {"type": "image_url", "image_url": {"url": data_url(picture)}}
    core_block = {"type": "image", "base64": base64.b64encode(picture).decode(), "mime_type": "image/png"}
    for part in (openai_part, core_block):
        message = HumanMessage(content=[{"type": "text", "text": "describe it"}, part])
        assert chat.invoke([message]).content == expected
        assert "".join(chunk.content for chunk in chat.stream([message])) == expected

    llm = OpenAILike(model=MODEL, api_base=base, api_key="unused", temperature=0.0, max_tokens=6, max_retries=0,
                     is_chat_model=True)
    blocks = [TextBlock(text="describe it"), ImageBlock(image=picture, image_mimetype="image/png")]
    assert llm.chat([ChatMessage(role="user", blocks=blocks)]).message.content == expected
    streamed = "".join(r.delta or "" for r in llm.stream_chat([ChatMessage(role="user", blocks=blocks)]))
    assert streamed == expected

BAD_IMAGES = {
    "truncated png": (data_url(png_bytes(64, 48)[:200]), "could not be read"),
    "decompression bomb": (data_url(bomb_png()), "pixels"),
    "text labelled png": (data_url(b"this is not an image at all"), "could not be read"),
    "not base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "not an image type": (data_url(png_bytes(8, 8), "text/plain"), "not an image"),
}


def test_bad_images_are_400s_naming_the_part_and_a_text_request_is_unaffected(serve):
    base = serve()

    def text_request():
        return httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "hello there"}]})

    expected_text = text_request().json()["choices"][0]["message"]["content"]
    cases = dict(BAD_IMAGES)
    cases["100 images"] = (data_url(png_bytes(8, 8)), "at most 8")
    with ThreadPoolExecutor(4) as pool:
        text = pool.submit(text_request)
        answers = {name: pool.submit(httpx.post, base + "/v1/chat/completions", timeout=60,
                                     json=image_chat(url, count=100 if name == "100 images" else 1))
                   for name, (url, _) in cases.items()}
        for name, future in answers.items():
            response = future.result()
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert cases[name][1] in error["message"], (name, error)
            assert error["param"].startswith("messages.0.content."), (name, error)
        assert text.result().status_code == 200
        assert text.result().json()["choices"][0]["message"]["content"] == expected_text


def test_url_fetching_is_off_by_default_and_loopback_needs_its_own_allowance(serve, image_host):
    url = image_host + "/img.png"
    refused = httpx.post(serve() + "/v1/chat/completions", json=image_chat(url), timeout=60)
    assert refused.status_code == 400 and "--allowed-media-domains" in refused.json()["error"]["message"]
    host_only = serve(MediaPolicy(allowed_domains=("127.0.0.1",)))
    loopback = httpx.post(host_only + "/v1/chat/completions", json=image_chat(url), timeout=60)
    assert loopback.status_code == 400 and "loopback" in loopback.json()["error"]["message"]
    allowed = serve(MediaPolicy(allowed_domains=("127.0.0.1",), allow_private_networks=True))
    fetched = httpx.post(allowed + "/v1/chat/completions", json=image_chat(url), timeout=60)
    assert fetched.status_code == 200, fetched.text
    inline = httpx.post(allowed + "/v1/chat/completions", timeout=60,
                        json=image_chat(data_url(png_bytes(48, 40, seed=3))))
    assert fetched.json()["choices"][0]["message"] == inline.json()["choices"][0]["message"]
    redirected = httpx.post(allowed + "/v1/chat/completions", json=image_chat(image_host + "/redirect"), timeout=60)
    assert redirected.status_code == 400 and "'localhost' is not allowed" in redirected.json()["error"]["message"]


def test_anthropic_responses_and_tgi_read_images(serve):
    base = serve()
    picture = png_bytes(64, 48, seed=5)
    chat = httpx.post(base + "/v1/chat/completions", timeout=60,
                      json=image_chat(data_url(picture), text="what is this?")).json()
    expected = chat["choices"][0]["message"]["content"]
    anthropic = httpx.post(base + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}}]}]})
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == expected
    for detail in ("high", "low"):  # "low": one unsplit view of the image (ImageData.split), as chat's
        responses = httpx.post(base + "/v1/responses", timeout=60, json={
            "model": MODEL, "max_output_tokens": 6, "temperature": 0, "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": data_url(picture), "detail": detail}]}]})
        assert responses.status_code == 200, responses.text
        if detail == "low":
            low = image_chat(data_url(picture), text="what is this?")
            low["messages"][0]["content"][1]["image_url"]["detail"] = "low"
            low = httpx.post(base + "/v1/chat/completions", timeout=60, json=low).json()
            assert low["usage"]["prompt_tokens"] < chat["usage"]["prompt_tokens"]
            expected = low["choices"][0]["message"]["content"]
        assert responses.json()["output"][0]["content"][0]["text"] == expected
    expected = chat["choices"][0]["message"]["content"]
    bad = httpx.post(base + "/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="}}]}]})
    assert bad.status_code == 400 and bad.json()["type"] == "error"
    assert "messages.0.content.0" in bad.json()["error"]["message"]
    bad_responses = httpx.post(base + "/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "what is this?"},
            {"type": "input_image", "image_url": data_url(b"not an image")}]}]})
    assert bad_responses.status_code == 400 and bad_responses.json()["error"]["param"] == "input.0.content.1"
    tgi = httpx.post(base + "/generate", timeout=60, json={
        "inputs": f"![]({data_url(picture)})what is this?", "parameters": {"max_new_tokens": 4, "details": True}})
    assert tgi.status_code == 200, tgi.text
    assert tgi.json()["details"]["generated_tokens"] >= 1
    tgi_bad = httpx.post(base + "/generate", timeout=60, json={
        "inputs": f"![]({data_url(b'not an image')})what is this?", "parameters": {"max_new_tokens": 4}})
    assert tgi_bad.status_code == 422 and "could not be read" in tgi_bad.json()["error"]


@pytest.mark.slow
def test_switchyard_serve_fetches_an_allowed_url_through_the_engine_process(model_dir, image_host):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "switchyard.gateway.cli", "serve", "--model", str(model_dir), "--hostname",
         "127.0.0.1", "--port", str(port), "--max-batch-total-tokens", "4096", "--enforce-eager",
         "--served-model-name", MODEL,
         "--allowed-media-domains", "127.0.0.1", "--allow-private-media-urls", "--limit-mm-per-prompt",
         '{"image": 2}'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 240)
        from openai import OpenAI

        client = OpenAI(base_url=base + "/v1", api_key="unused")
        fetched = client.chat.completions.create(**image_chat(image_host + "/img.png"))
        inline = client.chat.completions.create(**image_chat(data_url(png_bytes(48, 40, seed=3))))
        assert fetched.choices[0].message.content == inline.choices[0].message.content
        too_many = httpx.post(base + "/v1/chat/completions", json=image_chat(data_url(png_bytes(8, 8)), count=3),
                              timeout=60)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "messages.0.content.3"
    finally:
        proc.terminate()
        proc.wait(30)
