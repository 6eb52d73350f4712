"""Benchmark every swappable op: torch vs MLX (one crossing per op) vs an MLX island.

Why this shape of measurement: the box is shared, so absolute times drift; every variant of a
case runs interleaved in the same loop (order reversed on every other repeat) and the table
reports medians and ratios. "crossing %" is the share of the MLX call spent outside MLX
compute: 1 - (same MLX kernel on already-imported arrays + mx.eval) / (full bridged call).
`auto` in ops/registry.py is the set of ops whose MLX column beats torch on every shape.

    .venv/bin/python tools/bench_ops.py                 # all ops, both geometries
    .venv/bin/python tools/bench_ops.py --ops attention,rms_norm --repeats 9 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import importlib
import platform
import statistics
import time
from collections.abc import Callable

import torch

from ops.attention import KeyLayout

ATT = importlib.import_module("ops.attention")
NORM = importlib.import_module("ops.norm")
ROPE = importlib.import_module("ops.rope")
MOE = importlib.import_module("ops.moe")

GEOMETRY = {
    # hidden, q heads, kv heads, head_dim, window, sinks, experts, top_k, intermediate
    "smollm2-135m": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, window=None, sinks=False),
    "gpt-oss-20b": dict(
        hidden=2880, heads=64, kv_heads=8, head_dim=64, window=128, sinks=True,
        experts=32, top_k=4, inter=2880,
    ),
}  # fmt: skip
OP_NAMES = (
    "attention", "attention_paths", "rms_norm", "layer_norm", "apply_rope", "moe_gpt_oss", "island",
)  # fmt: skip
MAIN_VARIANTS = ("torch", "mlx", "mlx_island", "mlx_compute")


def _time(fn: Callable, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner * 1e3


def measure(variants: dict[str, Callable], repeats: int) -> dict[str, float]:
    """Median ms per variant; variants interleaved, order reversed on odd repeats."""
    for fn in variants.values():
        fn()  # warm-up (imports, allocator, lazy init)
    inner = {name: max(1, int(20 / max(_time(fn, 1), 1e-3))) for name, fn in variants.items()}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(_time(variants[name], inner[name]))
    return {name: statistics.median(v) for name, v in samples.items()}


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(shape) * scale).to(dtype)


def attention_cases(g, dtype):
    """(label, args, kwargs) for prefill and batched-decode shapes of geometry g."""
    h, hkv, d, w = g["heads"], g["kv_heads"], g["head_dim"], g["window"]
    sinks = _rand(h, dtype=dtype) if g["sinks"] else None
    kw = {"sm_scale": d**-0.5, "sinks": sinks}
    n = 512 if w else 256
    q, k, v = (
        _rand(1, h, n, d, dtype=dtype),
        _rand(1, hkv, n, d, dtype=dtype),
        _rand(1, hkv, n, d, dtype=dtype),
    )
    pos = torch.arange(n)[None]
    cases = [(f"prefill N={n} full", (q, k, v, pos, None), {**kw, "window": None})]
    if w:
        cases.append((f"prefill N={n} window {w}", (q, k, v, pos, None), {**kw, "window": w}))
    b, s = 8, 1024
    lens = torch.randint(s // 2, s + 1, (b,))
    lens[0] = s
    qd, kd, vd = (
        _rand(b, h, 1, d, dtype=dtype),
        _rand(b, hkv, s, d, dtype=dtype),
        _rand(b, hkv, s, d, dtype=dtype),
    )
    dpos = (lens - 1)[:, None]
    cases.append(
        (
            f"decode B={b} S<={s} ragged",
            (qd, kd, vd, dpos, KeyLayout.contiguous(lens)),
            {**kw, "window": None},
        )
    )
    if w:
        ring = 2 * w  # a windowed cache: key 0 sits at an absolute offset
        offsets = torch.full((b,), 3000)
        wl = KeyLayout(offsets, torch.full((b,), ring))
        wpos = (offsets + ring - 1)[:, None]
        ks, vs = kd[:, :, :ring].contiguous(), vd[:, :, :ring].contiguous()
        cases.append((f"decode B={b} window {w}", (qd, ks, vs, wpos, wl), {**kw, "window": w}))
    return cases


def attention_path_cases(g, dtype):
    """The torch fast path vs the alternatives it replaced, on the same inputs (prefill)."""
    h, hkv, d = g["heads"], g["kv_heads"], g["head_dim"]
    n = 512
    q, k, v = (
        _rand(1, h, n, d, dtype=dtype),
        _rand(1, hkv, n, d, dtype=dtype),
        _rand(1, hkv, n, d, dtype=dtype),
    )
    pos, scale = torch.arange(n)[None], d**-0.5
    sinks = _rand(h, dtype=dtype)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    no_sinks = {
        "torch": lambda: ATT.attention(q, k, v, pos, None, sm_scale=scale),
        "SDPA, causal as a bool mask": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal, scale=scale, enable_gqa=True
        ),
    }
    with_sinks = {
        "torch": lambda: ATT.attention(q, k, v, pos, None, sm_scale=scale, sinks=sinks),
        "sinks as an extra key column": lambda: ATT._attention_with_sinks(
            q, k, v, None, True, scale, sinks, True
        ),
    }
    cases = [
        ("attention_paths", f"prefill N={n} causal", no_sinks),
        ("attention_paths", f"prefill N={n} causal + sinks", with_sinks),
    ]
    w = g["window"]
    for nw in (512, 2048) if w else ():
        qw, kw, vw = (_rand(1, hh, nw, d, dtype=dtype) for hh in (h, hkv, hkv))
        band = ATT._additive_cached(ATT.tail_mask(nw, nw, w, qw.device), dtype)
        posw = torch.arange(nw)[None]
        cases.append(("attention_paths", f"prefill N={nw} window {w} + sinks", {
            "torch": lambda q=qw, k=kw, v=vw, p=posw: ATT.attention(
                q, k, v, p, None, sm_scale=scale, sinks=sinks, window=w),
            "one kernel call, [N, N] band mask": lambda q=qw, k=kw, v=vw, m=band: ATT._sdpa(
                q, k, v, m, False, scale, sinks, True),
        }))  # fmt: skip
    return cases


def run(args) -> list[tuple]:
    dtype = getattr(torch, args.dtype)
    use_mlx = not args.no_mlx
    if use_mlx:
        import mlx.core as mx

        from bridge import borrow_torch_tensors, mlx_call_multi, torch_to_mlx
        from ops.mlx import attention as m_att
        from ops.mlx import moe as m_moe
        from ops.mlx import norm as m_norm
        from ops.mlx import rope as m_rope

        def pure(kernel, *tensors, **kw):
            """The MLX kernel on arrays imported once: MLX compute only, no crossing."""
            arrays = [torch_to_mlx(t) if isinstance(t, torch.Tensor) else t for t in tensors]
            return lambda: mx.eval(kernel(*arrays, **kw))

    wanted = set(args.ops.split(","))
    rows = []
    for geo_name in args.shapes.split(","):
        g = GEOMETRY[geo_name]
        cases: list[tuple[str, str, dict]] = []  # (op, label, variants)
        if "attention" in wanted:
            for label, a, kw in attention_cases(g, dtype):
                variants = {"torch": lambda a=a, kw=kw: ATT.attention(*a, **kw)}
                if use_mlx:
                    mask = m_att.mask_for(a[3], a[4], a[0].shape[2], a[1].shape[2], kw["window"])
                    variants["mlx"] = lambda a=a, kw=kw: m_att.attention(*a, **kw)
                    variants["mlx_compute"] = pure(
                        m_att.sdpa_mx, *a[:3], mask, kw["sinks"], scale=kw["sm_scale"]
                    )
                cases.append(("attention", label, variants))
        if "attention_paths" in wanted:
            cases += attention_path_cases(g, dtype)
        for tokens, phase in ((512 if g["window"] else 256, "prefill"), (8, "decode")):
            x = _rand(tokens, g["hidden"], dtype=dtype)
            wgt, bias = _rand(g["hidden"], dtype=dtype), _rand(g["hidden"], dtype=dtype)
            if "rms_norm" in wanted:
                v = {"torch": lambda x=x, w=wgt: NORM.rms_norm(x, w, 1e-5)}
                if use_mlx:
                    v |= {"mlx": lambda x=x, w=wgt: m_norm.rms_norm(x, w, 1e-5),
                          "mlx_compute": pure(m_norm.rms_norm_mx, x, wgt, 1e-5)}  # fmt: skip
                cases.append(("rms_norm", f"{phase} [{tokens}, {g['hidden']}]", v))
            if "layer_norm" in wanted:
                v = {"torch": lambda x=x, w=wgt, b=bias: NORM.layer_norm(x, w, b, 1e-5)}
                if use_mlx:
                    v |= {"mlx": lambda x=x, w=wgt, b=bias: m_norm.layer_norm(x, w, b, 1e-5),
                          "mlx_compute": pure(m_norm.layer_norm_mx, x, wgt, bias, 1e-5)}  # fmt: skip
                cases.append(("layer_norm", f"{phase} [{tokens}, {g['hidden']}]", v))
            if "apply_rope" in wanted:
                b, n = (1, tokens) if phase == "prefill" else (tokens, 1)
                q = _rand(b, g["heads"], n, g["head_dim"], dtype=dtype)
                k = _rand(b, g["kv_heads"], n, g["head_dim"], dtype=dtype)
                pos = torch.arange(b * n).reshape(b, n) + 100
                inv = 1.0 / (10000 ** (torch.arange(0, g["head_dim"], 2).float() / g["head_dim"]))
                v = {"torch": lambda q=q, k=k, p=pos, i=inv: ROPE.apply_rope(q, k, p, i, 1.0)}
                if use_mlx:
                    v |= {"mlx": lambda q=q, k=k, p=pos, i=inv: m_rope.apply_rope(q, k, p, i, 1.0),
                          "mlx_compute": pure(m_rope.apply_rope_mx, q, k, pos, inv, 1.0)}  # fmt: skip
                cases.append(("apply_rope", f"{phase} B={b} N={n}", v))
            if (
                "moe_gpt_oss" in wanted
                and "experts" in g
                and (phase == "decode" or args.moe_prefill)
            ):
                e, hid, inter = g["experts"], g["hidden"], g["inter"]
                wts = [_rand(e, hid, dtype=dtype, scale=0.02), _rand(e, dtype=dtype),
                       _rand(e, hid, 2 * inter, dtype=dtype, scale=0.02), _rand(e, 2 * inter, dtype=dtype),
                       _rand(e, inter, hid, dtype=dtype, scale=0.02), _rand(e, hid, dtype=dtype)]  # fmt: skip
                topk = g["top_k"]
                v = {"torch": lambda x=x, w=wts, k=topk: MOE.moe_gpt_oss(x, *w, top_k=k)}
                if use_mlx:
                    v |= {"mlx": lambda x=x, w=wts, k=topk: m_moe.moe_gpt_oss(x, *w, top_k=k),
                          "mlx_compute": pure(m_moe.moe_gpt_oss_mx, x, *wts, top_k=g["top_k"], limit=7.0, alpha=1.702)}  # fmt: skip
                    views = borrow_torch_tensors(*wts)  # what a model keeping MLX views would pass
                    v["mlx, experts borrowed once"] = lambda x=x, w=views, k=topk: (
                        m_moe.moe_gpt_oss(x, *w, top_k=k)
                    )
                if args.moe_layouts:  # same values, stored [E, out, in] and passed as a view
                    wt = [
                        w.transpose(1, 2).contiguous().transpose(1, 2) if w.dim() == 3 else w
                        for w in wts
                    ]
                    v["torch, experts stored [E, out, in]"] = lambda x=x, w=wt, k=topk: (
                        MOE.moe_gpt_oss(x, *w, top_k=k)
                    )
                cases.append(("moe_gpt_oss", f"{phase} T={tokens} E={e} top{g['top_k']}", v))
            if "island" in wanted and use_mlx:
                cases.append(
                    (
                        "island",
                        f"{phase} norm+rope+attn",
                        island_variants(g, phase, dtype, mlx_call_multi, pure),
                    )
                )
        for op, label, variants in cases:
            med = measure(variants, args.repeats)
            rows.append((geo_name, op, label, med))
            print(_row(geo_name, op, label, med), flush=True)
    return rows


def island_variants(g, phase, dtype, mlx_call_multi, pure):
    """rms_norm -> rope -> attention on q/k/v views of one normed tensor: 3 crossings vs 1."""
    from ops.mlx import attention as m_att
    from ops.mlx import norm as m_norm
    from ops.mlx import rope as m_rope

    h, hkv, d = g["heads"], g["kv_heads"], g["head_dim"]
    b, n = (1, 256) if phase == "prefill" else (1, 1)
    x = _rand(b, h + 2 * hkv, n, d, dtype=dtype)
    w = _rand(d, dtype=dtype)
    pos = torch.arange(n)[None]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    scale = d**-0.5

    def torch_chain(norm=NORM.rms_norm, rope=ROPE.apply_rope, att=ATT.attention):
        y = norm(x, w, 1e-5)
        q, k, v = y[:, :h], y[:, h : h + hkv], y[:, h + hkv :]
        q, k = rope(q, k, pos, inv, 1.0)
        return att(q, k, v, pos, None, sm_scale=scale)

    def island(x, w, pos, inv):
        y = m_norm.rms_norm_mx(x, w, 1e-5)
        q, k = m_rope.apply_rope_mx(y[:, :h], y[:, h : h + hkv], pos, inv, 1.0)
        return (m_att.sdpa_mx(q, k, y[:, h + hkv :], "causal" if n > 1 else None, scale=scale),)

    return {
        "torch": torch_chain,
        "mlx": lambda: torch_chain(m_norm.rms_norm, m_rope.apply_rope, m_att.attention),
        "mlx_island": lambda: mlx_call_multi(island, x, w, pos, inv),
        "mlx_compute": pure(lambda *a: island(*a)[0], x, w, pos, inv),
    }


def _row(geo, op, label, med) -> str:
    t = med["torch"]
    cells = [geo, op, label, f"{t:.3f}"]
    for name in ("mlx", "mlx_island"):
        if name in med:
            share = max(0.0, 1 - med["mlx_compute"] / med[name]) if "mlx_compute" in med else 0.0
            cells.append(f"{med[name]:.3f} ({share:.0%}) x{med[name] / t:.2f}")
        else:
            cells.append("-")
    extra = [f"{k}: {m:.3f} x{m / t:.2f}" for k, m in med.items() if k not in MAIN_VARIANTS]
    cells.append("; ".join(extra) or "-")
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--ops", default=",".join(OP_NAMES), help=f"comma list of: {', '.join(OP_NAMES)}"
    )
    parser.add_argument(
        "--shapes", default=",".join(GEOMETRY), help=f"comma list of: {', '.join(GEOMETRY)}"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="tensor dtype"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="interleaved repeats per case (median reported)"
    )
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a loaded shared box 2 OpenMP threads stall ~100 ms whenever one is descheduled)")  # fmt: skip
    parser.add_argument("--no-mlx", action="store_true", help="torch column only")
    parser.add_argument(
        "--moe-layouts",
        action="store_true",
        help="also time torch MoE with expert weights stored [E, out, in] (passed as a transposed view)",
    )
    parser.add_argument(
        "--moe-prefill", action="store_true", help="also time MoE at the prefill token count (slow)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for name in args.ops.split(","):
        if name not in OP_NAMES:
            parser.error(f"--ops: unknown op {name!r}; allowed values: {', '.join(OP_NAMES)}")
    print(f"# bench_ops: {platform.system()}-{platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, dtype {args.dtype}, median of {args.repeats} interleaved repeats")  # fmt: skip
    print("\nms per call; MLX cells: median (crossing share) xratio-to-torch\n")
    print("| geometry | op | shape | torch | MLX op | MLX island | other |")
    print("|---|---|---|---|---|---|---|")
    rows = run(args)
    slower = {op for _, op, _, med in rows if "mlx" in med and med["mlx"] >= med["torch"]}
    faster = sorted({op for _, op, _, med in rows if "mlx" in med} - slower - {"island"})
    print(f"\nauto (MLX faster on every shape here): {', '.join(faster) or 'none'}")


if __name__ == "__main__":
    main()
