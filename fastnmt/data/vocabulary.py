"""Vocabularies: the joint sentencepiece model fastnmt trains, an Opus-MT (Marian) checkpoint's
tokenizer, and the bytes either is saved as in checkpoints and prepared data."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

import sentencepiece as spm

from fastnmt.data.files import write_atomically
from fastnmt.data.text import DataError


class Vocabulary:
    """Joint sentencepiece model; ids: pad=0, bos=1, eos=2, unk=3."""

    def __init__(self, processor: spm.SentencePieceProcessor, model: bytes):
        self._processor = processor
        self._model = model
        self.pad_id = processor.pad_id()
        self.bos_id = processor.bos_id()
        self.eos_id = processor.eos_id()
        self.unk_id = processor.unk_id()
        self._specials = {self.pad_id, self.bos_id, self.eos_id}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8000, *, seed: int = 1) -> Vocabulary:
        """Train a BPE model on ``texts`` (source and target sentences together).

        BPE, as in the OpenNMT-py baseline this package is measured against (joint BPE 8k), so
        that vocabularies compare like for like. character_coverage 1.0 keeps every character of
        the training text (no <unk> on it). ``vocab_size`` is an upper bound: small data gets the
        vocabulary it supports instead of an error. Training uses all sentences in order, so the
        same texts give the same model byte for byte.
        """
        texts = list(texts)
        if not any(texts):
            raise DataError("cannot train a vocabulary: the training text is empty")
        # The seed matters only where sentencepiece samples; fixed anyway so no run depends on it.
        spm.set_random_generator_seed(seed)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(texts),
                model_writer=model,
                model_type="bpe",
                vocab_size=vocab_size,
                hard_vocab_limit=False,
                character_coverage=1.0,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                pad_id=0,
                bos_id=1,
                eos_id=2,
                unk_id=3,
                minloglevel=2,
            )
        except RuntimeError as error:
            # sentencepiece's message starts with its source location; keep the readable part.
            reason = str(error).splitlines()[0].rpartition("] ")[2].strip()
            raise DataError(f"cannot train a vocabulary of size {vocab_size}: {reason}") from None
        return cls.from_bytes(model.getvalue())

    @classmethod
    def from_bytes(cls, model: bytes) -> Vocabulary:
        processor = spm.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model)
        except RuntimeError:
            raise DataError("not a sentencepiece model") from None
        if min(processor.pad_id(), processor.bos_id(), processor.eos_id()) < 0:
            # Batches need all three; a model trained elsewhere with the defaults has no pad.
            raise DataError("the sentencepiece model lacks a pad, bos or eos piece")
        return cls(processor, model)

    def to_bytes(self) -> bytes:
        return self._model

    def save(self, path: str | Path) -> None:
        """Write the .model file (atomically, as checkpoints are written)."""
        write_atomically(Path(path), self._model)

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return _read_vocabulary(path, cls.from_bytes)

    def __len__(self) -> int:
        return self._processor.get_piece_size()

    # One sentence at a time: sentencepiece's list calls start a thread pool per call, which
    # costs ~100-180 us against ~5 us for encoding one short sentence (translating sentence by
    # sentence made that a visible share of decoding).

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Token ids per sentence, without bos/eos."""
        return _each_or_all(self._processor.encode, list(sentences), out_type=int)

    def encode_target(self, sentences: list[str]) -> list[list[int]]:
        """Target-side ids: one joint model for both sides, so ``encode``'s."""
        return self.encode(sentences)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Text per id sequence: everything from the first eos on is dropped, as are pad and bos,
        so raw decoder output can be passed in."""
        return _each_or_all(self._processor.decode, [self._strip(sequence) for sequence in ids])

    def _strip(self, ids: list[int]) -> list[int]:
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return [i for i in ids if i not in self._specials]

    def pieces(self, ids: list[int]) -> list[str]:
        """The subword string of each id, for attention plots."""
        return [self._processor.id_to_piece(i) for i in ids]


# Lists of at least this many texts are (de)tokenized in one call, on sentencepiece's threads: half
# the time of a call per text on two cores (2,000 sentences: 8.9 ms against 19.8), where a shorter
# list pays more for starting the threads (about 50 µs a call) than it saves.
_THREADED = 128


def _each_or_all(method: Callable, items: list, **options) -> list:
    """``method`` (a SentencePieceProcessor's encode or decode) of each of ``items``: in one
    threaded call for a long list, else a call each."""
    if len(items) >= _THREADED:
        return method(items, **options)
    return [method(item, **options) for item in items]


def _language_code(sentence: str) -> tuple[list[str], str]:
    """([">>code<<"], the rest) for a sentence starting with a target language code, else
    ([], sentence): Marian's multi-target models take the code as one token."""
    if sentence.startswith(">>") and (end := sentence.find("<<")) != -1:
        return [sentence[: end + 2]], sentence[end + 2 :]
    return [], sentence


class MarianVocabulary:
    """An Opus-MT (Marian) checkpoint's tokenizer, without transformers: source text split by its
    source.spm, target text by its target.spm, pieces mapped to ids by the vocab.json both sides
    share, as transformers' ``MarianTokenizer`` does (a leading ``>>lang<<`` code of a
    multi-target model is one token; a piece vocab.json lacks is <unk>). The decoder starts from
    ``bos_id`` (Marian's: pad). Serialised (``to_bytes``) as a zip of the three files and the
    special ids, written byte-identically each time: prepared data and checkpoints compare it by
    hash."""

    FILES = ("source.spm", "target.spm", "vocab.json")
    SPECIALS = "specials.json"

    def __init__(self, files: dict[str, bytes], bos_id: int):
        self.files = {name: files[name] for name in self.FILES}
        self._source, self._target = (
            spm.SentencePieceProcessor(model_proto=files[name]) for name in self.FILES[:2]
        )
        self._ids: dict[str, int] = json.loads(files["vocab.json"])
        self.pad_id, self.eos_id, self.unk_id = map(self._special, ("<pad>", "</s>", "<unk>"))
        self.bos_id = bos_id
        self._pieces = {i: piece for piece, i in self._ids.items()}
        specials = {self.pad_id, self.bos_id, self.eos_id, self.unk_id}
        self._text_pieces = {i: p for i, p in self._pieces.items() if i not in specials}

    def _special(self, piece: str) -> int:
        if piece not in self._ids:
            raise DataError(f"vocab.json has no {piece} piece")
        return self._ids[piece]

    @classmethod
    def from_directory(cls, directory: str | Path, bos_id: int) -> MarianVocabulary:
        """The tokenizer files of a saved Marian checkpoint (``save_pretrained``'s layout)."""
        directory = Path(directory)
        if (directory / "target_vocab.json").exists():
            raise DataError(
                f"{directory}: separate source and target vocabularies are not supported "
                "(fastnmt's model shares one embedding)"
            )
        files = {}
        for name in cls.FILES:
            try:
                files[name] = (directory / name).read_bytes()
            except OSError:
                raise DataError(f"{directory / name}: file not found") from None
        return cls(files, bos_id)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            specials = json.dumps({"bos_id": self.bos_id}).encode()
            for name, data in [*self.files.items(), (self.SPECIALS, specials)]:
                archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> MarianVocabulary:
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                files = {name: archive.read(name) for name in (*cls.FILES, cls.SPECIALS)}
            bos_id = json.loads(files[cls.SPECIALS])["bos_id"]
            return cls(files, bos_id)
        except (zipfile.BadZipFile, KeyError, ValueError, RuntimeError) as error:
            raise DataError(f"not a Marian tokenizer archive ({error})") from None

    def __len__(self) -> int:
        return max(self._ids.values()) + 1

    def _encode(self, processor, sentences: list[str]) -> list[list[int]]:
        split = [_language_code(sentence) for sentence in sentences]
        pieces = _each_or_all(processor.encode, [text for _, text in split], out_type=str)
        ids, unk = self._ids, self.unk_id
        return [
            [ids.get(piece, unk) for piece in code + rest]
            for (code, _), rest in zip(split, pieces, strict=True)
        ]

    def encode(self, sentences: list[str]) -> list[list[int]]:
        """Source ids per sentence, without eos."""
        return self._encode(self._source, sentences)

    def encode_target(self, sentences: list[str]) -> list[list[int]]:
        """Target ids per sentence, without eos."""
        return self._encode(self._target, sentences)

    def decode(self, ids: list[list[int]]) -> list[str]:
        """Target text per id sequence, up to its first eos, without special pieces (as
        ``MarianTokenizer.decode(skip_special_tokens=True)``)."""
        texts = []
        for sequence in ids:
            if self.eos_id in sequence:
                sequence = sequence[: sequence.index(self.eos_id)]
            pieces = [self._text_pieces[i] for i in sequence if i in self._text_pieces]
            texts.append(self._target.decode_pieces(pieces).replace("\u2581", " ").strip())
        return texts

    def pieces(self, ids: list[int]) -> list[str]:
        return [self._pieces.get(i, "<unk>") for i in ids]


_ZIP_MAGIC = b"PK\x03\x04"
# The file a vocabulary's bytes are saved as (checkpoints, prepared data): joint, Marian.
VOCABULARY_FILES = ("spm.model", "marian_vocabulary.zip")


def vocabulary_file(data: bytes) -> str:
    return VOCABULARY_FILES[data.startswith(_ZIP_MAGIC)]


def vocabulary_from_bytes(data: bytes) -> Vocabulary | MarianVocabulary:
    """The vocabulary ``to_bytes`` wrote: a joint sentencepiece model, or a Marian tokenizer."""
    if data.startswith(_ZIP_MAGIC):
        return MarianVocabulary.from_bytes(data)
    return Vocabulary.from_bytes(data)


def load_vocabulary(path: str | Path) -> Vocabulary | MarianVocabulary:
    """The vocabulary file a checkpoint or prepared directory holds, of either kind."""
    return _read_vocabulary(path, vocabulary_from_bytes)


def _read_vocabulary(path: str | Path, parse):
    path = Path(path)
    try:
        return parse(path.read_bytes())
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except DataError as error:
        raise DataError(f"{path}: {error}") from None
