"""Corpus-level scores with sacreBLEU: detokenized cased BLEU (13a) and chrF, with signatures."""

from __future__ import annotations

from dataclasses import dataclass

import sacrebleu


@dataclass(frozen=True)
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} {self.score:.2f} ({self.signature})"


def bleu(hypotheses: list[str], references: list[str]) -> Score:
    metric = sacrebleu.BLEU()
    score = metric.corpus_score(hypotheses, [references])
    return Score("BLEU", score.score, str(metric.get_signature()))


def chrf(hypotheses: list[str], references: list[str]) -> Score:
    metric = sacrebleu.CHRF()
    score = metric.corpus_score(hypotheses, [references])
    return Score("chrF", score.score, str(metric.get_signature()))
