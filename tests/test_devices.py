"""fastnmt.devices: the process settings of the command-line tools."""

import os
import subprocess
import sys

import pytest

from fastnmt import devices


def _run(code: str, **env) -> str:
    """``code``'s output in a fresh interpreter, with ``env`` over this environment (None
    removes a variable) and glibc's MALLOC_* variables removed."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={k: v for k, v in {**environment, **env}.items() if v is not None},
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_applies_on_glibc_unless_the_environment_tunes_malloc():
    code = "from fastnmt import devices; print(devices.keep_freed_memory())"
    assert _run(code) == "True"
    assert _run(code, MALLOC_TRIM_THRESHOLD_="131072") == "False"


def test_primitive_cache_capacity_is_a_default_the_environment_overrides(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    devices.limit_primitive_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == devices.TRAINING_PRIMITIVE_CACHE_CAPACITY
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


def test_translating_processes_keep_a_cache_for_every_decoding_shape():
    """Decoding meets hundreds of GEMM shapes in turn: the training cap would rebuild them."""
    code = "from fastnmt import devices; import os; devices.configure_process({}); "
    code += "print(os.environ['LRU_CACHE_CAPACITY'], os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    clean = {"LRU_CACHE_CAPACITY": None, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": None}
    for decoding, capacity in ((True, "1024"), (False, "64")):
        assert _run(code.format(f"decoding={decoding}"), **clean) == f"{capacity} {capacity}"
