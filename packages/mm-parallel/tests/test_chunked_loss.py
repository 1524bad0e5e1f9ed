"""The chunked linear + cross entropy against the plain one (full logits, ``F.cross_entropy``): loss and the
gradients of the hidden states, weight and bias in fp32, for chunk sizes that split the positions unevenly,
with ignored positions, per-position weights, a frozen weight; and the head that carries it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mm_parallel.memory.chunked_loss import ChunkedLossHead, linear_cross_entropy

VOCAB, HIDDEN = 53, 12


def _inputs(seed: int = 0, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, 11, HIDDEN, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, VOCAB, (3, 11), generator=g)
    targets[0, :4] = -100
    targets[2, -1] = -100
    return hidden, weight, b, targets


def _plain(hidden, weight, bias, targets, weights=None):
    logits = F.linear(hidden, weight, bias).float()
    losses = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    if weights is not None:
        losses = losses * weights.reshape(-1)
    return losses.sum()


def _grads(loss, tensors):
    (loss * 0.37).backward()  # a non-unit incoming gradient: the backward scales what the forward computed
    out = [t.grad.clone() if t is not None else None for t in tensors]
    for t in tensors:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("chunk", [1, 4, 7, 33, 1000])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_the_plain_loss_and_gradients(chunk, weighted):
    hidden, weight, bias, targets = _inputs()
    weights = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) if weighted else None
    tensors = (hidden, weight, bias)
    ref = _plain(hidden, weight, bias, targets, weights)
    ref_grads = _grads(ref, tensors)
    got = linear_cross_entropy(hidden, weight, bias, targets, weights, chunk_size=chunk)
    assert got.dim() == 0 and got.dtype == torch.float32
    torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-6)
    for name, a, b in zip(("hidden", "weight", "bias"), _grads(got, tensors), ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_frozen_weight_and_no_bias():
    hidden, weight, _, targets = _inputs(bias=False)
    weight.requires_grad_(False)
    ref_h = _grads(_plain(hidden, weight, None, targets), (hidden,))[0]
    got = linear_cross_entropy(hidden, weight, None, targets, chunk_size=5)
    got_h = _grads(got, (hidden,))[0]
    torch.testing.assert_close(got_h, ref_h, rtol=1e-5, atol=1e-6)
    assert weight.grad is None


def test_no_grad_and_every_position_ignored():
    hidden, weight, bias, targets = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            linear_cross_entropy(hidden, weight, bias, targets, chunk_size=4),
            _plain(hidden, weight, bias, targets),
        )
    none = torch.full_like(targets, -100)
    loss = linear_cross_entropy(hidden, weight, bias, none, chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad is not None and not hidden.grad.any() and not weight.grad.any()


def test_bad_shapes_are_named():
    hidden, weight, bias, targets = _inputs()
    with pytest.raises(ValueError, match="one target per position"):
        linear_cross_entropy(hidden, weight, bias, targets[:, :5])
    with pytest.raises(ValueError, match="weights of shape"):
        linear_cross_entropy(hidden, weight, bias, targets, torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, bias, targets, chunk_size=0)


def test_head_keeps_parameters_and_is_linear_outside_the_loss():
    emb = nn.Embedding(VOCAB, HIDDEN)
    linear = nn.Linear(HIDDEN, VOCAB, bias=False)
    linear.weight = emb.weight  # tied, as in models with tie_word_embeddings
    head = ChunkedLossHead.replacing(linear, chunk_size=4)
    assert head.weight is emb.weight and head.bias is None
    assert list(head.state_dict()) == ["weight"]
    hidden, _, _, targets = _inputs()
    torch.testing.assert_close(head(hidden), linear(hidden))
    with head.computing_loss(targets):
        loss = head(hidden)
        assert head.calls == 1
        with pytest.raises(RuntimeError, match="called twice"):
            head(hidden)
    torch.testing.assert_close(loss, _plain(hidden, emb.weight, None, targets))
    assert head(hidden).shape == (3, 11, VOCAB)  # the plain layer again
    loss.backward()
    assert emb.weight.grad is not None
    with pytest.raises(TypeError, match="plain nn.Linear"):
        ChunkedLossHead.replacing(head, chunk_size=4)


def test_backward_twice_is_refused():
    hidden, weight, bias, targets = _inputs()
    loss = linear_cross_entropy(hidden, weight, bias, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()
