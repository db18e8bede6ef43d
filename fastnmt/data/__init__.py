"""Training data: parallel text (Multi30k, parallel files, TSV), vocabularies, encoded corpora with
length filtering, and token-bucketed batches; the prepared (binarized) corpus is
``fastnmt.data.prepared``.

One module per job: ``text`` (reading files), ``multi30k``, ``vocabulary``, ``corpus`` (token
arrays, encoding, filtering), ``batches``, ``files`` (writing atomically), ``prepared``. Their
names are re-exported here, except ``prepared``'s and settings such as ``multi30k.MULTI30K_URL``
that are read at call time (patch those in their own module).

Every problem with the user's data raises :class:`DataError` with a one-line message naming the file
(and line where there is one), so the command line can print it and exit with status 2.
"""

from fastnmt.data.batches import (
    Batch,
    TokenBatches,
    collate,
    make_batch,
    pack_by_tokens,
    seeded_generator,
)
from fastnmt.data.corpus import (
    FILTER_REASONS,
    EncodedCorpus,
    MappedFile,
    TokenArray,
    corpus_stats,
    count_dropped,
    encode_corpus,
    filter_codes,
    nothing_kept,
)
from fastnmt.data.files import write_atomically
from fastnmt.data.multi30k import (
    DATA_DIR_ENV,
    MULTI30K_LANGS,
    MULTI30K_SPLITS,
    download,
    load_multi30k,
    multi30k_dir,
    multi30k_file,
)
from fastnmt.data.text import (
    DataError,
    InputFile,
    PairChunk,
    PairReader,
    ParallelCorpus,
    find_side,
    not_utf8,
    read_lines,
    read_parallel,
    read_parallel_prefix,
    read_tsv,
    split_tsv_line,
)
from fastnmt.data.vocabulary import (
    VOCABULARY_FILES,
    MarianVocabulary,
    Vocabulary,
    load_vocabulary,
    vocabulary_file,
    vocabulary_from_bytes,
)

__all__ = [
    "DATA_DIR_ENV",
    "FILTER_REASONS",
    "MULTI30K_LANGS",
    "MULTI30K_SPLITS",
    "VOCABULARY_FILES",
    "Batch",
    "DataError",
    "EncodedCorpus",
    "InputFile",
    "MappedFile",
    "MarianVocabulary",
    "PairChunk",
    "PairReader",
    "ParallelCorpus",
    "TokenArray",
    "TokenBatches",
    "Vocabulary",
    "collate",
    "corpus_stats",
    "count_dropped",
    "download",
    "encode_corpus",
    "filter_codes",
    "find_side",
    "load_multi30k",
    "load_vocabulary",
    "make_batch",
    "multi30k_dir",
    "multi30k_file",
    "not_utf8",
    "nothing_kept",
    "pack_by_tokens",
    "read_lines",
    "read_parallel",
    "read_parallel_prefix",
    "read_tsv",
    "seeded_generator",
    "split_tsv_line",
    "vocabulary_file",
    "vocabulary_from_bytes",
    "write_atomically",
]
