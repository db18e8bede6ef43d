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

from fastnmt.cli import (
    UsageError,
    add_length_penalty_arguments,
    add_model_arguments,
    check_output_path,
    forced_backend,
    load_translator,
    run_command,
)
from fastnmt.data import read_parallel


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastnmt.score", description=__doc__.split("\n")[0])
    add_model_arguments(p)
    add_length_penalty_arguments(p.add_argument_group("score"))
    io = p.add_argument_group("input and output")
    io.add_argument("--source", required=True, help="source sentences, one a line")
    io.add_argument("--target", required=True, help="their targets, line for line")
    io.add_argument("--output", help="scores file (default: stdout)")
    return p


def run(args) -> int:
    for flag, value in (("--max-tokens", args.max_tokens), ("--max-sentences", args.max_sentences)):
        if value < 1:
            raise UsageError(f"{flag} must be positive, got {value}")
    check_output_path(args.output, "--output")
    pairs = read_parallel(args.source, args.target)  # one-line error when the counts differ
    translator = load_translator(args)
    started = time.perf_counter()
    with forced_backend(args.backend):
        scores = translator.score(pairs.src, pairs.tgt, lenpen=args.lenpen, alpha=args.alpha)
    seconds = time.perf_counter() - started
    lines = "".join(f"{s.log_prob:.4f}\t{s.per_token:.4f}\t{s.normalised:.4f}\n" for s in scores)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as output:
            output.write(lines)
    else:
        sys.stdout.write(lines)
    rate = len(scores) / max(seconds, 1e-9)
    print(f"Scored {len(scores):,} pairs in {seconds:.1f} s ({rate:,.1f} pairs/s)", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
