"""``python -m fastnmt.train``: train an encoder-decoder Transformer for translation.

With no arguments: English->German Multi30k, the ``tiny`` preset, the fastest precision for the
device, then a test-set score. ``torchrun --nproc_per_node N -m fastnmt.train ...`` trains with DDP
(one GPU per process, ``cuda:$LOCAL_RANK``). Exit codes: 0 done, 1 training failed (non-finite
loss), 2 bad input, 130 interrupted (saved).

This module is the command line and the setting up of a run; the loop is ``fastnmt.trainer``,
the devices and process groups ``fastnmt.distributed``.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fastnmt
from fastnmt import checkpoint
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import (
    MULTI30K_LANGS,
    DataError,
    Vocabulary,
    encode_corpus,
    load_multi30k,
    read_parallel_prefix,
    read_tsv,
)
from fastnmt.distributed import Distributed, resolve_device
from fastnmt.model import PRESETS, ModelConfig, preset
from fastnmt.runtime import configure_process
from fastnmt.trainer import PRECISIONS, RESUME_KEYS, Corpora, Trainer
from fastnmt.translator import fastest_dtype

# Arguments that must match an existing checkpoint for training to continue from it.
MODEL_OVERRIDES = (
    "encoder_layers",
    "decoder_layers",
    "d_model",
    "heads",
    "d_ff",
    "dropout",
    "attention_dropout",
    "activation_dropout",
)


class UsageError(ValueError):
    """A bad command-line value; the message is one line."""


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds from "90", "90s", "25m", "1.5h"."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 25m or 2h, got {text!r}")
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastnmt.train", description=__doc__.split("\n")[0])
    data = p.add_argument_group("data")
    data.add_argument("--dataset", default="multi30k", help="built-in dataset (default multi30k)")
    data.add_argument("--data-dir", help="local Multi30k copy (else $FASTNMT_DATA_DIR or download)")
    data.add_argument("--src-lang", default="en", help="source language (multi30k: en de fr cs)")
    data.add_argument("--tgt-lang", default="de", help="target language")
    data.add_argument("--train", help="own data: PREFIX.{src,tgt} or PREFIX.{src-lang,tgt-lang}")
    data.add_argument("--valid", help="own validation data prefix")
    data.add_argument("--test", help="own test data prefix")
    data.add_argument("--train-tsv", help="own training data as a src<TAB>tgt file")
    data.add_argument("--valid-tsv", help="own validation data as a TSV file")
    data.add_argument("--test-tsv", help="own test data as a TSV file")
    data.add_argument("--vocab-size", type=int, default=8000, help="joint sentencepiece vocab")
    data.add_argument("--max-len", type=int, default=256, help="drop pairs longer (tokens)")
    data.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per batch, padding included"
    )
    model = p.add_argument_group("model")
    model.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    model.add_argument("--postnorm", action="store_true", help="post-norm instead of pre-norm")
    for flag, kind in (
        ("--encoder-layers", int),
        ("--decoder-layers", int),
        ("--d-model", int),
        ("--heads", int),
        ("--d-ff", int),
        ("--dropout", float),
        ("--attention-dropout", float),
        ("--activation-dropout", float),
    ):
        model.add_argument(flag, type=kind, help="override the preset's value")
    optim = p.add_argument_group("optimisation")
    optim.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    optim.add_argument("--warmup", type=int, default=500, help="linear warmup steps")
    optim.add_argument("--label-smoothing", type=float, default=0.1)
    optim.add_argument("--clip-norm", type=float, default=0.0, help="0 = no clipping")
    optim.add_argument("--update-freq", type=int, default=1, help="batches per update")
    optim.add_argument("--precision", default="auto", choices=["auto", *PRECISIONS])
    optim.add_argument("--backend", default="auto", choices=["auto", *fastnmt.BACKENDS])
    optim.add_argument(
        "--device", default="auto", help="auto (cuda:$LOCAL_RANK if CUDA, else cpu), cpu, cuda:N"
    )
    optim.add_argument("--seed", type=int, default=1)
    budget = p.add_argument_group("budget")
    budget.add_argument("--max-epochs", type=int, default=0, help="0 = no limit")
    budget.add_argument("--max-steps", type=int, default=0, help="0 = no limit")
    budget.add_argument("--max-time", type=parse_duration, default=None, help="e.g. 25m")
    budget.add_argument("--patience", type=int, default=0, help="epochs without BLEU gain; 0 = off")
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default="runs/multi30k-en-de", help="checkpoints and logs")
    out.add_argument("--resume", action="store_true", help="require a checkpoint to continue")
    out.add_argument("--save-interval", type=int, default=0, help="also save every N steps")
    out.add_argument("--keep-last", type=int, default=2, help="step checkpoints to keep")
    out.add_argument("--log-interval", type=int, default=50, help="steps between log lines")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    out.add_argument(
        "--beam", type=int, default=4, help="beam of the final test score (validation is greedy)"
    )
    out.add_argument(
        "--average-last",
        type=int,
        default=5,
        help="at the end, average the last N checkpoints and keep the average if its validation "
        "BLEU beats the best checkpoint's (1 = off)",
    )
    out.add_argument(
        "--check-replicas", action="store_true", help="with DDP: verify ranks agree at the end"
    )
    return p


def check_arguments(args) -> None:
    if args.train and args.train_tsv:
        raise UsageError("give --train or --train-tsv, not both")
    own = args.train or args.train_tsv
    if own and not (args.valid or args.valid_tsv):
        raise UsageError("own training data needs --valid (or --valid-tsv) for validation")
    if not own and args.dataset != "multi30k":
        raise UsageError(f"--dataset must be multi30k (or give --train), got {args.dataset!r}")
    if not own:
        for flag, lang in (("--src-lang", args.src_lang), ("--tgt-lang", args.tgt_lang)):
            if lang not in MULTI30K_LANGS:
                raise UsageError(
                    f"{flag} must be one of {MULTI30K_LANGS} for multi30k, got {lang!r}"
                )
    if args.src_lang == args.tgt_lang:
        raise UsageError("--src-lang and --tgt-lang must differ")
    for flag, value in (
        ("--vocab-size", args.vocab_size),
        ("--max-tokens", args.max_tokens),
        ("--update-freq", args.update_freq),
        ("--keep-last", args.keep_last),
        ("--average-last", args.average_last),
        ("--log-interval", args.log_interval),
        ("--max-len", args.max_len),
        ("--beam", args.beam),
    ):
        if value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    for name in MODEL_OVERRIDES:
        value = getattr(args, name)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if name.endswith("dropout") and not 0 <= value < 1:
            raise UsageError(f"{flag} must be in [0, 1), got {value}")
        if not name.endswith("dropout") and value <= 0:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.lr <= 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_corpora(args) -> Corpora:
    if args.train or args.train_tsv:

        def own(prefix, tsv):
            if tsv:
                return read_tsv(tsv)
            return read_parallel_prefix(prefix, args.src_lang, args.tgt_lang) if prefix else None

        return Corpora(
            own(args.train, args.train_tsv),
            own(args.valid, args.valid_tsv),
            own(args.test, args.test_tsv),
        )
    splits = ("train", "val", "test_2016_flickr")
    loaded = [load_multi30k(s, args.src_lang, args.tgt_lang, args.data_dir) for s in splits]
    return Corpora(*loaded)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Setting up a run
# ---------------------------------------------------------------------------------------------


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        dtype = fastest_dtype(device)
        return next(name for name, value in PRECISIONS.items() if value == dtype)
    if requested == "fp16" and device.type != "cuda":
        raise UsageError("--precision fp16 needs a GPU (loss scaling); use bf16 or fp32 on a CPU")
    return requested


def model_config(args, vocab: Vocabulary) -> ModelConfig:
    overrides = dict(
        vocab_size=len(vocab),
        pad_id=vocab.pad_id,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        prenorm=not args.postnorm,
        max_positions=max(1024, args.max_len + 2),
    )
    overrides.update({k: getattr(args, k) for k in MODEL_OVERRIDES if getattr(args, k) is not None})
    cfg = preset(args.preset, **overrides)
    if cfg.d_model % cfg.heads:
        raise UsageError(f"d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
    return cfg


def existing_checkpoint(args) -> checkpoint.Checkpoint | None:
    last = Path(args.output_dir) / checkpoint.LAST
    if not last.exists():
        if args.resume:
            raise UsageError(f"--resume: {args.output_dir} holds no checkpoint to resume from")
        return None
    return checkpoint.load(last, with_trainer_state=True)


def check_compatible(loaded: checkpoint.Checkpoint, args, cfg: ModelConfig) -> None:
    """An output dir may only be continued by the same run: same data and model."""
    current = {"data": {k: getattr(args, k) for k in RESUME_KEYS}, "model": cfg.to_dict()}
    for section, values in current.items():
        for key, value in values.items():
            saved = loaded.config[section].get(key)
            if saved != value:
                raise CheckpointError(
                    f"{args.output_dir} holds a checkpoint of another run ({section}.{key} is "
                    f"{saved!r} there, {value!r} here); use another --output-dir"
                )


def prepare(args) -> Trainer:
    """Everything before the first step: data, vocabulary, model, and a checkpoint to resume."""
    check_arguments(args)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        raise UsageError(str(error)) from None
    args.precision = resolve_precision(args.precision, device)
    world = Distributed.from_environment(device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    loaded = existing_checkpoint(args)
    corpora = load_corpora(args)
    if loaded is not None:
        vocab = Vocabulary.from_bytes(loaded.spm_model)
    else:  # every rank would train the same model: rank 0 trains it, the others receive it
        model_bytes = None
        if world.main:
            model_bytes = Vocabulary.train(
                corpora.train.src + corpora.train.tgt, args.vocab_size, seed=args.seed
            ).to_bytes()
        vocab = Vocabulary.from_bytes(world.broadcast(model_bytes))
    data = encode_corpus(corpora.train, vocab, max_len=args.max_len)
    cfg = model_config(args, vocab)
    if loaded is not None:
        check_compatible(loaded, args, cfg)
    trainer = Trainer(args, cfg, vocab, data, corpora, device, world)
    trainer.log.line(
        f"{corpora.train.name}: {len(data.src):,} training pairs kept, {data.dropped:,} filtered "
        f"out (empty, longer than {args.max_len} tokens or length ratio); vocabulary {len(vocab):,}"
    )
    if loaded is not None:
        trainer.restore(loaded)
        last = checkpoint.resolve(Path(args.output_dir) / checkpoint.LAST)
        trainer.log.line(f"resumed from {last} at step {trainer.progress.step}")
    return trainer


def train(args) -> int:
    with fastnmt.backend(args.backend):
        return prepare(args).run()


def main(argv: list[str] | None = None) -> int:
    configure_process()
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (UsageError, DataError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
