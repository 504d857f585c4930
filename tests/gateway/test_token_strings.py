"""gateway/tokens.py: the bytes of single tokens (OpenAI logprobs `bytes`, TGI token details)
come from the one byte-to-unicode table in core/grammar/vocabulary.py, so the gateway shows
the same bytes the grammar compilers match."""
from __future__ import annotations

from switchyard.core.grammar.vocabulary import token_bytes
from switchyard.gateway.tokens import TokenStrings


def test_token_bytes_are_the_grammar_vocabularys(default_tokenizer):
    strings = TokenStrings(default_tokenizer)
    special = set(default_tokenizer.all_special_ids)
    for piece, token_id in sorted(default_tokenizer.get_vocab().items(), key=lambda item: item[1])[:3000]:
        if token_id not in special:
            assert bytes(strings.bytes(token_id)) == token_bytes(piece, byte_level=True), (token_id, piece)


def test_a_token_that_splits_a_character_gives_its_own_bytes(default_tokenizer):
    strings = TokenStrings(default_tokenizer)
    ids = default_tokenizer.encode("日本", add_special_tokens=False)
    assert b"".join(bytes(strings.bytes(i)) for i in ids) == "日本".encode()
    assert any(strings.text(i) == "\ufffd" for i in ids)  # the text alone cannot say which bytes
