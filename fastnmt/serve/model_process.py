"""The model in a process of its own: ``ModelProcess`` loads a ``Translator`` in a child process
and stands in for it on the server's side.

The search is Python driving short ops, so it holds the interpreter lock most of the time, and so
does the event loop while it answers requests: in one process each waits for the other
(another thread holding the lock a sixth of the time slows beam search by a tenth). In two, they
run side by side: the server's model thread calls ``translate_full`` as it would call the
Translator's, sends the batch down a pipe and waits (the lock released) while the child
translates, handing each sentence back as soon as the search has finished it.
"""

from __future__ import annotations

import gc
import multiprocessing
import pickle
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

from fastnmt.devices import configure_process
from fastnmt.serve.api import one_line
from fastnmt.translator import Translation, Translator


class ModelProcess:
    """A Translator loaded by ``load`` (picklable) in a child process, on ``threads`` threads
    (None: PyTorch's default); what the server uses of a Translator: ``vocab``,
    ``max_source_tokens``, ``max_target_tokens`` and a blocking ``translate_full``. A load that
    fails raises its error here, in one line."""

    def __init__(self, load: Callable[[], Translator], threads: int | None = None):
        context = multiprocessing.get_context("spawn")  # forking a threaded process is unsafe
        self._connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, load, threads), name="fastnmt-model", daemon=True
        )
        self.process.start()
        child.close()
        self.vocab, self.max_source_tokens, self.max_target_tokens = self._receive("loaded")

    def translate_full(
        self,
        sentences: list[Translation],
        *,
        on_translated: Callable[[int, Translation], None] | None = None,
        **options,
    ) -> list[Translation]:
        """``Translator.translate_full`` in the child; ``sentences`` are Translations with their
        source tokens, whose candidates are filled in."""
        try:
            self._connection.send((sentences, options))
        except OSError:  # the child is gone
            raise self._gone() from None
        while True:
            found = self._receive("done", "end")
            if found is None:
                return sentences
            index, candidates = found
            sentences[index].candidates = candidates
            if on_translated is not None:
                on_translated(index, sentences[index])

    def _receive(self, *expected: str):
        """The payload of the child's next message, of a kind ``expected`` ("end": None); the
        child's error raised; RuntimeError once the child has ended."""
        try:
            kind, payload = self._connection.recv()
        except (EOFError, OSError):
            raise self._gone() from None
        if kind == "error":
            raise payload
        assert kind in expected, kind
        return payload

    @property
    def ended(self) -> str | None:
        """Why the child can no longer translate, or None while it runs."""
        if self.process.is_alive():
            return None
        return f"the model's process ended (exit code {self.process.exitcode})"

    def _gone(self) -> RuntimeError:
        self.process.join(5)
        return RuntimeError(self.ended or "the model's process closed its pipe")


def _serve(connection: Connection, load: Callable[[], Translator], threads: int | None) -> None:
    """The child: load, then translate each batch sent until the server closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on Ctrl-C, with the model
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    configure_process(decoding=True)
    try:
        translator = load()
    except Exception as error:
        _send(connection, "error", ValueError(one_line(error)))
        return
    gc.freeze()  # the model and the imports live as long as the process: out of the collector's way
    limits = (translator.vocab, translator.max_source_tokens, translator.max_target_tokens)
    _send(connection, "loaded", limits)

    def hand_over(index: int, translation: Translation) -> None:
        _send(connection, "done", (index, translation.candidates))

    while True:
        try:
            sentences, options = connection.recv()
        except EOFError:  # the server has gone
            return
        try:
            translator.translate_full(sentences, on_translated=hand_over, **options)
        except Exception as error:  # the server's to answer
            _send(connection, "error", error)
            continue
        _send(connection, "end", None)


def _send(connection: Connection, kind: str, payload) -> None:
    """One message to the server; an error that does not pickle goes as a RuntimeError."""
    try:
        message = pickle.dumps((kind, payload))
    except Exception:
        message = pickle.dumps(("error", RuntimeError(one_line(payload))))
    connection.send_bytes(message)
