"""A fastnmt model as a Hugging Face Marian directory (``MarianMTModel`` and ``MarianTokenizer``,
written by their ``save_pretrained``), behind ``python -m fastnmt.export --format huggingface``.

The inverse of ``convert.py``'s import, through the same map of parameters (``parameter_sources``):
- layers: post-norm only, as Marian's are (``MarianConfig`` has no pre-norm setting), so a
  pre-norm model is refused;
- positions: Marian's table puts the sin features in the first half and the cos in the second;
  fastnmt's own (``sinusoidal``) interleaves the same features. Such a model is written with its
  residual features permuted into Marian's order: an exact reparametrisation, since LayerNorm,
  attention and the FFN all commute with a permutation of the residual stream's features applied
  to every weight that reads or writes it. fairseq's positions (from position pad + 1, other
  frequencies) are refused;
- activations relu, gelu and silu (Marian's swish); dropouts and ``scale_embedding`` as they are;
- the tied embedding (encoder, decoder, LM head) and ``final_logits_bias`` (zeros without one);
- fastnmt's bos as ``decoder_start_token_id`` (an imported Marian model's is its pad), and the
  generation settings of fastnmt's search: beam 4, length penalty 1, no pad or bos generated;
- the tokenizer: a Marian tokenizer's own files, or the joint sentencepiece model as both
  source.spm and target.spm with vocab.json its pieces in id order.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from fastnmt.data import MarianVocabulary, Vocabulary
from fastnmt.integrations.transformers.attention import UnsupportedModelError
from fastnmt.integrations.transformers.convert import CONFIG_FIELDS, parameter_sources
from fastnmt.model import ModelConfig

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "swish"}  # fastnmt's -> Marian's
# Suffixes of the parameters that read the residual stream (its features are their columns) and
# of those that write it or act on it feature-wise (its features are their rows).
READ_RESIDUAL = ("embedding.weight", "in_proj_weight", "linear1.weight")
WRITE_RESIDUAL = ("out_proj.weight", "out_proj.bias", "linear2.weight", "linear2.bias")
NORMS = ("_norm.weight", "_norm.bias")


def check_expressible(cfg: ModelConfig) -> None:
    """A one-line UnsupportedModelError naming what Marian cannot express."""
    if cfg.prenorm:
        raise UnsupportedModelError(
            "Marian's layers are post-norm and this model is pre-norm (train with --postnorm "
            "for a model that exports to Marian)"
        )
    if cfg.positions == "fairseq":
        raise UnsupportedModelError(
            "Marian's sinusoids start at position 0; this model has fairseq's (M2M100/NLLB) "
            "positions"
        )
    if cfg.activation not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"Marian's activations are {sorted(ACTIVATIONS)}, this model's is {cfg.activation!r}"
        )


def marian_order(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """``weights`` with the residual features in the order of Marian's position table."""
    if cfg.positions == "marian":
        return weights
    order = torch.cat([torch.arange(0, cfg.d_model, 2), torch.arange(1, cfg.d_model, 2)])
    permuted = {}
    for name, tensor in weights.items():
        if name.endswith(READ_RESIDUAL):
            tensor = tensor[:, order]
        elif name.endswith(WRITE_RESIDUAL + NORMS):
            tensor = tensor[order]
        permuted[name] = tensor
    return permuted


def marian_config(cfg: ModelConfig) -> transformers.MarianConfig:
    return transformers.MarianConfig(
        vocab_size=cfg.vocab_size,
        decoder_vocab_size=cfg.vocab_size,
        **{name: getattr(cfg, field) for field, name in CONFIG_FIELDS.items()},
        decoder_attention_heads=cfg.heads,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=ACTIVATIONS[cfg.activation],
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
    )


def _generation_settings(model: transformers.MarianMTModel, cfg: ModelConfig) -> None:
    """``generate()``'s defaults: fastnmt's beam search (length penalty 1, stop when every beam
    has ended) and its bans: pad, and bos where it is not pad."""
    settings = model.generation_config
    settings.num_beams, settings.length_penalty, settings.early_stopping = 4, 1.0, True
    settings.decoder_start_token_id = cfg.bos_id
    settings.bad_words_ids = [[i] for i in sorted({cfg.pad_id, cfg.bos_id})]
    settings.forced_eos_token_id = None
    settings.max_length = cfg.max_positions


def marian_model(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> transformers.MarianMTModel:
    """A ``MarianMTModel`` computing what ``Transformer(cfg)`` with ``weights`` computes."""
    check_expressible(cfg)
    model = transformers.MarianMTModel(marian_config(cfg)).eval()
    weights = marian_order(weights, cfg)
    with torch.no_grad():
        if not cfg.output_bias:
            model.final_logits_bias.zero_()
        for name, parts in parameter_sources(model, cfg).items():
            pieces = weights[name].split([part.shape[0] for part in parts])
            for part, piece in zip(parts, pieces, strict=True):
                part.copy_(piece.reshape(part.shape))
    _generation_settings(model, cfg)
    return model


def _tokenizer_files(vocab: Vocabulary | MarianVocabulary) -> dict[str, bytes]:
    """source.spm, target.spm and vocab.json of ``vocab``."""
    if isinstance(vocab, MarianVocabulary):
        return dict(vocab.files)
    pieces = {piece: i for i, piece in enumerate(vocab.pieces(range(len(vocab))))}
    model = vocab.to_bytes()
    return {"source.spm": model, "target.spm": model, "vocab.json": json.dumps(pieces).encode()}


def marian_tokenizer(
    vocab: Vocabulary | MarianVocabulary, folder: Path
) -> transformers.MarianTokenizer:
    """A ``MarianTokenizer`` that encodes and decodes as ``vocab`` does, its files written into
    ``folder``."""
    pieces = vocab.pieces([vocab.pad_id, vocab.eos_id, vocab.unk_id])
    specials = dict(zip(("pad_token", "eos_token", "unk_token"), pieces, strict=True))
    if vocab.bos_id != vocab.pad_id:  # special, so that decode(skip_special_tokens=True) drops it
        specials["bos_token"] = vocab.pieces([vocab.bos_id])[0]
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in _tokenizer_files(vocab).items():
        (folder / name).write_bytes(data)
    return transformers.MarianTokenizer(
        source_spm=str(folder / "source.spm"),
        target_spm=str(folder / "target.spm"),
        vocab=str(folder / "vocab.json"),
        **specials,
    )


def save_marian(
    cfg: ModelConfig,
    weights: dict[str, torch.Tensor],
    vocab: Vocabulary | MarianVocabulary,
    output: Path,
) -> None:
    """Write the Marian directory of a fastnmt model (``save_pretrained``'s layout) into
    ``output``."""
    marian_model(cfg, weights).save_pretrained(output)
    marian_tokenizer(vocab, output).save_pretrained(output)
