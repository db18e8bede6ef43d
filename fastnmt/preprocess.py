"""``python -m fastnmt.preprocess``: prepare a training corpus once, for any number of runs.

Reads the training text (Multi30k, PREFIX.{src,tgt} files or a TSV file, plain or gzip) in
chunks, trains the joint sentencepiece vocabulary on a sample of it, encodes both sides on all
cores and writes a prepared directory (its files: ``fastnmt.data.prepared``). ``python -m
fastnmt.train`` takes the same corpus arguments (defined here) and runs the same step into
OUTPUT_DIR/prepared when it finds no prepared data matching them, and reuses the directory
otherwise. Exit codes: 0 done, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from fastnmt.cli import UsageError, check_counts, check_output_path, report_error
from fastnmt.data import MULTI30K_LANGS, DataError, find_side, multi30k_file
from fastnmt.data.prepared import DEFAULT_SAMPLE, Options, Source, available_cores, prepare


def add_corpus_arguments(group: argparse._ArgumentGroup) -> None:
    """The arguments that name a training corpus and how it is prepared (shared with
    ``python -m fastnmt.train``)."""
    group.add_argument("--dataset", default="multi30k", help="built-in dataset (default multi30k)")
    group.add_argument(
        "--data-dir", help="local Multi30k copy (else $FASTNMT_DATA_DIR or download)"
    )
    group.add_argument("--src-lang", default="en", help="source language (multi30k: en de fr cs)")
    group.add_argument("--tgt-lang", default="de", help="target language")
    group.add_argument("--train", help="own data: PREFIX.{src,tgt} or PREFIX.{src-lang,tgt-lang}")
    group.add_argument("--train-tsv", help="own training data as a src<TAB>tgt file")
    group.add_argument("--vocab-size", type=int, default=8000, help="joint sentencepiece vocab")
    group.add_argument(
        "--spm-sample",
        type=int,
        default=DEFAULT_SAMPLE,
        help="sentences (both sides) sentencepiece is trained on, sampled from the corpus",
    )
    group.add_argument("--max-len", type=int, default=256, help="drop pairs longer (tokens)")
    group.add_argument(
        "--workers",
        type=int,
        default=available_cores(),
        help="encoding processes (default: all cores)",
    )


def check_corpus_arguments(args) -> None:
    if args.train and args.train_tsv:
        raise UsageError("give --train or --train-tsv, not both")
    if not (args.train or args.train_tsv):
        if args.dataset != "multi30k":
            raise UsageError(f"--dataset must be multi30k (or give --train), got {args.dataset!r}")
        for flag, lang in (("--src-lang", args.src_lang), ("--tgt-lang", args.tgt_lang)):
            if lang not in MULTI30K_LANGS:
                raise UsageError(
                    f"{flag} must be one of {MULTI30K_LANGS} for multi30k, got {lang!r}"
                )
    if args.src_lang == args.tgt_lang:
        raise UsageError("--src-lang and --tgt-lang must differ")
    check_counts(
        1,
        ("--vocab-size", args.vocab_size),
        ("--spm-sample", args.spm_sample),
        ("--max-len", args.max_len),
        ("--workers", args.workers),
    )


def source_from_arguments(args) -> Source:
    """The training text the arguments name (Multi30k is downloaded on first use)."""
    if args.train_tsv:
        return Source((Path(args.train_tsv),), args.train_tsv)
    if args.train:
        paths = (
            find_side(args.train, (args.src_lang, "src")),
            find_side(args.train, (args.tgt_lang, "tgt")),
        )
        return Source(paths, args.train)
    paths = tuple(
        multi30k_file("train", lang, args.data_dir) for lang in (args.src_lang, args.tgt_lang)
    )
    return Source(paths, "multi30k/train")


def options_from_arguments(args) -> Options:
    return Options(args.vocab_size, args.spm_sample, args.seed, args.max_len)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastnmt.preprocess", description=__doc__.split("\n")[0]
    )
    group = p.add_argument_group("corpus")
    add_corpus_arguments(group)
    group.add_argument("--seed", type=int, default=1, help="of the vocabulary's sample")
    p.add_argument("--prepared-dir", required=True, help="where the prepared data goes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on a terminal")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    try:
        check_corpus_arguments(args)
        check_output_path(args.prepared_dir, "--prepared-dir", folder=True)
        prepared = prepare(
            source_from_arguments(args),
            Path(args.prepared_dir),
            options_from_arguments(args),
            workers=args.workers,
            log=lambda line: tqdm.write(line, file=sys.stderr),  # above a progress bar
            progress=not args.no_progress,
        )
    except (UsageError, DataError) as error:
        return report_error(error)
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    print(prepared.summary(), file=sys.stderr)
    print(f"{args.prepared_dir} ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
