"""``python -m fastnmt.train``: train an encoder-decoder Transformer for translation.

With no arguments: English->German Multi30k, the ``tiny`` preset, the fastest precision for the
device, then a test-set score. ``--init-from DIR`` fine-tunes an Opus-MT (Marian) model or a
fastnmt checkpoint instead (``fastnmt.training.fine_tune``; docs/fine-tuning.md).
``torchrun --nproc_per_node N -m fastnmt.train ...`` trains with DDP (one GPU per process,
``cuda:$LOCAL_RANK``; ``--nnodes`` for several machines). The training text is prepared once
(``fastnmt.preprocess``) into ``--prepared-dir`` and memory-mapped from there.
Exit codes: 0 done, 1 training failed (non-finite loss), 2 bad input, 130 interrupted (saved).

This module is the command line and the setting up of a run; the loop is
``fastnmt.training.trainer``, the devices and process groups ``fastnmt.training.distributed``.
"""

from __future__ import annotations

import argparse
import importlib
import random
import re
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

import fastnmt
from fastnmt import checkpoint, preprocess
from fastnmt.checkpoint import CheckpointError
from fastnmt.cli import (
    BAD_INPUT_ERRORS,
    UsageError,
    check_counts,
    check_output_path,
    finite_float,
    forced_backend,
    report_error,
)
from fastnmt.data import (
    DataError,
    Vocabulary,
    load_multi30k,
    read_parallel_prefix,
    read_tsv,
    vocabulary_from_bytes,
)
from fastnmt.data.prepared import Prepared, check_prepared
from fastnmt.data.prepared import prepare as prepare_data
from fastnmt.devices import configure_process, resolve_device
from fastnmt.model import PRESETS, ModelConfig, preset
from fastnmt.precision import AUTO_HELP, PrecisionChoice, choose_precision
from fastnmt.training import fine_tune, graph_updates
from fastnmt.training.distributed import Distributed
from fastnmt.training.fine_tune import Initial
from fastnmt.training.trainer import PRECISIONS, RESUME_KEYS, Corpora, Trainer

# Arguments that must match an existing checkpoint for training to continue from it.
# Shape buckets of CUDA-graph training when --shape-buckets does not say: one graph each.
GRAPH_BUCKETS = 8
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
    preprocess.add_corpus_arguments(data)
    data.add_argument("--valid", help="own validation data prefix")
    data.add_argument("--test", help="own test data prefix")
    data.add_argument("--valid-tsv", help="own validation data as a TSV file")
    data.add_argument("--test-tsv", help="own test data as a TSV file")
    data.add_argument(
        "--prepared-dir", help="the prepared training data (default OUTPUT_DIR/prepared)"
    )
    data.add_argument(
        "--max-tokens", type=int, default=4096, help="tokens per batch, padding included"
    )
    data.add_argument(
        "--data-workers", type=int, default=1, help="batch-collating processes (0: in this one)"
    )
    data.add_argument(
        "--shape-buckets",
        type=int,
        default=0,
        help="pad batches to this many fixed shapes, split into micro-batches (0: off; "
        f"{GRAPH_BUCKETS} with CUDA graphs); for CUDA graphs and torch.compile, which "
        "specialize on shapes",
    )
    data.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="replay each update as CUDA graphs (auto: on a GPU, unless --precision fp16)",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--init-from",
        metavar="DIR",
        help="fine-tune this model: a Hugging Face Marian (Opus-MT) directory or a fastnmt "
        "checkpoint; its weights, vocabulary and tokenizer (docs/fine-tuning.md)",
    )
    model.add_argument(
        "--preset", choices=sorted(PRESETS), help=f"default {fine_tune.SCRATCH_PRESET}"
    )
    model.add_argument("--postnorm", action="store_true", help="post-norm instead of pre-norm")
    for flag, kind in (
        ("--encoder-layers", int),
        ("--decoder-layers", int),
        ("--d-model", int),
        ("--heads", int),
        ("--d-ff", int),
        ("--dropout", finite_float),
        ("--attention-dropout", finite_float),
        ("--activation-dropout", finite_float),
    ):
        model.add_argument(flag, type=kind, help="override the preset's value")
    optim = p.add_argument_group("optimisation")
    optim.add_argument(
        "--lr",
        type=finite_float,
        help=f"peak learning rate (default {fine_tune.SCRATCH_LR}; "
        f"{fine_tune.FINE_TUNE_LR} with --init-from)",
    )
    optim.add_argument(
        "--warmup",
        type=int,
        help=f"linear warmup steps (default {fine_tune.SCRATCH_WARMUP}; "
        f"{fine_tune.FINE_TUNE_WARMUP} with --init-from)",
    )
    optim.add_argument("--label-smoothing", type=finite_float, default=0.1)
    optim.add_argument("--clip-norm", type=finite_float, default=0.0, help="0 = no clipping")
    optim.add_argument("--update-freq", type=int, default=1, help="batches per update")
    optim.add_argument(
        "--precision", default="auto", choices=["auto", *PRECISIONS], help=AUTO_HELP["training"]
    )
    optim.add_argument("--backend", default="auto", choices=["auto", *fastnmt.BACKENDS])
    optim.add_argument(
        "--device", default="auto", help="auto (cuda:$LOCAL_RANK if CUDA, else cpu), cpu, cuda:N"
    )
    optim.add_argument("--seed", type=int, default=1)
    budget = p.add_argument_group("budget")
    budget.add_argument("--max-epochs", type=int, default=0, help="0 = no limit")
    budget.add_argument("--max-steps", type=int, default=0, help="0 = no limit")
    budget.add_argument("--max-time", type=parse_duration, default=None, help="e.g. 25m")
    budget.add_argument(
        "--patience", type=int, default=0, help="validations without BLEU gain; 0 = off"
    )
    out = p.add_argument_group("output")
    out.add_argument("--output-dir", default="runs/multi30k-en-de", help="checkpoints and logs")
    out.add_argument("--resume", action="store_true", help="require a checkpoint to continue")
    out.add_argument("--save-interval", type=int, default=0, help="also save every N steps")
    out.add_argument("--keep-last", type=int, default=2, help="step checkpoints to keep")
    out.add_argument(
        "--valid-interval",
        type=int,
        default=1,
        help="validate and save every N epochs, and when training stops (0: only then)",
    )
    out.add_argument("--log-interval", type=int, default=50, help="steps between log lines")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    out.add_argument(
        "--tensorboard", metavar="DIR", help="also write the metrics as TensorBoard events"
    )
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
    preprocess.check_corpus_arguments(args)
    if (args.train or args.train_tsv) and not (args.valid or args.valid_tsv):
        raise UsageError("own training data needs --valid (or --valid-tsv) for validation")
    # 0: none, off or no limit. A negative --max-steps ended training before its first step; a
    # negative --clip-norm turned every gradient around.
    check_counts(
        0,
        ("--data-workers", args.data_workers),
        ("--valid-interval", args.valid_interval),
        ("--shape-buckets", args.shape_buckets),
        ("--clip-norm", args.clip_norm),
        ("--max-epochs", args.max_epochs),
        ("--max-steps", args.max_steps),
        ("--patience", args.patience),
        ("--save-interval", args.save_interval),
    )
    if args.tensorboard:
        require_tensorboard()
    for flag, folder in (
        ("--output-dir", args.output_dir),
        ("--prepared-dir", args.prepared_dir),
        ("--tensorboard", args.tensorboard),
    ):
        check_output_path(folder, flag, folder=True)
    check_counts(
        1,
        ("--max-tokens", args.max_tokens),
        ("--update-freq", args.update_freq),
        ("--keep-last", args.keep_last),
        ("--average-last", args.average_last),
        ("--log-interval", args.log_interval),
        ("--beam", args.beam),
    )
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
    check_counts(0, ("--warmup", args.warmup))


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def require_tensorboard() -> None:
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError:
        raise UsageError(
            "--tensorboard needs the tensorboard package: pip install 'fastnmt[tensorboard]'"
        ) from None


def load_corpora(args) -> Corpora:
    """The validation and test text (small: read whole; the training text is prepared)."""
    if args.train or args.train_tsv:

        def own(prefix, tsv):
            if tsv:
                return read_tsv(tsv)
            return read_parallel_prefix(prefix, args.src_lang, args.tgt_lang) if prefix else None

        return Corpora(own(args.valid, args.valid_tsv), own(args.test, args.test_tsv))
    splits = ("val", "test_2016_flickr")
    return Corpora(*(load_multi30k(s, args.src_lang, args.tgt_lang, args.data_dir) for s in splits))


def prepared_data(args, world: Distributed, vocabulary: bytes | None) -> Prepared:
    """The prepared training data: rank 0 reuses or builds it, the other ranks then map it (a
    failure on rank 0 is every rank's one-line error)."""
    directory = Path(args.prepared_dir or Path(args.output_dir) / "prepared")
    options = preprocess.options_from_arguments(args)
    prepared, failure = None, None
    if world.main:
        try:
            prepared = prepare_data(
                preprocess.source_from_arguments(args),
                directory,
                options,
                vocabulary=vocabulary,
                workers=args.workers,
                log=lambda line: tqdm.write(line, file=sys.stderr),  # above a progress bar
                progress=not args.no_progress,
            )
        except DataError as error:
            failure = str(error)
    failure = world.broadcast(failure)  # also the other ranks' wait for rank 0's preparation
    if failure is not None:
        raise DataError(failure)
    if prepared is None:
        source = preprocess.source_from_arguments(args)
        prepared = check_prepared(source, directory, options, vocabulary)
    return prepared


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Setting up a run
# ---------------------------------------------------------------------------------------------


def resolve_precision(
    requested: str, device: torch.device, cfg: ModelConfig, world: Distributed
) -> PrecisionChoice:
    """``--precision`` with auto resolved for ``cfg``'s shapes, decided once, on rank 0: every
    rank must train in the same precision."""
    if requested == "fp16" and device.type != "cuda":
        raise UsageError("--precision fp16 needs a GPU (loss scaling); use bf16 or fp32 on a CPU")
    if requested != "auto":
        return PrecisionChoice(requested, "given by --precision")
    return world.broadcast(choose_precision("training", device, cfg) if world.main else None)


def resolve_cuda_graphs(args, device: torch.device) -> None:
    """``--cuda-graphs`` as "on" or "off" for this device and precision; graphs replay fixed
    shapes, so "on" implies shape buckets."""
    reasons = graph_updates.capture_reasons(device, loss_scaling=args.precision == "fp16")
    if args.cuda_graphs == "on" and reasons:
        raise UsageError(f"--cuda-graphs on: {'; '.join(reasons)}")
    args.cuda_graphs = "off" if reasons or args.cuda_graphs == "off" else "on"
    if args.cuda_graphs == "on" and not args.shape_buckets:
        args.shape_buckets = GRAPH_BUCKETS


def model_shape(args) -> ModelConfig:
    """The model the arguments ask for, before its vocabulary exists (--vocab-size words)."""
    overrides = {k: getattr(args, k) for k in MODEL_OVERRIDES if getattr(args, k) is not None}
    cfg = preset(
        args.preset,
        vocab_size=args.vocab_size,
        prenorm=not args.postnorm,
        max_positions=max(1024, args.max_len + 2),
        **overrides,
    )
    if cfg.d_model % cfg.heads:
        raise UsageError(f"d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
    return cfg


def model_config(args, vocab: Vocabulary, initial: Initial | None) -> ModelConfig:
    """The model to train: the initial model's, or the arguments' with the vocabulary's."""
    if initial is not None:
        return initial.cfg
    return replace(
        model_shape(args),
        vocab_size=len(vocab),
        pad_id=vocab.pad_id,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
    )


def existing_checkpoint(args, world: Distributed) -> checkpoint.Checkpoint | None:
    """The checkpoint to continue from, after rank 0 has completed or undone what a crash left
    in the middle of a save; a damaged one is an error, never a silent fresh start."""
    output_dir = Path(args.output_dir)
    if world.main:
        checkpoint.recover(output_dir)
    world.broadcast(None)  # the other ranks read the checkpoint once it is recovered
    loaded = checkpoint.load_last(output_dir)
    if loaded is None and args.resume:
        raise UsageError(f"--resume: {args.output_dir} holds no checkpoint to resume from")
    return loaded


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
    fine_tune.apply_defaults(args)
    check_arguments(args)
    try:
        device = resolve_device(args.device)
    except ValueError as error:
        raise UsageError(str(error)) from None
    world = Distributed.from_environment(device)
    try:
        initial = fine_tune.load_initial(args) if args.init_from else None
    except ValueError as error:  # a flag or --init-from's directory, named in the message
        raise UsageError(str(error)) from None
    shape = initial.cfg if initial is not None else model_shape(args)
    precision = resolve_precision(args.precision, device, shape, world)
    args.precision = precision.precision
    resolve_cuda_graphs(args, device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    loaded = existing_checkpoint(args, world)
    # The data must be encoded with the vocabulary of the checkpoint or the initial model.
    vocabulary = initial.vocab.to_bytes() if initial else None
    if loaded is not None:
        vocabulary = loaded.vocabulary
        check_compatible(
            loaded, args, model_config(args, vocabulary_from_bytes(vocabulary), initial)
        )
    prepared = prepared_data(args, world, vocabulary)
    corpora = load_corpora(args)
    cfg = model_config(args, prepared.vocab, initial)
    weights = initial.weights if initial and loaded is None else None
    trainer = Trainer(args, cfg, prepared.vocab, prepared.corpus, corpora, device, world, weights)
    trainer.log.line(prepared.summary())
    trainer.log.line(f"precision {precision}")
    if loaded is not None:
        trainer.restore(loaded)
        last = checkpoint.resolve(Path(args.output_dir) / checkpoint.LAST)
        trainer.log.line(f"resumed from {last} at step {trainer.progress.step}")
    return trainer


def train(args) -> int:
    with forced_backend(args.backend):
        return prepare(args).run()


def main(argv: list[str] | None = None) -> int:
    configure_process()
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except BAD_INPUT_ERRORS as error:
        return report_error(error)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
