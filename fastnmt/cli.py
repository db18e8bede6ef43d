"""What the ``python -m fastnmt.*`` commands share: the one UsageError, reporting bad input as one
line on stderr with exit status 2, the check of the paths they write, and the model, search and
sampling arguments of the commands that translate (translate, evaluate, score, export)."""

from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
from pathlib import Path

import fastnmt
from fastnmt.checkpoint import CheckpointError
from fastnmt.data import DataError
from fastnmt.decoding.next_token import SAMPLING_METHODS, Sampling
from fastnmt.devices import configure_process, resolve_device
from fastnmt.ops import dispatch
from fastnmt.precision import AUTO_HELP, choose_precision
from fastnmt.translator import PRECISIONS, Translator

BAD_INPUT = 2  # the exit status of a bad argument, bad data or a bad checkpoint


class UsageError(ValueError):
    """A bad command-line value; the message is one line."""


# What a command reports in one line with exit status BAD_INPUT: a bad value, bad data, a bad
# checkpoint, or a --backend forced onto calls it cannot run.
BAD_INPUT_ERRORS = (UsageError, DataError, CheckpointError, dispatch.BackendUnavailableError)


def report_error(error: Exception) -> int:
    """Print ``error: MESSAGE`` on stderr; returns the exit status for bad input."""
    print(f"error: {error}", file=sys.stderr)
    return BAD_INPUT


def finite_float(text: str) -> float:
    """argparse's type of a float argument: a finite number (nan or inf would pass every range
    check written as a comparison, and reach the arithmetic)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def check_counts(minimum: int, *values: tuple[str, float | None]) -> None:
    """UsageError naming the first ``(flag, value)`` below ``minimum``: 1 for the counts that
    must be positive, 0 for those where 0 means none, off or no limit; None (not given)
    passes."""
    for flag, value in values:
        if value is not None and value < minimum:
            expected = "positive" if minimum == 1 else f">= {minimum}"
            raise UsageError(f"{flag} must be {expected}, got {value}")


def check_output_path(path: str | Path | None, argument: str, *, folder: bool = False) -> None:
    """Refuse, before any work, a path a command is to write (a file, or with ``folder`` a
    folder) that it cannot: one of the other kind, or under a file, or where nothing can be
    created. Creating is probed (a temporary folder, removed) in the folder itself or its
    nearest existing ancestor, as permissions alone do not tell (root, read-only mounts)."""
    if not path:
        return
    path = Path(path)
    kind, other = ("folder", "file") if folder else ("file", "folder")
    if path.exists() and path.is_dir() != folder:
        raise UsageError(f"{argument} {path} is a {other}, expected a {kind}")
    place = path if path.is_dir() else path.parent
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        raise UsageError(f"{argument} {path}: {place} is a file, not a folder")
    try:
        tempfile.TemporaryDirectory(dir=place).cleanup()
    except OSError as error:
        raise UsageError(f"{argument} {path}: cannot write in {place} ({error.strerror})") from None


def run_command(run_args, parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Exit code of ``run_args(parsed argv)``: 2 with a one-line error for bad input or a bad
    checkpoint, 130 on Ctrl-C, 0 when stdout's reader closed the pipe."""
    configure_process(decoding=True)
    args = parser.parse_args(argv)
    try:
        return run_args(args)
    except BAD_INPUT_ERRORS as error:
        return report_error(error)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into head: the reader has all it wants
        return 0


def forced_backend(name: str):
    """``--backend``'s block: ``auto`` lets every op choose, another backend is forced onto the
    ops that have it (``dispatch.ops_with``) while the others choose, so that ``--backend
    triton`` runs the model's ops on Triton and the decoding ops on their own best backend."""
    ops = None if name == "auto" else dispatch.ops_with(name)
    return fastnmt.backend(name, ops=ops)


def add_model_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The model and how it runs (shared with ``fastnmt.score``); returns the "running"
    group."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        nargs="+",
        help="checkpoint or training output dir (several: an ensemble averaging their "
        "probabilities), or a Hugging Face Opus-MT / NLLB model directory",
    )
    parser.add_argument("--src-code", help="NLLB/M2M100 source language code, e.g. eng_Latn")
    parser.add_argument("--tgt-code", help="NLLB/M2M100 target language code, e.g. deu_Latn")
    run = parser.add_argument_group("running")
    run.add_argument("--max-tokens", type=int, default=6000, help="padded source tokens/batch")
    run.add_argument("--max-sentences", type=int, default=256, help="sentences per batch")
    run.add_argument(
        "--precision", default="auto", choices=["auto", *PRECISIONS], help=AUTO_HELP["translation"]
    )
    run.add_argument("--backend", default="auto", choices=["auto", *fastnmt.BACKENDS])
    run.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda:$LOCAL_RANK if available)")
    return run


def add_length_penalty_arguments(group) -> None:
    group.add_argument("--lenpen", type=finite_float, default=1.0, help="score / length**lenpen")
    group.add_argument("--alpha", type=finite_float, help="GNMT length penalty ((5+len)/6)**alpha")


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, search and batching options, shared with ``fastnmt.evaluate``."""
    run = add_model_arguments(parser)
    search = parser.add_argument_group("search")
    search.add_argument("--beam", type=int, default=4, help="beam size; 1 = greedy (default 4)")
    add_length_penalty_arguments(search)
    search.add_argument(
        "--max-len-a", type=finite_float, default=1.2, help="max length = a*src + b"
    )
    search.add_argument("--max-len-b", type=int, default=10)
    search.add_argument(
        "--no-repeat-ngram", type=int, default=0, help="no n-gram of N tokens twice in an output"
    )
    sampling = parser.add_argument_group("sampling (instead of beam search)")
    sampling.add_argument("--sampling", choices=SAMPLING_METHODS, help="sample the output")
    sampling.add_argument("--sampling-topk", type=int, help="from the K best (default: all)")
    sampling.add_argument(
        "--sampling-topp", type=finite_float, help="from the P nucleus (default 0.9)"
    )
    sampling.add_argument(
        "--temperature", type=finite_float, help="softmax(logits / T) (default 1)"
    )
    sampling.add_argument("--seed", type=int, help="the same seed, the same samples")
    sampling.add_argument("--samples", type=int, help="samples per sentence (default 1)")
    run.add_argument("--shortlist", help="score only the words this file lists (fastnmt.shortlist)")
    run.add_argument(
        "--static-search",
        default="auto",
        choices=["auto", "on", "off"],
        help="search on fixed batch buckets, decided on the device and replayed as CUDA graphs "
        "(auto: on CUDA without --shortlist)",
    )


SAMPLING_FLAGS = ("sampling_topk", "sampling_topp", "temperature", "seed", "samples")


def sampling_option(args) -> Sampling | None:
    """--sampling and its settings as a ``Sampling``, checked."""
    given = [f for f in SAMPLING_FLAGS if getattr(args, f) is not None]
    if args.sampling is None:
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} needs --sampling")
        return None
    if args.sampling == "topp" and args.sampling_topk is not None:
        raise UsageError("--sampling-topk is for --sampling topk")
    if args.sampling == "topk" and args.sampling_topp is not None:
        raise UsageError("--sampling-topp is for --sampling topp")
    settings = dict(
        topk=args.sampling_topk,
        topp=args.sampling_topp,
        temperature=args.temperature,
        seed=args.seed,
        samples=args.samples,
    )
    try:
        return Sampling(args.sampling, **{k: v for k, v in settings.items() if v is not None})
    except ValueError as error:  # "<field> must ...": name the flag instead
        field_name, rule = str(error).split(" ", 1)
        flag = {"topk": "sampling-topk", "topp": "sampling-topp"}.get(field_name, field_name)
        raise UsageError(f"--{flag} {rule}") from None


def search_options(args) -> dict:
    """The keyword arguments of ``Translator.translate_full`` from checked arguments."""
    check_counts(
        1,
        ("--beam", args.beam),
        ("--max-tokens", args.max_tokens),
        ("--max-sentences", args.max_sentences),
    )
    if args.max_len_a < 0 or args.max_len_b < 0 or args.max_len_a + args.max_len_b < 1:
        raise UsageError(
            f"--max-len-a and --max-len-b must be >= 0 and leave room for a token, got "
            f"{args.max_len_a} and {args.max_len_b}"
        )
    check_counts(0, ("--no-repeat-ngram", args.no_repeat_ngram))
    return dict(
        beam=args.beam,
        lenpen=args.lenpen,
        alpha=args.alpha,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        sampling=sampling_option(args),
        no_repeat_ngram=args.no_repeat_ngram,
    )


def search_translator_options(args) -> dict:
    """The Translator's search options (shortlist, static search) from the arguments."""
    static = {"auto": None, "on": True, "off": False}[args.static_search]
    return dict(shortlist=args.shortlist, static=static)


def load_translator(args, **options) -> Translator:
    """The translator of --checkpoint (several: an ensemble), with the model arguments and
    ``options`` of the Translator; with --precision auto, says on stderr what auto chose and
    why."""
    try:
        device = resolve_device(args.device or "auto")
        translator = Translator.load(
            args.checkpoint,
            src_code=args.src_code,
            tgt_code=args.tgt_code,
            device=device,
            precision=args.precision,
            max_tokens=args.max_tokens,
            max_sentences=args.max_sentences,
            **options,
        )
    except CheckpointError:
        raise
    except (ValueError, ImportError) as error:  # bad options, unsupported models, no transformers
        raise UsageError(str(error).splitlines()[0]) from None
    if args.precision == "auto":  # the choice the load made (remembered, not measured again)
        choice = choose_precision("translation", device, translator.model.cfg)
        print(f"precision {choice}", file=sys.stderr)
    # What exists now (imports, the model) lives as long as the command: out of the collector's
    # reach, a full collection walks only what the batches leave, not about 190,000 objects
    # (about 100 ms each time, every few thousand sentences on a 2-core EPYC).
    gc.freeze()
    return translator
