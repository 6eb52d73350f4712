"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is faster, and far faster on a loaded 2-core box.
    Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def exact_fp32(monkeypatch):
    """An fp32 model's quantized linears compute in fp32 (not in bf16, as they do on a bf16 CPU:
    ops/quant/int_linear.py), for tests whose oracle is the exact fp32 matmul."""
    from models import quantize

    monkeypatch.setattr(quantize, "ROUND_FP32_ACTIVATIONS", False)
    monkeypatch.setenv("TORCH_RUNNER_EXACT_FP32_QUANT", "1")  # spawned tensor-parallel ranks
    # torch's kernels: the native CPU ones (ops/cpu_native) round activations to q8 blocks
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "torch")


@pytest.fixture
def torch_cpu_kernels(monkeypatch):
    """CPU linears on torch's kernels (ops/quant/int_linear.py formats, oneDNN packing), not the
    native ones (ops/cpu_native), for tests that pin the torch path's own numerics."""
    monkeypatch.setenv("TORCH_RUNNER_CPU_KERNELS", "torch")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama engine checkpoint with large weights (initializer_range 0.5: distinct
    logits, so greedy tokens are stable): (path, transformers reference model)."""
    from engine_helpers import save_engine_checkpoint

    path, hf = save_engine_checkpoint(
        "llama", tmp_path_factory.mktemp("llama"), initializer_range=0.5
    )
    return str(path), hf


@pytest.fixture(scope="session")
def harmony_tokenizer_dir(tmp_path_factory):
    """gpt-oss's real tokenizer (o200k_harmony, from quicktok-v1's offline data), saved once."""
    from harmony_tokenizer import save_harmony_tokenizer

    return save_harmony_tokenizer(tmp_path_factory.mktemp("harmony_tokenizer"))


@pytest.fixture(scope="session")
def harmony_encoding(harmony_tokenizer_dir, tmp_path_factory):
    """openai-harmony's encoding, loaded without network from that tokenizer (as the server does)."""
    from transformers import AutoTokenizer

    from torch_runner.serve.reasoning import harmony_encoding as loader

    tokenizer = AutoTokenizer.from_pretrained(str(harmony_tokenizer_dir))
    with pytest.MonkeyPatch.context() as env:
        env.delenv(loader.ENCODINGS_ENV, raising=False)
        env.setenv("TORCH_RUNNER_CACHE_DIR", str(tmp_path_factory.mktemp("harmony_cache")))
        return loader.load_harmony_encoding(tokenizer)
