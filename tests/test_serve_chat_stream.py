"""Streamed chat choices render from each increment's own snapshot, however far rendering lags.

The flake `test_stream_accumulates_to_the_non_streamed_answer[auto-extra2]` once streamed content
"Sure.>" where the answer is "Sure.": rendering lags the engine (the pump folds later outputs
into the `Choice` while an older increment waits to be sent), and the parser was finished when
the *choice* had finished, not the increment. The increment holding `...</tool_call` then
flushed the held-back `</tool_call` into the open block and closed it; the `>` of the next
increment arrived after that and became content. These tests rebuild that lag deterministically
(every output folded in before the first render) with the real hermes parser; the oracle is the
parser's own `parse` of the whole text and the openai-style accumulation of the deltas.
"""

from __future__ import annotations

from torch_runner.outputs import RequestOutput
from torch_runner.serve.chat_stream import ChoiceRenderer
from torch_runner.serve.generation import Choice, apply_output
from torch_runner.serve.metrics import ChoiceTracker
from torch_runner.serve.parsing import DeltaMessage, accumulate
from torch_runner.serve.tool_parsers.hermes import HermesToolParser

TEXT = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
EOS = 0


def _outputs(text: str, sizes: list[int]) -> list[RequestOutput]:
    """Cumulative outputs, one per chunk of `sizes` characters (one token per character), then
    the EOS that finishes the request (it adds no text)."""
    outputs, end, ids = [], 0, []
    for size in [*sizes, 0]:
        end = min(len(text), end + size)
        ids = [ord(c) for c in text[:end]] + ([EOS] if size == 0 else [])
        finished = size == 0
        outputs.append(
            RequestOutput(
                "r", [], ids, text[:end], "", [], None, finished, "stop" if finished else None, 0
            )
        )
    return outputs


def _lagged_increments(sizes):
    """Every output folded into the choice before any is rendered: the most rendering can lag."""
    choice = Choice(0, 0, "r", [], None, ChoiceTracker(0.0))
    return choice, [apply_output(choice, output, 0.0) for output in _outputs(TEXT, sizes)]


def _splits():
    """The chunkings that end an increment right before the `>` of `</tool_call>`, and others."""
    gt = len(TEXT) - 1
    yield [gt, 1]
    yield [5, gt - 5, 1]
    yield [1] * len(TEXT)
    yield [gt - 3, 3, 1]


def test_a_lagging_render_finishes_the_parser_only_on_the_final_increment():
    whole = HermesToolParser().parse(TEXT, [])
    for sizes in _splits():
        choice, increments = _lagged_increments(sizes)
        assert choice.is_finished and [i.is_final for i in increments].count(True) == 1
        renderer = ChoiceRenderer(HermesToolParser(), None, lambda c: len(c.token_ids) - 1)
        deltas = [r[0] for r in map(renderer.render, increments) if r is not None]
        streamed = accumulate(deltas)
        assert streamed.content == whole.content == "Sure.", sizes
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls
        ]


def test_finishing_on_the_choice_state_reproduces_the_flake():
    """The old rule (finish when the lagging choice is finished) gives exactly the flake's text."""
    choice, increments = _lagged_increments([len(TEXT) - 1, 1])
    parser, deltas = HermesToolParser(), []
    for increment in increments:
        message = parser.feed(increment.delta_text, increment.delta_token_ids)
        deltas.append(message)
        if choice.is_finished:  # live state: already true while the first increment renders
            deltas.append(parser.finish())
    assert accumulate(deltas).content == "Sure.>"


def test_the_hermes_parser_is_exact_at_every_pair_of_splits():
    """No chunking by itself yields the flake: only finishing early does (test above)."""
    whole = HermesToolParser().parse(TEXT, [])
    for i in range(1, len(TEXT)):
        for j in range(i, len(TEXT), 7):
            parser = HermesToolParser()
            pieces = [TEXT[:i], TEXT[i:j], TEXT[j:]]
            deltas: list[DeltaMessage] = [parser.feed(p, []) for p in pieces] + [parser.finish()]
            assert accumulate(deltas).content == whole.content, (i, j)


class _CharTable:
    """One character per token (id = code point), as the byte tokenizer of the HTTP tests."""

    @staticmethod
    def text(token_id: int) -> str:
        return chr(token_id) if token_id else ""


LABEL_TEXTS = [
    TEXT,
    "x < y <tool_ and more",
    "<tool_call>hello</tool_call> tail",
    'pre <tool_call>{"name": "f", "arguments": {}}</tool_call> post',
    'a <tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
    "only words, trailing blanks   ",
]


def test_content_logprobs_spell_the_content_at_any_chunking():
    """Oracle: the parser's own `parse` of the whole text; the picked tokens' characters must
    spell its content exactly (the end-of-turn token never picked), for seeded random chunkings."""
    import random

    from torch_runner.serve.logprob_fields import TokenLabeler

    rng = random.Random(0)
    for text in LABEL_TEXTS:
        want = HermesToolParser().parse(text, []).content or ""
        for _ in range(15):
            sizes = []
            while sum(sizes) < len(text):
                sizes.append(rng.randint(1, 6))
            choice = Choice(0, 0, "r", [], None, ChoiceTracker(0.0))
            outputs = _outputs(text, sizes)
            for output in outputs:
                output.logprobs = [
                    type("L", (), {"logprob": -1.0, "top_logprobs": []})() for _ in output.token_ids
                ]
            increments = [apply_output(choice, output, 0.0) for output in outputs]
            parser = HermesToolParser()
            labeler = TokenLabeler(parser, _CharTable(), frozenset({EOS}))
            renderer = ChoiceRenderer(parser, labeler, lambda c: len(c.token_ids) - 1)
            picked = "".join(
                chr(token_id)
                for rendered in map(renderer.render, increments)
                if rendered is not None
                for token_id, _ in rendered[1]
            )
            assert picked == want, (text, sizes)
