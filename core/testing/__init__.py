"""Test support shipped with the package, for backends in this tree and out of it.

`BackendContract` (backend_contract.py) imports pytest; nothing else in switchyard does."""
from .backend_contract import BackendContract
from .reference_backend import ReferenceBackend

__all__ = ["BackendContract", "ReferenceBackend"]
