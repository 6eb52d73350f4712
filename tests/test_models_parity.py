"""Every family matches transformers (eager attention, fp32) and its own cached decode.

Oracle: the transformers model the checkpoint was saved from. Contracts pinned:
- logits of a 64-token prompt within 1e-4 (max abs) of transformers, batch of 2;
- a greedy 32-token continuation through our caches equals transformers' `generate`;
- prefill then one-token decodes (and a chunked prefill) equal one full forward.
"""

from __future__ import annotations

import pytest
import torch
from reference_cache import ContiguousCache, RaggedCache, make_caches
from tiny_models import FAMILIES, VOCAB_SIZE, build_tiny_model, save_tiny_checkpoint

import models

PROMPT_LEN = 64
NEW_TOKENS = 32
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny matmuls: one thread avoids OpenMP oversubscription on the shared 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model_type, our LoadedModel, the transformers reference) for one family."""
    model_type = request.param
    path = save_tiny_checkpoint(model_type, tmp_path_factory.mktemp(model_type))
    loaded = models.load_model(path, device="cpu", dtype="float32")
    return model_type, loaded, build_tiny_model(model_type)


def prompt(batch: int = 1, length: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (batch, length), generator=gen)  # [B, N], no special ids


def positions_for(ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)


@torch.no_grad()
def test_logits_match_transformers_within_1e4(family):
    model_type, loaded, reference = family
    ids = prompt(batch=2)
    want = reference(ids).logits  # [2, 64, V]
    got = loaded.model.compute_logits(loaded.model(ids, positions_for(ids), None))
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < ATOL, f"{model_type}: max abs logit error {err}"


@torch.no_grad()
def greedy(model, args, ids: torch.Tensor, num_new: int) -> list[int]:
    """Our greedy loop: one prefill through per-layer caches, then one token per step."""
    caches = make_caches(args)
    hidden = model(ids, positions_for(ids), caches)
    out = []
    token = model.compute_logits(hidden[:, -1]).argmax(-1)  # [1]
    for step in range(num_new):
        out.append(int(token))
        if step == num_new - 1:
            break
        pos = torch.tensor([[ids.shape[1] + step]])
        hidden = model(token[:, None], pos, caches)
        token = model.compute_logits(hidden[:, -1]).argmax(-1)
    return out


@torch.no_grad()
def test_greedy_continuation_equals_transformers_generate(family):
    model_type, loaded, reference = family
    ids = prompt()
    reference.generation_config.eos_token_id = None  # never stop early
    want = reference.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )[0, PROMPT_LEN:].tolist()
    assert len(want) == NEW_TOKENS
    assert greedy(loaded.model, loaded.args, ids, NEW_TOKENS) == want, model_type


@torch.no_grad()
@pytest.mark.parametrize("prefill_chunk", [PROMPT_LEN, 20])
def test_prefill_then_decode_equals_full_forward(family, prefill_chunk):
    model_type, loaded, _ = family
    model = loaded.model
    ids = prompt(batch=2, length=PROMPT_LEN + 16, seed=3)
    full = model(ids, positions_for(ids), None)  # [2, 80, H], no cache
    caches = make_caches(loaded.args)
    pieces = []
    for start in range(0, PROMPT_LEN, prefill_chunk):
        chunk = ids[:, start : min(start + prefill_chunk, PROMPT_LEN)]
        pieces.append(model(chunk, positions_for(chunk, start), caches))
    for t in range(PROMPT_LEN, ids.shape[1]):
        pieces.append(model(ids[:, t : t + 1], positions_for(ids[:, t : t + 1], t), caches))
    stepped = torch.cat(pieces, dim=1)
    err = (stepped - full).abs().max().item()
    assert err < 1e-5, f"{model_type}: cached forward drifts from full forward by {err}"


@torch.no_grad()
def test_windowed_layers_see_only_their_window(family):
    """With every cache full-history (no windowed storage), sliding layers must still apply
    their window: outputs equal the windowed-cache run. Catches a model that forgets `window`."""
    model_type, loaded, _ = family
    if loaded.args.sliding_window is None:
        pytest.skip(f"{model_type} tiny config has no sliding layers")
    model = loaded.model
    ids = prompt(length=PROMPT_LEN, seed=5)
    full_history = [ContiguousCache() for _ in loaded.args.layer_types]
    windowed = make_caches(loaded.args)
    a = model(ids, positions_for(ids), full_history)
    b = model(ids, positions_for(ids), windowed)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.slow
def test_mlx_backend_swaps_into_every_family():
    """With TORCH_RUNNER_USE_MLX=1 the models pick up MLX attention/rms_norm with no code change
    and still match transformers (run in a subprocess: the backend is chosen once per process)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("mlx") is None:
        pytest.skip("mlx is not installed")
    env = {**os.environ, "TORCH_RUNNER_USE_MLX": "1"}
    script = "import ops, models; assert ops.backends()['attention'] == 'mlx'; print('mlx')"
    assert (
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True
        ).stdout
        == "mlx\n"
    )
    test_id = f"{__file__}::test_logits_match_transformers_within_1e4"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert f"{len(FAMILIES)} passed" in result.stdout


@torch.no_grad()
def test_batched_decode_rows_at_different_positions_match_single_rows(family):
    """One decode step over two requests of different lengths (padded keys, per-row kv_lens and
    positions) equals decoding each request alone: rows never leak into each other."""
    model_type, loaded, _ = family
    model, num_layers = loaded.model, loaded.args.num_hidden_layers
    lengths, next_tokens = (40, 64), torch.tensor([[7], [11]])
    per_row, singles = [], []
    for row, length in enumerate(lengths):
        ids = prompt(length=length, seed=10 + row)
        # full-history caches on every layer: sliding layers apply their window from positions
        caches = [ContiguousCache() for _ in range(num_layers)]
        model(ids, positions_for(ids), caches)
        per_row.append(caches)
        alone = make_caches(loaded.args)  # the windowed storage as the single-row oracle
        model(ids, positions_for(ids), alone)
        singles.append(model(next_tokens[row : row + 1], torch.tensor([[length]]), alone))
    ragged = [RaggedCache([per_row[0][i], per_row[1][i]], capacity=80) for i in range(num_layers)]
    batched = model(next_tokens, torch.tensor([[lengths[0]], [lengths[1]]]), ragged)  # [2, 1, H]
    err = (batched - torch.cat(singles)).abs().max().item()
    assert err < 1e-5, f"{model_type}: batched ragged decode differs from single rows by {err}"
