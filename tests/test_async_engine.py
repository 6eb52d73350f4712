"""AsyncEngine contracts: concurrent requests stream the same tokens as the offline engine,
leaving the stream early aborts (pool returns), a bad request fails only itself, and a full
waiting queue refuses new requests with a clear over-capacity error."""

import asyncio

import pytest
import torch
from engine_helpers import save_engine_checkpoint

from torch_runner import AsyncEngine, Engine, EngineOverCapacityError, SamplingParams

PROMPTS = [[5, 6, 7], list(range(20, 45)), [100] * 9]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory, _ = save_engine_checkpoint(
        "llama", tmp_path_factory.mktemp("llama"), initializer_range=0.5
    )
    yield str(directory)
    torch.set_num_threads(before)


def _engine(path, **kwargs):
    return Engine(
        path, device="cpu", max_total_tokens=1024, block_size=4, chunked_prefill_size=16, **kwargs
    )


async def _collect(async_engine, rid, prompt, params):
    outs = [out async for out in async_engine.generate(rid, prompt, params)]
    return outs


def test_concurrent_streams_equal_offline_generate(path):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = _engine(path).generate(PROMPTS, params)
    async_engine = AsyncEngine(_engine(path))
    async_engine.start()
    try:

        async def main():
            return await asyncio.gather(
                *(_collect(async_engine, f"r{i}", p, params) for i, p in enumerate(PROMPTS))
            )

        results = asyncio.run(main())
    finally:
        async_engine.shutdown()
    for outs, ref in zip(results, offline):
        assert outs[-1].finished and outs[-1].token_ids == ref.token_ids
        assert [t for o in outs for t in o.delta_token_ids] == ref.token_ids
        assert "".join(o.delta_text for o in outs) == ref.text


def test_leaving_a_stream_aborts_it_and_frees_the_pool(path):
    engine = _engine(path, enable_prefix_caching=False)
    initial = engine.block_manager.num_free_blocks
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    try:

        async def main():
            stream = async_engine.generate("long", PROMPTS[1], params)
            async for out in stream:
                if len(out.token_ids) >= 3:
                    break
            await stream.aclose()
            for _ in range(200):
                if async_engine.stats()["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)

        asyncio.run(main())
        stats = async_engine.stats()
    finally:
        async_engine.shutdown()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert engine.block_manager.num_free_blocks == initial


def test_bad_request_fails_alone_and_full_queue_is_over_capacity(path):
    async_engine = AsyncEngine(_engine(path, max_num_seqs=1), max_waiting=1)
    async_engine.start()
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    try:

        async def wait_for(key, value):
            for _ in range(500):
                if async_engine.stats()[key] == value:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"{key} never reached {value}")

        async def main():
            with pytest.raises(ValueError, match="out of range"):
                await _collect(async_engine, "bad", [999], short)
            good = await _collect(async_engine, "good", PROMPTS[0], short)
            assert good[-1].finished
            running = asyncio.create_task(_collect(async_engine, "a", PROMPTS[0], long))
            await wait_for("num_running", 1)
            queued = asyncio.create_task(_collect(async_engine, "b", PROMPTS[0], short))
            await wait_for("num_waiting", 1)  # max_num_seqs=1: "b" waits behind "a"
            with pytest.raises(EngineOverCapacityError, match="over capacity"):
                await _collect(async_engine, "c", PROMPTS[0], short)
            running.cancel()
            done = await queued  # "a" was aborted by the cancel, so "b" runs
            assert done[-1].finished and len(done[-1].token_ids) == 4

        asyncio.run(main())
    finally:
        async_engine.shutdown()


def test_a_consumer_behind_the_engine_gets_merged_outputs_with_every_delta(path):
    """The consumer reads nothing until the request is done: the queued outputs arrive merged
    (fewer outputs than tokens), their deltas still add up to the offline engine's tokens and
    text, and the last one is the finished cumulative state."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (ref,) = _engine(path).generate([PROMPTS[1]], params)
    async_engine = AsyncEngine(_engine(path))
    async_engine.start()
    try:

        async def main():
            stream = async_engine.generate("late", PROMPTS[1], params)
            first = await stream.__anext__()
            while async_engine.engine.has_unfinished():  # the engine runs on; nobody reads
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the last step's callback reaches the loop
            return [first] + [out async for out in stream]

        outs = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert len(outs) < len(ref.token_ids)  # merged, not one per step
    assert outs[-1].finished and outs[-1].token_ids == ref.token_ids and outs[-1].text == ref.text
    assert [t for o in outs for t in o.delta_token_ids] == ref.token_ids
    assert "".join(o.delta_text for o in outs) == ref.text
