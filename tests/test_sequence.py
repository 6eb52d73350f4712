"""Sequence.token_slice against the brute-force slice of the whole token list."""

from torch_runner.sequence import Sequence


def test_token_slice_is_the_slice_of_prompt_plus_outputs():
    seq = Sequence("r", [10, 11, 12, 13])
    for token in (20, 21, 22):
        seq.append_token(token)
    whole = seq.prompt_token_ids + seq.output_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert seq.token_slice(start, end) == whole[start:end], (start, end)
