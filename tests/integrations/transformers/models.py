"""Tiny random Hugging Face translation models of each family, and their tokenizers, built and
saved locally (no internet): sentencepiece models trained on Multi30k lines."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import sentencepiece as spm
import torch
import transformers

from tests.helpers import multi30k_file

FAMILIES = ("marian", "bart", "mbart", "m2m_100", "pegasus")
CONFIGS = {
    "marian": transformers.MarianConfig,
    "bart": transformers.BartConfig,
    "mbart": transformers.MBartConfig,
    "m2m_100": transformers.M2M100Config,
    "pegasus": transformers.PegasusConfig,
}
# Each family's own activation where the kernels have it, so every activation is covered.
ACTIVATIONS = {"marian": "swish", "bart": "gelu", "mbart": "gelu", "m2m_100": "relu"}
VOCAB, PAD, EOS = 97, 1, 2


def tiny_model(family: str, vocab_size: int = VOCAB, *, pad: int = PAD, eos: int = EOS, **options):
    """A random 2+2-layer model (d_model 32, 4 heads, FFN 48) on eager attention, in eval mode,
    without dropout unless ``options`` ask for it. Weights are drawn
    wider than transformers' init (std 0.02) so that searches do not all emit the same token."""
    start = pad if family == "marian" else eos
    settings = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0) | options
    settings |= dict(encoder_layerdrop=0.0, decoder_layerdrop=0.0)  # M2M100's default skips
    settings.setdefault("activation_function", ACTIVATIONS.get(family, "relu"))
    config = CONFIGS[family](
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=48,
        decoder_ffn_dim=48,
        max_position_embeddings=64,
        pad_token_id=pad,
        eos_token_id=eos,
        bos_token_id=0,
        decoder_start_token_id=start,
        forced_eos_token_id=None,
        scale_embedding=True,
        **settings,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed_positions" not in name:  # Marian's are sinusoids
                parameter.normal_(0, 0.3 if "embed" not in name else 1.0)
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.normal_(0, 0.5)
    model.generation_config.forced_eos_token_id = None
    model.generation_config.bad_words_ids = [[pad]] if start == pad else None
    return model


def _lines(split: str, lang: str, count: int) -> list[str]:
    with gzip.open(multi30k_file(split, lang), "rt", encoding="utf-8") as f:
        return [next(f).strip() for _ in range(count)]


def _train_spm(texts: list[str], prefix: Path, vocab_size: int, **options) -> Path:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        minloglevel=2,
        **options,
    )
    return prefix.with_suffix(".model")


def marian_directory(folder: Path) -> Path:
    """An Opus-MT-like en-de checkpoint: source.spm, target.spm, vocab.json, model."""
    source = _train_spm(_lines("train", "en", 2000), folder / "source", 120, bos_id=-1, eos_id=-1)
    target = _train_spm(_lines("train", "de", 2000), folder / "target", 120, bos_id=-1, eos_id=-1)
    vocab = {"</s>": 0, "<unk>": 1}
    for model_file in (source, target):
        processor = spm.SentencePieceProcessor(model_file=str(model_file))
        for i in range(processor.get_piece_size()):
            vocab.setdefault(processor.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(source), target_spm=str(target), vocab=str(folder / "vocab.json")
    )
    directory = folder / "opus-mt-tiny"
    tokenizer.save_pretrained(directory)
    model = tiny_model("marian", len(vocab), pad=vocab["<pad>"], eos=0)
    model.save_pretrained(directory)
    return directory


NLLB_LANGUAGES = ["eng_Latn", "deu_Latn", "fra_Latn"]


def nllb_directory(folder: Path) -> Path:
    """An NLLB-like checkpoint: one sentencepiece BPE model with language codes, M2M100 model."""
    spm_folder = folder / "nllb-spm"
    spm_folder.mkdir()
    texts = _lines("train", "en", 1500) + _lines("train", "de", 1500)
    model_file = _train_spm(texts, spm_folder / "spm", 200, model_type="bpe")
    model_file.rename(spm_folder / "sentencepiece.bpe.model")
    tokenizer = transformers.NllbTokenizer.from_pretrained(
        spm_folder, src_lang="eng_Latn", tgt_lang="deu_Latn", extra_special_tokens=NLLB_LANGUAGES
    )
    directory = folder / "nllb-tiny"
    tokenizer.save_pretrained(directory)
    model = tiny_model("m2m_100", len(tokenizer), pad=tokenizer.pad_token_id, eos=2)
    model.save_pretrained(directory)
    return directory
