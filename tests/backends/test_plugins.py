"""Discovery, probing and selection of backends through the `switchyard.backends` entry points."""
from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from switchyard.core.backend import ProbeResult
from switchyard.core.plugins import BackendError, BackendReport, discover_backends, select_backend

BUILTIN = ["cuda", "rocm", "xpu", "tpu", "neuron", "cpu"]  # in priority order
TOY_PKG = Path(__file__).parent / "toy_backend_pkg"


def test_discovery_lists_the_six_builtins_in_priority_order_with_cpu_usable():
    reports = [r for r in discover_backends() if r.name in BUILTIN]
    assert [r.name for r in reports] == BUILTIN
    assert [r.priority for r in reports] == [100, 90, 80, 70, 60, 0]
    by_name = {r.name: r for r in reports}
    cpu = by_name["cpu"]
    assert isinstance(cpu, BackendReport) and cpu.usable and cpu.reason == "always available"
    assert cpu.capabilities is not None and "float32" in cpu.capabilities.dtypes
    assert cpu.attention_impl.startswith("decodes: ") and "SDPA over gathered blocks" in cpu.attention_impl


def test_vendor_backends_report_why_they_are_not_usable():
    """On this CPU-only machine they are unusable; those still pending say their kernel is planned."""
    for report in discover_backends():
        if report.name in BUILTIN[:-1]:
            assert not report.usable and report.reason and "not usable" not in report.reason
            assert report.capabilities is None and report.attention_impl
            if report.name not in ("cuda", "rocm", "tpu", "neuron", "xpu"):
                assert report.attention_impl.endswith("(planned)")


def test_select_none_is_the_highest_priority_usable_backend_which_is_cpu_here():
    assert select_backend(None).name == "cpu"
    assert select_backend("cpu").name == "cpu"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(BackendError, match="unknown backend 'warp-drive'.*cpu, cuda, neuron, rocm, tpu, xpu"):
        select_backend("warp-drive")


@pytest.mark.parametrize("name", BUILTIN[:-1])
def test_unusable_name_carries_the_probe_reason(name):
    reason = next(r.reason for r in discover_backends() if r.name == name)
    with pytest.raises(BackendError) as error:
        select_backend(name)
    assert f"backend {name!r} is not usable here" in str(error.value) and reason in str(error.value)


def test_pending_backends_refuse_work():
    from switchyard.core.plugins import PendingBackend

    class Pending(PendingBackend):  # every built-in backend is implemented now
        name = "pending"

        @classmethod
        def probe(cls):
            return ProbeResult(False, "not yet")

    with pytest.raises(NotImplementedError, match="arrives with its own issue"):
        Pending().capabilities()


def run_python(code: str, pythonpath: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_plugin_that_fails_to_load_does_not_break_the_others(tmp_path):
    dist_info = tmp_path / "switchyard_broken_plugins-0.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: switchyard-broken-plugins\nVersion: 0.0\n")
    (dist_info / "entry_points.txt").write_text(
        "[switchyard.backends]\nbroken = switchyard_no_such_module:Backend\nnotabackend = os:path\n")
    result = run_python("""
        from switchyard.core.plugins import discover_backends, select_backend
        reports = {r.name: r for r in discover_backends()}
        for name in ("broken", "notabackend"):
            print(name, reports[name].usable, reports[name].reason)
        print("cpu", reports["cpu"].usable, select_backend(None).name)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("broken False failed to load switchyard_no_such_module:Backend: "
                               "ModuleNotFoundError")
    assert lines[1].startswith("notabackend False") and "not a switchyard Backend subclass" in lines[1]
    assert lines[2] == "cpu True cpu"


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory) -> Path:
    """The toy package pip-installed into its own --target directory (built from a copy,
    so no build artefacts land in the repository)."""
    work = tmp_path_factory.mktemp("toy")
    source, target = work / "src", work / "site"
    shutil.copytree(TOY_PKG, source)
    base = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(source)]
    result = subprocess.run(base + ["--no-build-isolation", "--no-index"], capture_output=True, text=True)
    if result.returncode != 0:  # the setuptools installed here cannot build it: let pip fetch one
        result = subprocess.run(base, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return target


def test_an_out_of_tree_backend_is_discovered_and_selectable(toy_site):
    result = run_python("""
        from switchyard.core.plugins import discover_backends, select_backend
        names = [r.name for r in discover_backends()]
        toy = next(r for r in discover_backends() if r.name == "toy")
        backend = select_backend("toy")
        print(names.index("cpu") < names.index("toy"), toy.usable, toy.reason, toy.attention_impl)
        print(type(backend).__module__, type(backend).__name__, select_backend(None).name)
    """, toy_site)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True True toy backend, always usable reference (toy)",
                                          "toy_backend ToyBackend cpu"]


def test_the_cli_lists_an_out_of_tree_backend(toy_site):
    if importlib.util.find_spec("switchyard.gateway.cli") is None:
        pytest.skip("switchyard.gateway.cli does not exist yet")
    result = run_python("""
        import sys
        from switchyard.gateway.cli import main
        sys.argv = ["switchyard", "backends"]
        sys.exit(main() or 0)
    """, toy_site)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in BUILTIN + ["toy"]:
        assert any(name in line for line in lines), (name, result.stdout)


def test_an_out_of_tree_backend_runs_the_engine_and_agrees_with_cpu(toy_site, tmp_path):
    """The plugin is not only listed: the whole engine generates through its kernel."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    result = run_python(f"""
        from switchyard.core.config import CacheConfig, EngineConfig, ModelConfig
        from switchyard.core.engine.core import EngineCore
        from switchyard.core.params import SamplingParams
        from switchyard.core.scheduling.request import Request
        outputs = []
        for backend in ("toy", "cpu"):
            engine = EngineCore(EngineConfig(model=ModelConfig(model={str(tmp_path)!r}),
                                             cache=CacheConfig(num_blocks=16), backend=backend))
            engine.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=8,
                                                                            ignore_eos=True)))
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [t for out in engine.step() for t in out.new_token_ids]
            outputs.append((engine.backend.name, tokens))
        print(outputs)
    """, toy_site)
    assert result.returncode == 0, result.stderr
    (toy_name, toy_tokens), (cpu_name, cpu_tokens) = ast.literal_eval(result.stdout.strip().splitlines()[-1])
    assert (toy_name, cpu_name) == ("toy", "cpu")
    assert len(toy_tokens) == 8 and toy_tokens == cpu_tokens
