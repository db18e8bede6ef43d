"""Decoding speed: sentences/s and target tokens/s translating Multi30k test_2016_flickr.

Rows: greedy and beam 4, batches of 32 and 64 sentences or the Translator's default batching, the
fused path (auto: the C++ kernels on a CPU) and the reference path, the KV cache against
recomputing the whole prefix every step, and fp32 weights against bf16 ones (packed GEMMs or
not) and int8 GEMMs (``fastnmt.quantize``). Groups of their own: sampling against greedy,
scoring the pairs against beam-4 translation, and an ensemble of two against one model.
Beside them, CTranslate2 (when installed) on the same model exported by ``fastnmt.export``, in
a process of its own: float32 and int8, batches of 32 sentences or of 6,000 tokens, 2 threads,
the same beam, length penalty and bans (pad, bos); every row reports BLEU. The "interleaved
ratios" group measures the targets' ratios (sampling against greedy, scoring against beam 4 with
CTranslate2's scoring beside it, beam 4 against CTranslate2's faster row) in FASTNMT_BENCH_ROUNDS
rounds (3) that run every row in turn.

A trained model gives realistic output lengths: set FASTNMT_BENCH_CHECKPOINT=DIR to translate all
1,000 sentences with it. Without one, a randomly initialised ``tiny`` model (the same size)
translates the first SUBSET sentences with every output forced to its source's length (no eos),
so rows still compare like for like; ``extra_info["model"]`` says which. CTranslate2 has no
per-sentence length limit: on the random model it suppresses eos too and stops at the batch's
longest source, so compare its target tokens/s there, and sentences/s on a trained model.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fastnmt
from fastnmt import checkpoint, export, metrics, shortlist
from fastnmt.data import Vocabulary, load_multi30k
from fastnmt.decoding.next_token import Sampling
from fastnmt.model import Transformer, preset
from fastnmt.translator import Translator, load_checkpoint

SUBSET = 200  # sentences translated by the random model
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"
PATHS = ("fused", "reference")
DEFAULT = "default"  # the Translator's own batching: up to 6,000 source tokens, 256 sentences
ROWS = [  # (search, batch, path, cache); batches of 1: a sentence at a time, as a server's
    *[(s, b, p, "kv-cache") for s in ("greedy", "beam4") for b in (32, 64) for p in PATHS],
    *[(s, 1, "fused", "kv-cache") for s in ("greedy", "beam4")],
    *[(s, b, "fused", c) for s in ("greedy", "beam4") for b in (64, DEFAULT)
      for c in ("kv-cache", "recompute") if (b, c) != (64, "kv-cache")],
]  # fmt: skip


def _data_dir() -> Path | None:
    if os.environ.get("FASTNMT_DATA_DIR") or not SHARED_DATA.exists():
        return None  # $FASTNMT_DATA_DIR, or the download cache
    return SHARED_DATA


CT2_ROWS = [  # (search, compute type, batching)
    (s, c, b) for s in ("greedy", "beam4") for c in ("float32", "int8")
    for b in ("32 sentences", "6000 tokens")
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Translator, list[str], dict]:
    """(translator, source sentences, options of translate_full that fix the model's kind);
    the info also holds the references and the model's checkpoint path."""
    test = load_multi30k("test_2016_flickr", "en", "de", _data_dir())
    path = os.environ.get("FASTNMT_BENCH_CHECKPOINT")
    if path:
        translator = Translator.from_checkpoint(path)
        info = {"model": f"checkpoint {path}", "checkpoint": path}
        return translator, test.src, {**info, "references": test.tgt}
    vocab = Vocabulary.train(test.src + test.tgt, 8000)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=len(vocab))).eval().requires_grad_(False)
    config = {"model": model.cfg.to_dict()}
    saved = checkpoint.Checkpoint(model.state_dict(), config, vocab.to_bytes(), None)
    path = checkpoint.write(tmp_path_factory.mktemp("random-tiny"), "checkpoint", saved)
    translator = Translator.from_checkpoint(path)  # as a user's: packed at precision auto
    fixed = {"eos": False, "max_len_a": 1.0, "max_len_b": 0}  # output length = source length
    info = {"model": "random tiny, output length = source length (eos suppressed)", **fixed}
    info.update(checkpoint=path, references=test.tgt[:SUBSET])
    return translator, test.src[:SUBSET], info


SETUP_KEYS = ("model", "checkpoint", "references")  # of the info, not options of the search


@pytest.mark.benchmark(group="translate")
@pytest.mark.parametrize(("search", "batch", "path", "cache"), ROWS, ids=lambda v: str(v))
def test_translate(benchmark, setup, search, batch, path, cache):
    translator, sentences, info = setup
    defaults = translator.max_sentences, translator.max_tokens
    options = _search_options(info, search)
    options.update(incremental=cache == "kv-cache")
    if batch != DEFAULT:
        translator.max_sentences, translator.max_tokens = batch, 1 << 30
    try:
        with fastnmt.backend("reference" if path == "reference" else "auto"):
            _measure(benchmark, translator, sentences, options, info["references"])
    finally:  # the translator is shared by the module's rows
        translator.max_sentences, translator.max_tokens = defaults
    benchmark.extra_info.update(model=info["model"], batch_sentences=batch, path=path, cache=cache)


@pytest.mark.benchmark(group="translate")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16 unpacked", "int8"])
@pytest.mark.parametrize("search", ["greedy", "beam4"])
def test_translate_precision(benchmark, setup, search, precision):
    """The Translator's default batching with fp32 weights, bf16 weights (packed GEMMs where the
    CPU has native bf16; "unpacked": F.linear's), or int8 GEMMs (fastnmt.quantize)."""
    _, sentences, info = setup
    if precision == "bf16 unpacked":
        translator = Translator(*load_checkpoint(info["checkpoint"]), dtype=torch.bfloat16)
    else:
        path = info["checkpoint"]
        translator = Translator.from_checkpoint(path, device="cpu", precision=precision)
    _measure(benchmark, translator, sentences, _search_options(info, search), info["references"])
    benchmark.extra_info.update(model=info["model"], batch_sentences=DEFAULT, precision=precision)


@pytest.mark.benchmark(group="translate")
@pytest.mark.parametrize("search", ["greedy", "beam4"])
def test_translate_shortlist(benchmark, setup, search, tmp_path_factory):
    """int8 with a vocabulary shortlist (fastnmt.shortlist, default sizes) built from the
    training output's prepared corpus."""
    _, sentences, info = setup
    prepared = Path(info["checkpoint"]) / "prepared"
    if not prepared.is_dir():
        pytest.skip("needs FASTNMT_BENCH_CHECKPOINT=a training output directory (its prepared/)")
    path = tmp_path_factory.mktemp("shortlist") / "shortlist.st"
    assert shortlist.main(["--prepared-dir", str(prepared), "--output", str(path)]) == 0
    translator = Translator.from_checkpoint(info["checkpoint"], precision="int8", shortlist=path)
    _measure(benchmark, translator, sentences, _search_options(info, search), info["references"])
    benchmark.extra_info.update(model=info["model"], precision="int8", shortlist=True)


def _search_options(info: dict, search: str) -> dict:
    options = {k: v for k, v in info.items() if k not in SETUP_KEYS}
    return {**options, "beam": 1 if search == "greedy" else 4}


def _measure(benchmark, translator, sentences, options, references) -> None:
    """Time one translation of ``sentences`` after a warm-up; speed and BLEU into extra_info."""
    results = {}

    def run():
        started = time.perf_counter()
        translations = translator.translate_full(sentences, **options)
        results["seconds"] = time.perf_counter() - started
        results["tokens"] = sum(len(t.candidates[0].tokens) for t in translations)
        results["texts"] = [t.text for t in translations]

    translator.translate(sentences[:64], **options)  # warm-up: kernels, allocator
    benchmark.pedantic(run, rounds=1, iterations=1)
    seconds = results["seconds"]
    benchmark.extra_info.update(
        search="greedy" if options["beam"] == 1 else f"beam{options['beam']}",
        dtype=str(translator.model.embedding.weight.dtype).removeprefix("torch."),
        packed_gemms=type(translator.model.packed_output).__name__,
        sentences=len(sentences),
        target_tokens=results["tokens"],
        sentences_per_s=round(len(sentences) / seconds, 1),
        target_tokens_per_s=round(results["tokens"] / seconds),
        bleu=round(metrics.bleu(results["texts"], references).score, 2),
    )


SAMPLINGS = {
    "greedy": None,
    "sampling top-10": Sampling("topk", topk=10, seed=0),
    "sampling top-p 0.9": Sampling("topp", topp=0.9, seed=0),
    "sampling unrestricted": Sampling(seed=0),
}


@pytest.mark.benchmark(group="sampling")
@pytest.mark.parametrize("search", SAMPLINGS)
def test_sampling(benchmark, setup, search):
    """Sampling against greedy search (the goal: at least 0.9x greedy's sentences/s), the
    Translator's default batching: one token a step either way."""
    translator, sentences, info = setup
    options = {**_search_options(info, "greedy"), "sampling": SAMPLINGS[search]}
    _measure(benchmark, translator, sentences, options, info["references"])
    benchmark.extra_info.update(model=info["model"], search=search)


@pytest.mark.benchmark(group="scoring")
@pytest.mark.parametrize("task", ["score", "beam4"])
def test_scoring(benchmark, setup, task):
    """Scoring the source/reference pairs (teacher-forced, the fused loss) against translating
    the same sources with beam 4 (the goal: at least 5x the sentences/s)."""
    translator, sentences, info = setup
    if task == "beam4":
        _measure(benchmark, translator, sentences, _search_options(info, task), info["references"])
    else:
        references = info["references"]
        translator.score(sentences[:64], references[:64])  # warm-up
        results = {}

        def run():
            started = time.perf_counter()
            translator.score(sentences, references)
            results["seconds"] = time.perf_counter() - started

        benchmark.pedantic(run, rounds=1, iterations=1)
        rate = len(sentences) / results["seconds"]
        benchmark.extra_info.update(sentences=len(sentences), sentences_per_s=round(rate, 1))
    benchmark.extra_info.update(model=info["model"], task=task)


@pytest.mark.benchmark(group="ensemble")
@pytest.mark.parametrize("models", [1, 2])
def test_ensemble(benchmark, setup, models):
    """Beam 4 with one model and with an ensemble of two (the goal: the pair at least 0.45x one
    model's sentences/s). The second model: FASTNMT_BENCH_ENSEMBLE=DIR, else the first's
    checkpoint loaded again (the same cost; the pair translates as the model alone)."""
    translator, sentences, info = setup
    members = [translator.model, _second_model(translator, info)][:models]
    ensemble = Translator(members, translator.vocab, dtype=translator.model.embedding.weight.dtype)
    options = _search_options(info, "beam4")
    _measure(benchmark, ensemble, sentences, options, info["references"])
    benchmark.extra_info.update(model=info["model"], models=models)


def _second_model(translator: Translator, info: dict) -> Transformer:
    """Loaded as the first was (its packed GEMMs cannot be deep-copied)."""
    path = os.environ.get("FASTNMT_BENCH_ENSEMBLE", info["checkpoint"])
    return Translator.from_checkpoint(path, device=translator.device).model


@pytest.fixture(scope="module")
def ctranslate2_dirs(setup, tmp_path_factory) -> dict[str, Path]:
    """The setup's model exported to CTranslate2, per compute type."""
    pytest.importorskip("ctranslate2")
    folder = tmp_path_factory.mktemp("ctranslate2")
    path = setup[2]["checkpoint"]
    return {q: export.export_ctranslate2(path, folder / q, q) for q in ("float32", "int8")}


# CTranslate2 runs in a process of its own, as it is deployed: in fastnmt's process, once it had
# translated, fastnmt's beam 4 ran 1.4x slower (its memory and threads are the process's too).
# Its task: translate (inputs: the sources' pieces) or score (the sources' and targets' pieces).
CT2_WORKER = """
import json, sys
import ctranslate2
model_dir, compute_type = sys.argv[1:3]
engine = ctranslate2.Translator(model_dir, "cpu", compute_type=compute_type, intra_threads=2)
task, inputs, options = json.loads(sys.stdin.readline())
def run(part):
    if task == "translate":
        return [r.hypotheses[0] for r in engine.translate_batch(inputs[part], **options)]
    sources, targets = inputs
    return [sum(r.log_probs) for r in engine.score_batch(sources[part], targets[part], **options)]
run(slice(64))  # warm-up
print(ctranslate2.__version__, flush=True)
for _ in sys.stdin:
    print(json.dumps(run(slice(None))), flush=True)
"""


class Ctranslate2Process:
    """CTranslate2 running one task on one input on request, in a child process; calling it
    returns the best hypothesis' pieces of each sentence (translate) or each pair's summed
    log-probability (score)."""

    def __init__(self, model_dir: Path, compute_type: str, task: str, inputs: list, options: dict):
        self.process = subprocess.Popen(
            [sys.executable, "-c", CT2_WORKER, str(model_dir), compute_type],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._send(json.dumps([task, inputs, options]))
        self.version = self.process.stdout.readline().strip()  # once warmed up

    def _send(self, line: str) -> None:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def __call__(self) -> list:
        self._send("run")
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


@pytest.fixture
def ctranslate2_processes():
    """``start(model_dir, compute_type, task, inputs, options)``: a warmed-up
    ``Ctranslate2Process`` (closed after the test)."""
    started: list[Ctranslate2Process] = []

    def start(*arguments) -> Ctranslate2Process:
        started.append(Ctranslate2Process(*arguments))
        return started[-1]

    yield start
    for process in started:
        process.close()


@pytest.fixture
def ctranslate2_engines(setup, ctranslate2_dirs, ctranslate2_processes):
    """``start(search, compute_type, batching)``: a warmed-up ``Ctranslate2Process`` translating
    the setup's sentences."""

    def start(search: str, compute_type: str, batching: str) -> Ctranslate2Process:
        translator, sentences, info = setup
        vocab = translator.vocab
        size, kind = batching.split()
        options = dict(
            beam_size=1 if search == "greedy" else 4,
            length_penalty=1.0,
            max_batch_size=int(size),
            batch_type="examples" if kind == "sentences" else "tokens",
            **export.search_options(vocab),
        )
        if "eos" in info:  # the random model: no eos, the longest source's length (docstring)
            options["suppress_sequences"].append(vocab.pieces([vocab.eos_id]))
            options["max_decoding_length"] = max(len(ids) + 1 for ids in vocab.encode(sentences))
        tokens = export.to_pieces(vocab, sentences)
        return ctranslate2_processes(ctranslate2_dirs[compute_type], compute_type, "translate",
                                     tokens, options)  # fmt: skip

    return start


@pytest.mark.benchmark(group="translate")
@pytest.mark.parametrize(("search", "compute_type", "batching"), CT2_ROWS, ids=str)
def test_ctranslate2(benchmark, setup, ctranslate2_engines, search, compute_type, batching):
    _, sentences, info = setup
    translate = ctranslate2_engines(search, compute_type, batching)
    results = {}

    def run():
        started = time.perf_counter()
        results["hypotheses"] = translate()
        results["seconds"] = time.perf_counter() - started

    benchmark.pedantic(run, rounds=1, iterations=1)
    seconds, hypotheses = results["seconds"], results["hypotheses"]
    produced = sum(len(h) for h in hypotheses)
    texts = export.from_pieces(setup[0].vocab, hypotheses)
    benchmark.extra_info.update(
        model=info["model"],
        engine=f"ctranslate2 {translate.version}",
        search=search,
        compute_type=compute_type,
        batching=batching,
        sentences=len(sentences),
        target_tokens=produced,
        sentences_per_s=round(len(sentences) / seconds, 1),
        target_tokens_per_s=round(produced / seconds),
        bleu=round(metrics.bleu(texts, info["references"]).score, 2),
    )


# The targets' ratios, each from one interleaved run: RATIO_ROUNDS rounds in which every row runs
# once, in turn, each ratio taken within its round. A shared machine's speed drifts over minutes,
# so rows timed minutes apart (the groups above) can differ by more than a target's margin.
RATIO_ROUNDS = int(os.environ.get("FASTNMT_BENCH_ROUNDS", "3"))


def _interleaved(benchmark, runs: dict[str, Callable[[], object]]) -> dict[str, list[float]]:
    """Each run's seconds in every round (the runs warmed up by their makers)."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}

    def rounds():
        for _ in range(RATIO_ROUNDS):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)

    benchmark.pedantic(rounds, rounds=1, iterations=1)
    return seconds


def _record_ratios(benchmark, seconds: dict, sentences: int, baseline: str, goal: str) -> None:
    """A row per run: its median sentences/s and the median over rounds of its speed relative
    to ``baseline``'s in the same round."""
    for name, times in seconds.items():
        relative = statistics.median(b / t for b, t in zip(seconds[baseline], times, strict=True))
        benchmark.extra_info[name] = {
            "sentences_per_s": round(sentences / statistics.median(times), 1),
            f"speed_vs_{baseline.replace(' ', '_')}": round(relative, 3),
        }
    benchmark.extra_info.update(goal=goal, rounds=RATIO_ROUNDS)


@pytest.mark.benchmark(group="interleaved ratios")
def test_ratio_sampling(benchmark, setup):
    """Sampling's speed against greedy search's (the goal: at least 0.9x)."""
    translator, sentences, info = setup
    runs = {}
    for name, sampling in SAMPLINGS.items():
        options = {**_search_options(info, "greedy"), "sampling": sampling}
        translator.translate(sentences[:64], **options)  # warm-up
        runs[name] = functools.partial(translator.translate, sentences, **options)
    seconds = _interleaved(benchmark, runs)
    _record_ratios(benchmark, seconds, len(sentences), "greedy", "sampling >= 0.9x greedy")
    benchmark.extra_info["model"] = info["model"]


@pytest.mark.benchmark(group="interleaved ratios")
def test_ratio_scoring(benchmark, setup, request):
    """Scoring the pairs against beam-4 translation of their sources (the goal: at least 5x);
    beside them, when installed, CTranslate2's ``score_batch`` of the same pairs (float32 and
    int8, batches of 6,000 tokens)."""
    translator, sentences, info = setup
    references, options = info["references"], _search_options(info, "beam4")
    translator.translate(sentences[:64], **options)  # warm-up
    translator.score(sentences[:64], references[:64])
    runs: dict[str, Callable[[], object]] = {
        "beam4": functools.partial(translator.translate, sentences, **options),
        "score": functools.partial(translator.score, sentences, references),
    }
    if importlib.util.find_spec("ctranslate2"):
        dirs = request.getfixturevalue("ctranslate2_dirs")
        start = request.getfixturevalue("ctranslate2_processes")
        pairs = [export.to_pieces(translator.vocab, side) for side in (sentences, references)]
        for compute_type in ("float32", "int8"):
            runs[f"ctranslate2 {compute_type} score"] = start(
                dirs[compute_type], compute_type, "score", pairs,
                dict(max_batch_size=6000, batch_type="tokens"),
            )  # fmt: skip
    seconds = _interleaved(benchmark, runs)
    _record_ratios(benchmark, seconds, len(sentences), "beam4", "score >= 5x beam4")
    benchmark.extra_info["model"] = info["model"]


@pytest.mark.benchmark(group="interleaved ratios")
def test_ratio_ctranslate2(benchmark, setup, ctranslate2_engines):
    """Beam 4 at the Translator's defaults (precision auto) against CTranslate2's faster of
    float32 and int8 in batches of 6,000 tokens, per round (the goal: at least 2x)."""
    translator, sentences, info = setup
    options = _search_options(info, "beam4")
    translator.translate(sentences[:64], **options)  # warm-up
    runs: dict[str, Callable[[], object]] = {
        "fastnmt auto": functools.partial(translator.translate, sentences, **options)
    }
    for compute_type in ("float32", "int8"):
        runs[f"ctranslate2 {compute_type}"] = ctranslate2_engines(
            "beam4", compute_type, "6000 tokens"
        )
    seconds = _interleaved(benchmark, runs)
    ct2 = zip(seconds["ctranslate2 float32"], seconds["ctranslate2 int8"], strict=True)
    seconds["ctranslate2 best"] = [min(pair) for pair in ct2]
    _record_ratios(benchmark, seconds, len(sentences), "ctranslate2 best", "fastnmt >= 2x")
    benchmark.extra_info["model"] = info["model"]
