"""The tokenizer the gateway holds: a fast tokenizer without transformers.

transformers' fast tokenizers wrap one `tokenizers.Tokenizer` (Rust); everything a server asks
of them (encode, decode, single tokens, offsets, the vocabulary's size, the special tokens and
the chat template, which core/text/chat_template.py renders) is that object's or a few values read
once. The engine builds a ServingTokenizer from its transformers tokenizer and hands it to the
gateway (engine_loop's `Ready`), which then never imports transformers: ~30 MB less resident per
gateway (the default model's gateway: 129 -> 101 MB idle, 140 -> 109 MB at peak, 2-core AMX
Xeon), and no transformers import to wait for when the engine is ready. A tokenizer with no
fast backend (a slow, Python-only one) is handed over as it is.

A GGUF's converted metadata (core/loader/gguf_cache.py) keeps one in `TOKENIZER_FILE`, and a
cached start's engine uses it as its own tokenizer: with the config kept as plain attributes
(core/models/plain_config.py), such an engine imports no transformers. Grammar compilers still
take transformers' tokenizer (core/engine/core.py loads it on the first grammar).

Each method gives what the transformers tokenizer gives for the same call (tests/core/
test_serving_tokenizer.py compares them)."""
from __future__ import annotations

import functools
import json
import os
from typing import Any

from ..memory import trim_heap

TOKENIZER_FILE = "serving_tokenizer.json"
# transformers' clean_up_tokenization (for WordPiece-style tokenizers that set it)
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class ServingTokenizer:
    """Built from the tokenizer's JSON (`tokenizers`' own serialization); the Rust tokenizer is
    made on first use, so the engine that builds one to hand over never holds a second copy."""

    is_fast = True

    def __init__(self, tokenizer_json: str, chat_template: str | dict | None, special_tokens_map: dict[str, Any],
                 all_special_ids: list[int], clean_up_spaces: bool = False, split_special_tokens: bool = False):
        self.tokenizer_json = tokenizer_json
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens_map)
        self.all_special_ids = list(all_special_ids)
        self.clean_up_spaces = clean_up_spaces
        self.split_special_tokens = split_special_tokens

    @classmethod
    def from_transformers(cls, tokenizer) -> ServingTokenizer:
        """The same tokenizer, from a transformers fast tokenizer."""
        backend = tokenizer.backend_tokenizer
        # transformers skips the clean-up for BPE models unless forced: it strips real spaces there
        clean_up = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                            False)))
        return cls(backend.to_str(), tokenizer.chat_template, tokenizer.special_tokens_map,
                   tokenizer.all_special_ids, clean_up, bool(getattr(tokenizer, "split_special_tokens", False)))

    def save(self, directory: str) -> None:
        with open(os.path.join(directory, TOKENIZER_FILE), "w") as file:
            json.dump(self.__getstate__(), file)

    @classmethod
    def read(cls, directory: str) -> ServingTokenizer | None:
        """The tokenizer `save` kept in `directory`; None when there is none."""
        path = os.path.join(directory, TOKENIZER_FILE)
        if not os.path.isfile(path):
            return None
        with open(path) as file:
            return cls(**json.load(file))

    def build(self) -> ServingTokenizer:
        """The Rust tokenizer made now rather than on the first request, and the heap its JSON
        parse freed handed back: the default model's takes ~40 MB to build and holds ~15
        (2-core AMX Xeon). The gateway calls this when the engine says it is ready."""
        self.backend_tokenizer  # noqa: B018 - made and cached
        trim_heap()
        return self

    @functools.cached_property
    def backend_tokenizer(self):
        """The Rust tokenizer, with no truncation or padding, as transformers encodes one text."""
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(self.tokenizer_json)
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = self.split_special_tokens
        return backend

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "backend_tokenizer"}

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        encoding = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out = {"input_ids": encoding.ids, "attention_mask": encoding.attention_mask}
        if return_offsets_mapping:
            out["offset_mapping"] = encoding.offsets
        return out

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for before, after in _CLEAN_UP:
                text = text.replace(before, after)
        return text

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A token's id; an unknown token gives the unknown token's id (None without one)."""
        if isinstance(tokens, str):
            found = self.backend_tokenizer.token_to_id(tokens)
            unknown = self.special_tokens_map.get("unk_token")
            return found if found is not None or unknown is None else self.backend_tokenizer.token_to_id(unknown)
        return [self.convert_tokens_to_ids(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]


def gateway_tokenizer(tokenizer):
    """What the engine hands the gateway: a ServingTokenizer of a fast tokenizer, else the
    tokenizer itself (None stays None)."""
    if isinstance(tokenizer, ServingTokenizer):
        return tokenizer
    if tokenizer is None or getattr(tokenizer, "backend_tokenizer", None) is None or \
            not getattr(tokenizer, "is_fast", False):
        return tokenizer
    return ServingTokenizer.from_transformers(tokenizer)
