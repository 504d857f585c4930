"""`switchyard serve`'s flags of how the model is served (core/pooling/decide.py): `--task`
(vLLM's `--task` / `--runner pooling`: generate, embed, or auto, where the model's files
decide) and `--pooling` (how an embedding model pools, over what its files say). Read into
the engine's ModelConfig."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from switchyard.core.pooling.spec import POOLING_METHODS, TASKS


def add_task_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument("--task", choices=TASKS, default="auto",
                        help="what the model serves: generate (text), embed (embeddings: /v1/embeddings, TEI's "
                        "/embed), or auto: embed for an encoder (BERT, XLM-R), a sentence-transformers directory "
                        "or a GGUF whose pooling_type is mean, cls or last; generate otherwise")
    parser.add_argument("--pooling", choices=POOLING_METHODS, default=None,
                        help="with --task embed: pool the last token's, the mean or the first (CLS) token's hidden "
                        "state (default: what the model's sentence-transformers config or GGUF says, else cls for "
                        "an encoder and last for a decoder)")


def task_options(args: argparse.Namespace) -> dict:
    """ModelConfig's fields of these flags."""
    return {"task": args.task, "pooling": args.pooling}
