"""The training loop of ``python -m fastnmt.train``: updates, validation, checkpoints, logging.

A training step makes no host sync on the device (``tests/training/test_trainer.py`` counts them):
the step's loss statistics and gradient norm stay on the device in a ``Window`` until a log line,
a checkpoint or the end of training reads them all at once (and only then is a non-finite loss
noticed, naming its step; nothing non-finite is ever saved). Token counts come from the batches,
which are built on the host.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from fastnmt import checkpoint, metrics
from fastnmt.data import EncodedCorpus, ParallelCorpus, TokenBatches, Vocabulary, encode_corpus
from fastnmt.devices import autocast
from fastnmt.model import ModelConfig, Transformer
from fastnmt.ops import linear_cross_entropy
from fastnmt.training.buckets import ShapeBuckets
from fastnmt.training.distributed import Distributed
from fastnmt.training.graph_updates import BucketedUpdates
from fastnmt.translator import Translator

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# What must match for a run to continue from an output directory's checkpoint (with the model).
RESUME_KEYS = (
    "dataset", "train", "train_tsv", "src_lang", "tgt_lang", "vocab_size", "preset", "init_from"
)  # fmt: skip


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class Corpora:
    """The text scored during and after training (the training text is prepared data)."""

    valid: ParallelCorpus
    test: ParallelCorpus | None


def inverse_sqrt_lr(step: torch.Tensor, peak: float, warmup: int) -> torch.Tensor:
    """Linear warmup to ``peak`` over ``warmup`` steps, then peak * sqrt(warmup / step), of a
    device step count (computed on the device: a captured update reads no host value)."""
    if not warmup:
        return torch.full_like(step, peak)
    ratio = step.clamp(min=1) / warmup
    return peak * torch.minimum(ratio, ratio.rsqrt())


def label_smoothed_loss(model: Transformer, states, targets, positions, smoothing: float):
    """Summed label-smoothed cross entropy over the targets at flat ``positions`` (the non-pad
    ones: ``Batch.tgt_positions``) (the definition of ``F.cross_entropy(label_smoothing=)``), the
    summed nll, and the count of correct argmaxes. Only those positions are projected, by the
    fused op that never forms all their logits."""
    states = states.reshape(-1, states.shape[-1]).index_select(0, positions)  # (tokens, E)
    targets = targets.reshape(-1).index_select(0, positions)  # (tokens,)
    out = linear_cross_entropy(
        states,
        model.embedding.weight,
        model.output_bias,
        targets,
        smoothing,
        ignore_index=model.cfg.pad_id,  # the padded cells of shape-bucketed batches
        reduction="sum",
    )
    return out.loss, out.nll, out.correct


class Window:
    """The updates since the last log line. Each update's statistics (a float64 device tensor:
    loss sum, nll sum, correct predictions, gradient norm, learning rate) stay on the device
    until ``values()`` copies the pending ones to the host in one sync."""

    def __init__(self):
        self.started = time.monotonic()
        self.tokens = 0.0  # target tokens on all ranks
        self.steps: list[int] = []
        self._pending: list[torch.Tensor] = []
        self._host: list[list[float]] = []

    def add(self, step: int, statistics: torch.Tensor, tokens: float) -> None:
        self.steps.append(step)
        self._pending.append(statistics)
        self.tokens += tokens

    def values(self) -> list[list[float]]:
        """[loss, nll, correct, grad_norm, lr] of every update in the window, on the host."""
        if self._pending:
            self._host += torch.stack(self._pending).tolist()
            self._pending = []
        return self._host

    def first_non_finite(self) -> tuple[int, float] | None:
        """(step, value) of the first update whose loss (else gradient norm) was not finite."""
        for step, (loss, _, _, grad_norm, _) in zip(self.steps, self.values(), strict=True):
            for value in (loss, grad_norm):
                if not math.isfinite(value):
                    return step, value
        return None

    def tokens_per_second(self) -> float:
        return self.tokens / max(time.monotonic() - self.started, 1e-9)


class Log:
    """Log lines on stderr (rank 0), a tqdm progress bar on a terminal (plain log lines only
    otherwise), metrics.jsonl and, given a directory, the same scalars as TensorBoard events."""

    def __init__(
        self, output_dir: Path, enabled: bool, progress: bool, tensorboard=None, stream=None
    ):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.progress = progress and enabled and self.stream.isatty()
        self.jsonl = output_dir / "metrics.jsonl"
        self._bar: tqdm | None = None
        self._board = None
        self._step = 0  # of the latest record, for the TensorBoard events of those without one
        if enabled:
            output_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # optional: only when asked

                self._board = SummaryWriter(tensorboard)

    def line(self, text: str) -> None:
        if self.enabled:
            tqdm.write(text, file=self.stream)  # above the bar, if one is shown

    def record(self, event: str, **values) -> None:
        if not self.enabled:
            return
        with self.jsonl.open("a") as f:
            f.write(json.dumps({"event": event, **values}) + "\n")
        if self._board is not None:
            self._step = values.get("step", self._step)
            for name, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self._board.add_scalar(f"{event}/{name}", value, self._step)
            self._board.flush()

    def bar(self, epoch: int, done: int, total: int, text: str) -> None:
        """The epoch's bar at ``done`` of ``total`` batches (rate and ETA by tqdm)."""
        if not self.progress:
            return
        if self._bar is None or self._bar.desc != f"epoch {epoch}":
            self.close_bar()
            self._bar = tqdm(
                total=total, initial=done, desc=f"epoch {epoch}", unit="batch", file=self.stream
            )
        self._bar.set_postfix_str(text, refresh=False)
        self._bar.update(done - self._bar.n)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        self.close_bar()
        if self._board is not None:
            self._board.close()


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) until the block has run, then deliver it: the block (an update
    and the progress that counts it) happens entirely or not at all."""
    if threading.current_thread() is not threading.main_thread() or not callable(
        signal.getsignal(signal.SIGINT)
    ):  # signals reach the main thread only; a handler set outside Python cannot be restored
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: received.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        previous(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt


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
        weights: dict[str, torch.Tensor] | None = None,
    ):
        """``weights``: the model's initial state (fine-tuning), else a fresh initialisation."""
        self.args, self.cfg, self.vocab, self.corpora = args, cfg, vocab, corpora
        self.device, self.world = device, world
        self.output_dir = Path(args.output_dir)
        self.autocast_dtype = PRECISIONS[args.precision]
        self.model = Transformer(cfg)
        if weights is not None:
            self.model.load_state_dict(weights)
        self.model.to(device)
        # The update's device state: what a captured update reads and writes (graphs.py).
        self.updates = torch.zeros((), dtype=torch.float64, device=device)  # = progress.step
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_scale = torch.zeros((), dtype=torch.float32, device=device)  # 1 / tokens
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, nll, correct
        self.statistics = torch.zeros(5, dtype=torch.float64, device=device)  # Window.add's
        self.update_state = (self.updates, self.lr, self.loss_scale, self.sums, self.statistics)
        # fused: one pass over each parameter per update instead of six elementwise ops; on a
        # CPU the unfused update of a tiny model costs a good share of its step. capturable
        # with a tensor learning rate: its step can be replayed in a CUDA graph.
        self.optimizer = torch.optim.Adam(
            self.model.parameters(),
            lr=self.lr,
            betas=(0.9, 0.98),
            eps=1e-9,
            fused=True,
            capturable=True,
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
            workers=args.data_workers,
            pin_memory=device.type == "cuda",
        )
        # Shape-bucketed updates run through static programs (captured as CUDA graphs where
        # they can be), summing gradients over ranks themselves; other updates through DDP.
        self.bucketed = (
            BucketedUpdates(
                self.model,
                ShapeBuckets(args.max_tokens, args.max_len, args.shape_buckets, vocab.pad_id),
                lambda batch: self.accumulate(self.model, batch),
                self.apply_update,
                world.sum_on_device if world.world_size > 1 else None,
                device,
                self.update_state,
            )
            if args.shape_buckets
            else None
        )
        if self.bucketed is not None:
            world.broadcast_parameters(self.model)
        self.ddp = (
            DistributedDataParallel(self.model)
            if world.world_size > 1 and self.bucketed is None
            else None
        )
        self.progress = Progress()
        self.window = Window()
        self.log = Log(self.output_dir, world.main, not args.no_progress, args.tensorboard)
        # The RNG states at the start of the update under way (None between updates): what a
        # checkpoint saved on Ctrl-C in the middle of an update must hold, as its progress does
        # not count that update.
        self._rng_before_update: dict | None = None
        self.started = time.monotonic()
        self.valid_data = encode_corpus(corpora.valid, vocab, max_len=args.max_len)
        self.last_saved: Path | None = None

    # -- checkpoints ------------------------------------------------------------------------

    def config_record(self) -> dict:
        resumable = {key: getattr(self.args, key) for key in RESUME_KEYS}
        return {"model": self.cfg.to_dict(), "data": resumable, "training": vars(self.args)}

    def save(self) -> Path | None:
        """A checkpoint of this moment (rank 0), after checking that every update since the
        last one was finite."""
        self.check_finite()
        if not self.world.main:
            return None
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": vars(replace(self.progress, elapsed=self.elapsed())),
            "rng": self._rng_before_update or self.rng_states(),
        }
        saved = checkpoint.Checkpoint(
            {k: v.contiguous() for k, v in self.model.state_dict().items()},
            self.config_record(),
            self.vocab.to_bytes(),
            state,
        )
        keep = max(self.args.keep_last, self.args.average_last)
        return checkpoint.save(self.output_dir, self.progress.step, saved, keep)

    def rng_states(self) -> dict:
        states = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
        if self.device.type == "cuda":
            states["cuda"] = torch.cuda.get_rng_state(self.device)
        return states

    def restore(self, loaded: checkpoint.Checkpoint) -> None:
        self.model.load_state_dict(loaded.weights)
        state = loaded.trainer_state
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # loading replaced them with the saved ones
            group.update(lr=self.lr, capturable=True)
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self.updates.fill_(self.progress.step)
        self.started = time.monotonic()
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate((3, tuple(state["rng"]["python"]), None))
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def elapsed(self) -> float:
        """Training seconds, including those of the runs this one resumed."""
        return self.progress.elapsed + time.monotonic() - self.started

    # -- steps ------------------------------------------------------------------------------

    def train_step(self, batches) -> bool:
        """One update over ``batches`` (update_freq micro-batches on this rank, on the host),
        normalised by the target tokens of all of them on all ranks; True when a rank ran out of
        time. Adds the update's statistics to the window without reading them (no host sync).
        The update and the progress that counts it (step, position in the epoch) happen together
        or not at all, whenever Ctrl-C comes: a resumed run neither repeats nor skips a batch."""
        self._rng_before_update = self.rng_states()
        local_tokens = sum(b.num_tgt_tokens for b in batches)
        total_tokens, stop_votes = self.world.sum([local_tokens, float(self.out_of_time())])
        # DDP averages gradients over ranks, so its losses are scaled by world_size to make that
        # a global sum; the bucketed updates sum them.
        summed_over = self.world.world_size if self.ddp else 1
        self.loss_scale.fill_(summed_over / total_tokens)
        self.model.train()
        if self.bucketed is not None:
            self.bucketed.accumulate(batches)
        else:
            self.accumulate_eagerly(batches)
        with interrupts_deferred():
            (self.bucketed.update if self.bucketed is not None else self.apply_update)()
            self.progress.step += 1
            self.progress.batch_in_epoch += len(batches)
            self.window.add(self.progress.step, self.statistics.clone(), total_tokens)
            self._rng_before_update = None
        return stop_votes > 0

    def accumulate_eagerly(self, batches) -> None:
        """Forward + backward of batches of any shape (DDP all-reduces on the last one)."""
        model = self.ddp or self.model
        for i, batch in enumerate(batches):
            last = i == len(batches) - 1
            sync = self.ddp.no_sync() if self.ddp and not last else contextlib.nullcontext()
            with sync:
                self.accumulate(model, batch.to(self.device))

    def accumulate(self, model, batch) -> None:
        """Forward + backward of one batch on the device: its gradients, scaled by
        ``loss_scale``, added to ``.grad`` and its statistics to ``sums``."""
        loss, nll, correct = self.batch_loss(model, batch)
        self.scaler.scale(loss * self.loss_scale).backward()
        self.sums += torch.stack([loss.detach(), nll, correct]).double()

    def apply_update(self) -> None:
        """The optimizer step on the accumulated gradients, all on the device: the learning
        rate from the device step count, clipping, the step; then the update's statistics in
        ``statistics`` and the accumulators zeroed."""
        self.updates += 1
        self.lr.copy_(inverse_sqrt_lr(self.updates, self.args.lr, self.args.warmup))
        self.scaler.unscale_(self.optimizer)
        max_norm = self.args.clip_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        # With loss scaling the scaler skips non-finite updates itself (fused Adam: on device).
        self.scaler.step(self.optimizer)
        self.scaler.update()
        # A captured update keeps the gradient tensors (zeroed); eager ones free them.
        self.optimizer.zero_grad(set_to_none=self.bucketed is None)
        grad_norm, lr = grad_norm.double().reshape(1), self.lr.double().reshape(1)
        self.statistics.copy_(torch.cat([self.sums, grad_norm, lr]))
        self.sums.zero_()

    def batch_loss(self, model, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Summed label-smoothed loss, nll and correct predictions of a batch on the device;
        ``model`` is the module to call (the DDP wrapper in training)."""
        with autocast(self.device, self.autocast_dtype):
            states = model(batch.src, batch.src_lengths, batch.tgt_in)
            return label_smoothed_loss(
                self.model, states, batch.tgt_out, batch.tgt_positions, self.args.label_smoothing
            )

    def check_finite(self) -> None:
        """Raise NonFiniteLoss naming the first update of the window whose loss or gradient was
        not finite (without loss scaling, which skips those updates)."""
        found = self.window.first_non_finite()
        if found is not None and not self.scaler.is_enabled():
            raise NonFiniteLoss(f"loss became {found[1]} at step {found[0]}")

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
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss, nll, correct
        tokens = 0
        for batch in batches.iterate(epoch=1):
            batch = batch.to(self.device)
            loss, nll, correct = self.batch_loss(self.model, batch)
            sums += torch.stack([loss, nll, correct]).double()
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
            static=False,  # a translator per validation would capture its graphs each time
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
            return self.train_and_test()
        finally:
            self.batches.close()
            self.log.close()

    def train_and_test(self) -> int:
        try:
            try:
                self.train_epochs()
            except KeyboardInterrupt:
                self.log.close_bar()
                path = self.save()  # checks the unread updates first: never saves a nan
                self.log.line(
                    f"interrupted at step {self.progress.step}; saved {path}; "
                    f"run the same command again to resume"
                )
                return 130
        except NonFiniteLoss as error:
            where = self.last_saved or "none saved yet"
            self.log.line(f"error: {error}; training stopped. Last good checkpoint: {where}")
            return 1
        self.log.close_bar()
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
        if args.cuda_graphs == "on":
            self.model.train()
            self.bucketed.capture(self.optimizer, self.log.line)
        validated_at = progress.step
        while not args.max_epochs or progress.epoch <= args.max_epochs:
            stopped = self.train_epoch()
            if progress.batch_in_epoch >= len(self.batches):  # the epoch is complete
                progress.epoch, progress.batch_in_epoch = progress.epoch + 1, 0
            last = stopped or (args.max_epochs and progress.epoch > args.max_epochs)
            if progress.step > validated_at and (last or self.validation_due()):
                stopped = self.end_of_epoch() or stopped
                validated_at = progress.step
            if stopped:
                break
        if self.args.check_replicas:
            self.check_replicas()

    def validation_due(self) -> bool:
        """Whether the epoch just completed is one ``--valid-interval`` validates after (the last
        one, when training stops, always is)."""
        interval = self.args.valid_interval
        return bool(interval) and (self.progress.epoch - 1) % interval == 0

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
        group = []
        for batch in self.batches.iterate(progress.epoch, start=progress.batch_in_epoch):
            if args.max_steps and progress.step >= args.max_steps:  # e.g. resumed at the end
                return True
            group.append(batch)
            if len(group) < args.update_freq and progress.batch_in_epoch + len(group) < total:
                continue
            stop = self.train_step(group)
            group = []
            self.log.bar(
                progress.epoch,
                progress.batch_in_epoch,
                total,
                f"step {progress.step} {self.window.tokens_per_second():,.0f} tok/s",
            )
            if progress.step % args.log_interval == 0:
                self.report()
            if args.save_interval and progress.step % args.save_interval == 0:
                self.last_saved = self.save()
            if stop or (args.max_steps and progress.step >= args.max_steps):
                return True
        return False

    def report(self) -> None:
        """The log line of the window (every rank takes part: the sums cross ranks), then a new
        window."""
        self.check_finite()
        window, progress = self.window, self.progress
        totals = [sum(column) for column in zip(*window.values(), strict=True)]
        loss, nll, correct = self.world.sum(totals[:3])
        *_, grad_norm, lr = window.values()[-1]
        tokens, base2 = window.tokens, window.tokens * math.log(2)
        values = {
            "epoch": progress.epoch,
            "step": progress.step,
            "loss": loss / base2,
            "nll": nll / base2,
            "ppl": 2 ** (nll / base2),
            "accuracy": correct / tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "tgt_tokens_per_s": window.tokens_per_second(),
            "elapsed": self.elapsed(),
        }
        if self.device.type == "cuda":  # the caching allocator's, graph pools included
            values["memory_reserved_mib"] = torch.cuda.memory_reserved(self.device) / 2**20
        self.window = Window()
        self.log.record("train", **values)
        self.log.line(
            f"epoch {progress.epoch} step {progress.step} | loss {values['loss']:.3f} "
            f"nll {values['nll']:.3f} ppl {values['ppl']:.2f} acc {values['accuracy']:.3f} "
            f"| lr {lr:.2e} gnorm {values['grad_norm']:.2f} "
            f"| {values['tgt_tokens_per_s']:,.0f} tgt tok/s | {values['elapsed']:.0f} s"
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
                latest.vocabulary,
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
