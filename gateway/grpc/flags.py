"""`switchyard serve`'s gRPC flag: `--grpc-port` (env GRPC_PORT; off by default). Imports
no grpc, so the CLI works without the `grpc` extra; the server checks for it at start."""
from __future__ import annotations

import argparse
from collections.abc import Mapping


def add_grpc_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    default = environ.get("GRPC_PORT") or None
    parser.add_argument("--grpc-port", type=int, default=int(default) if default is not None else None,
                        help="also serve TGIS's gRPC API (fmaas.GenerationService, grpc.health.v1, reflection) on "
                        "this port, on --hostname (default: off; needs the `grpc` extra) [env: GRPC_PORT]")


def check_grpc(hostname: str, port: int | None) -> None:
    """Before any engine starts: --grpc-port needs the `grpc` extra and a port that can be
    had (a one-line user error otherwise, as a taken --port is)."""
    import socket

    from switchyard.core.params import ValidationError

    if port is None:
        return
    try:
        import grpc  # noqa: F401
        import grpc_health.v1  # noqa: F401
        import grpc_reflection.v1alpha  # noqa: F401
    except ImportError as exc:
        raise ValidationError(f"--grpc-port needs the grpc extra (pip install 'switchyard[grpc]'): {exc}") from None
    family = socket.AF_INET6 if ":" in hostname else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((hostname, port))
        except OSError as exc:
            raise ValidationError(f"cannot listen on {hostname}:{port} (--hostname, --grpc-port): "
                                  f"{exc.strerror or exc}") from None
