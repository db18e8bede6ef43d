r"""Position-wise feed-forward block: ``feed_forward(x, w1, b1, w2, b2, activation, dropout_p)``.

Math, for x (M, K) (all leading dimensions flattened into M tokens), W1 (F, K), W2 (N, F):

    a = x W1^T + b1            (M, F)   pre-activation
    z = act(a) * keep / (1-p)  (M, F)   act = ReLU or GELU (erf form, as nn.GELU())
    y = z W2^T + b2            (M, N)

Backward, given dy:

    dW2 = dy^T z,  db2 = sum_rows dy,  dz = dy W2
    da  = dz * keep / (1-p) * act'(a)         ReLU: act' = [a > 0]; GELU: Phi(a) + a phi(a)
    dW1 = da^T x,  db1 = sum_rows da,  dx = da W1

Weights use ``nn.Linear``'s (out_features, in_features) layout so a module's parameters pass as
they are. This file holds the PyTorch reference (the fallback and the test oracle); fused kernels
register themselves as further backends of the same dispatch entry.
"""

from __future__ import annotations

import torch.nn.functional as F

from fastnmt import _checks, dispatch

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}

# ---------------------------------------------------------------------------------------------
# PyTorch reference: Linear, activation, Dropout, Linear.
# ---------------------------------------------------------------------------------------------


def feed_forward_reference(x, w1, b1, w2, b2, activation, dropout_p):
    hidden = ACTIVATIONS[activation](F.linear(x, w1, b1))  # (..., F)
    if dropout_p > 0.0:
        hidden = F.dropout(hidden, p=dropout_p)
    return F.linear(hidden, w2, b2)  # (..., N)


# ---------------------------------------------------------------------------------------------
# Argument checks and the registered op.
# ---------------------------------------------------------------------------------------------


def _check_linear(prefix: str, weight, bias, in_features: int, in_name: str, like, like_name):
    _checks.tensor(f"w{prefix}", weight, ndim=2, floating=True)
    if weight.shape[1] != in_features:
        raise ValueError(
            f"w{prefix} must have shape (out_features, {in_features}) to take {in_name}, got "
            f"{tuple(weight.shape)}"
        )
    _checks.same_device(f"w{prefix}", weight, like_name, like)
    if bias is not None:
        _checks.tensor(f"b{prefix}", bias, floating=True)
        _checks.shape(f"b{prefix}", bias, (weight.shape[0],), f"w{prefix}'s out_features")
        _checks.same_device(f"b{prefix}", bias, like_name, like)
    if not _checks.autocasting(like.device):
        _checks.same_dtype(f"w{prefix}", weight, like_name, like)
        if bias is not None:
            _checks.same_dtype(f"b{prefix}", bias, like_name, like)


def _prepare(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    _checks.tensor("x", x, floating=True)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the features)")
    _check_linear("1", w1, b1, x.shape[-1], "x's last dimension", x, "x")
    _check_linear("2", w2, b2, w1.shape[0], "w1's out_features", x, "x")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    prepared = dict(
        x=x,
        w1=w1,
        b1=b1,
        w2=w2,
        b2=b2,
        activation=activation,
        dropout_p=_checks.probability("dropout_p", dropout_p),
    )
    return x.device, prepared


FEED_FORWARD = dispatch.define("feed_forward", _prepare)
FEED_FORWARD.register("reference")(feed_forward_reference)


def feed_forward(x, w1, b1, w2, b2, activation="relu", dropout_p=0.0):
    """``Linear(w1, b1) -> activation -> dropout -> Linear(w2, b2)`` on the last dimension of x.

    Args:
        x: (..., K).
        w1, b1: (F, K) and (F,) or None; w2, b2: (N, F) and (N,) or None (nn.Linear layout).
        activation: "relu" or "gelu".
        dropout_p: dropout after the activation (pass 0.0 in evaluation).

    Returns:
        (..., N)
    """
    return FEED_FORWARD(x, w1, b1, w2, b2, activation, dropout_p)
