"""`switchyard generate`: the model's chat template when it has one (--raw for a plain
completion, --chat insists on one), and the text printed as it is decoded, not at the end.
On the llama-tiny shape with random weights; its byte tokenizer is given a template here."""
from __future__ import annotations

import io
import sys

import pytest

from switchyard.core import LLM, SamplingParams
from switchyard.core import llm as llm_module
from switchyard.core.engine.core import EngineCore
from switchyard.gateway.cli import main

TINY = ["--model-id", "llama-tiny", "--load-format", "dummy", "--backend", "cpu", "--dtype", "float32",
        "--max-tokens", "12", "--ignore-eos"]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
PROMPT = "Name a colour."


@pytest.fixture
def templated(monkeypatch):
    """The tiny model's tokenizer with a chat template, as an instruct model's has."""
    real = llm_module.load_hf_tokenizer

    def with_template(model_config):
        tokenizer = real(model_config)
        tokenizer.chat_template = TEMPLATE
        return tokenizer

    monkeypatch.setattr(llm_module, "load_hf_tokenizer", with_template)


def _offline(chat: bool) -> str:
    with LLM(model="llama-tiny", load_format="dummy", backend="cpu") as llm:
        params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
        if chat:
            return llm.chat([{"role": "user", "content": PROMPT}], params)[0].text
        return llm.generate(PROMPT, params)[0].text


def test_generate_uses_the_chat_template_when_the_model_has_one(templated, capsys):
    assert main(["generate", *TINY, PROMPT]) == 0
    chat = capsys.readouterr().out
    assert main(["generate", *TINY, "--raw", PROMPT]) == 0
    raw = capsys.readouterr().out
    assert chat == _offline(chat=True) + "\n" and raw == _offline(chat=False) + "\n"
    assert chat != raw


def test_a_model_without_a_template_completes_and_chat_is_refused_in_one_line(capsys):
    assert main(["generate", *TINY, PROMPT]) == 0
    assert capsys.readouterr().out == _offline(chat=False) + "\n"
    assert main(["generate", *TINY, "--chat", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == ("switchyard: error: --chat: this model has no chat template "
                                    "(drop --chat for a plain completion)") and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["generate", *TINY, "--chat", "--raw", PROMPT])  # one or the other


def test_text_is_printed_as_it_is_decoded(monkeypatch):
    steps = []
    step = EngineCore.step
    monkeypatch.setattr(EngineCore, "step", lambda self: steps.append(1) or step(self))

    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.writes = []  # (engine steps taken so far, the piece written)

        def write(self, text):
            self.writes.append((len(steps), text))
            return super().write(text)

    recorder = Recorder()
    monkeypatch.setattr(sys, "stdout", recorder)
    assert main(["generate", *TINY, "--raw", PROMPT, "Another prompt"]) == 0
    at_step = [taken for taken, piece in recorder.writes if piece.strip("\n")]
    assert len(at_step) >= 12  # a piece per decoded token or so, not one write at the end
    assert at_step == sorted(at_step) and at_step[0] < at_step[-1] <= len(steps)
    assert recorder.getvalue().count("\n") == 2  # each prompt's text ends its line


def test_offline_generate_calls_on_text_with_each_piece():
    pieces = []
    with LLM(model="llama-tiny", load_format="dummy", backend="cpu") as llm:
        [result] = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0),
                                on_text=lambda i, j, text: pieces.append((i, j, text)))
    assert len(pieces) > 1 and {(i, j) for i, j, _ in pieces} == {(0, 0)}
    assert "".join(text for _, _, text in pieces) == result.text
