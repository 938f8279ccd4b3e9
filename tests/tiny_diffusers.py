"""Tiny diffusers video transformers (1 layer, 2 heads, bf16, seeded) shared by the RoPE tests.

Each builder returns ``(model, args, kwargs)`` for one forward; shapes are chosen so self-attention has
192-200 tokens and the cross-attention's text is 8 tokens.
"""
import pytest
import torch

BF = torch.bfloat16


def wan(fp32_rope: bool = False):
    """``fp32_rope``: keep the rope tables in fp32, as ``from_pretrained(torch_dtype=bf16)`` leaves them."""
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4,
                              out_channels=4, text_dim=16, freq_dim=32, ffn_dim=64, num_layers=1,
                              rope_max_seq_len=32).to(BF).eval()
    if fp32_rope:
        m.rope.float()
    return m, (torch.randn(1, 4, 3, 16, 16, dtype=BF), torch.tensor([999]), torch.randn(1, 8, 16, dtype=BF)), {}


def cogvideox_transformer():
    """The CogVideoX transformer alone (the pipeline tests wrap it in a CogVideoXPipeline)."""
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers import CogVideoXTransformer3DModel
    torch.manual_seed(0)
    return CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=1, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True).to(BF).eval()


def cogvideox():
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    m = cogvideox_transformer()
    cos, sin = get_3d_rotary_pos_embed(embed_dim=64, crops_coords=((0, 0), (8, 8)), grid_size=(8, 8),
                                       temporal_size=3)
    args = (torch.randn(1, 3, 4, 16, 16, dtype=BF), torch.randn(1, 8, 16, dtype=BF), torch.tensor([999]))
    return m, args, {"image_rotary_emb": (cos, sin)}


def ltx():
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers import LTXVideoTransformer3DModel
    torch.manual_seed(0)
    m = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
                                   num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
                                   num_layers=1, caption_channels=16).to(BF).eval()
    args = (torch.randn(1, 48, 8, dtype=BF), torch.randn(1, 8, 16, dtype=BF), torch.tensor([999]),
            torch.ones(1, 8, dtype=torch.long))
    return m, args, dict(num_frames=3, height=4, width=4)


def cosmos():
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers import CosmosTransformer3DModel
    torch.manual_seed(0)
    m = CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64,
                                 num_layers=1, mlp_ratio=2.0, text_embed_dim=16, adaln_lora_dim=8,
                                 max_size=(4, 32, 32), patch_size=(1, 2, 2), concat_padding_mask=False,
                                 extra_pos_embed_type="learnable").to(BF).eval()
    return m, (torch.randn(1, 4, 3, 16, 16, dtype=BF), torch.tensor([0.5]), torch.randn(1, 8, 16, dtype=BF)), {}


def hunyuan(padded_text: bool = False):
    """``padded_text``: the last 3 of the 8 text tokens are padding (mask 0)."""
    pytest.importorskip("diffusers")  # a test dependency: skipped where it is not installed
    from diffusers import HunyuanVideoTransformer3DModel
    torch.manual_seed(0)
    m = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(16, 24, 24)).to(BF).eval()
    mask = torch.ones(1, 8, dtype=torch.long)
    if padded_text:
        mask[:, 5:] = 0
    args = (torch.randn(1, 4, 3, 16, 16, dtype=BF), torch.tensor([999]), torch.randn(1, 8, 16, dtype=BF), mask,
            torch.randn(1, 8, dtype=BF))
    return m, args, {"guidance": torch.tensor([6000.0])}
