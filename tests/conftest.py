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


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama engine checkpoint with large weights (initializer_range 0.5: distinct
    logits, so greedy tokens are stable): (path, transformers reference model)."""
    from engine_helpers import save_engine_checkpoint

    path, hf = save_engine_checkpoint(
        "llama", tmp_path_factory.mktemp("llama"), initializer_range=0.5
    )
    return str(path), hf
