"""Tiny seeded Hugging Face checkpoints for every supported family (the shared test helper).

Each config is small enough to run in milliseconds on CPU (hidden 64, 3-4 layers, vocab 256)
but keeps every feature the family has switched on: GQA, a sliding window of 8 where the family
has one (mixed with full layers where the family allows it), llama3/YaRN rope, biases, q/k
norm, sinks, MoE with a dense layer mixed in, tied embeddings for Llama (as SmolLM2 has).

    path = save_tiny_checkpoint("qwen3", tmp_path)            # config.json + model.safetensors
    hf_model = build_tiny_model("gpt_oss")                       # transformers reference, eager
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 256
WINDOW = 8

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    initializer_range=0.05,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        num_hidden_layers=3,
        intermediate_size=128,
        tie_word_embeddings=True,
        # tied + small init predicts "repeat the last token" forever; stronger layers vary it
        initializer_range=0.2,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "mistral": dict(num_hidden_layers=3, intermediate_size=128, sliding_window=WINDOW),
    "qwen2": dict(
        num_hidden_layers=4,
        intermediate_size=128,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    ),
    "qwen3": dict(
        num_hidden_layers=4,
        intermediate_size=128,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    ),
    "qwen3_moe": dict(
        num_hidden_layers=3,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        use_sliding_window=True,
        sliding_window=WINDOW,
    ),
    "gpt_oss": dict(
        num_hidden_layers=4,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
        ),
    ),
    "gemma3_text": dict(
        num_hidden_layers=4,
        intermediate_size=128,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        final_logit_softcapping=3.0,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
    ),
}
FAMILIES = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, **overrides):
    """The transformers config object for a tiny `model_type` model (eager attention)."""
    from transformers import AutoConfig

    values = {**_COMMON, **TINY_CONFIGS[model_type], **overrides}
    config = AutoConfig.for_model(model_type, **values)
    config._attn_implementation = "eager"
    return config


def build_tiny_model(model_type: str, *, seed: int = 0, **overrides):
    """A seeded transformers model (fp32, eval, eager attention): the reference."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(model_type, **overrides), attn_implementation="eager"
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            # HF initialises norms to a constant and biases to 0: perturb them so the weight
            # and bias paths are exercised (a norm that ignored its weight would still pass)
            if "norm" in name or name.endswith(("_bias", "router.bias", ".sinks")):
                param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


def save_tiny_checkpoint(
    model_type: str, directory: str | Path, *, seed: int = 0, **overrides
) -> Path:
    """Save a tiny seeded checkpoint (config.json, safetensors, generation_config.json) to `directory`."""
    directory = Path(directory)
    model = build_tiny_model(model_type, seed=seed, **overrides)
    model.save_pretrained(directory)
    return directory
