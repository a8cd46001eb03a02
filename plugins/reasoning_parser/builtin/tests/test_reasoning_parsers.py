"""The built-in reasoning parsers against outputs written the way DeepSeek-R1 and Qwen3 think."""

import pytest

from fw import plugins
from fw.interfaces.reasoning_parser import ReasoningDelta
from fw.interfaces.spec import PluginError
from fw.testing.parser_conformance import ReasoningParserConformance

COMMON = {
    "<think>\nThe user greets me; 東京 is Tokyo.\n</think>\n\nHello! 👋": ("\nThe user greets me; 東京 is Tokyo.\n", "\n\nHello! 👋"),
    "<think>Short.</think>": ("Short.", ""),
    "<think></think>Straight to it.": (None, "Straight to it."),
    "<think>Cut off in the middle of thinking": ("Cut off in the middle of thinking", None),
    # Only the first </think> ends the reasoning; later tags are the answer's text.
    "<think>a</think>b</think><think>c": ("a", "b</think><think>c"),
    "": (None, None),
}


class TestDeepSeekR1(ReasoningParserConformance):
    plugin = "deepseek_r1"
    samples = {
        **COMMON,
        # R1's template opens <think> in the prompt: the output starts inside the reasoning.
        "The sum is 4.\n</think>\n\n2 + 2 = 4.": ("The sum is 4.\n", "\n\n2 + 2 = 4."),
        "Never closed": ("Never closed", None),
        "</think>Nothing to think about.": (None, "Nothing to think about."),
    }


class TestQwen3(ReasoningParserConformance):
    plugin = "qwen3"
    samples = {
        **COMMON,
        # enable_thinking=False: the template closes an empty think block in the prompt; the output is all answer.
        "Hello! How can I help?": (None, "Hello! How can I help?"),
        "Hi <think>not a tag here</think> ok": (None, "Hi <think>not a tag here</think> ok"),
        "  \n<think>leading whitespace</think>answer": ("leading whitespace", "answer"),
    }


@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_a_stream_cut_inside_either_tag_waits_for_its_end(name):
    parser = plugins.load_parser("reasoning_parsers", name)(None)
    sent = [parser.feed(piece) for piece in ("<thi", "nk>Let me see", ".</thi", "nk>", "The answer.")] + [parser.finish()]
    assert [(d.reasoning, d.content) for d in sent] == [
        ("", ""), ("Let me see", ""), (".", ""), ("", ""), ("", "The answer."), ("", ""),
    ]


def test_qwen3_without_thinking_streams_its_answer_as_it_comes():
    parser = plugins.load_parser("reasoning_parsers", "qwen3")(None)
    assert [parser.feed(piece).content for piece in ("Hel", "lo ", "there")] == ["Hel", "lo", " there"]
    assert parser.finish() == ReasoningDelta()  # nothing was held back


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from fw.testing.models import write_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path)
    return path


def test_reasoning_ends_with_the_tokens_of_its_tag(tokenizer_dir):
    from fw.sdk.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(str(tokenizer_dir))
    parser = plugins.load_parser("reasoning_parsers", "deepseek_r1")(tokenizer)
    reasoning = tokenizer.encode("I should answer briefly.</think>", add_special_tokens=False)
    answer = tokenizer.encode("Yes.", add_special_tokens=False)
    assert not parser.is_reasoning_end(reasoning[:-1])  # "</think" is not the tag yet
    assert parser.is_reasoning_end(reasoning)
    assert parser.content_token_ids(reasoning + answer) == answer


def test_an_unknown_parser_names_the_installed_ones():
    with pytest.raises(PluginError, match=r"unknown reasoning parser 'r2' \(installed: deepseek_r1, qwen3"):
        plugins.load_parser("reasoning_parsers", "r2")
