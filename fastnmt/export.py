"""``python -m fastnmt.export --checkpoint DIR --format ctranslate2 --output OUT``: a fastnmt
checkpoint as a CTranslate2 model directory, for deployments built on CTranslate2 (as OpenNMT-py
and fairseq models are converted to it). ``--format huggingface``: as a Hugging Face Marian
directory that transformers loads (``MarianMTModel``, ``MarianTokenizer``; the mapping and what
Marian cannot express are in ``fastnmt.integrations.transformers.export``).

The mapping onto CTranslate2's Transformer specification:

    fastnmt                              CTranslate2 (TransformerSpec)
    embedding (V, E), tied               encoder/decoder embeddings and the decoder projection
    output_bias (imported Marian)        decoder projection bias
    positions (sinusoidal / Marian /     position_encodings.encodings: fastnmt's own table, so
      fairseq layouts)                   every layout gives the same vectors
    scale_embedding                      scale_embeddings (x sqrt(E))
    prenorm / post-norm                  pre_norm; encoder_norm / decoder_norm -> layer_norm
    self_attn.in_proj (3E, E)            self_attention.linear[0] (fused q, k, v)
    cross_attn.in_proj                   attention.linear[0] (q) and linear[1] (fused k, v)
    out_proj                             linear[-1]
    *_norm before/after a sublayer       that sublayer's layer_norm (its place set by pre_norm)
    ffn.linear1 / linear2, activation    ffn.linear_0 / linear_1, relu | gelu | swish
    sentencepiece pieces (pad 0, bos 1,  the source and target vocabularies; the source gets
      eos 2, unk 3)                      eos appended, the decoder starts from <s>

CTranslate2 takes sentencepiece pieces, not text: ``to_pieces`` and ``from_pieces`` tokenize and
detokenize around it, and ``search_options`` bans what fastnmt's search never generates
(docs/export.md). ``ctranslate2`` and ``transformers`` are optional dependencies (the
``ctranslate2`` and ``transformers`` extras). Exit codes: 0 done, 2 bad input or checkpoint, 130
Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from fastnmt.cli import UsageError, check_output_path, run_command
from fastnmt.data import Vocabulary
from fastnmt.model import ModelConfig, position_table
from fastnmt.translator import is_pretrained_directory, load_checkpoint

FORMATS = ("ctranslate2", "huggingface")
QUANTIZATIONS = (
    "float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16",
    "bfloat16",
)  # fmt: skip
ACTIVATIONS = {"relu": "RELU", "gelu": "GELU", "silu": "SWISH", "swish": "SWISH"}
LAYER_NORM_EPS = 1e-5  # fastnmt's add_layer_norm default, which the model uses


def _ctranslate2():
    try:
        import ctranslate2
    except ImportError:
        raise UsageError(
            'the CTranslate2 export needs ctranslate2: pip install "fastnmt[ctranslate2]"'
        ) from None
    return ctranslate2


def load_for_export(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], Vocabulary]:
    """The model config, fp32 weights and vocabulary of a fastnmt checkpoint (or training output
    directory: its best checkpoint)."""
    if is_pretrained_directory(path):
        raise UsageError(
            f"{path} is a Hugging Face model already (CTranslate2 converts it itself: "
            "ct2-transformers-converter --model DIR)"
        )
    model, vocab = load_checkpoint(path)
    return model.cfg, model.state_dict(), vocab


def _linear(spec, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    spec.weight = weight.contiguous().numpy()
    if bias is not None:
        spec.bias = bias.contiguous().numpy()


def _layer_norm(spec, weights: dict, name: str) -> None:
    spec.gamma = weights[f"{name}.weight"].numpy()
    spec.beta = weights[f"{name}.bias"].numpy()


def _attention(spec, weights: dict, name: str, self_attention: bool) -> None:
    w, b = weights[f"{name}.in_proj_weight"], weights[f"{name}.in_proj_bias"]
    if self_attention:
        _linear(spec.linear[0], w, b)  # q, k, v fused, as in_proj already is
    else:
        width = w.shape[1]
        _linear(spec.linear[0], w[:width], b[:width])  # q, from the decoder
        _linear(spec.linear[1], w[width:], b[width:])  # k, v fused, from the encoder output
    _linear(spec.linear[-1], weights[f"{name}.out_proj.weight"], weights[f"{name}.out_proj.bias"])


def _feed_forward(spec, weights: dict, name: str) -> None:
    _linear(spec.linear_0, weights[f"{name}.linear1.weight"], weights[f"{name}.linear1.bias"])
    _linear(spec.linear_1, weights[f"{name}.linear2.weight"], weights[f"{name}.linear2.bias"])


def _stack_inputs(spec, cfg: ModelConfig, embedding, table) -> None:
    embeddings = spec.embeddings if isinstance(spec.embeddings, list) else [spec.embeddings]
    for embeddings_spec in embeddings:
        embeddings_spec.weight = embedding
    spec.scale_embeddings = cfg.scale_embedding
    spec.position_encodings.encodings = table


def ctranslate2_spec(cfg: ModelConfig, weights: dict, vocab: Vocabulary):
    """The CTranslate2 TransformerSpec of a fastnmt model (the mapping in the module docstring)."""
    ctranslate2 = _ctranslate2()
    specs = ctranslate2.specs
    if cfg.activation not in ACTIVATIONS:
        raise UsageError(f"activation {cfg.activation!r} has no CTranslate2 equivalent")
    spec = specs.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.heads,
        pre_norm=cfg.prenorm,
        activation=getattr(specs.Activation, ACTIVATIONS[cfg.activation]),
    )
    embedding = weights["embedding.weight"].numpy()
    table = position_table(cfg).numpy()
    for stack in (spec.encoder, spec.decoder):
        _stack_inputs(stack, cfg, embedding, table)
    output_bias = weights["output_bias"] if cfg.output_bias else None
    _linear(spec.decoder.projection, weights["embedding.weight"], output_bias)
    if cfg.prenorm:
        _layer_norm(spec.encoder.layer_norm, weights, "encoder_norm")
        _layer_norm(spec.decoder.layer_norm, weights, "decoder_norm")
    for i, layer in enumerate(spec.encoder.layer):
        prefix = f"encoder.{i}"
        _attention(layer.self_attention, weights, f"{prefix}.self_attn", self_attention=True)
        _layer_norm(layer.self_attention.layer_norm, weights, f"{prefix}.self_attn_norm")
        _feed_forward(layer.ffn, weights, f"{prefix}.ffn")
        _layer_norm(layer.ffn.layer_norm, weights, f"{prefix}.ffn_norm")
    for i, layer in enumerate(spec.decoder.layer):
        prefix = f"decoder.{i}"
        _attention(layer.self_attention, weights, f"{prefix}.self_attn", self_attention=True)
        _layer_norm(layer.self_attention.layer_norm, weights, f"{prefix}.self_attn_norm")
        _attention(layer.attention, weights, f"{prefix}.cross_attn", self_attention=False)
        _layer_norm(layer.attention.layer_norm, weights, f"{prefix}.cross_attn_norm")
        _feed_forward(layer.ffn, weights, f"{prefix}.ffn")
        _layer_norm(layer.ffn.layer_norm, weights, f"{prefix}.ffn_norm")
    pieces = vocab.pieces(range(len(vocab)))
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    spec.config.add_source_eos = True  # fastnmt's sources end with eos
    spec.config.bos_token = spec.config.decoder_start_token = pieces[vocab.bos_id]
    spec.config.eos_token = pieces[vocab.eos_id]
    spec.config.unk_token = pieces[vocab.unk_id]
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    return spec


def to_pieces(vocab: Vocabulary, sentences: list[str]) -> list[list[str]]:
    """The source tokens CTranslate2 takes for ``sentences`` (it appends eos itself)."""
    return [vocab.pieces(ids) for ids in vocab.encode(sentences)]


def search_options(vocab: Vocabulary) -> dict:
    """The CTranslate2 ``translate_batch`` options that search as fastnmt does: pad and bos are
    never generated."""
    return {"suppress_sequences": [vocab.pieces([vocab.pad_id]), vocab.pieces([vocab.bos_id])]}


def from_pieces(vocab: Vocabulary, hypotheses: list[list[str]]) -> list[str]:
    """The text of CTranslate2's output tokens."""
    index = {piece: i for i, piece in enumerate(vocab.pieces(range(len(vocab))))}
    return vocab.decode([[index[piece] for piece in tokens] for tokens in hypotheses])


def _check_output(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise UsageError(f"--output {output} exists; pass --force to replace it")


def export_ctranslate2(
    checkpoint_path: str | Path, output: str | Path, quantization: str = "float32", force=False
) -> Path:
    """Write the CTranslate2 model directory of a fastnmt checkpoint; returns its path."""
    if quantization not in QUANTIZATIONS:
        raise UsageError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    output = Path(output)
    _check_output(output, force)
    cfg, weights, vocab = load_for_export(Path(checkpoint_path))
    spec = ctranslate2_spec(cfg, weights, vocab)

    class _Converter(_ctranslate2().converters.Converter):
        def _load(self):
            return spec

    return Path(_Converter().convert(str(output), quantization=quantization, force=force))


def _marian_export():
    try:
        from fastnmt.integrations.transformers import UnsupportedModelError, export
    except ImportError as error:
        raise UsageError(f"the Hugging Face export: {error}") from None
    return export, UnsupportedModelError


def export_huggingface(checkpoint_path: str | Path, output: str | Path, force=False) -> Path:
    """Write the Hugging Face Marian directory of a fastnmt checkpoint; returns its path. The
    directory appears complete or not at all (written beside it, then renamed)."""
    output = Path(output)
    _check_output(output, force)
    export, unsupported = _marian_export()
    cfg, weights, vocab = load_for_export(Path(checkpoint_path))
    output.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        export.save_marian(cfg, weights, vocab, temporary)
        temporary.chmod(0o755)  # mkdtemp makes it private; a model directory is meant to be shared
        if output.exists():
            shutil.rmtree(output)
        os.rename(temporary, output)
    except unsupported as error:
        raise UsageError(f"cannot export {checkpoint_path} to Marian: {error}") from None
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return output


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fastnmt.export",
        description="Export a fastnmt checkpoint as a CTranslate2 model directory or a Hugging "
        "Face Marian directory.",
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint or training output directory")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--output", required=True, help="the model directory to write")
    p.add_argument(
        "--quantization",
        default="float32",
        choices=QUANTIZATIONS,
        help="CTranslate2's weights (default fp32); a Hugging Face export is fp32",
    )
    p.add_argument("--force", action="store_true", help="replace --output if it exists")
    return p


def run(args) -> int:
    check_output_path(args.output, "--output", folder=True)
    if args.format == "huggingface":
        if args.quantization != "float32":
            raise UsageError("--quantization is for --format ctranslate2")
        path = export_huggingface(args.checkpoint, args.output, args.force)
        print(f"wrote {path} (Hugging Face Marian)", file=sys.stderr)
        return 0
    path = export_ctranslate2(args.checkpoint, args.output, args.quantization, args.force)
    print(f"wrote {path} (CTranslate2, {args.quantization})", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
