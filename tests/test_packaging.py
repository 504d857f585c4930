"""The folders core/, gateway/ and backends/ ship as switchyard.core, switchyard.gateway
and switchyard.backends.* in a regular (wheel) install, not only in the editable one."""
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = {"core": "switchyard.core", "gateway": "switchyard.gateway", "backends": "switchyard.backends"}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _source_packages() -> set[str]:
    found = set()
    for folder, package in FOLDERS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, folder))
                found.add(package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}")
    return found


def test_every_source_package_is_listed_in_pyproject():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert _source_packages() == listed


def test_every_backend_folder_is_a_registered_plugin():
    entry_points = _pyproject()["project"]["entry-points"]["switchyard.backends"]
    assert set(entry_points) == {"cpu", "cuda", "rocm", "xpu", "neuron", "tpu"}


@pytest.mark.slow
def test_wheel_holds_the_namespaced_packages_and_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), ROOT], check=True, capture_output=True)
    (wheel,) = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    for module in ["switchyard/core/engine/core.py", "switchyard/core/kv/block_pool.py", "switchyard/gateway/cli.py",
                   "switchyard/backends/cpu/attention.py", "switchyard/backends/cuda/__init__.py"]:
        assert module in names
    csrc = os.path.join(ROOT, "backends", "cpu", "csrc")
    for source in os.listdir(csrc):  # the C++ kernels compile at first use, headers included
        assert f"switchyard/backends/cpu/csrc/{source}" in names
    assert "[switchyard.backends]" in entry_points and "cpu = switchyard.backends.cpu:CpuBackend" in entry_points
    assert "switchyard = switchyard.gateway.cli:main" in entry_points
    # Imported from the unpacked wheel alone (-S: no site-packages, so not the editable copy).
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r}); import switchyard.core.params as p; print(p.__file__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip().startswith(str(tmp_path / "site"))


def test_test_module_names_are_unique():
    """tests/ has no packages (rootdir-relative imports), so two test files with one
    name stop pytest from collecting the whole suite."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    seen: dict[str, str] = {}
    for folder, _, files in os.walk(tests_dir):
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                assert name not in seen, f"{name} is in both {seen[name]} and {folder}"
                seen[name] = folder
