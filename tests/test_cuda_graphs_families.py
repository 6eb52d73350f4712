"""CUDA graphs for the families beyond Llama (torch_runner/runner/cuda_graphs.py): gpt-oss
(sinks, sliding windows, MoE), Qwen3-MoE and Mistral (sliding windows). On CPU the static decode
with windows paged in the pool gives transformers' greedy tokens; on CUDA graph replay equals the
windowed eager engine (and transformers).
"""

import pytest
import torch
from engine_helpers import hf_greedy, save_engine_checkpoint
from test_cuda_graphs import MAX_TOKENS, PROMPTS, _engine, _run, _static

pytestmark = pytest.mark.usefixtures("one_thread")


FAMILIES = ("gpt_oss", "qwen3_moe", "mistral")  # sinks + SWA + MoE, MoE (+ SWA), SWA


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path, hf = save_engine_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, hf.eval()


def test_paged_windows_static_decode_equals_transformers(family):
    """SWA layers in the pool (swa_kv='paged', what CUDA graphs use) through the static decode,
    run eagerly on CPU: transformers' greedy tokens for every family."""
    path, hf = family
    engine = _engine(path, swa_kv="paged")
    assert engine.runner.layout.swa_layers == ()
    _static(engine)
    outputs = _run(engine)
    for prompt, tokens, m in zip(PROMPTS, outputs, MAX_TOKENS):
        assert tokens == hf_greedy(hf, prompt, m), prompt


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_cover_every_family_and_equal_the_windowed_eager_engine(family):
    path, hf = family
    windowed = _run(_engine(path, device="cuda", enforce_eager=True, swa_kv="windowed"))
    engine = _engine(path, device="cuda", cuda_graph_max_bs=8)
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.capture  # SWA, sinks and MoE are captured
    graphs.min_keys = 8
    warmed = set(graphs.graphs)
    assert _run(engine) == windowed
    assert len(set(graphs.graphs) - warmed) >= 4
    for prompt, tokens, m in zip(PROMPTS, windowed, MAX_TOKENS):
        assert tokens == hf_greedy(hf, prompt, m), prompt


def test_swa_kv_picks_where_window_layers_live_and_rejects_bad_values(family):
    from torch_runner.config import EngineConfig
    from torch_runner.runner.model_runner import ModelRunner

    with pytest.raises(
        ValueError, match="swa_kv='ring' is invalid; allowed values: auto, windowed, paged"
    ):
        EngineConfig(swa_kv="ring")
    path, _ = family
    windowed = _engine(path)  # auto on CPU: per-request windows
    paged = _engine(path, swa_kv="paged")
    args = windowed.args
    num_layers = len(args.layer_types)
    assert paged.runner.layout.full_layers == tuple(range(num_layers))
    if "sliding_attention" in args.layer_types:
        assert windowed.runner.layout.swa_layers and windowed.runner.pool.k.shape[0] < num_layers
        assert paged.runner.pool.k.shape[0] == num_layers
    per = ModelRunner.kv_bytes_per_token
    assert (
        per(args, torch.float32, True)
        == 2 * num_layers * args.num_key_value_heads * args.head_dim * 4
    )
    cuda = EngineConfig(swa_kv="auto")
    assert ModelRunner.pages_windows(cuda, torch.device("cuda"))
    assert not ModelRunner.pages_windows(cuda, torch.device("cpu"))
