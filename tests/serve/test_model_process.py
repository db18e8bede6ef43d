"""The model's own process: it translates as the Translator does in process, handing each
sentence over once; a failed load or batch raises its error in the server's process, in one
line, and the child goes on; a child that dies fails the server's probes and its requests."""

import functools
import os
import signal
import time

import pytest

from fastnmt.translator import Translation, Translator
from tests.serve.helpers import SERVE_EXTRA, ServerProcess
from tests.test_translator import SENTENCES

httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)


@pytest.fixture(scope="module")
def model_process(checkpoint_dir):
    from fastnmt.serve import ModelProcess

    process = ModelProcess(functools.partial(Translator.load, checkpoint_dir, precision="fp32"))
    yield process
    process.process.kill()


def _encoded(translator, texts: list[str]) -> list[Translation]:
    encoded = translator.vocab.encode(texts)
    return [Translation(text, tokens) for text, tokens in zip(texts, encoded, strict=True)]


def test_it_translates_as_the_translator_does_handing_each_sentence_over_once(
    model_process, offline
):
    handed = []
    found = model_process.translate_full(
        _encoded(model_process, SENTENCES), beam=2, nbest=2,
        on_translated=lambda index, translation: handed.append((index, translation.candidates)),
    )  # fmt: skip
    expected = [t.candidates for t in offline.translate_full(SENTENCES, beam=2, nbest=2)]
    assert [t.candidates for t in found] == expected
    assert sorted(handed) == sorted(enumerate(expected))
    assert model_process.vocab.encode(SENTENCES) == offline.vocab.encode(SENTENCES)
    assert model_process.max_source_tokens == offline.max_source_tokens
    assert model_process.max_target_tokens == offline.max_target_tokens


def test_a_failed_batch_raises_its_error_here_and_the_child_goes_on(model_process, offline):
    with pytest.raises(ValueError, match=r"prefix of line 1: .* past the length limit"):
        model_process.translate_full(_encoded(model_process, ["Dogs."]), prefix=["x " * 500])
    [found] = model_process.translate_full(_encoded(model_process, ["Dogs."]), beam=1)
    assert found.text == offline.translate(["Dogs."], beam=1)[0]
    assert model_process.ended is None


def test_a_load_that_fails_raises_a_one_line_error(tmp_path):
    from fastnmt.serve import ModelProcess

    with pytest.raises(ValueError) as raised:
        ModelProcess(functools.partial(Translator.load, tmp_path / "none"))
    assert str(raised.value) and "\n" not in str(raised.value)


def _spawned_children(pid: int) -> list[int]:
    """The processes that multiprocessing spawned for ``pid`` (not its resource tracker)."""
    children = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                spawned = b"spawn_main" in cmdline.read()
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if parent == pid and spawned:
            children.append(int(entry))
    return children


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="finds the child in /proc (Linux)")
def test_a_model_process_that_dies_fails_the_probes_and_the_requests(checkpoint_dir):
    server = ServerProcess(checkpoint_dir, "--no-access-log")
    try:
        [child] = _spawned_children(server.process.pid)
        os.kill(child, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while server.client.ready() and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert health.json()["error"] == "the model's process ended (exit code -9)"
        answer = server.post({"text": "Dogs."})
        assert answer.status_code == 503 and "model's process ended" in answer.json()["error"]
    finally:
        assert server.stop() == 0


def test_a_hugging_face_checkpoint_translates_as_in_process(tmp_path):
    """An Opus-MT-like checkpoint: its vocabulary travels to the server's process."""
    pytest.importorskip("transformers", reason="Hugging Face checkpoints need transformers")
    from fastnmt.serve import ModelProcess
    from tests.integrations.transformers.models import marian_directory

    directory = marian_directory(tmp_path)
    offline = Translator.load(directory, precision="fp32")
    process = ModelProcess(functools.partial(Translator.load, directory, precision="fp32"))
    try:
        texts = [s for s in SENTENCES if s.strip()]
        found = process.translate_full(_encoded(process, texts), beam=2)
        assert [t.text for t in found] == offline.translate(texts, beam=2)
    finally:
        process.process.kill()
