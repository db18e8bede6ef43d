"""``python -m fastnmt.score --checkpoint DIR --source F --target F``: each pair's log-probability.

Scores every source/target line pair under the model (several checkpoints: an ensemble), teacher
forced in batches through the fused loss, and writes one line per pair, tab-separated: the summed
log-probability of the target's tokens and eos, the same per token, and the length-normalised
score the search ranks by (--lenpen / --alpha). For corpus filtering and reranking. The summary
goes to stderr. Exit codes: 0 done, 2 bad input or checkpoint, 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fastnmt.cli import (
    add_length_penalty_arguments,
    add_model_arguments,
    check_counts,
    check_output_path,
    forced_backend,
    load_translator,
    run_command,
)
from fastnmt.data import PairReader
from fastnmt.translator import Score


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastnmt.score", description=__doc__.split("\n")[0])
    add_model_arguments(p)
    add_length_penalty_arguments(p.add_argument_group("score"))
    io = p.add_argument_group("input and output")
    io.add_argument("--source", required=True, help="source sentences, one a line")
    io.add_argument("--target", required=True, help="their targets, line for line")
    io.add_argument("--output", help="scores file (default: stdout)")
    io.add_argument(
        "--buffer-size", type=int, default=10000,
        help="pairs read, sorted by length and scored together (the files are never read whole)",
    )  # fmt: skip
    return p


def run(args) -> int:
    check_counts(
        1,
        ("--max-tokens", args.max_tokens),
        ("--max-sentences", args.max_sentences),
        ("--buffer-size", args.buffer_size),
    )
    check_output_path(args.output, "--output")
    paths = (Path(args.source), Path(args.target))
    _check_pairs(paths, args.buffer_size)
    translator = load_translator(args)
    output = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115
    scored, seconds = 0, 0.0
    try:
        with forced_backend(args.backend):
            for chunk in PairReader(paths, args.buffer_size).chunks():
                started = time.perf_counter()
                scores = translator.score(
                    *chunk.texts(),
                    lenpen=args.lenpen,
                    alpha=args.alpha,
                    first_line=chunk.first_line,
                )
                seconds += time.perf_counter() - started
                output.write("".join(map(_line, scores)))
                output.flush()  # a chunk's scores are kept whatever happens to the next ones
                scored += len(scores)
    finally:
        if output is not sys.stdout:
            output.close()
    rate = scored / max(seconds, 1e-9)
    print(f"Scored {scored:,} pairs in {seconds:.1f} s ({rate:,.1f} pairs/s)", file=sys.stderr)
    return 0


def _check_pairs(paths: tuple[Path, Path], pairs: int) -> None:
    """Every line of the files read and decoded once before any pair is scored (fast next to
    scoring): a line-count mismatch, an empty file or a line that is not UTF-8 is an error at
    once, not after the pairs before it were scored."""
    for chunk in PairReader(paths, pairs).chunks():
        chunk.texts()


def _line(score: Score) -> str:
    return f"{score.log_prob:.4f}\t{score.per_token:.4f}\t{score.normalised:.4f}\n"


def main(argv: list[str] | None = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
