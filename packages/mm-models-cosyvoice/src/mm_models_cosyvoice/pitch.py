"""A pitch (F0) target for the vocoder's pitch predictor when the data carries none: YIN, per mel frame.

The official recipe computes F0 with pyworld (Harvest + StoneMask) in its data pipeline. The speech store
holds no pitch, and pyworld is not a dependency of mm, so the ``cosyvoice_vocoder`` task estimates it from
the real audio crop with YIN (de Cheveigné & Kawahara, 2002), in torch, once per step:

1. one analysis frame per mel frame ``t``: a window of ``W = 960`` samples (40 ms) centred on sample
   ``480·t + 240`` (the wave is zero-padded at both ends), compared with itself shifted by up to
   ``sr / fmin`` samples;
2. the difference function ``d(τ) = Σ_j (x_j − x_{j+τ})²`` over the window (energies from cumulative sums,
   the cross term by FFT), normalised by its cumulative mean: ``d'(τ) = d(τ) · τ / Σ_{k=1..τ} d(k)``;
3. the pitch period is the first lag in ``[sr / fmax, sr / fmin]`` where ``d'`` drops below ``threshold``,
   moved on to the bottom of that dip and refined by a parabola through its neighbours; ``f0 = sr / τ``.
   A frame without such a dip, or nearly silent, is unvoiced: 0 Hz (as pyworld reports it).

Everything runs in float64 on each sample independently, so a sample's target does not depend on the batch
it is in. A batch field ``f0`` [B, T] (Hz), when a collator provides one, replaces the estimate.
"""

from __future__ import annotations

import torch

SAMPLE_RATE = 24000
HOP = 480
WINDOW = 960
FMIN, FMAX = 50.0, 600.0
THRESHOLD = 0.15
#: frames whose mean square is below this are unvoiced (about -60 dBFS)
SILENCE = 1e-6


def estimate_f0(
    wave: torch.Tensor,
    sample_rate: int = SAMPLE_RATE,
    hop: int = HOP,
    fmin: float = FMIN,
    fmax: float = FMAX,
    threshold: float = THRESHOLD,
) -> torch.Tensor:
    """YIN pitch of ``wave`` [B, L] per frame of ``hop`` samples: [B, L // hop] in Hz, 0 where unvoiced
    (module docstring). float32, on the wave's device."""
    x = wave.detach().to(torch.float64)
    batch, length = x.shape
    frames = length // hop
    lag_min, lag_max = int(sample_rate // fmax), int(sample_rate // fmin)
    span = WINDOW + lag_max + 1  # the window and every lag (one more for the parabola)
    left = WINDOW // 2 - hop // 2
    padded = torch.nn.functional.pad(x, (left, span))
    segs = padded.unfold(-1, span, hop)[:, :frames]  # [B, T, span]; the window is centred on hop·t + hop/2
    ref = segs[..., :WINDOW]
    n = 1 << (span + WINDOW - 1).bit_length()
    cross = torch.fft.irfft(torch.fft.rfft(ref, n).conj() * torch.fft.rfft(segs, n), n)[..., : lag_max + 2]
    squares = torch.nn.functional.pad(segs.square().cumsum(-1), (1, 0))
    lags = torch.arange(lag_max + 2, device=x.device)
    energy_ref = squares[..., WINDOW : WINDOW + 1]
    energy_lag = squares[..., lags + WINDOW] - squares[..., lags]
    diff = (energy_ref + energy_lag - 2 * cross).clamp(min=0.0)
    running = diff[..., 1:].cumsum(-1)
    cmnd = torch.ones_like(diff)
    cmnd[..., 1:] = diff[..., 1:] * lags[1:] / running.clamp(min=1e-12)
    search = cmnd[..., lag_min : lag_max + 1]  # lags lag_min..lag_max
    below = search < threshold
    first = below.to(torch.int64).argmax(-1, keepdim=True)
    idx = torch.arange(search.shape[-1], device=x.device)
    nxt = cmnd[..., lag_min + 1 : lag_max + 2]
    bottom = ((idx >= first) & (nxt >= search)).to(torch.int64).argmax(-1, keepdim=True)
    lag = bottom + lag_min
    a = cmnd.gather(-1, lag - 1)
    b = cmnd.gather(-1, lag)
    c = cmnd.gather(-1, lag + 1)
    curve = a - 2 * b + c
    shift = torch.where(curve > 0, (a - c) / (2 * curve.clamp(min=1e-12)), torch.zeros_like(curve))
    period = lag.to(torch.float64) + shift.clamp(-1.0, 1.0)
    f0 = (sample_rate / period).squeeze(-1)
    voiced = below.any(-1) & (energy_ref.squeeze(-1) / WINDOW > SILENCE)
    return torch.where(voiced, f0, torch.zeros_like(f0)).to(torch.float32)
