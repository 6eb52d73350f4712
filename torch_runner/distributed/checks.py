"""What a tensor-parallel launch refuses before any rank starts: a family that does not shard,
a geometry that does not split N ways, an int4 shard that would cut a quantization group, an
fp8 shard that would cut a scale block."""

from __future__ import annotations

from models.quantize import INT4_GROUP_SIZE
from ops.quant.int_linear import check_int4_shape
from ops.quant.mxfp4 import GROUP_SIZE as MXFP4_GROUP

SHARDABLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3_text")


def check_shardable(raw_config: dict, size: int) -> None:
    """One clear error before loading for a family or a geometry that cannot split `size` ways."""
    model_type = raw_config.get("model_type")
    if model_type not in SHARDABLE_FAMILIES:
        raise ValueError(
            f"tensor_parallel_size={size} is not supported for model_type {model_type!r}; "
            f"supported families: {', '.join(SHARDABLE_FAMILIES)}"
        )
    heads = raw_config.get("num_attention_heads")
    kv_heads = raw_config.get("num_key_value_heads", heads)
    if not heads or heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads ({heads})")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} must divide num_key_value_heads ({kv_heads}) "
            "or be a multiple of it"
        )
    for name in ("intermediate_size", "moe_intermediate_size"):
        value = raw_config.get(name)
        if (name == "intermediate_size" or value is not None) and (not value or value % size):
            raise ValueError(f"tensor_parallel_size={size} must divide {name} ({value})")


def check_int4_shards(raw: dict, size: int) -> None:
    """int4 quantizes each shard of a linear on its own rank: a shard must keep every group of
    INT4_GROUP_SIZE input columns whole (and rows in eights), exactly where the one-rank model
    quantizes that linear, or the ranks would compute with other codes (or a dense weight)."""
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or hidden // heads
    local_kv = kv_heads // size if kv_heads >= size else 1
    inter = raw.get("intermediate_size")
    vocab = raw["vocab_size"]
    linears = {  # name: (full [N, K], this rank's [N, K])
        "q/k/v": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "lm_head": (vocab, hidden),
    }
    local = {
        "q/k/v": ((heads // size + 2 * local_kv) * head_dim, hidden),
        "o_proj": (hidden, heads // size * head_dim),
        "lm_head": (-(-vocab // size), hidden),
    }
    if inter and raw.get("model_type") != "gpt_oss":  # gpt-oss has no dense MLP
        linears |= {"gate/up": (2 * inter, hidden), "down_proj": (hidden, inter)}
        local |= {"gate/up": (2 * inter // size, hidden), "down_proj": (hidden, inter // size)}
    for name, full in linears.items():
        if _int4_fits(*full) and not _int4_fits(*local[name]):
            n, k = local[name]
            raise ValueError(
                f"quantization='int4' with tensor_parallel_size={size}: the {name} shard "
                f"[{n}, {k}] would split an int4 group of {INT4_GROUP_SIZE} columns (or rows "
                f"not in eights) that the one-rank model keeps whole; use a tensor_parallel_size "
                f"whose shards keep in_features divisible by {INT4_GROUP_SIZE}, or "
                "quantization='int8'"
            )


def _int4_fits(n: int, k: int) -> bool:
    try:
        check_int4_shape(n, k, INT4_GROUP_SIZE)
    except ValueError:
        return False
    return True


def check_moe_shards(raw: dict, size: int, expert_parallel: bool, moe_weights: str) -> None:
    """Expert parallel needs the experts to split evenly; packed MXFP4 experts split within
    each expert only at 32-element block boundaries of the intermediate dimension."""
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts:
        return
    if expert_parallel:
        if experts % size:
            raise ValueError(
                f"enable_expert_parallel with tensor_parallel_size={size} must divide the "
                f"number of experts ({experts})"
            )
        return
    method = (raw.get("quantization_config") or {}).get("quant_method")
    inter = raw.get("intermediate_size", 0)
    if method == "mxfp4" and moe_weights == "packed" and (inter // size) % MXFP4_GROUP:
        raise ValueError(
            f"packed MXFP4 experts with tensor_parallel_size={size}: each rank's slice of "
            f"intermediate_size ({inter} / {size}) must be a multiple of the {MXFP4_GROUP}-value "
            "MXFP4 block; use enable_expert_parallel (whole experts per rank) or "
            "moe_weights='dequantized'"
        )


def check_fp8_shards(raw: dict, size: int) -> None:
    """A block-scaled fp8 checkpoint splits only at its scale blocks: every rank's rows of q/k/v
    and gate/up, and columns of o_proj and down_proj, must be whole blocks (per-tensor and
    per-channel scales split anywhere)."""
    from models.fp8 import checkpoint_format

    try:
        fmt = checkpoint_format(raw)
    except ValueError:
        return  # the loader names the bad quantization_config field
    if fmt is None or fmt.block is None:
        return
    (block_rows, block_cols), heads = fmt.block, raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads", heads)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    inter = raw.get("intermediate_size") or 0
    local = {  # name: (this rank's length, the block it must be a multiple of)
        "q_proj rows": (heads // size * head_dim, block_rows),
        "k_proj/v_proj rows": (
            (kv_heads // size if kv_heads >= size else 1) * head_dim,
            block_rows,
        ),
        "o_proj columns": (heads // size * head_dim, block_cols),
        "gate_proj/up_proj rows": (inter // size, block_rows),
        "down_proj columns": (inter // size, block_cols),
    }
    for name, (length, block) in local.items():
        if length % block:
            raise ValueError(
                f"tensor_parallel_size={size} with a block-scaled fp8 checkpoint (blocks "
                f"{block_rows}x{block_cols}): each rank's {name} ({length}) must be a multiple of "
                f"{block}; use a tensor_parallel_size whose shards keep whole scale blocks"
            )
