"""Encoder-decoder Transformer for translation, built from fastnmt's ops.

Reads top-down: config and presets, the residual stack shared by encoder and decoder, the layers,
the model (training forward, logits, incremental decoding with a KV cache; the searches that use
it are in ``fastnmt.decoding.search``).
Shapes: B sentences, S source tokens, T target tokens, E = d_model, V = vocabulary, H heads.
Padding travels as lengths (B,), never as dense masks; sequences may also travel packed, without
padding (``forward_packed``: N_s source and N_t target tokens in all).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from fastnmt.attention import MultiheadAttention, Packed
from fastnmt.kv_cache import CacheRows, KVCache
from fastnmt.ops import add_layer_norm, dropout_seeds, feed_forward
from fastnmt.ops.add_layer_norm import UnscaledRows, add_unscaled_layer_norm


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
    # The layouts of imported models (fastnmt.integrations.transformers): see position_table.
    positions: str = "sinusoidal"
    scale_embedding: bool = True  # embeddings times sqrt(d_model) (Vaswani et al.; BART: False)
    output_bias: bool = False  # a fixed bias on the logits (Marian's final_logits_bias)
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def to_dict(self) -> dict:
        return asdict(self)

    def dropout_sites(self) -> int:
        """The fused ops that apply dropout in a training forward: the add_layer_norm of each
        sublayer (and of each pre-norm stack's end), and where their dropout is set, each
        attention and each feed-forward."""
        sublayers = 2 * self.encoder_layers + 3 * self.decoder_layers
        attentions = self.encoder_layers + 2 * self.decoder_layers
        feed_forwards = self.encoder_layers + self.decoder_layers
        return (
            (sublayers + 2 * self.prenorm) * (self.dropout > 0.0)
            + attentions * (self.attention_dropout > 0.0)
            + feed_forwards * (self.activation_dropout > 0.0)
        )


PRESETS = {
    # Multi30k on a CPU: the size of the OpenNMT-py baseline it is compared with. Dropout 0.2:
    # Multi30k's 29k pairs make 25 minutes on a fast CPU some 30 epochs, past which 0.1 overfits
    # (its validation BLEU stops rising after about 15); 0.2 keeps up with it until then and
    # goes on rising.
    "tiny": ModelConfig(dropout=0.2),
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
# A training forward's dropout seeds (``fastnmt.ops.dropout_seeds``: one draw, not one per op),
# taken in call order; None: each op draws its own.
Seeds = Iterator[torch.Tensor] | None


def next_seed(seeds: Seeds, dropout_p: float) -> torch.Tensor | None:
    """The seed of the next fused op of a forward, if it applies dropout (None once the seeds
    run out, e.g. after a module's dropout was raised by hand: the op then draws its own)."""
    return next(seeds, None) if seeds is not None and dropout_p > 0.0 else None


def residual_stack(
    x, sublayers: list[Sublayer], final_norm: LayerNorm | None, cfg, training, seeds: Seeds
):
    """Run sublayers with residual connections and LayerNorm, fusing dropout + add + norm.

    Pre-norm: h_0 = dropout(x); y_i = LN_i(h_i); h_{i+1} = h_i + dropout(f_i(y_i)); out = LN_f(h_n).
    Post-norm: x_0 = dropout(x); x_{i+1} = LN_i(x_i + dropout(f_i(x_i))).
    """
    p = cfg.dropout if training else 0.0

    def add_norm(pending, h, norm):
        if isinstance(pending, UnscaledRows):  # an int8 GEMM's rows, finished in the norm
            return add_unscaled_layer_norm(pending, h, norm.weight, norm.bias)
        return add_layer_norm(
            pending, h, norm.weight, norm.bias, dropout_p=p, dropout_seed=next_seed(seeds, p)
        )

    if cfg.prenorm:
        pending, h = x, None
        for norm, sublayer in sublayers:
            y, h = add_norm(pending, h, norm)
            pending = sublayer(y)
        return add_norm(pending, h, final_norm)[0]
    x = F.dropout(x, p, training)
    for norm, sublayer in sublayers:
        x = add_norm(sublayer(x), x, norm)[0]
    return x


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x, seeds: Seeds = None):  # (B, L, E) -> (B, L, E)
        if not isinstance(self.linear1, nn.Linear):  # packed layers (fastnmt.quantize), inference
            return self.linear1.then(self.linear2, x)  # linear1 applies the activation
        p = self.cfg.activation_dropout if self.training else 0.0
        return feed_forward(
            x,
            self.linear1.weight,
            self.linear1.bias,
            self.linear2.weight,
            self.linear2.bias,
            self.cfg.activation,
            p,
            next_seed(seeds, p),
        )


@dataclass
class AttentionRecord:
    """Per-head attention probabilities of every layer, in layer order, each (B, H, Lq, Lk):
    filled by ``encode``/``decode`` when one is passed (for plots and alignments)."""

    encoder: list[torch.Tensor] = field(default_factory=list)  # self-attention, (B, H, S, S)
    decoder: list[torch.Tensor] = field(default_factory=list)  # self-attention, (B, H, T, T)
    cross: list[torch.Tensor] = field(default_factory=list)  # (B, H, T, S)


def _attend(
    module: MultiheadAttention,
    query,
    key,
    record: list | None,
    seeds: Seeds,
    *,
    causal=False,
    **kwargs,
):
    """Attention output (the module's lean ``attend``); with ``record`` a list, also append the
    probabilities (B, H, Lq, Lk), which the fused path computes exactly from the log-sum-exp it
    returns."""
    if record is None:
        seed = next_seed(seeds, module.dropout if module.training else 0.0)
        return module.attend(query, key, causal=causal, dropout_seed=seed, **kwargs)
    out, weights = module(query, key, key, average_attn_weights=False, is_causal=causal, **kwargs)
    record.append(weights)
    return out


def _attention(cfg: ModelConfig) -> MultiheadAttention:
    return MultiheadAttention(
        cfg.d_model, cfg.heads, dropout=cfg.attention_dropout, batch_first=True
    )


def _source_keys(src_lengths: torch.Tensor | Packed, queries: Packed | None = None) -> dict:
    """How attention over the source sees its keys: by their lengths (padded), or packed
    (``queries``: the queries' layout, the source's own in self-attention)."""
    if isinstance(src_lengths, Packed):
        return dict(packed=(queries or src_lengths, src_lengths))
    return dict(key_lengths=src_lengths)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.self_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.ffn, self.ffn_norm = FeedForward(cfg), LayerNorm(cfg.d_model)

    def sublayers(
        self, src_lengths, record: AttentionRecord | None, seeds: Seeds
    ) -> list[Sublayer]:
        keys = _source_keys(src_lengths)

        def self_attention(y):
            weights = None if record is None else record.encoder
            return _attend(self.self_attn, y, y, weights, seeds, **keys)

        return [
            (self.self_attn_norm, self_attention),
            (self.ffn_norm, lambda y: self.ffn(y, seeds)),
        ]


@dataclass
class LayerCache:
    """One decoder layer's keys/values: its own past steps and the projected encoder output."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=lambda: KVCache(static=True))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.self_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.cross_attn, self.cross_attn_norm = _attention(cfg), LayerNorm(cfg.d_model)
        self.ffn, self.ffn_norm = FeedForward(cfg), LayerNorm(cfg.d_model)

    def sublayers(
        self,
        memory,
        src_lengths,
        cache: LayerCache | None,
        record: AttentionRecord | None,
        seeds: Seeds,
        packed: Packed | None = None,
    ) -> list[Sublayer]:
        """``packed``: the targets' layout, when they are packed (so are the sources then:
        ``src_lengths`` is their ``Packed``)."""
        # Padded target positions need no mask: causal queries never see later (padded) keys,
        # and the loss ignores padded queries.
        targets = {} if packed is None else dict(packed=(packed, packed))

        def self_attention(y):
            cached = None if cache is None else cache.self_attn
            weights = None if record is None else record.decoder
            return _attend(
                self.self_attn, y, y, weights, seeds, causal=True, cache=cached, **targets
            )

        def cross_attention(y):  # y (B*K, T, E): K hypotheses of each sentence, sentence-major
            if packed is not None:  # y (N_t, E)
                return _attend(
                    self.cross_attn, y, memory, None, seeds, **_source_keys(src_lengths, packed)
                )
            cached = None if cache is None else cache.cross_attn
            weights = None if record is None else []
            rows, length, width = y.shape
            # Cross-attention has no mask between queries, so the K*T queries of one sentence
            # can share its keys: memory and the cross-attention cache stay (B, S, E) for any K.
            queries = y.reshape(src_lengths.shape[0], -1, width)  # (B, K*T, E)
            out = _attend(
                self.cross_attn,
                queries,
                memory,
                weights,
                seeds,
                key_lengths=src_lengths,
                cache=cached,
            )
            if record is not None:  # (B, H, K*T, S) -> (B*K, H, T, S)
                sentences, heads, _, keys = weights[0].shape
                per_sentence = weights[0].view(sentences, heads, -1, length, keys)
                record.cross.append(per_sentence.transpose(1, 2).reshape(rows, heads, length, keys))
            return out.reshape(rows, length, width)

        return [
            (self.self_attn_norm, self_attention),
            (self.cross_attn_norm, cross_attention),
            (self.ffn_norm, lambda y: self.ffn(y, seeds)),
        ]


def sinusoidal_positions(length: int, width: int) -> torch.Tensor:
    """(length, width) sin/cos position encodings of Vaswani et al. (sin on even, cos on odd)."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, width, 2, dtype=torch.float32) * (-math.log(1e4) / width))
    table = torch.zeros(length, width)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency[: width // 2])
    return table


def marian_positions(length: int, width: int) -> torch.Tensor:
    """Marian's (Opus-MT's) table: Vaswani et al.'s frequencies, sin in the first half of the
    features and cos in the second, computed in float64 as transformers does."""
    position = torch.arange(length, dtype=torch.float64)[:, None]
    angle = position / 10000 ** (torch.arange(0, width, 2, dtype=torch.float64) / width)
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


def fairseq_positions(length: int, width: int, pad_id: int) -> torch.Tensor:
    """fairseq's (M2M100's, NLLB's) table: frequencies spaced over width/2 - 1 steps, sin then
    cos halves, in float32; position t is fairseq's row t + pad_id + 1."""
    half = width // 2
    frequency = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
    angle = torch.arange(pad_id + 1, pad_id + 1 + length).float()[:, None] * frequency[None]
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1)


def position_table(cfg: ModelConfig) -> torch.Tensor:  # (max_positions, E)
    if cfg.positions == "sinusoidal":
        return sinusoidal_positions(cfg.max_positions, cfg.d_model)
    if cfg.positions == "marian":
        return marian_positions(cfg.max_positions, cfg.d_model)
    if cfg.positions == "fairseq":
        return fairseq_positions(cfg.max_positions, cfg.d_model, cfg.pad_id)
    raise ValueError(f"positions must be sinusoidal, marian or fairseq, got {cfg.positions!r}")


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # One joint vocabulary: source, target and output embeddings are the same matrix.
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.register_buffer("positions", position_table(cfg), persistent=False)
        # Fixed, like the buffer it is imported from; None (no bias) for fastnmt's own models.
        self.output_bias = nn.Buffer(torch.zeros(cfg.vocab_size)) if cfg.output_bias else None
        self.encoder = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.decoder = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.encoder_norm = LayerNorm(cfg.d_model) if cfg.prenorm else None
        self.decoder_norm = LayerNorm(cfg.d_model) if cfg.prenorm else None
        # The output layer as a packed GEMM (int8 or bf16): set by fastnmt.quantize.
        self.packed_output: nn.Module | None = None
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

    def embed(self, tokens, start: int | torch.Tensor = 0):  # (B, L) -> (B, L, E)
        """``start`` a (1,) device tensor (one token a row): the position is read on the device,
        as a captured decoding step must; or the (N,) positions of packed tokens (N,). Its
        caller keeps them below max_positions."""
        scale = math.sqrt(self.cfg.d_model) if self.cfg.scale_embedding else 1.0
        if isinstance(start, torch.Tensor):
            positions = self.positions.index_select(0, start)
        elif start + tokens.shape[1] > self.cfg.max_positions:
            raise ValueError(
                f"sequence of {start + tokens.shape[1]} tokens exceeds max_positions "
                f"({self.cfg.max_positions})"
            )
        else:
            positions = self.positions[start : start + tokens.shape[1]]
        # positions + scale * embedding in one pass (the scaled embedding is not written)
        return torch.add(positions, self.embedding(tokens), alpha=scale)

    def encode(
        self, src, src_lengths, record: AttentionRecord | None = None, seeds: Seeds = None
    ):  # -> (B, S, E); packed: (N_s,) -> (N_s, E)
        """``src_lengths``: (B,), or the sources' ``Packed`` layout when src is packed."""
        sublayers = [
            s for layer in self.encoder for s in layer.sublayers(src_lengths, record, seeds)
        ]
        start = src_lengths.positions if isinstance(src_lengths, Packed) else 0
        return residual_stack(
            self.embed(src, start), sublayers, self.encoder_norm, self.cfg, self.training, seeds
        )

    def decode(
        self,
        tgt_in,
        memory,
        src_lengths,
        caches=None,
        start: int | torch.Tensor = 0,
        record: AttentionRecord | None = None,
        seeds: Seeds = None,
        packed: Packed | None = None,
    ):
        """Decoder states (B*K, T, E) for target inputs (B*K, T) at positions start.. (with
        caches: the cached steps are positions 0..start-1). ``memory`` (B, S, E) and
        ``src_lengths`` (B,) are per sentence: rows b*K .. b*K+K-1 of ``tgt_in`` are K
        hypotheses of sentence b (K = 1 in training). ``packed``: the targets' layout when
        tgt_in (N_t,) is packed (memory (N_s, E) and ``src_lengths`` the sources' Packed):
        states (N_t, E)."""
        sublayers = [
            s
            for i, layer in enumerate(self.decoder)
            for s in layer.sublayers(
                memory, src_lengths, None if caches is None else caches[i], record, seeds, packed
            )
        ]
        x = self.embed(tgt_in, start if packed is None else packed.positions)
        return residual_stack(x, sublayers, self.decoder_norm, self.cfg, self.training, seeds)

    def logits(self, states):  # (..., E) -> (..., V)
        """Logits with the tied output embedding (and ``output_bias``)."""
        if self.packed_output is not None:
            return self.packed_output(states)
        return F.linear(states, self.embedding.weight, self.output_bias)

    def output_layer(
        self, vocabulary: torch.Tensor | None = None
    ) -> Callable[[torch.Tensor], torch.Tensor]:  # (N, E) -> (N, V), or (N, len(vocabulary))
        """``logits`` for many decoding steps (no gradients), of every word or of the sorted ids
        ``vocabulary`` only (a shortlist): the tied embedding's rows transposed and contiguous
        once, the layout a library GEMM reads fastest for a few hundred rows (twice as fast as
        the (V, E) weight at 64 rows on a CPU), on a CPU in blocks (``BlockedOutputLayer``: its
        logits are valid until its next call); or the packed (int8 or bf16) output layer (those
        rows packed once)."""
        if self.packed_output is not None:
            return self.packed_output if vocabulary is None else self.packed_output.rows(vocabulary)
        weight, bias = self.embedding.weight, self.output_bias
        if vocabulary is not None:
            weight, bias = weight[vocabulary], None if bias is None else bias[vocabulary]
        if weight.device.type == "cpu":
            return BlockedOutputLayer(weight.t(), bias)
        weight = weight.t().contiguous()  # (E, V)
        if bias is None:
            return lambda states: torch.matmul(states, weight)
        return lambda states: torch.addmm(bias, states, weight)

    def forward(self, src, src_lengths, tgt_in):  # -> decoder states (B, T, E)
        seeds = self.dropout_seeds(src.device)
        memory = self.encode(src, src_lengths, seeds=seeds)
        return self.decode(tgt_in, memory, src_lengths, seeds=seeds)

    def forward_packed(
        self, src, src_packed: Packed, tgt_in, tgt_packed: Packed
    ):  # (N_s,), (N_t,) -> decoder states (N_t, E)
        """``forward`` over packed sequences: every GEMM, LayerNorm and attention runs on the
        real tokens only (``attention_varlen``), none on padding. Without dropout, the states
        of ``forward`` at the unpadded positions."""
        seeds = self.dropout_seeds(src.device)
        memory = self.encode(src, src_packed, seeds=seeds)
        return self.decode(tgt_in, memory, src_packed, seeds=seeds, packed=tgt_packed)

    def dropout_seeds(self, device: torch.device) -> Seeds:
        """Every dropout seed of a training forward, from one draw (one kernel, where each op
        would launch its own); None in evaluation."""
        sites = self.cfg.dropout_sites() if self.training else 0
        return iter(dropout_seeds(sites, device)) if sites else None

    def new_caches(self, steps: int = 16) -> list[LayerCache]:
        """Empty caches of every decoder layer, with room for ``steps`` target positions
        reserved (the length limit of a search: the caches then never grow). The layers'
        self-attention caches share their rows, so that a search reorders them once a step
        (``reorder_self_attention``)."""
        rows = CacheRows()
        return [LayerCache(KVCache(reserve=steps, shared_rows=rows)) for _ in self.decoder]


def reorder_self_attention(caches: list[LayerCache], index: torch.Tensor) -> None:
    """Keep hypotheses ``index`` (N',) in the layers' self-attention caches: one gather per rows
    table, however many layers share it (all of them in ``new_caches``'s)."""
    one_per_table = {id(cache.self_attn.shared_rows): cache.self_attn for cache in caches}
    for cache in one_per_table.values():
        cache.reorder(index)


class BlockedOutputLayer:
    """(N, E) -> (N, V) logits on a CPU, for decoding steps (no gradients): ``x @ weight + bias``
    with an (E, V) weight of over ``CACHED_BYTES`` in contiguous blocks of ``BLOCK`` columns, each
    GEMM writing its columns of one logits buffer that every call reuses (the result is valid
    until the next call).

    Why blocks: with a few hundred rows, a library GEMM over a weight larger than the cache gives
    each thread its own rows and so streams the whole weight from memory once per thread; a
    (E, 1024) block is read from memory once and then from the cache. Why one buffer: a fresh
    (N, V) tensor of over 32 MB is a fresh mapping from the allocator, and its page faults cost as
    much as a third of the GEMM. A weight that fits in the cache (the tiny preset's 8 MB) stays
    one block, where blocks gain nothing.
    """

    BLOCK = 1024
    CACHED_BYTES = 32 << 20  # a last-level cache (an EPYC's 8-core complex)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):  # weight (E, V)
        weight = weight.detach()
        self.width = weight.shape[1]
        large = weight.numel() * weight.element_size() > self.CACHED_BYTES
        block = self.BLOCK if large else self.width
        columns = [slice(i, i + block) for i in range(0, self.width, block)]
        self.blocks = [  # (first column, (E, width) weight block, its bias or None)
            (s.start, weight[:, s].contiguous(), None if bias is None else bias.detach()[s])
            for s in columns
        ]
        self.buffer = weight.new_empty(0, self.width)

    def __call__(self, states: torch.Tensor) -> torch.Tensor:
        rows = states.shape[0]
        if self.buffer.shape[0] < rows or self.buffer.dtype != states.dtype:
            self.buffer = states.new_empty(rows, self.width)
        logits = self.buffer[:rows]
        for start, block, bias in self.blocks:
            columns = logits[:, start : start + block.shape[1]]
            if bias is None:
                torch.mm(states, block, out=columns)
            else:
                torch.addmm(bias, states, block, out=columns)
        return logits
