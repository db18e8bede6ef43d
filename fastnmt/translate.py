"""``python -m fastnmt.translate --checkpoint DIR``: translate text, one output line per input line.

Reads --input FILE or stdin (interactively, a line at a time, when stdin is a terminal) and writes
--output FILE or stdout; an empty input line gives an empty output line, so line counts always
match (with --nbest N: N lines per input line, ``LINE ||| text ||| score``). Invalid UTF-8 is
replaced (U+FFFD) and counted; too long lines are truncated with a warning naming the line.
--reference FILE scores the output with sacreBLEU (BLEU and chrF, with signatures). Sampling,
--prefix-file, --no-repeat-ngram and ensembles (several --checkpoint): docs/translation.md. The
summary line and all messages go to stderr. Exit codes: 0 done, 2 bad input or checkpoint, 130
Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO

from fastnmt import metrics
from fastnmt.cli import (
    UsageError,
    add_search_arguments,
    check_counts,
    check_output_path,
    forced_backend,
    load_translator,
    run_command,
    search_options,
    search_translator_options,
)
from fastnmt.data import DataError, read_lines
from fastnmt.translator import Translation, Translator


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastnmt.translate", description=__doc__.split("\n")[0]
    )
    add_search_arguments(p)
    io = p.add_argument_group("input and output")
    io.add_argument("--input", help="input file (default: stdin)")
    io.add_argument("--output", help="output file (default: stdout)")
    io.add_argument(
        "--nbest", type=int, default=1, help="candidates per line (<= --beam, or --samples)"
    )
    io.add_argument("--prefix-file", help="per input line, text its translation starts with")
    io.add_argument("--reference", help="score the output against this file (BLEU, chrF)")
    io.add_argument("--buffer-size", type=int, default=5000, help="lines translated together")
    io.add_argument("--alignments", help="write hard alignments (src-tgt pairs) to this file")
    plots = p.add_argument_group("attention heat maps")
    plots.add_argument("--plot-attention", metavar="DIR", help="write PNG heat maps here")
    plots.add_argument("--plot-lines", default="1-10", help="lines to plot, e.g. 1,4-6")
    plots.add_argument(
        "--plot-self-attention", action="store_true", help="also encoder/decoder self-attention"
    )
    return p


def parse_line_ranges(text: str) -> set[int]:
    """Line numbers from "1,4-6" (1-based)."""
    lines: set[int] = set()
    try:
        for part in filter(None, text.split(",")):
            first, _, last = part.partition("-")
            lines.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise UsageError(f"--plot-lines must look like 1,4-6, got {text!r}") from None
    if not lines or min(lines) < 1:
        raise UsageError(f"--plot-lines must name lines from 1, got {text!r}")
    return lines


# ---------------------------------------------------------------------------------------------
# Reading input


@dataclass
class Input:
    """Decoded input lines, counting those that held invalid UTF-8."""

    invalid_lines: list[int] = field(default_factory=list)
    count: int = 0

    def decode(self, raw: bytes) -> str:
        self.count += 1
        text = raw.removesuffix(b"\n").removesuffix(b"\r")
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError:
            self.invalid_lines.append(self.count)
            return text.decode("utf-8", errors="replace")

    def chunks(self, stream: BinaryIO, size: int) -> Iterator[list[str]]:
        chunk: list[str] = []
        for raw in stream:
            chunk.append(self.decode(raw))
            if len(chunk) == size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


# ---------------------------------------------------------------------------------------------
# Translating


@dataclass
class Totals:
    sentences: int = 0
    tokens: int = 0  # target subword tokens of the best candidates, without eos
    seconds: float = 0.0
    hypotheses: list[str] = field(default_factory=list)  # kept only to score against a reference

    def summary(self) -> str:
        seconds = max(self.seconds, 1e-9)
        return (
            f"Translated {self.sentences:,} sentences ({self.tokens:,} tokens) in "
            f"{self.seconds:.1f} s ({self.sentences / seconds:,.1f} sent/s, "
            f"{self.tokens / seconds:,.0f} tok/s)"
        )


class Session:
    """Translates chunks of lines and writes every requested output for them."""

    def __init__(
        self,
        translator: Translator,
        args,
        options: dict,
        output: TextIO,
        prefixes: list[str] | None = None,
    ):
        self.translator, self.args, self.options, self.output = translator, args, options, output
        self.prefixes = prefixes  # per input line (--prefix-file)
        self.totals = Totals()
        self.plot_lines = parse_line_ranges(args.plot_lines) if args.plot_attention else set()
        self.alignments = open(args.alignments, "w", encoding="utf-8") if args.alignments else None  # noqa: SIM115

    def translate(self, lines: list[str]) -> None:
        first = self.totals.sentences + 1
        started = time.perf_counter()
        try:
            translations = self.translator.translate_full(
                lines,
                nbest=self.args.nbest,
                prefix=self._prefixes(first, len(lines)),
                attention=self.alignments is not None,
                first_line=first,
                **self.options,
            )
        except ValueError as error:  # a line the options cannot serve, e.g. a too long prefix
            raise UsageError(str(error).splitlines()[0]) from None
        self.totals.seconds += time.perf_counter() - started
        self.totals.sentences += len(lines)
        self.totals.tokens += sum(len(t.candidates[0].tokens) for t in translations if t.candidates)
        for number, translation in enumerate(translations, first):
            self.write(number, translation)
        if self.args.reference:
            self.totals.hypotheses.extend(t.text for t in translations)
        self.output.flush()
        chosen = {n: t for n, t in enumerate(translations, first) if n in self.plot_lines}
        self.plot({n: t for n, t in chosen.items() if t.candidates})

    def _prefixes(self, first: int, count: int) -> list[str] | None:
        """The --prefix-file lines of input lines first.. first + count - 1."""
        if self.prefixes is None:
            return None
        if len(self.prefixes) < first - 1 + count:
            raise DataError(f"--prefix-file has {len(self.prefixes)} lines but the input has more")
        return self.prefixes[first - 1 : first - 1 + count]

    def write(self, number: int, translation: Translation) -> None:
        if self.args.nbest == 1:
            self.output.write(translation.text + "\n")
        else:
            candidates = translation.candidates or [None]
            for candidate in candidates:
                text, score = ("", 0.0) if candidate is None else (candidate.text, candidate.score)
                self.output.write(f"{number} ||| {text} ||| {score:.4f}\n")
        if self.alignments is not None:
            from fastnmt.plot import hard_alignment, pharaoh

            pairs = hard_alignment(translation) if translation.candidates else []
            self.alignments.write(pharaoh(pairs) + "\n")

    def plot(self, translations: dict[int, Translation]) -> None:
        """Heat maps of the chosen lines, named after their line numbers."""
        if not translations:
            return
        from fastnmt.plot import plot_attention  # matplotlib loads only when plotting

        missing = [t for t in translations.values() if t.attention is None]
        if missing:
            with forced_backend(self.args.backend):
                self.translator.add_attention(missing)
        for number, translation in translations.items():
            plot_attention(
                translation,
                self.translator.vocab,
                Path(self.args.plot_attention),
                f"line{number}",
                self_attention=self.args.plot_self_attention,
            )

    def close(self) -> None:
        if self.alignments is not None:
            self.alignments.close()


# ---------------------------------------------------------------------------------------------
# Running


def check_arguments(args) -> dict:
    options = search_options(args)
    sampling = options["sampling"]
    width, name = (args.beam, "--beam") if sampling is None else (sampling.samples, "--samples")
    if not 1 <= args.nbest <= width:
        raise UsageError(f"--nbest must be between 1 and {name} ({width}), got {args.nbest}")
    check_counts(1, ("--buffer-size", args.buffer_size))
    if args.plot_attention:
        parse_line_ranges(args.plot_lines)
    if args.input and not Path(args.input).is_file():
        raise UsageError(f"--input: {args.input} is not a file")
    check_output_path(args.output, "--output")
    check_output_path(args.alignments, "--alignments")
    check_output_path(args.plot_attention, "--plot-attention", folder=True)
    return options


def run(args) -> int:
    options = check_arguments(args)
    references = read_lines(args.reference) if args.reference else None
    prefixes = read_lines(args.prefix_file) if args.prefix_file else None
    translator = load_translator(args, **search_translator_options(args))
    interactive = args.input is None and sys.stdin.isatty()
    output = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout  # noqa: SIM115
    source = Input()
    session = Session(translator, args, options, output, prefixes)
    try:
        with forced_backend(args.backend), warnings.catch_warnings():
            warnings.showwarning = _show_warning
            if interactive:
                _interactive(session, source)
            else:
                stream = open(args.input, "rb") if args.input else sys.stdin.buffer  # noqa: SIM115
                with stream:
                    for chunk in source.chunks(stream, args.buffer_size):
                        session.translate(chunk)
    finally:
        session.close()
        if output is not sys.stdout:
            output.close()
    _report(session.totals, source, references)
    if prefixes is not None and len(prefixes) != source.count:
        raise DataError(f"--prefix-file has {len(prefixes)} lines but the input has {source.count}")
    return 0


def _interactive(session: Session, source: Input) -> None:
    """A line at a time: prompt, translate, print, until end of input."""
    while True:
        sys.stderr.write("> ")
        sys.stderr.flush()
        raw = sys.stdin.buffer.readline()
        if not raw:
            sys.stderr.write("\n")
            return
        session.translate([source.decode(raw)])


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _report(totals: Totals, source: Input, references: list[str] | None) -> None:
    if source.invalid_lines:
        shown = ", ".join(map(str, source.invalid_lines[:10]))
        more = ", ..." if len(source.invalid_lines) > 10 else ""
        print(
            f"warning: {len(source.invalid_lines)} lines held invalid UTF-8, replaced by U+FFFD "
            f"(lines {shown}{more})",
            file=sys.stderr,
        )
    print(totals.summary(), file=sys.stderr)
    if references is not None:
        if len(references) != len(totals.hypotheses):
            raise DataError(
                f"--reference has {len(references)} lines but the input has "
                f"{len(totals.hypotheses)}"
            )
        for score in (
            metrics.bleu(totals.hypotheses, references),
            metrics.chrf(totals.hypotheses, references),
        ):
            print(score, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
