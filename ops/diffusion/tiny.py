"""Tiny random diffusers pipelines built offline, for tests, benchmarks and the docs example.

Real diffusers classes (Flux, Sana, PixArt transformers, AutoencoderKL, flow-match scheduler) at
toy sizes with random weights: they exercise every module `patch` swaps without downloading a
checkpoint. Text encoders are left out; callers pass prompt embeddings directly. diffusers is
imported inside the functions, so importing ops never imports it.
"""

from __future__ import annotations

import torch


def tiny_flux_pipeline(
    num_layers: int = 2,
    num_single_layers: int = 2,
    num_heads: int = 2,
    head_dim: int = 16,
    text_dim: int = 32,
    seed: int = 0,
):
    """A FluxPipeline with a tiny FluxTransformer2DModel and a one-block AutoencoderKL.

    head_dim must be a multiple of 4 (rope axes take head_dim/4, /4 and /2 channels).
    """
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4; got {head_dim}")
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,  # 1 latent channel packed 2x2
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=head_dim,
        num_attention_heads=num_heads,
        joint_attention_dim=text_dim,
        pooled_projection_dim=text_dim,
        axes_dims_rope=(head_dim // 4, head_dim // 4, head_dim // 2),
    )
    vae = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer.eval(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_flux_prompt(pipe, batch_size: int = 1, num_tokens: int = 8, seed: int = 0) -> dict:
    """Random prompt embeddings shaped for `pipe`'s transformer (what a text encoder would give)."""
    config = pipe.transformer.config
    generator = torch.Generator().manual_seed(seed)
    dtype = pipe.transformer.dtype
    return {
        "prompt_embeds": torch.randn(
            batch_size, num_tokens, config.joint_attention_dim, generator=generator
        ).to(dtype),
        "pooled_prompt_embeds": torch.randn(
            batch_size, config.pooled_projection_dim, generator=generator
        ).to(dtype),
    }


def tiny_sana_transformer(num_layers: int = 2, seed: int = 0):
    """A SanaTransformer2DModel: LayerNorms, an RMSNorm caption norm, SanaModulatedNorm output."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(seed)
    return SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=num_layers,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=8,
    ).eval()


def tiny_pixart_transformer(num_layers: int = 2, seed: int = 0):
    """A PixArtTransformer2DModel (adaLN-single: modulation inline in the blocks)."""
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        sample_size=8,
        num_layers=num_layers,
        patch_size=2,
        attention_head_dim=8,
        num_attention_heads=3,
        caption_channels=32,
        in_channels=4,
        cross_attention_dim=24,
        out_channels=8,
        attention_bias=True,
        activation_fn="gelu-approximate",
        num_embeds_ada_norm=1000,
        norm_type="ada_norm_single",
        norm_elementwise_affine=False,
        norm_eps=1e-6,
    ).eval()


def tiny_transformer_inputs(transformer, batch_size: int = 2, seed: int = 0) -> dict:
    """Random forward() keyword arguments for a tiny Flux, Sana or PixArt transformer.

    Floating inputs take the transformer's dtype; timesteps stay fp32 as pipelines pass them.
    """
    generator = torch.Generator().manual_seed(seed)
    dtype = transformer.dtype
    config = transformer.config
    kind = type(transformer).__name__

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    timestep = torch.rand(batch_size, generator=generator)
    if kind == "FluxTransformer2DModel":
        side, num_tokens = 8, 8
        y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        img_ids = torch.stack((torch.zeros_like(y), y, x), dim=-1).reshape(-1, 3).float()  # [S, 3]
        return {
            "hidden_states": randn(batch_size, side * side, config.in_channels),
            "encoder_hidden_states": randn(batch_size, num_tokens, config.joint_attention_dim),
            "pooled_projections": randn(batch_size, config.pooled_projection_dim),
            "timestep": timestep,
            "img_ids": img_ids,
            "txt_ids": torch.zeros(num_tokens, 3),
            "return_dict": False,
        }
    if kind == "SanaTransformer2DModel":
        return {
            "hidden_states": randn(batch_size, config.in_channels, 8, 8),
            "encoder_hidden_states": randn(batch_size, 6, config.caption_channels),
            "timestep": timestep * 1000,
            "return_dict": False,
        }
    if kind == "PixArtTransformer2DModel":
        return {
            "hidden_states": randn(batch_size, config.in_channels, 8, 8),
            "encoder_hidden_states": randn(batch_size, 6, config.caption_channels),
            "timestep": (timestep * 1000).long(),
            "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
            "return_dict": False,
        }
    raise ValueError(
        f"tiny_transformer_inputs: transformer {kind} is not supported; allowed: "
        "FluxTransformer2DModel, SanaTransformer2DModel, PixArtTransformer2DModel"
    )
