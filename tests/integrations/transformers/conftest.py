import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()
