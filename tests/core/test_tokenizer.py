from switchyard.core.text.tokenizer import IncrementalDetokenizer


def _stream(tokenizer, ids, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, [1], **kwargs)
    deltas = [detok.update([t], finished=(i == len(ids) - 1)) for i, t in enumerate(ids)]
    return detok, deltas


def test_incremental_text_equals_full_decode_and_never_splits_characters(default_tokenizer):
    text = "Héllo wörld! 🌍🚀 世界 naïve café — ok"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    _, deltas = _stream(default_tokenizer, ids)
    assert "".join(deltas) == default_tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # the emoji bytes arrived over several tokens


def test_stop_string_trims_and_is_held_back(default_tokenizer):
    ids = default_tokenizer.encode("The answer is 42. END of story", add_special_tokens=False)
    detok, deltas = _stream(default_tokenizer, ids, stop=(" END",))
    assert detok.stop_string_hit == " END"
    assert "".join(deltas) == "The answer is 42."
    assert "E" not in "".join(deltas)


def test_stop_string_included_when_asked(default_tokenizer):
    ids = default_tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    detok, deltas = _stream(default_tokenizer, ids, stop=("beta",), include_stop_str_in_output=True)
    assert "".join(deltas) == "alpha beta"


def test_special_tokens_skipped_or_kept(default_tokenizer):
    ids = default_tokenizer.encode("hi", add_special_tokens=False) + [default_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    _, skipped = _stream(default_tokenizer, ids, skip_special_tokens=True)
    _, kept = _stream(default_tokenizer, ids, skip_special_tokens=False)
    assert "".join(skipped) == "hi"
    assert "".join(kept) == "hi<|im_end|>"
