"""gateway/reasoning without a server: each format's splitter on whole outputs and on the same
outputs streamed in every split (a marker cut anywhere), where each format says an output
starts (the prompt's end), the auto selection from chat templates, --reasoning-parser, the gate
that counts reasoning tokens, and earlier assistant turns' thinking moved out of their content."""
from __future__ import annotations

import pytest
from reasoning_templates import DEEPSEEK_R1, GPT_OSS, MAGISTRAL, QWEN3

from switchyard.core.grammar.gate import GrammarGate
from switchyard.core.params import ValidationError
from switchyard.gateway.cli import build_parser
from switchyard.gateway.reasoning.formats import FORMATS
from switchyard.gateway.reasoning.history import separated
from switchyard.gateway.reasoning.pieces import held_suffix, joined
from switchyard.gateway.reasoning.select import parser_name, reasoning_format
from switchyard.gateway.serve import server_settings

SMOLLM2 = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>"
                  "4<|return|>")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>")

# (format, where the output starts, output text, drops) -> (reasoning, content)
CASES = [
    ("qwen3", "maybe", "<think>\nAdd them.\n</think>\n\n4", (), ("Add them.", "4")),
    ("qwen3", "maybe", "4 is the answer, not <think>", (), (None, "4 is the answer, not <think>")),
    ("qwen3", "maybe", "  <think>Still going", (), ("Still going", "")),
    ("qwen3", "maybe", "<think>\n\n</think>\n\nHi", (), (None, "Hi")),
    ("qwen3", "thinking", "Add them.</think>4", (), ("Add them.", "4")),
    ("qwen3", "answer", "<think>not thinking</think>4", (), (None, "<think>not thinking</think>4")),
    ("deepseek_r1", "thinking", "Add  them.\n</think>\n\n4 it is", (), ("Add  them.", "4 it is")),
    ("deepseek_r1", "thinking", "no end marker: all thinking", (), ("no end marker: all thinking", "")),
    ("deepseek_r1", "thinking", "<think>\nOpened anyway</think>4", (), ("Opened anyway", "4")),
    ("deepseek_r1", "thinking", "<thinking is a word>", (), ("<thinking is a word>", "")),
    ("mistral", "maybe", "[THINK]Add them.[/THINK]4<|im_end|>", ("<|im_end|>",), ("Add them.", "4")),
    ("mistral", "maybe", "4<|im_end|>", ("<|im_end|>",), (None, "4")),
    ("gpt_oss", "maybe", HARMONY_ANSWER, (), ("Add them.", "4")),
    ("gpt_oss", "maybe", HARMONY_CALL, (), (
        "Need the weather.", "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        "<|message|>{\"city\":\"Paris\"}<|call|>")),
    ("gpt_oss", "maybe", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final"
     "<|message|>Done.<|return|>", (), (None, "Checking.Done.")),
    ("gpt_oss", "maybe", "plain words", (), (None, "plain words")),
    ("gpt_oss", "thinking", "Add them.<|end|><|start|>assistant<|channel|>final<|message|>4", (), ("Add them.", "4")),
    ("gpt_oss", "maybe", "<|channel|>analysis<|message|>cut short", (), ("cut short", "")),
]


def _split(fmt: str, start: str, pieces: list[str], drops=()) -> tuple[str | None, str]:
    splitter = FORMATS[fmt].splitter(start, drops)
    out = []
    for piece in pieces:
        out += splitter.feed(piece)
    return joined(out + splitter.finish())


@pytest.mark.parametrize("fmt, start, text, drops, expected", CASES)
def test_each_format_splits_a_whole_output(fmt, start, text, drops, expected):
    assert _split(fmt, start, [text], drops) == expected


@pytest.mark.parametrize("fmt, start, text, drops, expected", CASES)
def test_streamed_in_any_split_the_pieces_are_the_whole_outputs(fmt, start, text, drops, expected):
    """Every cut into two and three deltas, and one character at a time: markers split anywhere."""
    assert _split(fmt, start, list(text), drops) == expected
    for i in range(len(text) + 1):
        assert _split(fmt, start, [text[:i], text[i:]], drops) == expected, i
    for i in range(0, len(text), 3):
        for j in range(i, len(text), 5):
            assert _split(fmt, start, [text[:i], text[i:j], text[j:]], drops) == expected, (i, j)


def test_a_stream_holds_back_only_what_may_begin_a_marker():
    splitter = FORMATS["qwen3"].splitter("thinking")
    assert splitter.feed("Adding up </th") == [("reasoning", "Adding up")]  # "</th" may end the thinking
    assert splitter.feed("e rest") == [("reasoning", " </the rest")]  # it did not
    assert splitter.feed("</think>\n\n") == []
    assert splitter.feed("4") == [("content", "4")]
    undecided = FORMATS["qwen3"].splitter("maybe")
    assert undecided.feed("<thi") == []  # may open a thinking block
    assert undecided.feed("s is it") == [("content", "<this is it")]
    assert held_suffix("abc</thi", ("</think>",)) == 5 and held_suffix("abc", ("</think>",)) == 0


@pytest.mark.parametrize("fmt, prompt, start", [
    ("qwen3", "<|im_start|>assistant\n", "maybe"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "thinking"),  # Qwen3-Thinking-2507 opens it
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "answer"),  # enable_thinking: false
    ("deepseek_r1", "<｜Assistant｜><think>\n", "thinking"),
    ("deepseek_r1", "<｜Assistant｜>", "thinking"),  # R1 thinks unprompted too
    ("deepseek_r1", "<｜Assistant｜></think>", "answer"),  # DeepSeek-V3.1 without thinking
    ("mistral", "[SYSTEM_PROMPT]as [THINK]thoughts[/THINK]then[/SYSTEM_PROMPT][INST]hi[/INST]", "maybe"),
    ("gpt_oss", "<|start|>assistant", "maybe"),
])
def test_where_an_output_starts_is_read_from_the_prompts_end(fmt, prompt, start):
    assert FORMATS[fmt].start_of(prompt) == start


def test_auto_takes_the_format_a_template_names_unambiguously():
    assert reasoning_format("auto", QWEN3).name == "qwen3"
    assert reasoning_format("auto", DEEPSEEK_R1).name == "deepseek_r1"
    assert reasoning_format("auto", MAGISTRAL).name == "mistral"
    assert reasoning_format("auto", GPT_OSS).name == "gpt_oss"
    assert reasoning_format("auto", {"default": QWEN3, "tool_use": QWEN3}).name == "qwen3"
    assert reasoning_format("auto", SMOLLM2) is None and reasoning_format("auto", None) is None
    assert reasoning_format("auto", QWEN3 + GPT_OSS) is None  # two signs: left alone
    assert reasoning_format("none", QWEN3) is None
    assert reasoning_format("deepseek_r1", SMOLLM2).name == "deepseek_r1"  # named: whatever the template


def test_the_flag_takes_vllms_and_sglangs_spellings_and_refuses_others():
    parse = build_parser({}).parse_args
    assert server_settings(parse(["serve"])).reasoning_parser == "auto"
    assert server_settings(parse(["serve", "--reasoning-parser", "deepseek-r1"])).reasoning_parser == "deepseek_r1"
    assert server_settings(parse(["serve", "--reasoning-parser", "openai_gptoss"])).reasoning_parser == "gpt_oss"
    assert server_settings(build_parser({"REASONING_PARSER": "none"}).parse_args(["serve"])).reasoning_parser == "none"
    with pytest.raises(ValidationError, match="--reasoning-parser must be one of"):
        server_settings(parse(["serve", "--reasoning-parser", "granite"]))
    assert parser_name("Qwen3") == "qwen3"


def test_the_gate_counts_the_free_tokens_up_to_the_end_marker():
    think, end = 7, 9
    gate = GrammarGate(after=(end,))
    assert gate.num_free([1, 2, end, 3, 4]) == 3  # the end marker is reasoning, the answer is not
    assert gate.num_free([1, 2, 3]) == 3  # no end marker: all thinking
    optional = GrammarGate(after=(end,), opener=(think,))
    assert optional.num_free([think, 1, end, 3]) == 3
    assert optional.num_free([3, think, 1, end]) == 0  # answered at once: the grammar had every token
    overlapping = GrammarGate(after=(1, 1, 2))
    assert overlapping.num_free([1, 1, 1, 2, 5]) == 4  # Knuth-Morris-Pratt: the marker found after a false start
    two = GrammarGate(after=(5, 6), opener=(3, 4))
    state, free = two.step(two.start(), 3)
    assert (state.phase, state.matched, free) == ("opening", 1, True)
    with pytest.raises(ValidationError):
        GrammarGate(after=())


def test_earlier_turns_thinking_moves_out_of_their_content():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nHello"},
                {"role": "assistant", "content": "Plain", "reasoning_content": "kept"},
                {"role": "user", "content": "<think>a user's text is theirs</think>"}]
    out = separated(FORMATS["qwen3"], messages)
    assert out[1] == {"role": "assistant", "content": "Hello", "reasoning_content": "old thoughts"}
    assert out[2] is messages[2] and out[3] is messages[3]
    assert separated(None, messages) is messages
