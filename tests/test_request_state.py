"""RequestState's outputs on the byte-table detokenizer equal those on the tokenizer's own decode.

The reference is the same request state with its detokenizer decoding every window through the
tokenizer (`use_byte_table=False`), fed the same random tokens (split multi-byte characters,
special tokens, EOS, stop ids) under stop strings, min_tokens and include_stop_str_in_output;
every RequestOutput field must match at every step, and the final text must be the full decode
cut at the first stop string found after min_tokens.
"""

import random

import pytest

from ops.sampling.params import SamplingParams
from torch_runner.detokenizer import IncrementalDetokenizer, byte_table
from torch_runner.request_state import RequestState
from torch_runner.sequence import Sequence

STOPS = ["e", "\n", " the", "ing", "é", "\n\n", "ab", "?"]
EOS = {0, 2}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from models.default_model import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _pair(tok, prompt, params):
    fast = RequestState(Sequence("fast", prompt, params), tok, EOS, 10**6)
    slow = RequestState(Sequence("slow", prompt, params), tok, EOS, 10**6)
    slow.detokenizer = IncrementalDetokenizer(
        tok, prompt, params.skip_special_tokens, use_byte_table=False
    )
    assert fast.detokenizer._table is not None and slow.detokenizer._table is None
    return fast, slow


def _fields(output):
    return (output.text, output.delta_text, output.token_ids, output.delta_token_ids,
            output.finished, output.finish_reason, output.stop_reason)  # fmt: skip


def test_outputs_equal_the_tokenizer_decode_path(tok):
    rng = random.Random(0)
    table = byte_table(tok, True)
    single = [i for i, b in enumerate(table) if len(b) == 1]
    num_stopped = 0
    for trial in range(120):
        params = SamplingParams(
            max_tokens=rng.randrange(4, 80),
            min_tokens=rng.randrange(0, 4),
            stop=rng.sample(STOPS, rng.randrange(0, 3)) or None,
            include_stop_str_in_output=rng.random() < 0.5,
            stop_token_ids=[rng.randrange(100, 110)] if rng.random() < 0.3 else None,
            skip_special_tokens=rng.random() < 0.7,
            ignore_eos=rng.random() < 0.5,
        )
        prompt = [rng.randrange(100, 2000) for _ in range(rng.randrange(1, 12))]
        fast, slow = _pair(tok, prompt, params)
        ids = []
        while True:
            r = rng.random()
            token = rng.choice(single) if r < 0.4 else rng.randrange(0, 17) if r < 0.43 else (
                rng.randrange(100, 2000))  # fmt: skip
            ids.append(token)
            finishes = fast.append(token, None, None), slow.append(token, None, None)
            assert finishes[0] == finishes[1], (trial, ids)
            for state, finish in zip((fast, slow), finishes):
                if finish is not None:
                    state.seq.finish(*finish)
            assert _fields(fast.make_output()) == _fields(slow.make_output()), (trial, ids)
            if finishes[0] is not None:
                break
        if fast.seq.stop_reason in STOPS:
            num_stopped += 1
            full = tok.backend_tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
            context = tok.backend_tokenizer.decode(prompt[-5:])
            stop = fast.seq.stop_reason
            if not context.endswith("\ufffd"):  # a clean boundary: the text is the ids' decode
                cut = full.index(stop) if params.min_tokens == 0 else None
                if cut is not None:
                    end = cut + (len(stop) if params.include_stop_str_in_output else 0)
                    assert fast.make_output().text == full[:end]
    assert num_stopped > 20  # the stop-string path ran
