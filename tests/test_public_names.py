"""The names users call, listed once: a move inside the package cannot drop one unnoticed.

Every ``python -m fastnmt.X`` command answers ``--help``."""

import importlib
import os
import runpy
import subprocess
import sys
import warnings

import pytest

PUBLIC = {
    "fastnmt": [
        "BACKENDS",
        "BackendUnavailableError",
        "Translator",
        "backend",
        "environment",
        "explain",
        "extension_available",
        "extension_status",
        "ops",
    ],
    "fastnmt.ops": [
        "CrossEntropyOutput",
        "add_layer_norm",
        "attention",
        "attention_probabilities",
        "attention_varlen",
        "dropout_seeds",
        "feed_forward",
        "gather_cache_rows",
        "linear_cross_entropy",
        "log_softmax_topk",
        "sample_token",
    ],
    "fastnmt.attention": [
        "KVCache",
        "MultiheadAttention",
        "Packed",
        "scaled_dot_product_attention",
        "swap_multihead_attention",
    ],
    "fastnmt.integrations.transformers": [
        "FAMILIES",
        "NAME",
        "Packing",
        "UnsupportedModelError",
        "apply_fastnmt",
        "apply_fastnmt_to_bart",
        "apply_fastnmt_to_m2m_100",
        "apply_fastnmt_to_marian",
        "apply_fastnmt_to_mbart",
        "apply_fastnmt_to_pegasus",
        "fastnmt_attention_forward",
        "fused_loss",
        "register",
    ],
    "fastnmt.translator": ["Candidate", "Translation", "Translator", "load_checkpoint"],
    "fastnmt.client": ["Client", "ServerError"],
    "fastnmt.serve": ["app_from_environment", "create_app", "main"],
    "fastnmt.devices": ["autocast", "configure_process", "resolve_device"],
    "fastnmt.model": ["ModelConfig", "Transformer", "preset"],
}
COMMANDS = [
    "compile_check",
    "evaluate",
    "export",
    "preprocess",
    "score",
    "serve",
    "shortlist",
    "train",
    "translate",
]


def importable(*modules: str) -> bool:
    try:
        for module in modules:
            importlib.import_module(module)
    except ImportError:
        return False
    return True


# The GPU machine has no serve extra.
SERVE_EXTRA_MISSING = not importable("fastapi", "prometheus_client", "pydantic", "uvicorn")


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_are_importable(module):
    if module == "fastnmt.serve" and SERVE_EXTRA_MISSING:
        with pytest.raises(ImportError, match=r'pip install "fastnmt\[serve\]"'):
            importlib.import_module(module)
        return
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lost {missing}"


@pytest.mark.parametrize("module", ["fastnmt", "fastnmt.ops", "fastnmt.integrations.transformers"])
def test_all_lists_exactly_the_public_names(module):
    assert sorted(importlib.import_module(module).__all__) == sorted(PUBLIC[module])


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "compile_check"])  # compiles
def test_every_command_answers_help(command, monkeypatch, capsys):
    if command == "serve" and SERVE_EXTRA_MISSING:
        pytest.skip("its extra is not installed: test_serve_without_its_extra_says_so_in_one_line")
    monkeypatch.setattr(sys, "argv", [f"fastnmt.{command}", "--help"])
    with pytest.raises(SystemExit) as exit_info, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        runpy.run_module(f"fastnmt.{command}", run_name="__main__")
    assert exit_info.value.code == 0
    assert f"fastnmt.{command}" in capsys.readouterr().out


def test_serve_without_its_extra_says_so_in_one_line(tmp_path):
    """``python -m fastnmt.serve`` where fastapi cannot be imported (a package that raises, put
    first on the path): one line naming the extra, no traceback."""
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n"
    )
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    result = subprocess.run(
        [sys.executable, "-m", "fastnmt.serve", "--help"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "python -m fastnmt.serve: error: fastnmt.serve needs the serve extra "
        "(pip install \"fastnmt[serve]\"): No module named 'fastapi'"
    ]
