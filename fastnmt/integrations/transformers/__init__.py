"""fastnmt inside Hugging Face transformers (>= 5.0): ``pip install "fastnmt[transformers]"``.

Three uses:

- ``attn_implementation="fastnmt"`` for any model whose attention goes through transformers'
  attention registry (importing this module registers it): ``AutoModel.from_pretrained(name,
  attn_implementation="fastnmt")``;
- ``apply_fastnmt(model)``: the Marian/BART-family layers, attention and loss on fastnmt's fused
  ops (``layers.py``);
- ``fastnmt.Translator.from_pretrained(directory)``: Opus-MT (Marian) and NLLB/M2M100 checkpoints
  translated by fastnmt's own model and beam search (``convert.py``).
"""

from __future__ import annotations

# First: importing it raises a one-line ImportError without a supported transformers.
from fastnmt.integrations.transformers import _version  # noqa: F401
from fastnmt.integrations.transformers.attention import (
    NAME,
    Packing,
    UnsupportedModelError,
    fastnmt_attention_forward,
    register,
)
from fastnmt.integrations.transformers.layers import (
    FAMILIES,
    apply_fastnmt,
    apply_fastnmt_to_bart,
    apply_fastnmt_to_m2m_100,
    apply_fastnmt_to_marian,
    apply_fastnmt_to_mbart,
    apply_fastnmt_to_pegasus,
    fused_loss,
)

register()

__all__ = [
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
]
