"""The losses of CosyVoice3's vocoder GAN (HiFi-GAN / HiFTNet style), each a mean over samples.

With ``D_k`` the score maps of the sub-discriminators and ``F_k^l`` their feature maps (see
:mod:`mm_models_cosyvoice.discriminator`), ``y`` the real wave and ``ŷ`` the generated one:

- least-squares GAN: the discriminator minimises ``Σ_k mean((1 − D_k(y))²) + mean(D_k(ŷ)²)``, the generator
  ``Σ_k mean((1 − D_k(ŷ))²)``;
- feature matching: ``2 · Σ_k Σ_l mean|F_k^l(y) − F_k^l(ŷ)|`` (the factor 2 is part of this loss in the
  official code, which weights it by 2 again);
- truncated pointwise relativistic loss (TPR, from HiFTNet / StyleTTS 2): for score maps ``a``, ``b`` and
  ``m = median(a − b)``, ``min(τ, mean over the positions where a < b + m of ((a − b) − m)²)``, summed over
  the sub-discriminators; the discriminator takes ``(D(y), D(ŷ))``, the generator ``(D(ŷ), D(y))``;
- mel: ``mean|log_mel(y) − log_mel(ŷ)|`` with the store's log-mel
  (:func:`mm_data_audio.cosyvoice.audio.log_mel`);
- pitch: ``mean|f0_predicted − f0_target|`` in Hz over all frames.

**Per sample.** The official TPR takes the median and the mean over the whole batch, which would make the
loss depend on how a global batch is split over ranks and micro-batches. Here the median, the mean and the
``min(τ, ·)`` are taken per sample and then averaged over the samples, like every other loss: a sample's
loss is then the same on any layout, and FSDP's gradient average over ranks gives the global batch's
gradient. (With one sample per batch it is the official loss, ties aside: below.) Every other loss here is
a mean over equally shaped samples, where the two agree.

**Ties.** The official mean runs over the positions with ``a < b + m``: the ``(n − 1) // 2`` positions ranked
below the lower median of the ``n`` differences, unless some tie with it. A tied position adds 0 to the sum
and 1 to the count, so the loss jumps (by about ``1 / count``) where two differences meet the median, and
float rounding decides which side it falls on: the rounding of ``b + m`` itself, or of scores computed in a
batch of another size. Measured (``tests/test_grouping.py``, the same samples in micro-batches of 2 or of 1):
a score map of 1161 positions held an exact tie at its median in one grouping only, and its TPR term moved by
1/580 (the step's TPR by 6e-4 relative). Here the mean runs over the ``(n − 1) // 2`` lowest-ranked
differences: the official value wherever no difference ties the median, and continuous in the scores
everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mm_data_audio.cosyvoice.audio import log_mel


def discriminator_adversarial(real: Sequence[torch.Tensor], fake: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ_k mean((1 − real_k)²) + mean(fake_k²)`` (score maps [B, ...])."""
    terms = [((1 - r.float()) ** 2).mean() + (f.float() ** 2).mean() for r, f in zip(real, fake)]
    return torch.stack(terms).sum()


def generator_adversarial(fake: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ_k mean((1 − fake_k)²)``."""
    return torch.stack([((1 - f.float()) ** 2).mean() for f in fake]).sum()


def feature_matching(
    real: Sequence[Sequence[torch.Tensor]], fake: Sequence[Sequence[torch.Tensor]]
) -> torch.Tensor:
    """``2 · Σ_k Σ_l mean|real_k^l − fake_k^l|`` (module docstring)."""
    terms = [(r.float() - f.float()).abs().mean() for rs, fs in zip(real, fake) for r, f in zip(rs, fs)]
    return 2 * torch.stack(terms).sum()


def tpr(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], tau: float) -> torch.Tensor:
    """The truncated pointwise relativistic loss, per sample then averaged, over the ``(n − 1) // 2``
    positions ranked below the lower median (module docstring: the official positions, ties aside)."""
    terms = []
    for a_k, b_k in zip(a, b):
        diff = (a_k.float() - b_k.float()).flatten(1)
        below = (diff.shape[1] - 1) // 2  # the rank of torch.median's (lower) median
        ranked = diff.sort(dim=1).values
        m = ranked[:, below : below + 1]
        rel = ((ranked[:, :below] - m) ** 2).sum(1) / max(below, 1)
        terms.append((tau - F.relu(tau - rel)).mean())
    return torch.stack(terms).sum()


def mel_l1(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """``mean|log_mel(real) − log_mel(fake)|`` for waves [B, L]."""
    return (log_mel(real.float()) - log_mel(fake.float())).abs().mean()


def f0_l1(predicted: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``mean|predicted − target|`` (Hz, [B, T])."""
    return (predicted.float() - target.float()).abs().mean()
