"""``python -m fastnmt.shortlist``: build a lexical vocabulary shortlist
(``fastnmt.decoding.shortlist``) from a prepared training corpus."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fastnmt.data import DataError
from fastnmt.data.prepared import open_prepared
from fastnmt.decoding.shortlist import Shortlist


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastnmt.shortlist",
        description="Build a lexical vocabulary shortlist from a prepared training corpus.",
    )
    p.add_argument(
        "--prepared-dir", required=True, help="fastnmt.preprocess output (OUTPUT/prepared)"
    )
    p.add_argument("--output", required=True, help="the shortlist file to write (safetensors)")
    p.add_argument("--frequent", type=int, default=200, help="most frequent targets, always scored")
    p.add_argument("--per-token", type=int, default=50, help="targets listed per source token")
    p.add_argument("--max-pairs", type=int, default=1_000_000, help="pairs counted (a sample)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        prepared = open_prepared(Path(args.prepared_dir))
        shortlist = Shortlist.build(
            prepared.corpus,
            prepared.vocab,
            frequent=args.frequent,
            per_token=args.per_token,
            max_pairs=args.max_pairs,
        )
        shortlist.save(args.output)
    except (DataError, ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {str(error).splitlines()[0]}\n")
    listed = int((shortlist.candidates >= 0).sum())
    print(
        f"{args.output}: {len(shortlist.frequent)} frequent targets, {listed:,} listed for "
        f"{len(prepared.vocab):,} source tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
