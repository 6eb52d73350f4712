"""Weight-only int8 / int4 quality and speed against the unquantized model, side by side.

For each --dtype and each quantization (none, int8, int4), on the default model (or --model):
- perplexity of a fixed English text (TEXT below, one forward over its tokens);
- greedy agreement: --prompts prompts (slices of TEXT), --gen-len greedy tokens each; the share
  of positions equal to the unquantized model's tokens, and how many tokens match before the
  first difference (mean);
- batch-1 decode tok/s through the Engine (--prompt-len prompt, --decode-len tokens), the modes
  interleaved in rotating order for --repeats rounds, medians;
- resident weight bytes (dense tensors + packed weights; the placeholders take none).

    .venv/bin/python tools/bench_quant.py --dtypes float32,bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

MODES = ("none", "int8", "int4")
TEXT = (
    "The history of the lighthouse is a history of people trying to make the sea a little less "
    "dangerous. For centuries, ships approaching a coast at night had only fires lit on hills to "
    "guide them, and many were lost on rocks they never saw. The first great lighthouse, built on "
    "the island of Pharos near Alexandria, stood for more than a thousand years and gave its name "
    "to the word for lighthouse in several languages. Later towers used candles, then oil lamps "
    "with polished reflectors, and in the nineteenth century the Fresnel lens, which gathered the "
    "light of a single flame into a beam that could be seen twenty miles away. Keepers lived in "
    "the towers with their families, trimming wicks, winding the clockwork that turned the lens, "
    "and writing the weather into a log every few hours. Today most lighthouses are automatic, "
    "and satellites tell a ship exactly where it is, but the towers still stand, and on a dark "
    "night their light is as welcome as it ever was. A good recipe for bread needs only flour, "
    "water, salt and yeast; the rest is patience. Mix the dough, let it rise until it has doubled, "
    "shape it gently, and bake it in a hot oven until the crust sounds hollow when you knock on it."
)


def weight_bytes(model) -> int:
    from ops.quant.int_linear import QuantizedLinearWeight

    total, seen = 0, set()
    for module in model.modules():
        for value in [
            *module._parameters.values(),
            *module._buffers.values(),
            *vars(module).values(),
        ]:
            if isinstance(value, QuantizedLinearWeight) and id(value) not in seen:
                seen.add(id(value))
                total += value.nbytes()
            elif isinstance(value, torch.Tensor) and value.is_mkldnn:  # opaque: no storage
                if id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
            elif isinstance(value, torch.Tensor) and value.device.type != "meta":
                key = value.untyped_storage().data_ptr()  # fused q/k/v views share one storage
                if key not in seen:
                    seen.add(key)
                    total += value.untyped_storage().nbytes()
    return total


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    positions = torch.arange(ids.shape[1])[None]
    logits = model.compute_logits(model(ids, positions, None)).float()  # [1, S, V]
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    return float(torch.exp(loss))


def greedy(engine, prompts, gen_len: int) -> list[list[int]]:
    from ops.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def decode_tok_s(engine, prompt: list[int], decode_len: int) -> float:
    from ops.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=decode_len, temperature=0.0, ignore_eos=True)
    engine.add_request(None, prompt, params)
    engine.step()  # prefill + first token
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    total = sum(len(r) for r in ref)
    prefix = []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
        prefix.append(n)
    return same / total, statistics.mean(prefix)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models.default_model import default_model_path
    from torch_runner import Engine

    path = args.model or str(default_model_path())
    print(f"model {path}, threads {args.threads}, decode: prompt {args.prompt_len} + {args.decode_len}, "
          f"medians of {args.repeats} interleaved rounds")  # fmt: skip
    print(
        "| dtype | quantization | weights MB | perplexity | greedy agreement | tokens before first difference | decode tok/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes.split(","):
        engines = {
            m: Engine(path, device="cpu", dtype=dtype, quantization=m, max_total_tokens=4096)
            for m in MODES
        }
        ids = engines["none"].tokenizer(TEXT, return_tensors="pt").input_ids
        step = max(1, (ids.shape[1] - 24) // args.prompts)
        prompts = [ids[0, i * step : i * step + 24].tolist() for i in range(args.prompts)]
        outs = {m: greedy(e, prompts, args.gen_len) for m, e in engines.items()}
        speed = {m: [] for m in MODES}
        prompt = ids[0, : args.prompt_len].tolist()
        for r in range(args.repeats):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for m in order:
                speed[m].append(decode_tok_s(engines[m], prompt, args.decode_len))
        for m, engine in engines.items():
            model = engine.runner.model
            ppl = perplexity(model, ids)
            agree, prefix = agreement(outs["none"], outs[m])
            print(f"| {dtype} | {m} | {weight_bytes(model) / 1e6:.0f} | {ppl:.3f} | {agree:.1%} | "
                  f"{prefix:.1f} / {args.gen_len} | {statistics.median(speed[m]):.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
