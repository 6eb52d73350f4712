"""Decoder building blocks shared by the model families.

Every family in this package is a pre-norm decoder: embed -> N x (norm, attention, residual,
norm, MLP/MoE, residual) -> norm -> lm_head. The families differ only in small switches
(projection biases, q/k norm, sinks, windows, the MLP kind), so the blocks live here once and
each family file composes them. All math goes through `ops` (attention, rms_norm, rope, moe),
so an MLX backend chosen at start-up applies to every model without touching this code.

Parameter names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), so a checkpoint
loads by name with no renaming table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import ops
from models.args import ModelArgs
from ops.rope import rope_tables, rotate


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Holds inv_freq (built on CPU even when the model is built on `meta`, a non-persistent buffer).

    `layer_type` picks a per-layer-type entry of `rope_parameters` (Gemma 3 keeps two)."""

    def __init__(self, args: ModelArgs, layer_type: str | None = None):
        super().__init__()
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = ops.rope_init(args, layer_type)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D_rot / 2] fp32
        # `covering` > 0: every position of the coming forwards is below it (the static decode
        # sets it to its key bucket, cuda_graphs.py), so `at` gathers rows of a table built
        # once instead of computing them. Every table stays referenced: a captured graph reads
        # the one that existed at its capture
        self.covering = 0
        self._tables: list[torch.Tensor] = []  # [P, 2, D_rot] (cos, signed sin), growing P

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAt:
        """The rotation at this forward's positions [B, N], built once for every layer."""
        if ops.backends()["apply_rope"] != "torch":  # a routed op keeps its per-layer call
            return RopeAt(self, positions, None, None)
        table = self._table(positions.device, dtype) if self.covering else None
        if table is not None:  # one gather instead of the ~12 small kernels of rope_tables
            rows = table[positions]  # [B, N, 2, D_rot]
            return RopeAt(self, positions, rows[:, :, 0:1], rows[:, :, 1:2])
        cos, sin = rope_tables(positions, self.inv_freq, self.attention_scaling, dtype)
        return RopeAt(self, positions, cos, sin)

    def _table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """`rope_tables` of positions [0, P >= covering) on device: the same values (each is
        an elementwise function of its position), built outside a CUDA graph capture only."""
        held = self._tables[-1] if self._tables else None
        fits = held is not None and held.shape[0] >= self.covering
        if fits and held.device == device and held.dtype == dtype:
            return held
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        grow = held is not None and not fits  # doubling: at most twice the largest bucket held
        count = max(self.covering, 2 * held.shape[0] if grow else 0)
        positions = torch.arange(count, device=device)[None]  # [1, P]
        cos, sin = rope_tables(positions, self.inv_freq, self.attention_scaling, dtype)
        self._tables.append(torch.cat([cos, sin], dim=2)[0])  # [P, 2, D_rot]
        return self._tables[-1]


class RopeAt:
    """cos/sin tables of one forward (torch backend), or the routed `ops.apply_rope` per layer."""

    __slots__ = ("rotary", "positions", "cos", "sin")

    def __init__(self, rotary: Rotary, positions, cos, sin):
        self.rotary, self.positions, self.cos, self.sin = rotary, positions, cos, sin

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, H, D] -> rotated x [B, N, H, D]."""
        if self.cos is not None:
            return rotate(x, self.cos, self.sin)
        xt = x.transpose(1, 2)  # [B, H, N, D]: the registered op's layout
        r = self.rotary
        out, _ = ops.apply_rope(xt, xt[:, :1], self.positions, r.inv_freq, r.attention_scaling)
        return out.transpose(1, 2)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate linears' weights (and biases) along the output dim, and re-point each
    linear's parameters at its slice, so the HF-named state dict and the fused matmul share one
    storage (in-place updates such as load_state_dict reach both; no memory is duplicated)."""
    weight = torch.cat([lin.weight.detach() for lin in linears])  # [sum(out), in]
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    _point_at(linears, weight, bias)
    return weight, bias


def allocate_fused(
    linears, device: torch.device, dtype: torch.dtype, bias_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused matrix (and bias) of meta `linears`, allocated empty on `device`, each linear's
    parameters re-pointed at its slice as `fuse_linears` leaves them: the loader reads each
    checkpoint tensor straight into its slice, so fusing never holds the parts twice."""
    rows = sum(lin.out_features for lin in linears)
    weight = torch.empty(rows, linears[0].in_features, dtype=dtype, device=device)
    has_bias = linears[0].bias is not None
    bias = torch.empty(rows, dtype=bias_dtype or dtype, device=device) if has_bias else None
    _point_at(linears, weight, bias)
    return weight, bias


def _point_at(linears, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    start = 0
    for lin in linears:
        size = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start : start + size], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start : start + size], requires_grad=False)
        start += size


class Attention(nn.Module):
    """GQA self-attention over explicit positions; optional q/k norm, sinks and window."""

    def __init__(
        self,
        args: ModelArgs,
        layer_idx: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool = False,
        sinks: bool = False,
        norm_cls: type[nn.Module] = RMSNorm,
        scale: float | None = None,
    ):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5 if scale is None else scale
        self.window = args.layer_window(layer_idx)
        hidden, q_size, kv_size = (
            args.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=o_bias)
        self.q_norm = norm_cls(self.head_dim, args.rms_norm_eps) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, args.rms_norm_eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None

        # set by fuse() (non-persistent: the state dict keeps HF names): [Hq*D + 2*Hkv*D, hidden]
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    FUSED = ("qkv_weight", "qkv_bias", ("q_proj", "k_proj", "v_proj"))  # models/materialize.py

    def fuse(self) -> None:
        """One q/k/v matmul per layer instead of three (called by the loader after loading; a
        no-op when the loader read q/k/v into one buffer already)."""
        if self.qkv_weight is None:
            self.qkv_weight, self.qkv_bias = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RopeAt, cache
    ) -> torch.Tensor:
        b, n, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_weight is None:
            q = self.q_proj(x).view(b, n, hq, d)  # [B, N, Hq, D]
            k = self.k_proj(x).view(b, n, hkv, d)  # [B, N, Hkv, D]
            v = self.v_proj(x).view(b, n, hkv, d)
        else:
            project_attend = getattr(cache, "project_attend", None)  # the static (graph) decode
            if project_attend is not None and self.q_norm is None and rope.cos is not None:
                # q/k/v, rope, the pool write and attention from the pool: [B, Hq, D]
                out = project_attend(x[:, 0], self.qkv_weight, self.qkv_bias,
                                     rope.cos.reshape(b, -1), rope.sin.reshape(b, -1), hq,
                                     sm_scale=self.scale, sinks=self.sinks, window=self.window)  # fmt: skip
                return ops.linear(out.reshape(b, n, -1), self.o_proj.weight, self.o_proj.bias)
            qkv = ops.linear(x, self.qkv_weight, self.qkv_bias).view(b, n, hq + 2 * hkv, d)
            if self.q_norm is None:  # q and k rotate together: one rope for both
                qk = rope(qkv[:, :, : hq + hkv])  # [B, N, Hq + Hkv, D]
                q, k = qk[:, :, :hq], qk[:, :, hq:]
            else:
                q, k = qkv[:, :, :hq], qkv[:, :, hq : hq + hkv]
            v = qkv[:, :, hq + hkv :]  # [B, N, Hkv, D]
        if self.qkv_weight is None or self.q_norm is not None:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(q), rope(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, N, D]
        attend = getattr(cache, "attend", None)  # a paged cache may attend from its pool
        if attend is not None:
            out = attend(q, k, v, positions, sm_scale=self.scale, sinks=self.sinks,
                         window=self.window)  # fmt: skip
        else:
            layout = None
            if cache is not None:
                k, v, layout = cache.update_and_fetch(k, v)  # [B, Hkv, S, D]
            out = ops.attention(q, k, v, positions, layout, sm_scale=self.scale,
                                sinks=self.sinks, window=self.window)  # fmt: skip
        out = out.transpose(1, 2).reshape(b, n, -1)  # [B, N, Hq * D]
        return ops.linear(out, self.o_proj.weight, self.o_proj.bias)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the Llama/Qwen SwiGLU (and Gemma GeGLU) feed-forward."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool = False, act: str = "silu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act={act!r} is not supported; allowed values: {', '.join(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

        # set by fuse() (non-persistent: the state dict keeps HF names): [2I, hidden]
        self.register_buffer("gate_up_weight", None, persistent=False)
        self.register_buffer("gate_up_bias", None, persistent=False)

    FUSED = ("gate_up_weight", "gate_up_bias", ("gate_proj", "up_proj"))  # models/materialize.py

    def fuse(self) -> None:
        """One gate/up matmul instead of two (called by the loader after loading; a no-op when
        the loader read gate/up into one buffer already)."""
        if self.gate_up_weight is None:
            self.gate_up_weight, self.gate_up_bias = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        down = self.down_proj
        if self.act is F.silu:  # on CUDA one kernel, or none (in the GEMV's epilogue)
            h = ops.linear_silu_mul(x, self.gate_up_weight, self.gate_up_bias)  # [B, N, I]
            return ops.linear(h, down.weight, down.bias)  # [B, N, H]
        gate_up = ops.linear(x, self.gate_up_weight, self.gate_up_bias)  # [B, N, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        return ops.linear(self.act(gate) * up, down.weight, down.bias)


def fuse_projections(model: nn.Module) -> None:
    """Build every fused q/k/v and gate/up matmul of a loaded model (see `fuse_linears`)."""
    for module in model.modules():
        if isinstance(module, (Attention, GatedMLP)):
            module.fuse()


class PackedHead(nn.Module):
    """A tied model's lm_head once packed: a packed copy of the embedding matrix (the embedding
    itself stays dense for lookups). A non-persistent buffer, so the state dict is unchanged."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)


def to_placeholders(*linears: nn.Linear) -> None:
    """Replace each linear's weight (a view of a fused matrix that was re-laid out) by a `meta`
    tensor of its shape and dtype, so the dense matrix is freed and the names stay."""
    for lin in linears:
        meta = torch.empty(lin.weight.shape, dtype=lin.weight.dtype, device="meta")
        lin.weight = nn.Parameter(meta, requires_grad=False)


def pack_linear_weights(model: nn.Module) -> None:
    """Pack every decode matmul's weight for the CPU kernel (`ops.pack_weight`), in place.

    The fused q/k/v and gate/up matrices and o_proj / down_proj / lm_head become packed
    (opaque) tensors; the q/k/v and gate/up parameters, slices of the fused matrices, become
    `meta` placeholders of the same shape, so the dense copies are freed (memory neutral) and
    the state dict keeps every name and shape but is no longer a checkpoint. A tied lm_head
    adds one packed copy of the embedding. Inference only: the runner calls this once.
    """

    def pack_param(linear: nn.Linear) -> None:
        linear.weight = nn.Parameter(ops.pack_weight(linear.weight), requires_grad=False)

    # each dense matrix is freed as its packed copy replaces it; handing the freed memory back to
    # the OS after every module (glibc keeps it mapped) keeps the peak at the weights plus one
    # matrix instead of growing with every packed layer
    from models.quantize import return_freed_memory

    for module in list(model.modules()):
        if isinstance(module, (Attention, GatedMLP)):
            return_freed_memory()
        if isinstance(module, Attention):
            if module.qkv_weight is None:
                module.fuse()
            module.qkv_weight = ops.pack_weight(module.qkv_weight)
            to_placeholders(module.q_proj, module.k_proj, module.v_proj)
            pack_param(module.o_proj)
        elif isinstance(module, GatedMLP):
            if module.gate_up_weight is None:
                module.fuse()
            module.gate_up_weight = ops.pack_weight(module.gate_up_weight)
            to_placeholders(module.gate_proj, module.up_proj)
            pack_param(module.down_proj)
    if getattr(model, "lm_head", False) is None:  # tied: the embedding is also the lm_head
        model.lm_head = PackedHead(ops.pack_weight(model.model.embed_tokens.weight))
    elif isinstance(getattr(model, "lm_head", None), nn.Linear):
        pack_param(model.lm_head)
    return_freed_memory()


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, self_attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, positions, rope, cache, residual=None):
        """Pre-norm block over the residual stream carried as (x, residual): the stream is
        x + residual (x alone when residual is None, the first layer). Returns (mlp output,
        stream before it); the next layer's norm adds them (`ops.add_rms_norm`: one kernel on
        CUDA, and the same sums as `h = x + attn(norm(x)); h + mlp(norm(h))` elsewhere)."""
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x, residual = ops.add_rms_norm(x, residual, ln1.weight, ln1.eps)
        out = self.self_attn(x, positions, rope, cache)
        x, residual = ops.add_rms_norm(out, residual, ln2.weight, ln2.eps)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm (and the rotary tables)."""

    def __init__(self, args: ModelArgs, make_layer: Callable[[ModelArgs, int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(make_layer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary = Rotary(args)

    def forward(self, input_ids, positions, caches):
        h = self.embed_tokens(input_ids)  # [B, N, H]
        rope = self.rotary.at(positions, h.dtype)  # cos/sin once, not once per layer
        residual = None  # the residual stream is h + residual (see DecoderLayer.forward)
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, positions, rope, None if caches is None else caches[i],
                                residual)  # fmt: skip
        return ops.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]


def make_lm_head(args: ModelArgs) -> nn.Linear | None:
    """The output projection, or None for tied checkpoints (they have no lm_head tensor)."""
    if args.tie_word_embeddings:
        return None
    return nn.Linear(args.hidden_size, args.vocab_size, bias=False)


def project_to_vocab(
    hidden: torch.Tensor, embed_tokens: nn.Embedding, lm_head: nn.Linear | None
) -> torch.Tensor:
    """hidden [..., H] -> logits [..., V]; tied models (lm_head None) reuse the embedding matrix."""
    weight = embed_tokens.weight if lm_head is None else lm_head.weight
    return ops.linear(hidden, weight)


class CausalLM(nn.Module):
    """The model protocol the runner codes against: forward -> hidden, compute_logits -> logits."""

    def __init__(self, args: ModelArgs, make_layer: Callable[[ModelArgs, int], nn.Module]):
        super().__init__()
        self.args = args
        self.model = DecoderModel(args, make_layer)
        self.lm_head = make_lm_head(args)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list | None = None
    ) -> torch.Tensor:
        """input_ids, positions [B, N] int64; caches: one per layer or None -> hidden [B, N, H]."""
        if input_ids.shape != positions.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids and positions must both be [B, N]; got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if caches is not None and len(caches) != len(self.model.layers):
            raise ValueError(
                f"caches must hold one cache per layer ({len(self.model.layers)}); got {len(caches)}"
            )
        return self.model(input_ids, positions, caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> logits [..., V] (only for the rows the runner samples)."""
        return project_to_vocab(hidden, self.model.embed_tokens, self.lm_head)

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int):
        """(ids [M] int64, finite [M] bool): the first index of the maximum of
        compute_logits(hidden)[:, :vocab_size] and whether those logits were all finite, where
        the lm_head weight can pick it without every logit (`greedy`: the fp32 CPU head of
        ops/cpu_native/split_head.py); else None."""
        if type(self).compute_logits is not CausalLM.compute_logits:
            return None  # a family whose logits are not the plain product
        weight = (self.model.embed_tokens if self.lm_head is None else self.lm_head).weight
        pick = getattr(weight, "greedy", None)
        return None if pick is None else pick(hidden, vocab_size)
