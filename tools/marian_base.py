"""A Marian-base-shaped Hugging Face model with random weights (6+6 layers, d_model 512, 8 heads,
FFN 2048, vocabulary 58,101, swish), as Opus-MT's: the model of the Hugging Face benchmarks
(benchmarks/integrations, tools/gpu_bench.py)."""

from __future__ import annotations

import torch
import transformers

VOCAB, PAD, EOS = 58101, 58100, 0


def marian_base(dropout: float = 0.1, *, tiny: bool = False) -> transformers.MarianMTModel:
    """On transformers' SDPA attention; weights drawn from seed 0. ``tiny``: the same model at
    width 16, 1+1 layers (checking a script on a CPU)."""
    width, layers, heads = (16, 1, 2) if tiny else (512, 6, 8)
    config = transformers.MarianConfig(
        vocab_size=VOCAB,
        d_model=width,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=4 * width,
        decoder_ffn_dim=4 * width,
        activation_function="swish",
        dropout=dropout,
        attention_dropout=0.0,
        pad_token_id=PAD,
        eos_token_id=EOS,
        decoder_start_token_id=PAD,
        forced_eos_token_id=None,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.MarianMTModel._from_config(config, attn_implementation="sdpa")
