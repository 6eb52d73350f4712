"""Start like vLLM: a Hub model ID served offline from a real-layout cache, generation_config defaults.

The tiny checkpoint's generation_config.json says top_k=1, so with `--generation-config auto` (the
default) a request that sets no top_k decodes greedily, and with `vllm` it samples at the neutral
defaults. The oracle for "greedy" is the same server answering with temperature=0.
"""

from __future__ import annotations

import json

import openai
import pytest
from hf_cache import add_to_cache
from serve_fixtures import ServerProcess, save_serve_checkpoint

REPO = "tiny-org/tiny-llama"
PROMPT = "The sky is"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    checkpoint, _ = save_serve_checkpoint(root / "ckpt")
    config = json.loads((checkpoint / "generation_config.json").read_text())
    config.update(temperature=1.0, top_k=1, do_sample=True)
    (checkpoint / "generation_config.json").write_text(json.dumps(config))
    add_to_cache(root / "hf", REPO, checkpoint)
    return root


def _server(hf_home, *flags):
    env = {"HF_HOME": str(hf_home / "hf"), "HF_HUB_OFFLINE": "1"}
    return ServerProcess(None, "--model", REPO, *flags, log_dir=hf_home, env=env)


def _complete(client, **fields):
    response = client.completions.create(model=REPO, prompt=PROMPT, max_tokens=12, **fields)
    return [choice.text for choice in response.choices]


def test_hub_id_served_offline_with_generation_config_defaults(hf_home):
    server = _server(hf_home, "--seed", "3")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        (card,) = client.models.list().data
        assert card.id == REPO  # served under the Hub ID, as vLLM does
        assert card.model_extra["sampling_defaults"] == {"temperature": 1.0, "top_k": 1}
        assert client.models.retrieve(REPO).id == REPO
        assert "sampling defaults: temperature=1.0, top_k=1" in server.output()
        greedy = _complete(client, temperature=0.0)
        assert _complete(client, n=4) == greedy * 4  # top_k=1 from generation_config.json
        # a request's own value wins over the default
        sampled = _complete(client, n=4, extra_body={"top_k": -1})
        assert any(text != greedy[0] for text in sampled)
    finally:
        server.stop()


def test_generation_config_vllm_keeps_neutral_defaults(hf_home):
    server = _server(hf_home, "--generation-config", "vllm")
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        assert client.models.retrieve(REPO).model_extra["sampling_defaults"] == {}
        assert "sampling defaults: neutral (--generation-config vllm)" in server.output()
        greedy = _complete(client, temperature=0.0)
        assert any(text != greedy[0] for text in _complete(client, n=4))
    finally:
        server.stop()
