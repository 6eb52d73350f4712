"""Prefix-cache reuse on sliding-window models: how many prompt tokens the cache serves.

Two scenarios, each on a gpt-oss-style geometry (alternating sliding/full layers, window 128,
sinks, MoE; dummy weights) and a Llama geometry (full attention only), with chunked prefill at
--chunk and off:
- shared prefix: request 1 = a --prefix-len-token system prompt + its own question, then
  request 2 = the same system prompt + another question; reported: request 2's
  num_cached_tokens (the best possible is the prefix's whole blocks, 688 of 701 at block 16);
- chat: turn 1 = system prompt + question, --gen-len tokens generated; turn 2 = turn 1 + its
  answer + a new question; reported: turn 2's num_cached_tokens beside the previous turn's
  tokens that had KV (prompt + answer - 1), block-aligned.
Both check the greedy tokens against a cold engine (prefix caching off), and time turn 2's
prefill (max_tokens=1) warm vs cold (median of --repeats). Last, the pool blocks a paged
(swa_kv="paged") all-windowed model (Mistral-style, window 128) holds at most while one request
generates --long-gen tokens after the prefix (prefix caching off), beside the blocks its tokens
span: blocks wholly behind the window are given back.

    .venv/bin/python tools/bench_prefix_reuse.py
    .venv/bin/python tools/bench_prefix_reuse.py --swa-kv paged   # SWA layers in the pool
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from torch_runner import Engine, SamplingParams

COMMON = dict(vocab_size=4096, hidden_size=256, num_attention_heads=8, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-5, eos_token_id=2,
              bos_token_id=1)  # fmt: skip
GEOMETRIES = {
    "gpt-oss-style": dict(
        model_type="gpt_oss",
        architectures=["GptOssForCausalLM"],
        num_hidden_layers=4,
        intermediate_size=256,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_theta=150000.0,
        **COMMON,
    ),  # fmt: skip
    "mistral-style": dict(  # every layer windowed: paged mode can give back old blocks
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        num_hidden_layers=4,
        intermediate_size=512,
        sliding_window=128,
        rope_theta=10000.0,
        **COMMON,
    ),  # fmt: skip
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        num_hidden_layers=4,
        intermediate_size=512,
        rope_theta=10000.0,
        **COMMON,
    ),  # fmt: skip
}


def _checkpoint(directory: Path, config: dict) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _engine(path: str, args, chunk: int, caching: bool) -> Engine:
    from models.default_model import default_model_path

    return Engine(path, device="cpu", load_format="dummy", tokenizer=str(default_model_path()),
                  max_total_tokens=8192, chunked_prefill_size=chunk, swa_kv=args.swa_kv,
                  enable_prefix_caching=caching)  # fmt: skip


def _run(engine: Engine, prompt: list[int], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompt, params)[0]
    return out, time.perf_counter() - t0


def scenario(path: str, args, chunk: int) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(3, 4000) for _ in range(args.prefix_len)]
    questions = [[rng.randrange(3, 4000) for _ in range(24)] for _ in range(3)]
    warm, cold = _engine(path, args, chunk, True), _engine(path, args, chunk, False)
    first, _ = _run(warm, system + questions[0], args.gen_len)
    second, _ = _run(warm, system + questions[1], args.gen_len)
    same = second.token_ids == _run(cold, system + questions[1], args.gen_len)[0].token_ids
    turn2 = system + questions[0] + first.token_ids + questions[2]
    had_kv = len(system + questions[0]) + len(first.token_ids) - 1
    times = {True: [], False: []}
    chat = None
    for _ in range(args.repeats):
        for caching, engine in ((True, warm), (False, cold)):
            out, seconds = _run(engine, turn2, 1)
            times[caching].append(seconds)
            if caching and chat is None:
                chat = out
    cold_chat = _run(cold, turn2, args.gen_len)[0].token_ids
    same = same and _run(warm, turn2, args.gen_len)[0].token_ids == cold_chat
    bs = warm.config.block_size
    return dict(shared=second.num_cached_tokens, best_shared=(args.prefix_len // bs) * bs,
                chat=chat.num_cached_tokens, best_chat=(had_kv // bs) * bs, turn2=len(turn2),
                warm_ms=statistics.median(times[True]) * 1e3,
                cold_ms=statistics.median(times[False]) * 1e3, same=same)  # fmt: skip


def peak_blocks(path: str, args) -> tuple[int, int, int]:
    """Pool blocks in use by one long request: (most after a prefill step, most while it
    decodes, blocks its tokens span). Admission takes the whole prompt's blocks at once (the
    scheduler), so the prompt's blocks are the peak inside the first step."""
    from models.default_model import default_model_path

    engine = Engine(path, device="cpu", load_format="dummy", tokenizer=str(default_model_path()),
                    max_total_tokens=8192, swa_kv="paged", enable_prefix_caching=False)  # fmt: skip
    prompt = random.Random(1).choices(range(3, 4000), k=args.prefix_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.long_gen, ignore_eos=True)
    seq = engine.scheduler.find(engine.add_request(None, prompt, params))
    most = {True: 0, False: 0}  # decoding -> most blocks in use after a step
    while engine.has_unfinished():
        is_decoding = seq.num_computed_tokens >= len(prompt)
        engine.step()
        if engine.has_unfinished():
            used = engine.block_manager.num_used_blocks
            most[is_decoding] = max(most[is_decoding], used)
    return most[False], most[True], -(-(args.prefix_len + args.long_gen) // 16)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-len", type=int, default=701, help="shared system prompt tokens")
    parser.add_argument("--gen-len", type=int, default=40, help="tokens generated per turn")
    parser.add_argument("--chunk", type=int, default=512, help="chunked_prefill_size when on")
    parser.add_argument("--swa-kv", default="auto", help="auto | windowed | paged")
    parser.add_argument("--repeats", type=int, default=3, help="timed turn-2 prefills (median)")
    parser.add_argument("--long-gen", type=int, default=512, help="tokens of the block check")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_prefix_"))
    print(f"shared prefix {args.prefix_len} tokens, {args.gen_len} generated per turn, block 16, "
          f"swa_kv {args.swa_kv}, CPU, dummy weights\n")  # fmt: skip
    print("| geometry | chunking | shared prefix reused / best | chat turn 2 reused / best "
          "(turn 2 tokens) | turn-2 prefill ms warm / cold | greedy = cold |")  # fmt: skip
    print("|---|---|---:|---:|---:|---|")
    for name, config in GEOMETRIES.items():
        path = _checkpoint(tmp / name, config)
        for chunk in (args.chunk, 0):
            r = scenario(path, args, chunk)
            print(f"| {name} | {chunk or 'off'} | {r['shared']} / {r['best_shared']} "
                  f"| {r['chat']} / {r['best_chat']} ({r['turn2']}) "
                  f"| {r['warm_ms']:.1f} / {r['cold_ms']:.1f} | {'yes' if r['same'] else 'NO'} |")  # fmt: skip

    prefill, decode, spanned = peak_blocks(str(tmp / "mistral-style"), args)
    print(f"\nmistral-style, swa_kv paged, prefix caching off, {args.prefix_len} + {args.long_gen} "
          f"tokens ({spanned} blocks): at most {prefill} pool blocks in use after a prefill step, "
          f"{decode} while decoding")  # fmt: skip


if __name__ == "__main__":
    main()
