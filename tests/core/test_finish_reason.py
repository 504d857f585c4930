"""The finish-reason rule (core/scheduling/request.py decide_finish), and that each place that finds a
reason goes through it: the scheduler's token checks, the grammar, the stop strings."""
import itertools

import pytest

from switchyard.core.engine.output_processor import OutputProcessor
from switchyard.core.params import SamplingParams
from switchyard.core.scheduling.request import EngineCoreOutput, FinishReason, Request, decide_finish

R = FinishReason
ORDER = [R.EOS, R.STOP_TOKEN, R.GRAMMAR, R.STOP_STRING, R.LENGTH]


def test_nothing_holds():
    assert decide_finish() is None
    assert decide_finish(None, None) is None


@pytest.mark.parametrize("higher,lower", list(itertools.combinations(ORDER, 2)))
def test_precedence_whatever_the_order_found(higher, lower):
    assert decide_finish(higher, lower) is higher
    assert decide_finish(lower, None, higher) is higher


def test_abort_is_kept():
    assert decide_finish(R.ABORT, R.EOS) is R.ABORT


class _Tokenizer:
    """Each token id is one character: chr(id)."""

    eos_token_id = 0
    all_special_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]


def _process(reason: FinishReason | None, stop: list[str]):
    finished = []
    processor = OutputProcessor(_Tokenizer(), lambda rid, why: finished.append((rid, why)))
    request = Request("r", [ord("a")], SamplingParams(max_tokens=8, stop=stop))
    processor.add_request(request)
    out, = processor.process([EngineCoreOutput("r", tuple(map(ord, "xyz")), reason)])
    return out.finish_reason, finished


def test_a_stop_string_outranks_length_and_frees_a_running_request():
    assert _process(R.LENGTH, ["yz"]) == (R.STOP_STRING, [])  # the engine already freed it
    assert _process(None, ["yz"]) == (R.STOP_STRING, [("r", R.STOP_STRING)])


def test_the_models_own_end_outranks_a_stop_string():
    assert _process(R.EOS, ["yz"]) == (R.EOS, [])
    assert _process(R.GRAMMAR, ["yz"]) == (R.GRAMMAR, [])
