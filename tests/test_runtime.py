"""fastnmt.runtime: the process settings of the command-line tools."""

import os
import subprocess
import sys

import pytest

from fastnmt import runtime


def _run(code: str, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**environment, **env},
        check=True,
    )
    return result.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_keep_freed_memory_applies_on_glibc_unless_the_environment_tunes_malloc():
    code = "from fastnmt import runtime; print(runtime.keep_freed_memory())"
    assert _run(code) == "True"
    assert _run(code, MALLOC_TRIM_THRESHOLD_="131072") == "False"


def test_primitive_cache_capacity_is_a_default_the_environment_overrides(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    runtime.limit_primitive_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == runtime.PRIMITIVE_CACHE_CAPACITY
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
