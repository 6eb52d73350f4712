"""The server, end to end, through the official openai client against a real server process.

Oracles: the offline `Engine` on the same checkpoint (what the server must relay unchanged) and
transformers' reference model (greedy tokens and logprob values). The byte-level tokenizer makes
token id == byte value, so chat logprobs' `bytes` recover the generated ids exactly.
"""

from __future__ import annotations

import re

import httpx
import pytest
import torch
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import API_KEY, MODEL_NAME, ServerProcess, save_serve_checkpoint

from torch_runner import Engine, SamplingParams

PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0}
NO_EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_serve_checkpoint(tmp_path_factory.mktemp("serve_openai") / "tiny")


@pytest.fixture(scope="module")
def server(checkpoint):
    process = ServerProcess(checkpoint[0], "--api-key", API_KEY, "--max-total-tokens", "8192")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def engine(checkpoint):
    saved = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # the oracle runs in this process: avoid thread contention (see serve_fixtures)
    yield Engine(model=str(checkpoint[0]), device="cpu", max_total_tokens=4096)
    torch.set_num_threads(saved)


def _chat_prompt_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


def test_startup_banner_names_device_dtype_backends_kv_and_url(server):
    banner = server.output()
    assert banner.count("torch_runner serve:") == 1
    for needle in (
        "device: cpu",
        "dtype: float32",
        "attention=torch",
        "sampler=torch",
        "KV capacity: 8192 tokens",
    ):
        assert needle in banner, needle
    assert f"{server.base_url}/v1" in banner
    frozen = re.search(r"start-up heap: (\d+) objects frozen", banner)
    assert frozen and int(frozen.group(1)) > 10_000  # torch + the engine, after the warm-up


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completion_equals_offline_engine(client, engine):
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=24, **GREEDY, **NO_EOS
    )
    expected = engine.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    )[0]
    assert reply.choices[0].text == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 24
    assert reply.usage.prompt_tokens == len(engine.tokenizer(PROMPT).input_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 24


def test_greedy_chat_tokens_and_logprobs_match_transformers(client, engine, checkpoint):
    messages = [{"role": "user", "content": "Name three colours."}]
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=10,
        logprobs=True,
        top_logprobs=3,
        **GREEDY,
        **NO_EOS,
    )
    content = reply.choices[0].logprobs.content
    generated = [item.bytes[0] for item in content]  # byte tokenizer: id == byte value
    ids = _chat_prompt_ids(engine, messages)
    hf_model = checkpoint[1]
    with torch.no_grad():
        for item, token_id in zip(content, generated):
            logprobs = torch.log_softmax(
                hf_model(torch.tensor([ids])).logits[0, -1].float(), dim=-1
            )
            assert token_id == int(logprobs.argmax())
            assert item.logprob == pytest.approx(float(logprobs[token_id]), abs=1e-4)
            top = torch.topk(logprobs, 3)
            assert [alt.bytes[0] for alt in item.top_logprobs] == top.indices.tolist()
            assert [alt.logprob for alt in item.top_logprobs] == pytest.approx(
                top.values.tolist(), abs=1e-4
            )
            ids.append(token_id)
    assert len(generated) == reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len(_chat_prompt_ids(engine, messages))


def test_completion_logprobs_agree_with_chat_logprobs(client, engine):
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=8,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
        **NO_EOS,
    )
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt=_chat_prompt_ids(engine, messages),
        max_tokens=8,
        logprobs=2,
        **GREEDY,
        **NO_EOS,
    )
    logprobs = completion.choices[0].logprobs
    assert completion.choices[0].text == chat.choices[0].message.content
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert logprobs.token_logprobs == pytest.approx(
        [item.logprob for item in chat.choices[0].logprobs.content]
    )
    assert all(1 <= len(alternatives) <= 2 for alternatives in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_greedy_stream_equals_non_stream(client, endpoint):
    if endpoint == "completions":
        create = client.completions.create
        kwargs = {"prompt": PROMPT, "max_tokens": 20}
    else:
        create = client.chat.completions.create
        kwargs = {
            "messages": [{"role": "user", "content": "Stream me"}],
            "max_completion_tokens": 20,
        }
    whole = create(model=MODEL_NAME, **kwargs, **GREEDY, **NO_EOS)
    chunks = list(
        create(
            model=MODEL_NAME,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,
            **GREEDY,
            **NO_EOS,
        )
    )
    if endpoint == "completions":
        text, expected = (
            "".join(c.choices[0].text for c in chunks if c.choices),
            whole.choices[0].text,
        )
    else:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expected = whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant"
    assert text == expected
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    usage = chunks[-1].usage  # the streamed run comes second: its prompt may hit the prefix cache
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        whole.usage.prompt_tokens, 20, whole.usage.prompt_tokens + 20,
    )  # fmt: skip
    assert all(c.usage is None for c in chunks[:-1])


def test_n2_choices_differ_and_each_reproduces_with_seed_plus_i(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, **NO_EOS)
    both = client.completions.create(n=2, seed=1234, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    first = client.completions.create(seed=1234, **kwargs).choices[0].text
    second = client.completions.create(seed=1235, **kwargs).choices[0].text
    assert [c.text for c in both.choices] == [first, second]
    assert first != second
    assert both.usage.completion_tokens == 32


def test_streamed_n2_choices_equal_non_streamed_ones(client):
    kwargs = dict(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Two"}], max_completion_tokens=12
    )
    kwargs |= dict(n=2, seed=99, temperature=1.0, **NO_EOS)
    whole = client.chat.completions.create(**kwargs)
    texts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]


def test_same_seed_same_chat_text(client):
    kwargs = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Surprise me"}],
        max_completion_tokens=16,
    )
    texts = {
        client.chat.completions.create(seed=7, temperature=1.0, **kwargs).choices[0].message.content
        for _ in range(2)
    }
    other = (
        client.chat.completions.create(seed=8, temperature=1.0, **kwargs).choices[0].message.content
    )
    assert len(texts) == 1 and other not in texts


def test_stop_string_truncates_and_reports_stop(client):
    full = (
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=40, **GREEDY, **NO_EOS
        )
        .choices[0]
        .text
    )
    start = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    reply = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=40, stop=[stop], **GREEDY, **NO_EOS
    )
    assert reply.choices[0].text == full[: full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=40,
            stop=stop,
            stream=True,
            **GREEDY,
            **NO_EOS,
        )
    )
    assert (
        "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    )  # held-back text never leaks
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_bounds_length_and_finish_reason(client):
    reply = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=3,
        **GREEDY,
        **NO_EOS,
    )
    assert reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "length"


def test_logit_bias_reaches_the_sampler(client):
    # +100 on byte "A" (id 65 in the byte tokenizer) dominates a random model's logits.
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=1.0,
        seed=3,
        logit_bias={"65": 100},
        **NO_EOS,
    )
    assert reply.choices[0].text == "AAAAA"


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, **GREEDY, **NO_EOS
    )
    echoed = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, echo=True, **GREEDY, **NO_EOS
    )
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_prompt_list_and_token_ids_match_single_string_prompts(client, engine):
    prompts = [PROMPT, "Another prompt"]
    batch = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=8, **GREEDY, **NO_EOS
    )
    singles = [
        client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, **GREEDY, **NO_EOS)
        .choices[0]
        .text
        for p in prompts
    ]
    assert [c.text for c in batch.choices] == singles
    token_lists = [list(engine.tokenizer(p).input_ids) for p in prompts]
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=token_lists, max_tokens=8, **GREEDY, **NO_EOS
    )
    assert [c.text for c in by_ids.choices] == singles
    assert by_ids.usage.prompt_tokens == sum(len(ids) for ids in token_lists)


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = "A long shared prefix for the radix cache: " * 3  # 129 tokens: 8 full blocks of 16
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, **GREEDY)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens % 16 == 0
    assert second.choices[0].text == first.choices[0].text


def test_metrics_parse_as_prometheus_and_count_requests(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **GREEDY, **NO_EOS)
    text = httpx.get(f"{server.base_url}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    model = (("model", MODEL_NAME),)
    ok = (("endpoint", "/v1/completions"), ("model", MODEL_NAME), ("status", "200"))
    assert samples[("torch_runner_requests_total", ok)] >= 1
    assert samples[("torch_runner_generation_tokens_total", model)] >= 4
    assert samples[("torch_runner_time_to_first_token_seconds_count", model)] >= 1
    assert samples[("torch_runner_time_per_output_token_seconds_count", model)] >= 3
    assert samples[("torch_runner_num_requests_running", ())] == 0
    assert samples[("torch_runner_kv_cache_total_tokens", ())] == 8192


def test_openapi_schema_describes_the_endpoints(server):
    spec = httpx.get(f"{server.base_url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert path in spec["paths"], path
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
