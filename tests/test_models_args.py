"""ModelArgs: HF config keys in, `layer_types` derived for every family the way transformers
masks them (oracle: the transformers config object and its documented rules)."""

from __future__ import annotations

import pytest
from tiny_models import tiny_config

from models.registry import get_family, supported_model_types

FULL, SLIDING = "full_attention", "sliding_attention"


def args_for(model_type, **overrides):
    config = tiny_config(model_type, **overrides)
    return get_family(model_type).ModelArgs.from_hf_config(config), config


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gpt_oss", "gemma3_text"])
def test_layer_types_follow_the_transformers_config(model_type):
    args, config = args_for(model_type)
    assert args.layer_types == list(config.layer_types)
    assert {FULL, SLIDING} <= set(args.layer_types)  # the tiny configs mix both kinds
    assert args.sliding_window == config.sliding_window == 8


def test_qwen2_windows_start_at_max_window_layers():
    args, _ = args_for("qwen2", max_window_layers=1)
    assert args.layer_types == [FULL, SLIDING, SLIDING, SLIDING]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_qwen_without_use_sliding_window_is_all_full(model_type):
    overrides = {"use_sliding_window": False}
    if model_type != "qwen3_moe":
        overrides["layer_types"] = None
    args, config = args_for(model_type, **overrides)
    assert config.sliding_window is None
    assert args.sliding_window is None and set(args.layer_types) == {FULL}


@pytest.mark.parametrize("model_type", ["mistral", "qwen3_moe"])
def test_window_on_every_layer_when_the_family_has_no_layer_types(model_type):
    args, _ = args_for(model_type)
    assert args.layer_types == [SLIDING] * args.num_hidden_layers


def test_mistral_without_window_and_llama_are_all_full():
    mistral, _ = args_for("mistral", sliding_window=None)
    llama, _ = args_for("llama")
    for args in (mistral, llama):
        assert args.sliding_window is None and set(args.layer_types) == {FULL}


def test_fields_read_through_hf_aliases():
    args, config = args_for("qwen3_moe")
    assert args.num_experts == config.num_experts == 4  # stored as num_local_experts in config.json
    assert args.is_sparse_layer(0) and not args.is_sparse_layer(1)  # mlp_only_layers=[1]


def test_protocol_fields_exist_for_every_family():
    for model_type in supported_model_types():
        args, config = args_for(model_type)
        for name in (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_size",
            "vocab_size",
            "max_position_embeddings",
            "sliding_window",
            "layer_types",
        ):
            assert hasattr(args, name), (model_type, name)
        assert args.head_dim == config.head_dim == 16
        assert len(args.layer_types) == args.num_hidden_layers


def test_bad_layer_type_names_allowed_values():
    with pytest.raises(ValueError, match="allowed values: full_attention, sliding_attention"):
        get_family("gpt_oss").ModelArgs.from_hf_config(
            {
                "model_type": "gpt_oss",
                "hidden_size": 64,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 8,
                "sliding_window": 8,
                "layer_types": ["full_attention", "chunked_attention"],
            }
        )


def test_attention_softcapping_is_refused_with_its_field_name():
    config = tiny_config("gemma3_text", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        get_family("gemma3_text").ModelArgs.from_hf_config(config)
