"""`switchyard download-weights` against a local Hugging Face Hub (HF_ENDPOINT): a
threaded HTTP server in the test serving what huggingface_hub's `model_info`,
`snapshot_download` and `hf_hub_download` ask for (huggingface_hub 1.x/2.x):

- `GET /api/models/{repo}/revision/{rev}`: id, commit sha, siblings;
- `GET /api/models/{repo}/tree/{commit}?recursive=...`: the file list (`path`, `size`, `oid`);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: `X-Repo-Commit`, `ETag`, `Content-Length`, and
  206 for a `Range: bytes=N-` request; 404s carry the Hub's `X-Error-Code`.

Each download runs the real CLI in a subprocess: huggingface_hub reads HF_HOME,
HF_ENDPOINT and HF_HUB_OFFLINE when it is imported. The repositories hold tiny
random-weight Llamas built here."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from switchyard.gateway.download import DownloadError, choose_gguf, plan_download, split_model_id

CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    """repo id -> {file name: bytes}, served as the Hub serves them; `drop_once` maps files
    whose first full GET is cut off (the connection closed), once, to how many bytes are sent."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.drop_once: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.handle(self, body=False)

            def do_GET(self):
                hub.handle(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def _error(self, handler, status: int, code: str):
        payload = json.dumps({"error": code}).encode()
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def _json(self, handler, value, body: bool):
        payload = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if body:
            handler.wfile.write(payload)

    def handle(self, handler, body: bool):
        path = handler.path.split("?")[0]
        self.requests.append((handler.command, path, handler.headers.get("Range")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        repo = (api or resolve).group(1) if (api or resolve) else None
        if repo not in self.repos:
            return self._error(handler, 404, "RepoNotFound")
        files = self.repos[repo]
        revision = api.group(3) if api else resolve.group(2)
        if revision not in (None, "main", COMMIT):
            return self._error(handler, 404, "RevisionNotFound")
        if api and api.group(2) == "tree":
            return self._json(handler, [{"type": "file", "path": name, "size": len(data),
                                         "oid": hashlib.sha1(data).hexdigest()} for name, data in files.items()], body)
        if api:
            return self._json(handler, {"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                        "siblings": [{"rfilename": name} for name in files]}, body)
        name = resolve.group(3)
        if name not in files:
            return self._error(handler, 404, "EntryNotFound")
        data = files[name]
        start = int(re.fullmatch(r"bytes=(\d+)-", handler.headers["Range"]).group(1)) \
            if handler.headers.get("Range") else 0
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if not body:
            return
        if name in self.drop_once and not start:
            handler.wfile.write(data[:self.drop_once.pop(name)])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(2)  # cut off mid-file
            return
        handler.wfile.write(data[start:])


@pytest.fixture()
def hub():
    server = Hub()
    yield server
    server.close()


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The same tiny Llama (tied embeddings) as a safetensors repo and as a sharded
    pytorch_model*.bin repo (with its index), plus the state dict they hold."""
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG, tie_word_embeddings=True), dtype=torch.float32)
    root = tmp_path_factory.mktemp("checkpoints")
    hf.save_pretrained(root / "st", safe_serialization=True)
    (root / "st" / "README.md").write_text("not a weight")
    (root / "st" / "tf_model.h5").write_bytes(b"not ours")
    state = hf.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    names = [name for name in state if name != "lm_head.weight"]
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    halves["pytorch_model-00001-of-00002.bin"] += ["lm_head.weight"]  # shares memory with the embeddings
    binary = root / "bin"
    binary.mkdir()
    hf.config.to_json_file(binary / "config.json")
    for file_name, part in halves.items():
        torch.save({name: state[name] for name in part}, binary / file_name)
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (binary / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return {"st": _files(root / "st"), "bin": _files(binary),
            "state": {k: v.clone() for k, v in state.items()}}


def _env(tmp_path: Path, hub: Hub | None, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "TRANSFORMERS_OFFLINE"}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url if hub else "http://127.0.0.1:9",
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    return env


def _download(tmp_path, hub, *args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "switchyard.gateway.cli", "download-weights", *args],
                          env=_env(tmp_path, hub, **env), capture_output=True, text=True, timeout=180)


LOAD_BY_NAME = """
import sys, torch
from switchyard.core.config import ModelConfig
from switchyard.core.loader import load_model
from switchyard.core.testing import ReferenceBackend
states = [load_model(ModelConfig(model=name), ReferenceBackend(), 16).model.state_dict() for name in sys.argv[1:]]
for state in states[1:]:
    assert state.keys() == states[0].keys()
    assert all(torch.equal(state[k], states[0][k]) for k in state), "different tensors"
print("loaded", len(states))
"""


# -- the plan, without a hub ------------------------------------------------------------------------
def test_model_id_names_a_gguf_as_llama_cpp_and_ollama_write_it():
    assert split_model_id("org/m", None) == ("org/m", None)
    assert split_model_id("org/m:Q4_K_M", None) == ("org/m", "Q4_K_M")
    assert split_model_id("hf.co/org/m:m.Q8_0.gguf", None) == ("org/m", "m.Q8_0.gguf")
    assert split_model_id("org/m", "m.gguf") == ("org/m", "m.gguf")
    with pytest.raises(DownloadError, match="give one"):
        split_model_id("org/m:Q4_K_M", "m.gguf")
    files = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "big-Q4_0-00001-of-00002.gguf", "big-Q4_0-00002-of-00002.gguf"]
    assert choose_gguf("org/m", "q4_k_m", files) == ("m-Q4_K_M.gguf",)
    assert choose_gguf("org/m", "Q4_0", files) == ("big-Q4_0-00001-of-00002.gguf", "big-Q4_0-00002-of-00002.gguf")
    with pytest.raises(DownloadError, match="no GGUF file for 'Q2_K'"):
        choose_gguf("org/m", "Q2_K", files)


def test_the_plan_prefers_safetensors_then_converts_bin_and_refuses_the_rest():
    plan = plan_download("org/m", None, None, ["model.safetensors", "pytorch_model.bin", "config.json"])
    assert "*.safetensors" in plan.patterns and not plan.convert and "pytorch_model*.bin" not in plan.patterns
    assert plan_download("org/m", None, None, ["pytorch_model.bin", "config.json"]).convert
    with pytest.raises(DownloadError, match="GGUF files only"):
        plan_download("org/m", None, None, ["m.Q4_0.gguf", "README.md"])
    with pytest.raises(DownloadError, match="no weights"):
        plan_download("org/m", None, None, ["README.md", "tf_model.h5"])


# -- against the local hub ---------------------------------------------------------------------------------
def test_a_safetensors_repo_downloads_resumes_and_loads_offline_by_name(hub, checkpoints, tmp_path):
    hub.repos["acme/tiny"] = checkpoints["st"]
    size = len(checkpoints["st"]["model.safetensors"])
    hub.drop_once["model.safetensors"] = size // 2
    done = _download(tmp_path, hub, "acme/tiny")
    assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip().splitlines()[-1])
    assert snapshot.name == COMMIT and "models--acme--tiny" in str(snapshot)
    got = _files(snapshot)
    assert set(got) == {"config.json", "generation_config.json", "model.safetensors"}  # no README, no tf weights
    assert got["model.safetensors"] == checkpoints["st"]["model.safetensors"]
    gets = [path for method, path, _ in hub.requests if method == "GET" and path.endswith("model.safetensors")]
    assert gets == ["/acme/tiny/resolve/" + COMMIT + "/model.safetensors"] * 2  # cut off, fetched again

    again = _download(tmp_path, None, "acme/tiny", HF_HUB_OFFLINE="1")  # offline: the cached copy
    assert again.returncode == 0 and again.stdout.strip() == str(snapshot), again.stderr
    loaded = subprocess.run([sys.executable, "-c", LOAD_BY_NAME, "acme/tiny"], env=_env(tmp_path, None,
                            HF_HUB_OFFLINE="1"), capture_output=True, text=True, timeout=180)
    assert loaded.returncode == 0 and "loaded 1" in loaded.stdout, loaded.stderr


def test_a_bin_only_repo_is_converted_and_loads_with_identical_tensors(hub, checkpoints, tmp_path):
    from safetensors.torch import load_file

    hub.repos["acme/tiny"] = checkpoints["st"]
    hub.repos["acme/tiny-bin"] = checkpoints["bin"]
    for repo in ("acme/tiny", "acme/tiny-bin"):
        done = _download(tmp_path, hub, repo)
        assert done.returncode == 0, done.stderr
    snapshot = Path(done.stdout.strip().splitlines()[-1])
    assert "converted model-00001-of-00002.safetensors" in done.stderr
    converted = {}
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        converted.update(load_file(snapshot / name))
    state = checkpoints["state"]
    assert set(converted) == set(state) - {"lm_head.weight"}  # the tied copy is written once
    assert all(torch.equal(converted[name], state[name]) for name in converted)
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(converted)
    assert {index["weight_map"][n] for n in converted} == {"model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors"}
    # through the loader, offline, by name: the same tensors as the safetensors repo's
    loaded = subprocess.run([sys.executable, "-c", LOAD_BY_NAME, "acme/tiny", "acme/tiny-bin"],
                            env=_env(tmp_path, None, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                            timeout=180)
    assert loaded.returncode == 0 and "loaded 2" in loaded.stdout, loaded.stderr


def test_a_download_cut_off_is_resumed_with_a_range_request(hub, tmp_path):
    """huggingface_hub writes what it received in 10 MiB chunks and, when the connection
    drops, asks for the rest with `Range: bytes=N-` (N: the bytes it kept)."""
    chunk = 10 * 1024 * 1024
    data = b"GGUF" + os.urandom(chunk + 512 * 1024)
    hub.repos["acme/big-gguf"] = {"big-Q4_0.gguf": data}
    hub.drop_once["big-Q4_0.gguf"] = chunk + 256 * 1024
    done = _download(tmp_path, hub, "acme/big-gguf:Q4_0")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == data
    assert [r for method, path, r in hub.requests if method == "GET" and path.endswith(".gguf")] == \
        [None, f"bytes={chunk}-"]


def test_a_named_gguf_file(hub, tmp_path):
    hub.repos["acme/tiny-gguf"] = {"tiny-Q4_K_M.gguf": b"GGUF" + b"\0" * 60, "tiny-Q8_0.gguf": b"GGUF" + b"\1" * 60,
                                   "README.md": b"hi"}
    done = _download(tmp_path, hub, "acme/tiny-gguf:Q8_0")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and path.read_bytes() == hub.repos["acme/tiny-gguf"]["tiny-Q8_0.gguf"]
    assert not (path.parent / "tiny-Q4_K_M.gguf").exists()
    flag = _download(tmp_path, hub, "acme/tiny-gguf", "--gguf-file", "tiny-Q4_K_M.gguf")
    assert flag.returncode == 0 and Path(flag.stdout.strip()).name == "tiny-Q4_K_M.gguf", flag.stderr
    missing = _download(tmp_path, hub, "acme/tiny-gguf")
    assert missing.returncode == 2 and "GGUF files only" in missing.stderr


def _one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("switchyard: error: download-weights: "), done.stderr
    return lines[0]


def test_clear_errors_offline_unreachable_unknown_and_no_weights(hub, checkpoints, tmp_path):
    assert "HF_HUB_OFFLINE is set and acme/tiny is not in the Hugging Face cache" in _one_error_line(
        _download(tmp_path, hub, "acme/tiny", HF_HUB_OFFLINE="1"))
    assert "cannot download from http://127.0.0.1:9 (ConnectError" in _one_error_line(
        _download(tmp_path, None, "acme/tiny"))
    assert "model 'acme/nope' not found on" in _one_error_line(_download(tmp_path, hub, "acme/nope"))
    hub.repos["acme/tiny"] = checkpoints["st"]
    assert "revision 'v9' not found in acme/tiny" in _one_error_line(
        _download(tmp_path, hub, "acme/tiny", "--revision", "v9"))
    hub.repos["acme/empty"] = {"README.md": b"nothing", "tf_model.h5": b"x"}
    assert "holds no weights" in _one_error_line(_download(tmp_path, hub, "acme/empty"))
    assert not (tmp_path / "hf" / "hub" / "models--acme--empty" / "snapshots").exists()


# -- ids the Hub would refuse (issue 38): one line, exit 2, before any lookup -------------------------
@pytest.mark.parametrize("model_id", ["not-a-valid-id!!", "a/b/c", "org/name!!:Q4_K_M", ":Q4_K_M"])
def test_an_invalid_model_id_is_one_line_and_exit_2(model_id, capsys):
    from switchyard.gateway.cli import main

    assert main(["download-weights", model_id]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("switchyard: error: download-weights: invalid model id "), \
        captured.err
    assert captured.out == ""


def test_an_invalid_model_id_from_the_cli_online_or_offline_is_one_line(tmp_path):
    """The real CLI, as the issue ran it: no traceback online (nothing is asked of the endpoint,
    here unreachable), and offline it is called invalid, not "not in the cache"."""
    assert "invalid model id 'not-a-valid-id!!'" in _one_error_line(_download(tmp_path, None, "not-a-valid-id!!"))
    assert "invalid model id 'not-a-valid-id!!'" in _one_error_line(
        _download(tmp_path, None, "not-a-valid-id!!", HF_HUB_OFFLINE="1"))
    local = tmp_path / "my-model"
    local.mkdir()
    line = _one_error_line(_download(tmp_path, None, str(local)))
    assert "a local directory or file needs no download: give it to serve --model-id" in line
