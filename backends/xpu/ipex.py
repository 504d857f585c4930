"""intel-extension-for-pytorch: whether it fits this torch (without importing it), and its
paged-attention ops once imported.

IPEX x.y works only with torch x.y: on a mismatch its import prints an error and calls
`os.exit(127)`, which raises AttributeError. So the probe compares the installed
distributions' versions instead of importing, and load() turns both failure kinds into
one ImportError that names the versions."""
from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

DISTRIBUTION = "intel-extension-for-pytorch"


def _major_minor(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def ipex_problem(torch_version: str | None = None) -> str | None:
    """Why IPEX cannot be used with this torch (None when it can); never imports IPEX."""
    torch_version = torch_version or torch.__version__
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return f"{DISTRIBUTION} is not installed (pip install 'switchyard[xpu]')"
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return f"intel_extension_for_pytorch is importable but {DISTRIBUTION} has no installed metadata"
    if _major_minor(version) != _major_minor(torch_version):
        return (f"{DISTRIBUTION} {version} needs torch {'.'.join(_major_minor(version))}.*, "
                f"but torch {torch_version} is installed")
    return None


def ipex_status(torch_version: str | None = None) -> tuple[bool, str]:
    """(usable, why): ipex_problem, or which IPEX fits which torch."""
    problem = ipex_problem(torch_version)
    if problem is not None:
        return False, problem
    version = importlib.metadata.version(DISTRIBUTION)
    return True, f"{DISTRIBUTION} {version} fits torch {torch_version or torch.__version__}"


def _transformers_5_compat() -> None:
    """IPEX 2.8's package import runs its reference Hugging Face model code, which imports
    transformers.modeling_attn_mask_utils; transformers 5 removed that module, and the import
    then fails (NameError: MoeModelOutputWithPast). Switchyard runs none of that code, only the
    paged-attention ops, so a stand-in module whose two functions refuse to run lets IPEX import."""
    import sys
    import types

    name = "transformers.modeling_attn_mask_utils"
    if name in sys.modules or importlib.util.find_spec("transformers") is None:
        return
    try:
        importlib.import_module(name)
    except ImportError:
        def unavailable(*args, **kwargs):
            raise NotImplementedError(f"{name} was removed in transformers 5 (stand-in for IPEX's import)")

        stand_in = types.ModuleType(name)
        stand_in._prepare_4d_causal_attention_mask = unavailable
        stand_in._prepare_4d_attention_mask = unavailable
        sys.modules[name] = stand_in


def load():
    """The imported intel_extension_for_pytorch module; ImportError (with the reason) if it
    cannot be used with this torch."""
    problem = ipex_problem()
    if problem is not None:
        raise ImportError(problem)
    _transformers_5_compat()
    try:
        import intel_extension_for_pytorch as ipex
    except (ImportError, AttributeError, NameError) as error:  # AttributeError: IPEX's os.exit on a mismatch
        raise ImportError(f"importing intel_extension_for_pytorch failed: {error}") from error
    return ipex


def paged_attention():
    """ipex.llm.modules.PagedAttention: the same Python API on XPU and CPU tensors."""
    return load().llm.modules.PagedAttention
