"""``python -m fastnmt.train``: train an encoder-decoder Transformer for translation.

With no arguments: English->German Multi30k, the ``tiny`` preset, the fastest precision for the
device, then a test-set score. ``torchrun --nproc_per_node N -m fastnmt.train ...`` trains with DDP.
Exit codes: 0 done, 1 training failed (non-finite loss), 2 bad input, 130 interrupted (saved).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fastnmt
from fastnmt import checkpoint, metrics
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import (
    MULTI30K_LANGS,
    DataError,
    EncodedCorpus,
    ParallelCorpus,
    TokenBatches,
    Vocabulary,
    encode_corpus,
    load_multi30k,
    read_parallel_prefix,
    read_tsv,
)
from fastnmt.model import PRESETS, ModelConfig, Transformer, preset
from fastnmt.ops import linear_cross_entropy
from fastnmt.runtime import configure_process
from fastnmt.translator import Translator, autocast

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
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
RESUME_KEYS = ("dataset", "train", "train_tsv", "src_lang", "tgt_lang", "vocab_size", "preset")


class UsageError(ValueError):
    """A bad command-line value; the message is one line."""


class NonFiniteLoss(RuntimeError):
    pass


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


@dataclass
class Corpora:
    train: ParallelCorpus
    valid: ParallelCorpus
    test: ParallelCorpus | None


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


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then peak * sqrt(warmup / step)."""
    step = max(step, 1)
    return peak * min(step / warmup, math.sqrt(warmup / step)) if warmup else peak


def label_smoothed_loss(model: Transformer, states, targets, pad_id: int, smoothing: float):
    """Summed label-smoothed cross entropy over non-pad targets (the definition of
    ``F.cross_entropy(label_smoothing=)``), the summed nll, and the count of correct argmaxes.
    Only non-pad positions are projected, by the fused op that never forms all their logits."""
    keep = targets != pad_id
    out = linear_cross_entropy(
        states[keep], model.embedding.weight, None, targets[keep], smoothing, reduction="sum"
    )
    return out.loss, out.nll, out.correct


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: torch.device) -> Distributed:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), world_size)

    def sum(self, values: list[float]) -> list[float]:
        """Sum across ranks (identity for one process)."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def broadcast(self, value):
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class Log:
    """Log lines on stderr (rank 0), a progress bar on a terminal, and metrics.jsonl."""

    def __init__(self, output_dir: Path, enabled: bool, progress: bool):
        self.enabled = enabled
        self.progress = progress and enabled and sys.stderr.isatty()
        self.jsonl = output_dir / "metrics.jsonl"
        self._bar_shown = False
        if enabled:
            output_dir.mkdir(parents=True, exist_ok=True)

    def line(self, text: str) -> None:
        if self.enabled:
            self._clear_bar()
            print(text, file=sys.stderr, flush=True)

    def record(self, event: str, **values) -> None:
        if self.enabled:
            with self.jsonl.open("a") as f:
                f.write(json.dumps({"event": event, **values}) + "\n")

    def bar(self, epoch: int, done: int, total: int, text: str) -> None:
        if self.progress:
            width = 30
            filled = int(width * done / max(total, 1))
            sys.stderr.write(f"\repoch {epoch} [{'#' * filled}{'.' * (width - filled)}] {text}")
            sys.stderr.flush()
            self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            sys.stderr.write("\r\033[K")
            self._bar_shown = False


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    step: int = 0
    epoch: int = 1
    batch_in_epoch: int = 0  # batches of this epoch already trained on (this rank)
    best_bleu: float = -1.0
    epochs_without_gain: int = 0
    elapsed: float = 0.0  # training seconds before this process started


class Trainer:
    def __init__(
        self,
        args,
        cfg: ModelConfig,
        vocab: Vocabulary,
        data: EncodedCorpus,
        corpora: Corpora,
        device: torch.device,
        world: Distributed,
    ):
        self.args, self.cfg, self.vocab, self.corpora = args, cfg, vocab, corpora
        self.device, self.world = device, world
        self.output_dir = Path(args.output_dir)
        self.autocast_dtype = PRECISIONS[args.precision]
        self.model = Transformer(cfg).to(device)
        self.ddp = DistributedDataParallel(self.model) if world.world_size > 1 else None
        # fused: one pass over each parameter per update instead of six elementwise ops; on a
        # CPU the unfused update of a tiny model costs a good share of its step.
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, fused=True
        )
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
        self.batches = TokenBatches(
            data,
            args.max_tokens,
            seed=args.seed,
            rank=world.rank,
            world_size=world.world_size,
            pad_id=vocab.pad_id,
            bos_id=vocab.bos_id,
            eos_id=vocab.eos_id,
        )
        self.progress = Progress()
        self.log = Log(self.output_dir, world.main, not args.no_progress)
        self.started = time.monotonic()
        self.valid_data = encode_corpus(corpora.valid, vocab, max_len=args.max_len)
        self.last_saved: Path | None = None

    # -- checkpoints ------------------------------------------------------------------------

    def config_record(self) -> dict:
        resumable = {key: getattr(self.args, key) for key in RESUME_KEYS}
        return {"model": self.cfg.to_dict(), "data": resumable, "training": vars(self.args)}

    def save(self) -> Path | None:
        if not self.world.main:
            return None
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": vars(replace(self.progress, elapsed=self.elapsed())),
            "rng": {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])},
        }
        if self.device.type == "cuda":
            state["rng"]["cuda"] = torch.cuda.get_rng_state(self.device)
        saved = checkpoint.Checkpoint(
            {k: v.contiguous() for k, v in self.model.state_dict().items()},
            self.config_record(),
            self.vocab.to_bytes(),
            state,
        )
        keep = max(self.args.keep_last, self.args.average_last)
        return checkpoint.save(self.output_dir, self.progress.step, saved, keep)

    def restore(self, loaded: checkpoint.Checkpoint) -> None:
        self.model.load_state_dict(loaded.weights)
        state = loaded.trainer_state
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self.started = time.monotonic()
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate((3, tuple(state["rng"]["python"]), None))
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def elapsed(self) -> float:
        """Training seconds, including those of the runs this one resumed."""
        return self.progress.elapsed + time.monotonic() - self.started

    # -- steps ------------------------------------------------------------------------------

    def train_step(self, batches) -> dict:
        """One update over ``batches`` (update_freq micro-batches on this rank), normalised by the
        target tokens of all of them on all ranks."""
        local_tokens = sum(b.num_tgt_tokens for b in batches)
        total_tokens, stop_votes = self.world.sum([local_tokens, float(self.out_of_time())])
        model = self.ddp or self.model
        self.model.train()
        sums = torch.zeros(3, dtype=torch.float64)  # loss, nll, correct
        for i, batch in enumerate(batches):
            batch = batch.to(self.device)
            # DDP all-reduces gradients on the last micro-batch only.
            last = i == len(batches) - 1
            sync = self.ddp.no_sync() if self.ddp and not last else contextlib.nullcontext()
            with sync, autocast(self.device, self.autocast_dtype):
                states = model(batch.src, batch.src_lengths, batch.tgt_in)
                loss, nll, correct = label_smoothed_loss(
                    self.model, states, batch.tgt_out, self.vocab.pad_id, self.args.label_smoothing
                )
            # DDP averages gradients over ranks; scaling by world_size makes that a global sum.
            self.scaler.scale(loss * self.world.world_size / total_tokens).backward()
            sums += torch.stack([loss.detach(), nll, correct]).to(torch.float64).cpu()  # one sync
        loss_sum, nll_sum, correct_sum = self.world.sum(sums.tolist())
        if not math.isfinite(loss_sum) and not self.scaler.is_enabled():
            raise NonFiniteLoss(f"loss became {loss_sum} at step {self.progress.step + 1}")
        lr = inverse_sqrt_lr(self.progress.step + 1, self.args.lr, self.args.warmup)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        max_norm = self.args.clip_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.progress.step += 1
        return {
            "loss": loss_sum / total_tokens / math.log(2),
            "nll": nll_sum / total_tokens / math.log(2),
            "ppl": 2 ** (nll_sum / total_tokens / math.log(2)),
            "accuracy": correct_sum / total_tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": total_tokens,
            "stop": stop_votes > 0,
        }

    def out_of_time(self) -> bool:
        return self.args.max_time is not None and self.elapsed() >= self.args.max_time

    # -- validation -------------------------------------------------------------------------

    @torch.no_grad()
    def validation_loss(self) -> dict:
        self.model.eval()
        batches = TokenBatches(
            self.valid_data,
            self.args.max_tokens,
            shuffle=False,
            pad_id=self.vocab.pad_id,
            bos_id=self.vocab.bos_id,
            eos_id=self.vocab.eos_id,
        )
        sums = torch.zeros(3, dtype=torch.float64)  # loss, nll, correct
        tokens = 0
        for batch in batches.iterate(epoch=1):
            batch = batch.to(self.device)
            with autocast(self.device, self.autocast_dtype):
                states = self.model(batch.src, batch.src_lengths, batch.tgt_in)
                loss, nll, correct = label_smoothed_loss(
                    self.model, states, batch.tgt_out, self.vocab.pad_id, self.args.label_smoothing
                )
            sums += torch.stack([loss, nll, correct]).to(torch.float64).cpu()  # one sync
            tokens += batch.num_tgt_tokens
        loss, nll, correct = sums.tolist()
        base2 = tokens * math.log(2)
        return {
            "loss": loss / base2,
            "nll": nll / base2,
            "ppl": 2 ** (nll / base2),
            "accuracy": correct / tokens,
        }

    def translate(self, sentences: list[str], beam: int = 1) -> list[str]:
        """Translations by the model being trained (greedy unless ``beam`` > 1)."""
        translator = Translator(
            self.model,
            self.vocab,
            device=self.device,
            dtype=self.autocast_dtype,
            max_tokens=self.args.max_tokens,
        )
        return translator.translate(sentences, beam=beam)

    def validate(self) -> dict:
        """Validation loss and greedy sacreBLEU, computed on rank 0 and shared with all ranks."""
        result = None
        if self.world.main:
            started = time.monotonic()
            result = self.validation_loss()
            hypotheses = self.translate(self.corpora.valid.src)
            result["bleu"] = metrics.bleu(hypotheses, self.corpora.valid.tgt).score
            result["seconds"] = time.monotonic() - started
        return self.world.broadcast(result)

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Train until a budget runs out; then score the best checkpoint on the test set."""
        try:
            self.train_epochs()
        except NonFiniteLoss as error:
            where = self.last_saved or "none saved yet"
            self.log.line(f"error: {error}; training stopped. Last good checkpoint: {where}")
            return 1
        except KeyboardInterrupt:
            path = self.save()
            self.log.line(
                f"interrupted at step {self.progress.step}; saved {path}; "
                f"run the same command again to resume"
            )
            return 130
        if self.world.main:
            self.keep_average_if_better()
        self.evaluate_test()
        return 0

    def train_epochs(self) -> None:
        args, progress = self.args, self.progress
        self.log.line(
            f"training {sum(p.numel() for p in self.model.parameters()):,} parameters "
            f"on {self.device} ({args.precision}), {len(self.batches)} batches per epoch"
            f"{f' per rank x {self.world.world_size}' if self.world.world_size > 1 else ''}"
        )
        validated_at = progress.step
        while not args.max_epochs or progress.epoch <= args.max_epochs:
            stopped = self.train_epoch()
            if progress.batch_in_epoch >= len(self.batches):  # the epoch is complete
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            if progress.step > validated_at:
                stopped = self.end_of_epoch() or stopped
                validated_at = progress.step
            if stopped:
                break
        if self.args.check_replicas:
            self.check_replicas()

    def check_replicas(self) -> None:
        """Verify that DDP kept every rank's parameters identical (elementwise min == max)."""
        flat = torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])
        low, high = flat.clone(), flat.clone()
        if self.world.world_size > 1:
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
        if not torch.equal(low, high):
            raise RuntimeError("DDP replicas diverged: parameters differ between ranks")
        self.log.line(f"parameters identical on all {self.world.world_size} ranks")

    def train_epoch(self) -> bool:
        """Train on the rest of the current epoch; True when a budget ran out."""
        args, progress = self.args, self.progress
        total = len(self.batches)
        window = {"tokens": 0.0, "started": time.monotonic()}
        group = []
        for batch in self.batches.iterate(progress.epoch, start=progress.batch_in_epoch):
            if args.max_steps and progress.step >= args.max_steps:  # e.g. resumed at the end
                return True
            group.append(batch)
            if len(group) < args.update_freq and progress.batch_in_epoch + len(group) < total:
                continue
            stats = self.train_step(group)
            progress.batch_in_epoch += len(group)
            group = []
            window["tokens"] += stats["tokens"]
            tokens_per_s = window["tokens"] / max(time.monotonic() - window["started"], 1e-9)
            self.log.bar(
                progress.epoch,
                progress.batch_in_epoch,
                total,
                f"step {progress.step} loss {stats['loss']:.3f} {tokens_per_s:,.0f} tok/s",
            )
            if progress.step % args.log_interval == 0:
                self.report(stats, tokens_per_s)
                window = {"tokens": 0.0, "started": time.monotonic()}
            if args.save_interval and progress.step % args.save_interval == 0:
                self.last_saved = self.save()
            if stats["stop"] or (args.max_steps and progress.step >= args.max_steps):
                return True
        return False

    def report(self, stats: dict, tokens_per_s: float) -> None:
        progress = self.progress
        values = {
            "epoch": progress.epoch,
            "step": progress.step,
            **{k: stats[k] for k in ("loss", "nll", "ppl", "accuracy", "lr", "grad_norm")},
            "tgt_tokens_per_s": tokens_per_s,
            "elapsed": self.elapsed(),
        }
        self.log.record("train", **values)
        self.log.line(
            f"epoch {progress.epoch} step {progress.step} | loss {stats['loss']:.3f} "
            f"nll {stats['nll']:.3f} ppl {stats['ppl']:.2f} acc {stats['accuracy']:.3f} "
            f"| lr {stats['lr']:.2e} gnorm {stats['grad_norm']:.2f} "
            f"| {tokens_per_s:,.0f} tgt tok/s | {values['elapsed']:.0f} s"
        )

    def end_of_epoch(self) -> bool:
        """Validate, keep the best checkpoint; True when patience ran out."""
        progress = self.progress
        result = self.validate()
        improved = result["bleu"] > progress.best_bleu
        progress.best_bleu = max(progress.best_bleu, result["bleu"])
        progress.epochs_without_gain = 0 if improved else progress.epochs_without_gain + 1
        self.last_saved = self.save()
        if self.world.main and improved:
            checkpoint.point(self.output_dir, checkpoint.BEST, self.last_saved)
        self.log.record("valid", epoch=progress.epoch - 1, step=progress.step, **result)
        self.log.line(
            f"validation after {progress.step} steps | loss {result['loss']:.3f} "
            f"ppl {result['ppl']:.2f} acc {result['accuracy']:.3f} | BLEU {result['bleu']:.2f}"
            f"{' (best)' if improved else ''} | {result['seconds']:.0f} s"
        )
        patience = self.args.patience
        return bool(patience) and progress.epochs_without_gain >= patience

    def keep_average_if_better(self) -> None:
        """Average the weights of the last ``--average-last`` checkpoints (Vaswani et al.'s
        checkpoint averaging); if that scores higher validation BLEU than the best checkpoint,
        save it as ``checkpoint_average`` and point ``checkpoint_best`` at it."""
        steps = checkpoint.step_checkpoints(self.output_dir)[-self.args.average_last :]
        if self.args.average_last < 2 or len(steps) < 2:
            return
        self.model.load_state_dict(checkpoint.average_weights(steps))
        bleu = metrics.bleu(self.translate(self.corpora.valid.src), self.corpora.valid.tgt).score
        best = self.progress.best_bleu
        kept = bleu > best
        self.log.record("average", checkpoints=[p.name for p in steps], bleu=bleu, kept=kept)
        self.log.line(
            f"average of the last {len(steps)} checkpoints: validation BLEU {bleu:.2f} vs "
            f"{best:.2f} for the best one; {'kept' if kept else 'not kept'}"
        )
        if kept:
            latest = checkpoint.load(steps[-1], with_trainer_state=False)
            averaged = checkpoint.Checkpoint(
                {k: v.contiguous() for k, v in self.model.state_dict().items()},
                latest.config,
                latest.spm_model,
                None,
            )
            path = checkpoint.write(self.output_dir, checkpoint.AVERAGE, averaged)
            checkpoint.point(self.output_dir, checkpoint.BEST, path)

    def evaluate_test(self) -> None:
        """Score the best checkpoint on the test set; write its translations beside it."""
        test = self.corpora.test
        if test is None or not self.world.main:
            return
        best = checkpoint.load(checkpoint.resolve(self.output_dir), with_trainer_state=False)
        self.model.load_state_dict(best.weights)
        started = time.monotonic()
        hypotheses = self.translate(test.src, beam=self.args.beam)
        seconds = time.monotonic() - started
        output = self.output_dir / f"test.{self.args.tgt_lang}.hyp"
        output.write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
        scores = [metrics.bleu(hypotheses, test.tgt), metrics.chrf(hypotheses, test.tgt)]
        self.log.record(
            "test",
            **{s.name: s.score for s in scores},
            signatures={s.name: s.signature for s in scores},
            seconds=seconds,
            beam=self.args.beam,
        )
        search = "greedy" if self.args.beam == 1 else f"beam {self.args.beam}"
        self.log.line(f"test ({test.name}, {search}): " + " | ".join(map(str, scores)))
        self.log.line(f"translations written to {output}")


# ---------------------------------------------------------------------------------------------
# Setting up a run
# ---------------------------------------------------------------------------------------------


def resolve_precision(requested: str, device: torch.device) -> str:
    if requested == "auto":
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
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
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
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
