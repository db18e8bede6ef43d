"""Attention heat maps (PNG, matplotlib) and hard alignments of a translation.

Attention comes from ``Translator.translate_full(..., attention=True)`` (or ``add_attention``):
exact probabilities of every layer and head, from the fused path's log-sum-exp or the reference
path. Rows of a cross-attention map are the generated target subwords (and eos), columns the
source subwords and eos.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt
import torch

from fastnmt.data import Vocabulary
from fastnmt.translator import Translation

EOS = "</s>"


def labels(translation: Translation, vocab: Vocabulary) -> tuple[list[str], list[str]]:
    """(source, target) subword labels of the attention axes, eos included where it is."""
    best = translation.candidates[0]
    source = [*vocab.pieces(translation.source_tokens), EOS]
    target = vocab.pieces(best.tokens) + ([EOS] if best.ended else [])
    return source, target


def plot_attention(
    translation: Translation,
    vocab: Vocabulary,
    directory: str | Path,
    name: str = "sentence",
    *,
    self_attention: bool = False,
) -> list[Path]:
    """Write ``{name}.cross.layer{L}.png`` (one grid of heads per decoder layer) and, with
    ``self_attention``, ``{name}.encoder.layer{L}.png`` and ``{name}.decoder.layer{L}.png``
    into ``directory``; return the paths."""
    if translation.attention is None:
        raise ValueError("translation has no attention: translate with attention=True")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    source, target = labels(translation, vocab)
    kinds = [("cross", translation.attention.cross, target, source)]
    if self_attention:
        kinds.append(("encoder", translation.attention.encoder, source, source))
        kinds.append(("decoder", translation.attention.decoder, target, target))
    paths = []
    for kind, layers, rows, columns in kinds:
        for layer, weights in enumerate(layers, 1):
            path = directory / f"{name}.{kind}.layer{layer}.png"
            _heat_map_grid(weights, rows, columns, f"{name}: {kind}-attention, layer {layer}", path)
            paths.append(path)
    return paths


def _heat_map_grid(weights: torch.Tensor, rows, columns, title: str, path: Path) -> None:
    """One heat map per head of ``weights`` (H, len(rows), len(columns)), side by side."""
    heads = weights.shape[0]
    cell = 0.28  # inches per token, so labels stay readable for long sentences
    width = max(3.0, cell * len(columns) + 1.2)
    height = max(3.0, cell * len(rows) + 1.5)
    figure, axes = plt.subplots(1, heads, figsize=(width * heads, height), squeeze=False)
    for head, axis in enumerate(axes[0]):
        axis.imshow(weights[head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="equal")
        axis.set_title(f"head {head + 1}")
        axis.set_xticks(range(len(columns)), columns, rotation=90, fontsize=8)
        axis.set_yticks(range(len(rows)), rows, fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def hard_alignment(translation: Translation, layer: int = -1) -> list[tuple[int, int]]:
    """(source index, target index) pairs, 0-based: for each generated target subword, the source
    subword it attends to most (cross-attention of ``layer`` averaged over heads). Source and
    target eos are left out."""
    if translation.attention is None:
        raise ValueError("translation has no attention: translate with attention=True")
    weights = translation.attention.cross[layer].mean(dim=0)  # (T, S)
    targets = len(translation.candidates[0].tokens)
    sources = len(translation.source_tokens)
    if not sources:
        return []
    best = weights[:targets, :sources].argmax(dim=1)  # (T,)
    return [(source, target) for target, source in enumerate(best.tolist())]


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """Alignment in the Pharaoh format of fast_align and Moses: "0-0 1-2 ..." (source-target)."""
    return " ".join(f"{source}-{target}" for source, target in pairs)
