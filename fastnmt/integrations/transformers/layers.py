"""Fused layers for Hugging Face encoder-decoder translation models: ``apply_fastnmt(model)``.

Like Liger-Kernel's ``apply_liger_kernel_to_*``, but for the Marian/BART family, which Liger does
not cover. On the model instance (the classes stay untouched, so other models in the process are
unaffected) it:

- sets ``attn_implementation="fastnmt"`` (padding-aware fused attention, ``attention.py``);
- drops padded positions on CPUs: with a padding mask and no KV cache (training, and the encoder
  in ``generate()``), a layer packs its kept positions into (1, tokens, d) before its projections
  and FFN, and puts them back after; padded positions pass through the layer unchanged (their
  outputs are masked everywhere, as in transformers' flash-attention path). In training with
  labels the decoder's padding is the positions after each target's last label. On a GPU the
  layers stay padded (``packs``);
- makes every encoder and decoder layer run dropout + residual add + LayerNorm as one
  ``add_layer_norm`` and the feed-forward block as one ``feed_forward``; post-norm (Marian, BART:
  x = LN(x + dropout(f(x)))) or pre-norm (mBART, M2M100/NLLB, Pegasus: x = x + dropout(f(LN(x))))
  as the family computes it;
- with ``labels`` in training, computes the loss with ``linear_cross_entropy`` on the tied LM head
  and ``final_logits_bias``, never materialising the (tokens x vocabulary) logits.

Parameters, buffers, the state_dict and ``save_pretrained`` are unchanged.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from fastnmt.integrations.transformers import _version
from fastnmt.integrations.transformers.attention import (
    NAME,
    Packing,
    UnsupportedModelError,
    register,
)
from fastnmt.ops import add_layer_norm, feed_forward, linear_cross_entropy

# model_type -> pre-norm (True) or post-norm (False) layers.
FAMILIES = {"marian": False, "bart": False, "mbart": True, "m2m_100": True, "pegasus": True}
# transformers' activation_function names -> feed_forward's.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "silu": "silu", "swish": "silu"}
IGNORE_INDEX = -100  # transformers' label padding


def _family_prenorm(model: nn.Module) -> bool:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"apply_fastnmt supports model types {sorted(FAMILIES)}, got {model_type!r}"
        )
    return FAMILIES[model_type]


def _activation(config) -> str:
    name = config.activation_function
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"apply_fastnmt: activation_function must be one of {sorted(ACTIVATIONS)}, got {name!r}"
        )
    return ACTIVATIONS[name]


# ---------------------------------------------------------------------------------------------
# Packing: a layer computes its kept positions only.

# mask -> its Packing. A model passes every layer of a stack the same mask object, so the rows
# (and their host sync) are found once per stack, not once per layer.
_PACKINGS = WeakTensorKeyDictionary()


def packs(packing: bool | None, device: torch.device) -> bool:
    """Whether layers on ``device`` drop padded positions: ``packing`` when forced (True or
    False), else on CPUs only. On a CPU a step's time is its GEMMs, and padded rows cost as much
    as kept ones. On a GPU a step of a translation model is host work (each op's dispatch and
    launch, not its arithmetic), and packing adds ops: a Marian training step dispatched 2,991
    aten ops packed, 2,004 padded, against 2,479 for transformers' SDPA (6+6 tiny layers,
    3 x 12 tokens, counted on a CPU); and finding the kept rows syncs the host with the device."""
    return device.type == "cpu" if packing is None else packing


def _packing(layer: nn.Module, mask: torch.Tensor | None) -> Packing | None:
    """How ``layer`` packs the positions of its (B, L) padding mask; None when nothing is padded,
    its attention is not fastnmt's (only that one takes packed calls) or it does not pack on the
    mask's device (``packs``)."""
    if mask is None or mask.dim() != 2 or layer.self_attn.config._attn_implementation != NAME:
        return None
    if not packs(layer.fastnmt_packing, mask.device):
        return None
    if mask not in _PACKINGS:
        _PACKINGS[mask] = Packing.of(mask)
    packing = _PACKINGS[mask]
    return packing if packing.rows.numel() else None


def _packed_kwargs(kwargs: dict, queries: Packing | None, keys: Packing | None) -> dict:
    """An attention module's kwargs, with the packings its attention function must undo."""
    extra = {"fastnmt_query_packing": queries, "fastnmt_key_packing": keys}
    return kwargs | {name: packing for name, packing in extra.items() if packing is not None}


def _packed(packing: Packing | None, x: torch.Tensor | None) -> torch.Tensor | None:
    return x if packing is None or x is None else packing.pack(x)


def _unpacked(packing: Packing | None, x: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    return x if packing is None else packing.unpack(x, fill=padded)


# ---------------------------------------------------------------------------------------------
# Layers: each sublayer is (its LayerNorm, the function it wraps in a residual connection).


def _residual_sublayers(x, sublayers, prenorm: bool, dropout_p: float):
    """Post-norm: x = LN(x + dropout(f(x))) per sublayer. Pre-norm: x = x + dropout(f(LN(x))),
    each add fused with the next sublayer's LayerNorm."""
    if not prenorm:
        for norm, sublayer in sublayers:
            x = add_layer_norm(sublayer(x), x, norm.weight, norm.bias, norm.eps, dropout_p)[0]
        return x
    pending, h, p = x, None, 0.0  # the layer input is not dropped out: it is the residual
    for norm, sublayer in sublayers:
        y, h = add_layer_norm(pending, h, norm.weight, norm.bias, norm.eps, p)
        pending, p = sublayer(y), dropout_p
    return h + F.dropout(pending, dropout_p, training=dropout_p > 0)


def _feed_forward(layer, activation: str):
    def ffn(y):
        p = layer.activation_dropout if layer.training else 0.0
        fc1, fc2 = layer.fc1, layer.fc2
        return feed_forward(y, fc1.weight, fc1.bias, fc2.weight, fc2.bias, activation, p)

    return ffn


def _encoder_layer_forward(self, hidden_states, attention_mask, **kwargs):
    packing = _packing(self, attention_mask)
    kwargs = _packed_kwargs(kwargs, packing, packing)

    def self_attention(y):
        return self.self_attn(hidden_states=y, attention_mask=attention_mask, **kwargs)[0]

    sublayers = [
        (self.self_attn_layer_norm, self_attention),
        (self.final_layer_norm, _feed_forward(self, self.fastnmt_activation)),
    ]
    p = self.dropout if self.training else 0.0
    x = _residual_sublayers(_packed(packing, hidden_states), sublayers, self.fastnmt_prenorm, p)
    return _unpacked(packing, x, hidden_states)


def _decoder_layer_forward(
    self,
    hidden_states,
    attention_mask=None,
    encoder_hidden_states=None,
    encoder_attention_mask=None,
    use_cache=True,
    **kwargs,
):
    # The KV cache comes under the keyword this transformers version names it (_cache_keyword).
    cache = kwargs.pop(self.fastnmt_cache_keyword, None)
    attention_cache = {self.fastnmt_attention_cache_keyword: cache}
    # A KV cache holds (B, ...) keys and reorders them by batch entry: no packing with one.
    cached = cache is not None
    packing = None if cached else _packing(self, attention_mask)
    memory_packing = None if cached else _packing(self, encoder_attention_mask)
    memory = _packed(memory_packing, encoder_hidden_states)

    def self_attention(y):
        return self.self_attn(
            hidden_states=y,
            attention_mask=attention_mask,
            **attention_cache,
            **_packed_kwargs(kwargs, packing, packing),
        )[0]

    def cross_attention(y):
        return self.encoder_attn(
            hidden_states=y,
            key_value_states=memory,
            attention_mask=encoder_attention_mask,
            **attention_cache,
            **_packed_kwargs(kwargs, packing, memory_packing),
        )[0]

    sublayers = [(self.self_attn_layer_norm, self_attention)]
    if encoder_hidden_states is not None:
        sublayers.append((self.encoder_attn_layer_norm, cross_attention))
    sublayers.append((self.final_layer_norm, _feed_forward(self, self.fastnmt_activation)))
    p = self.dropout if self.training else 0.0
    x = _residual_sublayers(_packed(packing, hidden_states), sublayers, self.fastnmt_prenorm, p)
    return _unpacked(packing, x, hidden_states)


# The KV cache's keyword, newest name first: transformers 5.24 renamed past_key_values to cache
# (and deprecates the old name).
CACHE_KEYWORDS = ("cache", "past_key_values")


def _cache_keyword(module: nn.Module) -> str:
    """The keyword under which ``module.forward`` takes the KV cache, read from its signature
    (transformers' deprecation decorator keeps it visible through ``__wrapped__``)."""
    parameters = inspect.signature(type(module).forward).parameters
    for name in CACHE_KEYWORDS:
        if name in parameters:
            return name
    raise UnsupportedModelError(
        f"apply_fastnmt: {type(module).__name__}.forward takes its KV cache under none of "
        f"{CACHE_KEYWORDS} (transformers {_version.transformers.__version__}); fastnmt supports "
        f"transformers {_version.SUPPORTED}"
    )


def _patch_layers(model: nn.Module, prenorm: bool, activation: str, packing: bool | None) -> None:
    base = model.get_encoder().layers, model.get_decoder().layers
    for layers, forward in zip(base, (_encoder_layer_forward, _decoder_layer_forward), strict=True):
        for layer in layers:
            layer.fastnmt_prenorm, layer.fastnmt_activation = prenorm, activation
            layer.fastnmt_packing = packing
            layer.forward = types.MethodType(forward, layer)
    for layer in model.get_decoder().layers:  # the names its cache comes and goes under
        layer.fastnmt_cache_keyword = _cache_keyword(layer)
        layer.fastnmt_attention_cache_keyword = _cache_keyword(layer.self_attn)


# ---------------------------------------------------------------------------------------------
# The loss: the LM head fused with cross entropy.


def _decoder_inputs(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The family's own right shift of the labels (mBART rotates its language code to the front;
    the others prepend decoder_start_token_id)."""
    shift = sys.modules[type(model).__module__].shift_tokens_right
    config = model.config
    if "decoder_start_token_id" in inspect.signature(shift).parameters:
        return shift(labels, config.pad_token_id, config.decoder_start_token_id)
    return shift(labels, config.pad_token_id)


def _labelled_prefix(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) bool: the positions up to each row's last counted label. Nothing after it reaches
    the loss (the decoder is causal), so those are the decoder's padding."""
    positions = torch.arange(1, labels.shape[1] + 1, device=labels.device)
    last = ((labels != IGNORE_INDEX) * positions).amax(1, keepdim=True)  # 0 for no label
    return positions <= last


def fused_loss(model: nn.Module, hidden, labels, label_smoothing: float, items=None):
    """Mean label-smoothed cross entropy of ``lm_head(hidden) + final_logits_bias`` over the
    labels that are not -100 (or their sum over ``items``: transformers' ``num_items_in_batch``
    for gradient accumulation), without the logits."""
    head = model.get_output_embeddings()
    bias = getattr(model, "final_logits_bias", None)
    bias = head.bias if bias is None else bias[0]
    reduction = "mean" if items is None else "sum"
    # Only the labelled rows reach the vocabulary GEMMs: label padding is often more than half of
    # a batch's positions, and those rows would cost as much as the counted ones for a zero loss
    # and gradient. Finding them costs one host sync, far less than the GEMM rows it saves.
    labels = labels.flatten().to(hidden.device)
    counted = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    loss = linear_cross_entropy(
        hidden.flatten(0, -2).index_select(0, counted),
        head.weight,
        bias,
        labels.index_select(0, counted),
        label_smoothing,
        IGNORE_INDEX,
        reduction,
    ).loss
    return loss if items is None else loss / items


def _fused_loss_forward(self, *args, **kwargs):
    arguments = self.fastnmt_forward_signature.bind(*args, **kwargs).arguments
    arguments.update(arguments.pop("kwargs", {}))
    labels = arguments.pop("labels", None)
    if labels is None or not self.training:
        return self.fastnmt_original_forward(labels=labels, **arguments)
    from transformers.modeling_outputs import Seq2SeqLMOutput

    items = arguments.pop("num_items_in_batch", None)
    if all(arguments.get(name) is None for name in ("decoder_input_ids", "decoder_inputs_embeds")):
        arguments["decoder_input_ids"] = _decoder_inputs(self, labels)
    if arguments.get("decoder_attention_mask") is None and self.config._attn_implementation == NAME:
        arguments["decoder_attention_mask"] = _labelled_prefix(labels.to(self.device))
    arguments["use_cache"] = False
    outputs = self.model(**arguments)
    loss = fused_loss(self, outputs[0], labels, self.fastnmt_label_smoothing, items)
    return Seq2SeqLMOutput(
        loss=loss,
        logits=None,  # never formed: the point of the fused loss
        decoder_hidden_states=outputs.decoder_hidden_states,
        decoder_attentions=outputs.decoder_attentions,
        cross_attentions=outputs.cross_attentions,
        encoder_last_hidden_state=outputs.encoder_last_hidden_state,
        encoder_hidden_states=outputs.encoder_hidden_states,
        encoder_attentions=outputs.encoder_attentions,
    )


def _patch_loss(model: nn.Module, label_smoothing: float) -> None:
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if "fastnmt_original_forward" not in vars(model):
        model.fastnmt_original_forward = model.forward
        model.fastnmt_forward_signature = inspect.signature(model.forward)
    model.fastnmt_label_smoothing = label_smoothing
    model.forward = types.MethodType(_fused_loss_forward, model)


def apply_fastnmt(
    model: nn.Module,
    *,
    attention: bool = True,
    layers: bool = True,
    loss: bool = True,
    label_smoothing: float = 0.0,
    packing: bool | None = None,
) -> nn.Module:
    """Run ``model`` (a Marian/BART-family ``...ForConditionalGeneration``, or its base model for
    ``attention``/``layers``) on fastnmt's fused ops, in place; returns it.

    packing: whether the layers drop padded positions (True, False; None: on CPUs, decided at
    each call by the device of the inputs, see ``packs``).
    label_smoothing: of the fused training loss (the models' own loss has none). With
    transformers' Trainer, give it here and leave ``label_smoothing_factor`` at 0: the Trainer
    takes the labels away from the model to smooth them itself, which needs the full logits.
    Raises UnsupportedModelError (one line) for another family or activation.
    """
    if packing is not None and not isinstance(packing, bool):
        raise ValueError(f"packing must be True, False or None (on CPUs), got {packing!r}")
    prenorm = _family_prenorm(model)
    activation = _activation(model.config)
    if attention:
        register()
        model.set_attn_implementation(NAME)
    if layers:
        _patch_layers(model, prenorm, activation, packing)
    if loss and hasattr(model, "lm_head"):
        _patch_loss(model, label_smoothing)
    return model


def _for_family(model_type: str):
    def apply(model: nn.Module, **options) -> nn.Module:
        found = getattr(getattr(model, "config", None), "model_type", None)
        if found != model_type:
            raise UnsupportedModelError(f"expected a {model_type!r} model, got {found!r}")
        return apply_fastnmt(model, **options)

    apply.__name__ = apply.__qualname__ = f"apply_fastnmt_to_{model_type}"
    apply.__doc__ = f"``apply_fastnmt`` for {model_type!r} models only."
    return apply


apply_fastnmt_to_marian = _for_family("marian")
apply_fastnmt_to_bart = _for_family("bart")
apply_fastnmt_to_mbart = _for_family("mbart")
apply_fastnmt_to_m2m_100 = _for_family("m2m_100")
apply_fastnmt_to_pegasus = _for_family("pegasus")
