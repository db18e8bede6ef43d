"""Fine-tuning with ``python -m fastnmt.train --init-from DIR``: the starting model, its
vocabulary and the defaults that suit continuing from trained weights.

DIR is a Hugging Face Marian (Opus-MT) directory as ``save_pretrained`` writes it (config.json,
weights, source.spm, target.spm, vocab.json; needs ``fastnmt[transformers]``) or a fastnmt
checkpoint (or training output directory: its best checkpoint). The weights are converted as
``Translator.from_pretrained`` converts them (``fastnmt.integrations.transformers.convert``); the
tokenizer becomes a ``MarianVocabulary``, which encodes the training data without transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fastnmt.checkpoint import CheckpointError
from fastnmt.data import MarianVocabulary, Vocabulary
from fastnmt.model import PRESETS, ModelConfig
from fastnmt.translator import is_pretrained_directory, load_checkpoint

# From scratch: the learning rate and warmup of the small pre-norm presets.
SCRATCH_LR, SCRATCH_WARMUP, SCRATCH_PRESET = 2e-3, 500, "tiny"
# From trained weights: a peak 40x lower, the default of transformers' Trainer with which Opus-MT
# models are commonly fine-tuned; 2e-3 moves the weights far from the minimum they were trained
# into, and the model forgets its general domain within a few hundred steps.
# The warmup only has to let Adam's second-moment estimates settle (a few hundred updates at
# beta2 0.98 is already more than enough); a long one would spend most of a small in-domain
# corpus at a learning rate too low to adapt.
FINE_TUNE_LR, FINE_TUNE_WARMUP = 5e-5, 100
# The flags that shape the network: with --init-from the model's own values, or an error.
ARCHITECTURE = ("encoder_layers", "decoder_layers", "d_model", "heads", "d_ff")
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")


@dataclass
class Initial:
    """The model training starts from: its configuration, fp32 weights and vocabulary."""

    cfg: ModelConfig
    weights: dict[str, torch.Tensor]
    vocab: Vocabulary | MarianVocabulary


def apply_defaults(args) -> None:
    """The learning rate, warmup and preset the user left unset: fine-tuning values with
    --init-from, else training-from-scratch ones."""
    fine_tuning = args.init_from is not None
    if args.lr is None:
        args.lr = FINE_TUNE_LR if fine_tuning else SCRATCH_LR
    if args.warmup is None:
        args.warmup = FINE_TUNE_WARMUP if fine_tuning else SCRATCH_WARMUP
    if args.preset is None and not fine_tuning:
        args.preset = SCRATCH_PRESET


def load_initial(args) -> Initial:
    """The model of ``--init-from``, configured by the flags (a one-line ValueError for a directory
    that holds no model it can start from, or flags that contradict it)."""
    initial = _load(Path(args.init_from))
    initial.cfg = fine_tuning_config(args, initial.cfg)
    return initial


def _load(path: Path) -> Initial:
    """The model of a Hugging Face Marian directory or a fastnmt checkpoint."""
    if not path.is_dir():
        raise ValueError(f"--init-from {path}: not a directory")
    if is_pretrained_directory(path):
        return _from_marian(path)
    try:
        model, vocab = load_checkpoint(path)
    except CheckpointError as error:
        raise ValueError(f"--init-from: {error}") from None
    return Initial(model.cfg, model.state_dict(), vocab)


def _from_marian(path: Path) -> Initial:
    try:
        import transformers

        from fastnmt.integrations.transformers import UnsupportedModelError
        from fastnmt.integrations.transformers.convert import convert_model
    except ImportError as error:
        raise ValueError(f"--init-from {path} is a Hugging Face model: {error}") from None
    config = transformers.AutoConfig.from_pretrained(path)
    if config.model_type != "marian":
        raise ValueError(
            f"--init-from fine-tunes Marian (Opus-MT) models; {path} is {config.model_type!r}"
        )
    hf_model = transformers.MarianMTModel.from_pretrained(path, dtype=torch.float32)
    try:
        model = convert_model(hf_model)
    except UnsupportedModelError as error:
        raise ValueError(f"--init-from {path}: {error}") from None
    vocab = MarianVocabulary.from_directory(path, bos_id=config.decoder_start_token_id)
    if len(vocab) != model.cfg.vocab_size:
        raise ValueError(
            f"--init-from {path}: vocab.json has {len(vocab)} ids, the model {model.cfg.vocab_size}"
        )
    return Initial(model.cfg, model.state_dict(), vocab)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def fine_tuning_config(args, cfg: ModelConfig) -> ModelConfig:
    """The initial model's configuration with the dropouts the user set; an architecture flag
    that contradicts it is a one-line ValueError naming the flag."""
    for name in ARCHITECTURE:
        given, own = getattr(args, name), getattr(cfg, name)
        if given is not None and given != own:
            raise ValueError(f"{_flag(name)} {given} contradicts --init-from's model ({own})")
    if args.postnorm and cfg.prenorm:
        raise ValueError("--postnorm contradicts --init-from's model, which is pre-norm")
    if args.preset is not None:
        for name in ARCHITECTURE:
            given, own = getattr(PRESETS[args.preset], name), getattr(cfg, name)
            if given != own:
                raise ValueError(
                    f"--preset {args.preset} contradicts --init-from's model ({name} {given} "
                    f"in the preset, {own} in the model)"
                )
    if args.max_len > cfg.max_positions:
        raise ValueError(
            f"--max-len {args.max_len} exceeds --init-from's model's {cfg.max_positions} positions"
        )
    dropouts = {name: getattr(args, name) for name in DROPOUTS if getattr(args, name) is not None}
    return replace(cfg, **dropouts)
