"""``python -m fastnmt.evaluate --checkpoint DIR``: score a checkpoint on a dataset split.

Translates the source side of Multi30k ``--split`` (val, test_2016_flickr, ...; the language pair
of the checkpoint unless given) or of own data (--test PREFIX / --test-tsv FILE, as in training)
and prints sacreBLEU (13a, cased, detokenized) and chrF with their signatures, plus BLEU on
lowercased 13a-tokenized text, labelled as such, for comparison with papers that report it.
Exit codes: 0 done, 2 bad input or checkpoint, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import sacrebleu

from fastnmt import checkpoint, metrics
from fastnmt.cli import (
    UsageError,
    add_search_arguments,
    check_output_path,
    forced_backend,
    load_translator,
    run_command,
    search_options,
    search_translator_options,
)
from fastnmt.data import (
    MULTI30K_SPLITS,
    ParallelCorpus,
    load_multi30k,
    read_parallel_prefix,
    read_tsv,
)
from fastnmt.translator import is_pretrained_directory


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastnmt.evaluate", description=__doc__.split("\n")[0]
    )
    add_search_arguments(p)
    data = p.add_argument_group("data")
    data.add_argument("--dataset", default="multi30k", help="built-in dataset (default multi30k)")
    data.add_argument("--split", default="test_2016_flickr", help="multi30k split")
    data.add_argument("--data-dir", help="local Multi30k copy (else $FASTNMT_DATA_DIR or download)")
    data.add_argument("--src-lang", help="source language (default: the checkpoint's)")
    data.add_argument("--tgt-lang", help="target language (default: the checkpoint's)")
    data.add_argument("--test", help="own data: PREFIX.{src,tgt} or PREFIX.{src-lang,tgt-lang}")
    data.add_argument("--test-tsv", help="own data as a src<TAB>tgt file")
    p.add_argument("--output", help="also write the translations to this file")
    return p


def lowercased_tokenized_bleu(hypotheses: list[str], references: list[str]) -> metrics.Score:
    """BLEU on lowercased, 13a-tokenized text: what multi-bleu.perl on tokenized lowercased text
    reports, as in many Multi30k papers. Not comparable with sacreBLEU's cased score."""
    metric = sacrebleu.BLEU(lowercase=True, tokenize="13a")
    score = metric.corpus_score(hypotheses, [references])
    return metrics.Score("tokenized lowercased BLEU", score.score, str(metric.get_signature()))


def load_corpus(args) -> ParallelCorpus:
    if args.test and args.test_tsv:
        raise UsageError("give --test or --test-tsv, not both")
    if args.test_tsv:
        return read_tsv(args.test_tsv)
    if args.test:
        return read_parallel_prefix(args.test, args.src_lang or "src", args.tgt_lang or "tgt")
    if args.dataset != "multi30k":
        raise UsageError(f"--dataset must be multi30k (or give --test), got {args.dataset!r}")
    if args.split not in MULTI30K_SPLITS:
        raise UsageError(f"--split must be one of {', '.join(MULTI30K_SPLITS)}, got {args.split!r}")
    return load_multi30k(args.split, args.src_lang, args.tgt_lang, args.data_dir)


def default_languages(args) -> None:
    """Fill --src-lang / --tgt-lang from the checkpoint's training data when not given."""
    if args.src_lang and args.tgt_lang:
        return
    first = args.checkpoint[0]  # an ensemble's members share their data
    if is_pretrained_directory(first):  # no training data recorded: Multi30k's
        args.src_lang, args.tgt_lang = args.src_lang or "en", args.tgt_lang or "de"
        return
    loaded = checkpoint.load(checkpoint.resolve(Path(first)), with_trainer_state=False)
    data = loaded.config.get("data", {})
    args.src_lang = args.src_lang or data.get("src_lang", "en")
    args.tgt_lang = args.tgt_lang or data.get("tgt_lang", "de")


def evaluate(args) -> int:
    options = search_options(args)
    check_output_path(args.output, "--output")
    default_languages(args)
    corpus = load_corpus(args)
    translator = load_translator(args, **search_translator_options(args))
    started = time.perf_counter()
    with forced_backend(args.backend):
        hypotheses = translator.translate(corpus.src, **options)
    seconds = time.perf_counter() - started
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    search = "greedy" if args.beam == 1 else f"beam {args.beam}"
    print(
        f"{corpus.name} {args.src_lang}->{args.tgt_lang}, {search}: {len(hypotheses):,} "
        f"sentences in {seconds:.1f} s ({len(hypotheses) / max(seconds, 1e-9):,.1f} sent/s)"
    )
    for score in (
        metrics.bleu(hypotheses, corpus.tgt),
        metrics.chrf(hypotheses, corpus.tgt),
        lowercased_tokenized_bleu(hypotheses, corpus.tgt),
    ):
        print(score)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(evaluate, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
