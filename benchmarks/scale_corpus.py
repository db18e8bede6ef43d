"""Scale benchmark of the training data path (not part of the test suite): preprocessing time,
prepared size on disk, time to the first training step (first start and resume), and peak RSS
of a short training run, for synthetic corpora of N distinct pairs built from Multi30k, next to
the same training command on Multi30k itself.

    python benchmarks/scale_corpus.py --pairs 1000000 10000000 --work-dir /tmp/scale

Pair i of a synthetic corpus is Multi30k training pair i mod M (M = 29,000), joined with pair
(i mod M + i div M) mod M for i >= M: every pair is a distinct combination of sentences, about
twice Multi30k's length (closer to WMT's), and the text keeps Multi30k's vocabulary. Each stage
runs as a subprocess; its peak RSS is the largest resident set of its process tree (the trainer,
its DataLoader worker, the preprocessing workers), as ``/usr/bin/time -v`` reports it. Prints a
Markdown table (docs/large-corpora.md's) and writes the figures as JSON beside the corpora.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fastnmt.data import multi30k_file

STEP_LINE = " step {step} |"  # in the log line of a step, with --log-interval 1


def read_multi30k(split: str) -> tuple[list[str], list[str]]:
    sides = []
    for lang in ("en", "de"):
        with gzip.open(multi30k_file(split, lang), "rt", encoding="utf-8") as f:
            sides.append([line.rstrip("\n") for line in f])
    return sides[0], sides[1]


def write_synthetic(directory: Path, pairs: int, src: list[str], tgt: list[str]) -> Path:
    """PREFIX.en / PREFIX.de with ``pairs`` distinct pairs (see the module docstring)."""
    prefix = directory / "train"
    if (directory / "done").exists():
        return prefix
    directory.mkdir(parents=True, exist_ok=True)
    size = len(src)
    with (
        open(f"{prefix}.en", "w", encoding="utf-8") as en,
        open(f"{prefix}.de", "w", encoding="utf-8") as de,
    ):
        for start in range(0, pairs, size):
            count = min(size, pairs - start)
            round_ = start // size
            if round_ == 0:
                en.writelines(f"{s}\n" for s in src[:count])
                de.writelines(f"{t}\n" for t in tgt[:count])
                continue
            partners = [(a + round_) % size for a in range(count)]
            en.writelines(f"{src[a]} {src[b]}\n" for a, b in enumerate(partners))
            de.writelines(f"{tgt[a]} {tgt[b]}\n" for a, b in enumerate(partners))
    (directory / "done").touch()
    return prefix


def write_prefix(directory: Path, src: list[str], tgt: list[str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for lang, lines in (("en", src), ("de", tgt)):
        (directory / f"data.{lang}").write_text("".join(f"{s}\n" for s in lines), "utf-8")
    return directory / "data"


def run(command: list[str], step: int | None = None) -> dict:
    """Run ``command``; its wall time, peak RSS (MB, process tree) and, given ``step``, the
    seconds until that step's log line."""
    started = time.monotonic()
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    reached, lines = None, []
    for line in process.stderr:
        lines.append(line)
        if step is not None and reached is None and STEP_LINE.format(step=step) in line:
            reached = time.monotonic() - started
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        sys.exit(f"failed ({process.returncode}): {' '.join(command)}\n{''.join(lines[-20:])}")
    return {
        "seconds": time.monotonic() - started,
        "peak_rss_mb": usage.ru_maxrss / 1024,
        "to_step_seconds": reached,
    }


def directory_mb(directory: Path) -> float:
    return sum(p.stat().st_size for p in directory.iterdir()) / 1e6


def measure(name: str, slug: str, prefix: Path, valid: Path, work: Path, args) -> dict:
    """Preprocess, a short training run, then a resumed one, on the corpus at ``prefix``."""
    prepared, output = work / f"{slug}-prepared", work / f"{slug}-run"
    for stale in (prepared, output):  # of an earlier benchmark: measure from scratch
        shutil.rmtree(stale, ignore_errors=True)
    corpus = ["--train", str(prefix), "--prepared-dir", str(prepared)]
    corpus += shlex.split(args.corpus_args)
    preprocess = run([sys.executable, "-m", "fastnmt.preprocess", *corpus, "--no-progress"])
    training = [
        sys.executable, "-m", "fastnmt.train", *corpus, "--valid", str(valid),
        "--output-dir", str(output), "--log-interval", "1", "--average-last", "1",
        "--no-progress", *shlex.split(args.train_args),
    ]  # fmt: skip
    first = run([*training, "--max-steps", str(args.steps)], step=1)
    resumed = run([*training, "--max-steps", str(args.steps + 1)], step=args.steps + 1)
    return {
        "corpus": name,
        "preprocess_seconds": preprocess["seconds"],
        "preprocess_peak_rss_mb": preprocess["peak_rss_mb"],
        "prepared_mb": directory_mb(prepared),
        "first_step_seconds": first["to_step_seconds"],
        "resume_to_step_seconds": resumed["to_step_seconds"],
        "train_peak_rss_mb": first["peak_rss_mb"],
        "manifest": json.loads((prepared / "manifest.json").read_text())["pairs"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| corpus | pairs kept | preprocess | prepared on disk | first start to step 1 "
        "| resume to its first step | training peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['corpus']} | {row['manifest']['kept']:,} | {row['preprocess_seconds']:.0f} s "
            f"| {row['prepared_mb']:,.0f} MB | {row['first_step_seconds']:.1f} s "
            f"| {row['resume_to_step_seconds']:.1f} s | {row['train_peak_rss_mb']:,.0f} MB |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--work-dir", type=Path, default=Path("scale-benchmark"))
    p.add_argument("--steps", type=int, default=20, help="training steps of the short run")
    p.add_argument("--valid-pairs", type=int, default=200, help="Multi30k val pairs validated")
    p.add_argument("--corpus-args", default="", help='for both commands, e.g. "--workers 2"')
    p.add_argument("--train-args", default="", help='for training only, e.g. "--device cpu"')
    args = p.parse_args()
    src, tgt = read_multi30k("train")
    valid = write_prefix(
        args.work_dir / "valid", *(side[: args.valid_pairs] for side in read_multi30k("val"))
    )
    corpora = [("Multi30k", "multi30k", write_prefix(args.work_dir / "multi30k", src, tgt))]
    for pairs in args.pairs:
        directory = args.work_dir / f"synthetic-{pairs}"
        prefix = write_synthetic(directory, pairs, src, tgt)
        corpora.append((f"{pairs:,} synthetic pairs", f"synthetic-{pairs}", prefix))
    rows = []
    for name, slug, prefix in corpora:
        rows.append(measure(name, slug, prefix, valid, args.work_dir, args))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    (args.work_dir / "scale.json").write_text(json.dumps(rows, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()
