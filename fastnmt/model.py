"""Encoder-decoder Transformer for translation, built from fastnmt's ops.

Reads top-down: config and presets, the residual stack shared by encoder and decoder, the layers,
the model (training forward, logits, incremental decoding with a KV cache, batched greedy search).
Shapes: B sentences, S source tokens, T target tokens, E = d_model, V = vocabulary.
Padding travels as lengths (B,), never as dense masks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.attention import KVCache, MultiheadAttention
from fastnmt.ops import add_layer_norm, feed_forward


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 8000
    d_model: int = 256
    heads: int = 4
    d_ff: int = 1024
    encoder_layers: int = 3
    decoder_layers: int = 3
    dropout: float = 0.1  # on embeddings and every sublayer output
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    activation: str = "relu"
    prenorm: bool = True  # pre-norm (stable without long warmup); post-norm as in Vaswani et al.
    max_positions: int = 1024
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS = {
    # Multi30k on a CPU: the size of the OpenNMT-py baseline it is compared with.
    "tiny": ModelConfig(),
    # Vaswani et al. base.
    "base": ModelConfig(d_model=512, heads=8, d_ff=2048, encoder_layers=6, decoder_layers=6),
    # fairseq's transformer_iwslt_de_en.
    "iwslt": ModelConfig(d_model=512, heads=4, d_ff=1024, encoder_layers=6, decoder_layers=6),
}


def preset(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **overrides)


class LayerNorm(nn.Module):
    """LayerNorm parameters; the normalisation itself runs fused in ``add_layer_norm``."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))


Sublayer = tuple[LayerNorm, Callable[[torch.Tensor], torch.Tensor]]


def residual_stack(x, sublayers: list[Sublayer], final_norm: LayerNorm | None, cfg, training):
    """Run sublayers with residual connections and LayerNorm, fusing dropout + add + norm.

    Pre-norm: h_0 = dropout(x); y_i = LN_i(h_i); h_{i+1} = h_i + dropout(f_i(y_i)); out = LN_f(h_n).
    Post-norm: x_0 = dropout(x); x_{i+1} = LN_i(x_i + dropout(f_i(x_i))).
    """
    p = cfg.dropout if training else 0.0
    if cfg.prenorm:
        pending, h = x, None
        for norm, sublayer in sublayers:
            y, h = add_layer_norm(pending, h, norm.weight, norm.bias, dropout_p=p)
            pending = sublayer(y)
        return add_layer_norm(pending, h, final_norm.weight, final_norm.bias, dropout_p=p)[0]
    x = F.dropout(x, p, training)
    for norm, sublayer in sublayers:
        x = add_layer_norm(sublayer(x), x, norm.weight, norm.bias, dropout_p=p)[0]
    return x


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):  # (B, L, E) -> (B, L, E)
        p = self.cfg.activation_dropout if self.training else 0.0
        return feed_forward(
            x,
            self.linear1.weight,
            self.linear1.bias,
            self.linear2.weight,
            self.linear2.bias,
            self.cfg.activation,
            p,
        )


def _attention(cfg: ModelConfig) -> MultiheadAttention:
    return MultiheadAttention(
        cfg.d_model, cfg.heads, dropout=cfg.attention_dropout, batch_first=True
    )


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.self_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.ffn, self.ffn_norm = FeedForward(cfg), LayerNorm(cfg.d_model)

    def sublayers(self, src_lengths) -> list[Sublayer]:
        def self_attention(y):
            return self.self_attn(y, y, y, key_lengths=src_lengths, need_weights=False)[0]

        return [(self.self_attn_norm, self_attention), (self.ffn_norm, self.ffn)]


@dataclass
class LayerCache:
    """One decoder layer's keys/values: its own past steps and the projected encoder output."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))

    def reorder(self, index: torch.Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.self_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.cross_attn, self.cross_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.ffn, self.ffn_norm = FeedForward(cfg), LayerNorm(cfg.d_model)

    def sublayers(self, memory, src_lengths, cache: LayerCache | None) -> list[Sublayer]:
        # Padded target positions need no mask: causal queries never see later (padded) keys,
        # and the loss ignores padded queries.
        def self_attention(y):
            cached = None if cache is None else cache.self_attn
            return self.self_attn(y, y, y, is_causal=True, need_weights=False, cache=cached)[0]

        def cross_attention(y):
            cached = None if cache is None else cache.cross_attn
            return self.cross_attn(
                y, memory, memory, key_lengths=src_lengths, need_weights=False, cache=cached
            )[0]

        return [
            (self.self_attn_norm, self_attention),
            (self.cross_attn_norm, cross_attention),
            (self.ffn_norm, self.ffn),
        ]


def sinusoidal_positions(length: int, width: int) -> torch.Tensor:
    """(length, width) sin/cos position encodings of Vaswani et al. (sin on even, cos on odd)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(1e4) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # One joint vocabulary: source, target and output embeddings are the same matrix.
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer(
            "positions", sinusoidal_positions(cfg.max_positions, cfg.d_model), persistent=False
        )
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.encoder_norm = LayerNorm(cfg.d_model) if cfg.prenorm else None
        self.decoder_norm = LayerNorm(cfg.d_model) if cfg.prenorm else None
        self._init_weights()

    def _init_weights(self) -> None:
        """Xavier for projections; embeddings N(0, 1/E) so scaled embeddings are ~N(0, 1)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.embedding.weight, std=self.cfg.d_model**-0.5)
        with torch.no_grad():
            self.embedding.weight[self.cfg.pad_id].zero_()

    def embed(self, tokens, start: int = 0):  # (B, L) -> (B, L, E)
        if start + tokens.shape[1] > self.cfg.max_positions:
            raise ValueError(
                f"sequence of {start + tokens.shape[1]} tokens exceeds max_positions "
                f"({self.cfg.max_positions})"
            )
        scaled = self.embedding(tokens) * math.sqrt(self.cfg.d_model)
        return scaled + self.positions[start : start + tokens.shape[1]]

    def encode(self, src, src_lengths):  # (B, S) -> (B, S, E)
        sublayers = [s for layer in self.encoder for s in layer.sublayers(src_lengths)]
        return residual_stack(
            self.embed(src), sublayers, self.encoder_norm, self.cfg, self.training
        )

    def decode(self, tgt_in, memory, src_lengths, caches=None, start: int = 0):
        """Decoder states (B, T, E) for target inputs at positions start.. (with caches: the
        cached steps are positions 0..start-1)."""
        sublayers = [
            s
            for i, layer in enumerate(self.decoder)
            for s in layer.sublayers(memory, src_lengths, None if caches is None else caches[i])
        ]
        x = self.embed(tgt_in, start)
        return residual_stack(x, sublayers, self.decoder_norm, self.cfg, self.training)

    def logits(self, states):  # (..., E) -> (..., V), with the tied output embedding
        return F.linear(states, self.embedding.weight)

    def forward(self, src, src_lengths, tgt_in):  # -> decoder states (B, T, E)
        return self.decode(tgt_in, self.encode(src, src_lengths), src_lengths)

    def new_caches(self) -> list[LayerCache]:
        return [LayerCache() for _ in self.decoder]

    @torch.no_grad()
    def greedy(self, src, src_lengths, max_len: int) -> list[list[int]]:
        """Batched greedy decoding with the KV cache; token ids per sentence, without eos."""
        memory = self.encode(src, src_lengths)
        caches = self.new_caches()
        batch = src.shape[0]
        tokens = torch.full((batch, 1), self.cfg.bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(batch, dtype=torch.bool, device=src.device)
        output = []
        for step in range(max_len):
            states = self.decode(tokens, memory, src_lengths, caches, start=step)  # (B, 1, E)
            tokens = self.logits(states[:, -1]).argmax(-1, keepdim=True)  # (B, 1)
            tokens = tokens.masked_fill(finished[:, None], self.cfg.pad_id)
            output.append(tokens)
            finished |= tokens[:, 0] == self.cfg.eos_id
            if finished.all():
                break
        ids = torch.cat(output, dim=1).tolist()
        return [_until_eos(row, self.cfg.eos_id) for row in ids]


def _until_eos(ids: list[int], eos_id: int) -> list[int]:
    return ids[: ids.index(eos_id)] if eos_id in ids else ids
