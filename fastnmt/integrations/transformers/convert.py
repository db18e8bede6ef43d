"""Opus-MT (Marian) and NLLB/M2M100 checkpoints as fastnmt models: ``load_pretrained(directory)``,
behind ``fastnmt.Translator.from_pretrained``.

The mapping (transformers -> fastnmt):
- config: d_model, heads, FFN width, layers, activation (Marian's swish is SiLU), pre-norm
  (M2M100/NLLB) or post-norm (Marian), ``max_position_embeddings``, pad / eos, and the decoder's
  start symbol (Marian: pad; NLLB: eos) as fastnmt's bos;
- positions: Marian's sinusoids (sin and cos halves) or fairseq's (M2M100: frequencies over
  E/2 - 1 steps, from position pad + 1), computed by ``fastnmt.model.position_table``;
- weights: the shared embedding (tied with the LM head: one matrix in fastnmt), q/k/v projections
  packed into ``in_proj_weight`` (``nn.MultiheadAttention``'s layout), LayerNorms, FFN, the final
  encoder/decoder LayerNorms of pre-norm models, and Marian's ``final_logits_bias``;
- tokenizer: the checkpoint's own (Marian's source/target sentencepiece models and vocab.json;
  NLLB's sentencepiece model with language codes), wrapped as a fastnmt vocabulary; NLLB's
  target language is the forced first target token, as transformers' ``forced_bos_token_id``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fastnmt.integrations.transformers.attention import UnsupportedModelError
from fastnmt.integrations.transformers.layers import FAMILIES, _activation
from fastnmt.model import ModelConfig, Transformer

POSITIONS = {"marian": "marian", "m2m_100": "fairseq"}  # the families fastnmt's model can run


class PretrainedVocabulary:
    """A transformers tokenizer in the interface fastnmt's Translator uses: ``encode`` gives the
    source ids without the final eos (fastnmt appends it), ``encode_target`` the target side's,
    ``decode`` drops special tokens."""

    def __init__(self, tokenizer, model_config, src_lang: str | None, tgt_lang: str | None):
        self.tokenizer = tokenizer
        self.pad_id = model_config.pad_token_id
        self.bos_id = model_config.decoder_start_token_id
        self.eos_id = model_config.eos_token_id
        self.target_prefix: list[int] = []
        if model_config.model_type == "m2m_100":
            self.target_prefix = [self._language_id("tgt_lang", tgt_lang)]
            tokenizer.src_lang = src_lang
            self._language_id("src_lang", src_lang)
        elif src_lang or tgt_lang:
            raise ValueError(
                "src_lang/tgt_lang are for NLLB/M2M100 models; Opus-MT models translate one pair "
                "(multi-target ones read a >>lang<< token at the start of the source text)"
            )

    def _language_id(self, name: str, code: str | None) -> int:
        token_id = None if code is None else self.tokenizer.convert_tokens_to_ids(code)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            raise ValueError(
                f"{name} must be a language code of this model (e.g. eng_Latn), got {code!r}"
            )
        return token_id

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:  # transformers' tokenizers refuse an empty list
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return [ids[:-1] if ids and ids[-1] == self.eos_id else ids for ids in encoded]

    def encode_target(self, texts: list[str]) -> list[list[int]]:
        """Target ids as ``text_target`` encodes them (Opus-MT: its target.spm), without the
        language code and eos (the search's prefix and end)."""
        if not texts:
            return []
        return self.tokenizer(text_target=list(texts), add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)


def _check_supported(config) -> None:
    if config.model_type not in POSITIONS:
        raise UnsupportedModelError(
            f"Translator.from_pretrained supports model types {sorted(POSITIONS)} (Opus-MT, "
            f"NLLB/M2M100), got {config.model_type!r}"
        )
    same = (config.encoder_attention_heads, config.encoder_ffn_dim) == (
        config.decoder_attention_heads,
        config.decoder_ffn_dim,
    )
    if not same:
        raise UnsupportedModelError(
            "Translator.from_pretrained needs the same heads and FFN width in encoder and decoder"
        )


# ModelConfig fields and the transformers config attributes that hold them (encoder and decoder
# share heads and FFN width in fastnmt: the encoder's are read, both are written on export).
CONFIG_FIELDS = {
    "d_model": "d_model",
    "heads": "encoder_attention_heads",
    "d_ff": "encoder_ffn_dim",
    "encoder_layers": "encoder_layers",
    "decoder_layers": "decoder_layers",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "activation_dropout": "activation_dropout",
    "max_positions": "max_position_embeddings",
    "pad_id": "pad_token_id",
    "bos_id": "decoder_start_token_id",
    "eos_id": "eos_token_id",
    "scale_embedding": "scale_embedding",
}


def _model_config(config, vocab_size: int) -> ModelConfig:
    _check_supported(config)
    return ModelConfig(
        vocab_size=vocab_size,
        **{field: getattr(config, name) for field, name in CONFIG_FIELDS.items()},
        activation=_activation(config),
        prenorm=FAMILIES[config.model_type],
        positions=POSITIONS[config.model_type],
        output_bias=config.model_type == "marian",  # M2M100's LM head has no bias
    )


# fastnmt's parameters as lists of the transformers tensors they are made of, concatenated
# along their first dimension (q, k, v -> in_proj): read to import, split and written to export.
Sources = dict[str, list[torch.Tensor]]


def _attention_sources(prefix: str, attention: nn.Module) -> Sources:
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    return {
        f"{prefix}.in_proj_weight": [p.weight for p in projections],
        f"{prefix}.in_proj_bias": [p.bias for p in projections],
        f"{prefix}.out_proj.weight": [attention.out_proj.weight],
        f"{prefix}.out_proj.bias": [attention.out_proj.bias],
    }


def _norm_sources(prefix: str, norm: nn.LayerNorm) -> Sources:
    return {f"{prefix}.weight": [norm.weight], f"{prefix}.bias": [norm.bias]}


def _layer_sources(prefix: str, layer: nn.Module) -> Sources:
    sources = {
        **_attention_sources(f"{prefix}.self_attn", layer.self_attn),
        **_norm_sources(f"{prefix}.self_attn_norm", layer.self_attn_layer_norm),
        **_norm_sources(f"{prefix}.ffn_norm", layer.final_layer_norm),
        f"{prefix}.ffn.linear1.weight": [layer.fc1.weight],
        f"{prefix}.ffn.linear1.bias": [layer.fc1.bias],
        f"{prefix}.ffn.linear2.weight": [layer.fc2.weight],
        f"{prefix}.ffn.linear2.bias": [layer.fc2.bias],
    }
    if hasattr(layer, "encoder_attn"):
        sources.update(_attention_sources(f"{prefix}.cross_attn", layer.encoder_attn))
        sources.update(_norm_sources(f"{prefix}.cross_attn_norm", layer.encoder_attn_layer_norm))
    return sources


def _shared_embedding(hf_model: nn.Module) -> torch.Tensor:
    """The one matrix fastnmt uses for source, target and output embeddings."""
    matrices = (
        hf_model.get_encoder().embed_tokens.weight,
        hf_model.get_decoder().embed_tokens.weight,
        hf_model.get_output_embeddings().weight,
    )
    if any(m.shape != matrices[0].shape or not torch.equal(m, matrices[0]) for m in matrices):
        raise UnsupportedModelError(
            "Translator.from_pretrained needs one embedding shared by encoder, decoder and LM head "
            "(share_encoder_decoder_embeddings and tied word embeddings)"
        )
    return matrices[0]


def parameter_sources(hf_model: nn.Module, cfg: ModelConfig) -> Sources:
    """Where each of ``Transformer(cfg)``'s parameters is in a transformers model."""
    encoder, decoder = hf_model.get_encoder(), hf_model.get_decoder()
    sources = {"embedding.weight": [_shared_embedding(hf_model)]}
    for i, layer in enumerate(encoder.layers):
        sources.update(_layer_sources(f"encoder.{i}", layer))
    for i, layer in enumerate(decoder.layers):
        sources.update(_layer_sources(f"decoder.{i}", layer))
    if cfg.prenorm:
        sources.update(_norm_sources("encoder_norm", encoder.layer_norm))
        sources.update(_norm_sources("decoder_norm", decoder.layer_norm))
    if cfg.output_bias:
        sources["output_bias"] = [hf_model.final_logits_bias[0]]
    return sources


def convert_weights(hf_model: nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """fastnmt's state_dict for ``Transformer(cfg)`` from a transformers model's modules."""
    sources = parameter_sources(hf_model, cfg)
    return {name: torch.cat(parts).detach().clone() for name, parts in sources.items()}


def convert_model(hf_model: nn.Module) -> Transformer:
    """A fastnmt ``Transformer`` with ``hf_model``'s configuration and weights (fp32)."""
    cfg = _model_config(hf_model.config, hf_model.get_output_embeddings().weight.shape[0])
    model = Transformer(cfg)
    model.load_state_dict(convert_weights(hf_model.float(), cfg))
    return model


def load_pretrained(
    directory: str | Path, *, src_lang: str | None = None, tgt_lang: str | None = None
) -> tuple[Transformer, PretrainedVocabulary]:
    """The fastnmt model and vocabulary of a saved Opus-MT or NLLB/M2M100 checkpoint directory
    (``save_pretrained``'s, or a Hub snapshot). NLLB needs ``src_lang`` and ``tgt_lang``."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    config = AutoConfig.from_pretrained(directory)
    _check_supported(config)  # before loading the weights of a model it cannot run
    hf_model = AutoModelForSeq2SeqLM.from_pretrained(directory, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return convert_model(hf_model), PretrainedVocabulary(tokenizer, config, src_lang, tgt_lang)
