"""The fixtures of the server's tests: a tiny checkpoint, its offline translator and one real
server on it, shared by the test modules of this folder."""

import pytest

from fastnmt.translator import Translator
from tests.helpers import tiny_checkpoint


@pytest.fixture(scope="package")
def checkpoint_dir(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="package")
def offline(checkpoint_dir):
    return Translator.from_checkpoint(checkpoint_dir, precision="fp32")


@pytest.fixture(scope="package")
def server(checkpoint_dir):
    """``python -m fastnmt.serve`` on the tiny checkpoint (imported here: without the serve
    extra, the modules that use it are skipped, and this file must still load)."""
    from tests.serve.helpers import ServerProcess

    process = ServerProcess(checkpoint_dir, "--max-wait-ms", 20)
    yield process
    assert process.stop() == 0
