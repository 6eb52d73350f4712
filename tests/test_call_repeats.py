"""The repeat rule of `tool_choice: "required"` (serve/call_repeats.py) against a brute-force
reference, and the engine request it ends.

Reference: parse the whole list of calls with `json`, keep calls up to the first one whose name
and parsed arguments equal an earlier call's. The guard sees the same text in random chunks, as
the engine's increments bring it: what it shows must parse (with the server's forced-call parser,
streamed and whole) to exactly the kept calls, only ever grow, and never show a character of the
dropped repeat.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

from torch_runner.serve.call_repeats import RepeatGuard
from torch_runner.serve.generation import Choice, merge_choices
from torch_runner.serve.metrics import ChoiceTracker
from torch_runner.serve.parsing import accumulate
from torch_runner.serve.tool_parsers.forced import RequiredCallsParser

POOL = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_weather", {"city": "Rome", "unit": "celsius"}),
    ("get_weather", {"city": "Paris", "unit": "fahrenheit"}),
    ("get_weather", {"city": 'Pa"ris}, {', "unit": "celsius"}),  # brackets inside a string
    ("get_time", {"zone": "CET", "nested": {"a": [1, {"b": "}"}], "c": None}}),
    ("get_time", {}),
    ("get_time", {"zone": "Zürich\\n"}),
]


def _text(calls, layout: str) -> str:
    """The list as xgrammar's `required` grammar writes it (", " and ": "), or compacted."""
    items = [{"name": name, "parameters": args} for name, args in calls]
    if layout == "compact":
        return json.dumps(items, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(items, ensure_ascii=False)


def _reference(calls) -> tuple[list[tuple[str, dict]], bool]:
    seen, kept = set(), []
    for name, args in calls:
        key = (name, json.dumps(args, sort_keys=True))
        if key in seen:
            return kept, True
        seen.add(key)
        kept.append((name, args))
    return kept, False


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _parsed(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def test_the_guard_keeps_exactly_the_calls_before_the_first_repeat():
    rng = random.Random(0)
    for trial in range(600):
        calls = [rng.choice(POOL) for _ in range(rng.randint(1, 6))]
        text = _text(calls, rng.choice(["grammar", "compact"]))
        chunks = _chunks(text, rng)
        guard, parser, deltas = RepeatGuard(), RequiredCallsParser(), []
        shown, fed = "", ""
        for i, chunk in enumerate(chunks):
            fed += chunk
            visible = guard.visible(fed, is_final=i == len(chunks) - 1)
            assert visible.startswith(shown), trial  # text only grows
            deltas.append(parser.feed(visible[len(shown) :], []))
            shown = visible
            if guard.is_cut:
                break
        deltas.append(parser.finish())
        kept, is_cut = _reference(calls)
        assert guard.is_cut == is_cut, (trial, text)
        whole = RequiredCallsParser().parse(shown, [])
        assert _parsed(whole.tool_calls) == kept, (trial, text, shown)
        assert _parsed(accumulate(deltas).tool_calls) == kept, (trial, text, shown)
        if is_cut:  # nothing of the repeat (or after it) was ever shown
            assert text.startswith(shown)
            assert shown.rstrip(", ").endswith("}"), shown


def test_a_repeat_is_held_back_while_written_and_a_new_call_is_not():
    guard = RepeatGuard()
    first = '[{"name": "f", "parameters": {"city": "Paris"}}, '
    assert guard.visible(first) == first
    assert guard.visible(first + '{"name": "f", "parameters": {"ci') == first  # may repeat
    diverged = first + '{"name": "f", "parameters": {"city": "Ro'
    assert guard.visible(diverged) == diverged  # can no longer repeat: streamed at once
    assert not guard.is_cut


def test_output_cut_by_max_tokens_inside_a_held_call_is_all_shown():
    """finish_reason "length" inside a possible repeat: shown as it was (the parser reports the
    cut-off call as it does without the guard)."""
    text = '[{"name": "f", "parameters": {}}, {"name": "f", "param'
    guard = RepeatGuard()
    assert guard.visible(text) != text
    assert guard.visible(text, is_final=True) == text and not guard.is_cut


def test_only_an_exact_spelling_is_a_repeat():
    """The grammar fixes the layout, so equal JSON is equal text, but for a string escaped or a
    number spelled differently: that call counts as a new one (documented in docs/serving.md)."""
    text = (
        '[{"name": "f", "parameters": {"c": "P"}}, {"name": "f", "parameters": {"c": "\\u0050"}}]'
    )
    guard = RepeatGuard()
    assert guard.visible(text, is_final=True) == text and not guard.is_cut


class _LoopingEngine:
    """An engine whose one request writes `get_weather` Paris / Rome forever (what the 135M
    default model does): cumulative outputs, one call per step."""

    def __init__(self):
        self.aborted: list[str] = []
        self.num_outputs = 0

    def submit(self, requests):
        return [self._outputs() for _ in requests]

    async def _outputs(self):
        text = "["
        for step in range(10_000):
            city = "Paris" if step % 2 == 0 else "Rome"
            text += (", " if step else "") + json.dumps({"name": "f", "parameters": {"c": city}})
            self.num_outputs += 1
            yield SimpleNamespace(
                text=text, token_ids=list(range(step + 1)), logprobs=None, finished=False
            )
            await asyncio.sleep(0)

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_repeat_aborts_the_engine_request_with_finish_reason_stop():
    engine = _LoopingEngine()
    choice = Choice(0, 0, "r-0", [], None, ChoiceTracker(0.0), guard=RepeatGuard())

    async def run():
        return [increment async for increment in merge_choices(engine, [choice])]

    increments = asyncio.run(run())
    assert engine.aborted == ["r-0"] and engine.num_outputs == 3  # no step after the repeat
    assert increments[-1].is_final and choice.finish_reason == "stop"
    calls = RequiredCallsParser().parse(choice.text, []).tool_calls
    assert _parsed(calls) == [("f", {"c": "Paris"}), ("f", {"c": "Rome"})]
    assert "".join(increment.delta_text for increment in increments) == choice.text
