"""`switchyard serve`'s speculative decoding flags (core/spec): TGI's `--speculate N` (env
SPECULATE), proposed by n-gram prompt lookup (its n-gram sizes and window) or by a draft model
(`--speculative-model PATH`, env SPECULATIVE_MODEL; then N defaults to 4). Builds the engine's
SpeculativeConfig."""
from __future__ import annotations

import argparse
from collections.abc import Mapping

from switchyard.core.config import SpeculativeConfig


def _env_int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = environ.get(name)
    return int(value) if value not in (None, "") else default


def add_speculate_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    defaults = SpeculativeConfig()
    parser.add_argument("--speculate", type=int, default=_env_int(environ, "SPECULATE", None),
                        help="speculative decoding: verify up to N proposed tokens per decode step, proposed by "
                        "n-gram lookup in the request's own prompt and output, or by --speculative-model "
                        f"(default: 0, off; {defaults.DEFAULT_DRAFT_TOKENS} with --speculative-model) [env: SPECULATE]")
    parser.add_argument("--speculative-model", default=environ.get("SPECULATIVE_MODEL") or None,
                        help="a draft model that proposes the tokens greedily instead of n-gram lookup: a smaller "
                        "model with the model's tokenizer (local HF directory, .gguf file or HF cache name), run "
                        "beside it with its own KV cache (default: none, n-gram lookup) [env: SPECULATIVE_MODEL]")
    parser.add_argument("--speculate-ngram-min", type=int,
                        default=_env_int(environ, "SPECULATE_NGRAM_MIN", defaults.ngram_min),
                        help="shortest suffix n-gram looked up for proposals [env: SPECULATE_NGRAM_MIN]")
    parser.add_argument("--speculate-ngram-max", type=int,
                        default=_env_int(environ, "SPECULATE_NGRAM_MAX", defaults.ngram_max),
                        help="longest suffix n-gram looked up for proposals [env: SPECULATE_NGRAM_MAX]")
    parser.add_argument("--speculate-ngram-window", type=int,
                        default=_env_int(environ, "SPECULATE_NGRAM_WINDOW", defaults.ngram_window),
                        help="look n-grams up in only the last this many tokens (default 0: all of them) "
                        "[env: SPECULATE_NGRAM_WINDOW]")
    parser.add_argument("--speculate-min-acceptance", type=float, default=defaults.min_acceptance,
                        help="a request whose measured per-token acceptance is below this does not propose (default "
                        f"{defaults.min_acceptance}: above it, each request proposes as many tokens as pay for their "
                        "rows at the step's batch size)")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The engine's SpeculativeConfig, or ValidationError (a one-line user error)."""
    from switchyard.core.params import ValidationError

    draft = args.speculative_model
    speculate = args.speculate
    if speculate is None:
        speculate = SpeculativeConfig.DEFAULT_DRAFT_TOKENS if draft is not None else 0
    if speculate < 0:
        raise ValidationError(f"--speculate must be >= 0, got {speculate}")
    if draft is not None and speculate == 0:
        raise ValidationError("--speculative-model with --speculate 0 would propose nothing; give --speculate N >= 1 "
                              f"(or leave it out: {SpeculativeConfig.DEFAULT_DRAFT_TOKENS})")
    if not 1 <= args.speculate_ngram_min <= args.speculate_ngram_max:
        raise ValidationError("--speculate-ngram-min and --speculate-ngram-max must satisfy 1 <= min <= max, got "
                              f"{args.speculate_ngram_min} and {args.speculate_ngram_max}")
    if args.speculate_ngram_window < 0:
        raise ValidationError(f"--speculate-ngram-window must be >= 0, got {args.speculate_ngram_window}")
    if not 0.0 <= args.speculate_min_acceptance <= 1.0:
        raise ValidationError(f"--speculate-min-acceptance must be in [0, 1], got {args.speculate_min_acceptance}")
    return SpeculativeConfig(num_speculative_tokens=speculate, method="draft" if draft is not None else "ngram",
                             draft_model=draft, ngram_min=args.speculate_ngram_min,
                             ngram_max=args.speculate_ngram_max, ngram_window=args.speculate_ngram_window,
                             min_acceptance=args.speculate_min_acceptance)
