"""The rectified-flow (flow matching) objective of video diffusion transformers, drawn per sample from a seed.

For clean latents ``x0`` and Gaussian ``noise`` at noise level ``σ ∈ [0, 1]`` the model sees
``x_t = σ·noise + (1 − σ)·x0`` at timestep ``1000·σ`` and predicts the velocity ``noise − x0``; the loss is
the mean squared error between prediction and target, optionally weighted per sample.

**Sampling σ.** A base value ``u`` is uniform on [0, 1] (``timestep_sampling: uniform``) or
``sigmoid(N(logit_mean, logit_std²))`` (``logit_normal``, as in Stable Diffusion 3), then shifted
``σ = shift·u / (1 + (shift − 1)·u)`` (Wan's ``shift``/``flow_shift``: more steps at high noise for large
resolutions; ``shift: 1`` leaves ``u``). The distribution can be cut to ``[low, high)``: one expert of
Wan2.2 A14B trains only on its own noise levels. The cut is exact, by inverse transform:
``σ = F⁻¹(F(low) + v·(F(high) − F(low)))`` with ``v`` uniform and ``F`` the distribution function of σ,
so no draw is rejected and one ``v`` gives one σ.

**Seeds.** Every sample carries an integer ``noise_seed`` (from the dataset: derived from the training
seed, the epoch and the sample index, see ``mm_data_video``). A CPU generator seeded with it draws ``v`` and
then the noise, so a sample gets the same σ and noise whatever the number of ranks, the micro-batch it
lands in, the device, or whether the run was resumed.

**Dropping the text.** With ``text_dropout: p`` a sample's text embeddings are replaced by zeros with
probability ``p`` (decided by a second generator seeded from the same ``noise_seed``, so σ and the noise do
not change with ``p``): the model also learns the unconditional prediction, which classifier-free guidance
at sampling needs (``v = v(∅) + s·(v(text) − v(∅))`` with all-zero text for ``∅``). Wan and LTX-2 are
trained this way; 0 (the default) never drops.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mm_core.errors import ConfigError

SAMPLINGS = ("uniform", "logit_normal")
WEIGHTINGS = ("none", "cosmap")
#: ``timestep = TIMESTEP_SCALE · σ`` (diffusers' ``num_train_timesteps``)
TIMESTEP_SCALE = 1000.0
#: XOR-ed into a sample's ``noise_seed`` to seed its text-dropout draw (a stream apart from σ and the noise)
TEXT_STREAM = 0x5DEECE66D


@dataclass(frozen=True)
class FlowMatching:
    """How σ is drawn and how samples are weighted (``model.config_overrides.flow_matching``)."""

    timestep_sampling: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    weighting: str = "none"
    #: σ is drawn from ``[low, high)`` only (one expert's range); the whole range by default
    low: float = 0.0
    high: float = 1.0
    #: probability that a sample trains with all-zero text embeddings (classifier-free guidance)
    text_dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.timestep_sampling not in SAMPLINGS:
            raise ValueError(
                f"timestep_sampling: got {self.timestep_sampling!r}; accepted: {', '.join(SAMPLINGS)}"
            )
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: got {self.weighting!r}; accepted: {', '.join(WEIGHTINGS)}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift: got {self.shift!r}; expected a number greater than 0")
        if not (math.isfinite(self.logit_std) and self.logit_std > 0) or not math.isfinite(self.logit_mean):
            raise ValueError(
                f"logit_mean/logit_std: got {self.logit_mean!r}/{self.logit_std!r}; expected finite numbers, "
                "logit_std > 0"
            )
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ValueError(f"the σ range [{self.low}, {self.high}) must satisfy 0 <= low < high <= 1")
        if not 0.0 <= self.text_dropout < 1.0:
            raise ValueError(f"text_dropout: got {self.text_dropout!r}; expected a probability in [0, 1)")

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, key: str) -> FlowMatching:
        """Read the YAML mapping at ``key`` (unknown keys and bad values are ConfigErrors naming the key)."""
        options = dict(options or {})
        names = ("timestep_sampling", "logit_mean", "logit_std", "shift", "weighting", "text_dropout")
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: unknown key; accepted keys: {', '.join(names)}")
        for name in ("logit_mean", "logit_std", "shift", "text_dropout"):
            value = options.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f"{key}.{name}: got {value!r}; expected a number")
        try:
            return cls(**options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{key}: {exc}") from None

    # ------------------------------------------------------------------------------ the σ distribution
    def _shift(self, u: torch.Tensor) -> torch.Tensor:
        return self.shift * u / (1.0 + (self.shift - 1.0) * u)

    def _unshift(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma / (self.shift - (self.shift - 1.0) * sigma)

    def cdf(self, sigma: torch.Tensor) -> torch.Tensor:
        """``P(σ <= sigma)`` before the cut to ``[low, high)`` (float64)."""
        u = self._unshift(sigma.double())
        if self.timestep_sampling == "uniform":
            return u
        return torch.special.ndtr((torch.logit(u) - self.logit_mean) / self.logit_std)

    def quantile(self, p: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`cdf` (float64)."""
        p = p.double()
        if self.timestep_sampling == "uniform":
            u = p
        else:
            u = torch.sigmoid(self.logit_mean + self.logit_std * torch.special.ndtri(p))
        return self._shift(u)

    def sigma_of(self, v: torch.Tensor) -> torch.Tensor:
        """σ for uniform ``v`` in [0, 1), within ``[low, high)``."""
        lo, hi = self.cdf(torch.tensor(self.low)), self.cdf(torch.tensor(self.high))
        return self.quantile(lo + v.double() * (hi - lo)).clamp(self.low, self.high)

    # ----------------------------------------------------------------------------------- the draws
    def draw(self, seed: int, shape: Sequence[int]) -> tuple[float, torch.Tensor]:
        """σ and float32 noise of ``shape`` for one sample, from a CPU generator seeded with ``seed``."""
        sigma, (noise,) = self.draw_all(seed, [shape])
        return sigma, noise

    def draw_all(self, seed: int, shapes: Sequence[Sequence[int]]) -> tuple[float, list[torch.Tensor]]:
        """One σ and float32 noise for each of ``shapes`` (e.g. a sample's video and audio latents, noised at
        the same level), from one CPU generator seeded with ``seed``: σ first, then the noises in order (so
        the first noise is the one :meth:`draw` gives)."""
        g = torch.Generator()
        g.manual_seed(int(seed))
        v = torch.rand((), generator=g, dtype=torch.float64)
        noises = [torch.randn(tuple(shape), generator=g, dtype=torch.float32) for shape in shapes]
        return float(self.sigma_of(v)), noises

    def weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """Per-sample loss weights (``cosmap``: ``2 / (π (1 − 2σ + 2σ²))``, Stable Diffusion 3)."""
        if self.weighting == "cosmap":
            return 2.0 / (math.pi * (1.0 - 2.0 * sigma + 2.0 * sigma**2))
        return torch.ones_like(sigma)

    def noised(
        self, latents: torch.Tensor, seeds: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_t, sigmas, target)`` for a batch of clean ``latents`` [B, ...] and one seed per sample:
        ``x_t`` in the dtype of ``latents``, ``sigmas`` [B] and ``target = noise − x0`` in float32."""
        (x_t,), sigmas, (target,) = self.noised_all([latents], seeds)
        return x_t, sigmas, target

    def noised_all(
        self, latents: Sequence[torch.Tensor], seeds: Sequence[int]
    ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """:meth:`noised` for several latents of one batch (e.g. video and audio) at one σ per sample: the
        noised inputs, ``sigmas`` [B] and the targets, in the order of ``latents``."""
        batch = latents[0].shape[0]
        if any(x.shape[0] != batch for x in latents) or len(seeds) != batch:
            sizes = "/".join(str(x.shape[0]) for x in latents)
            raise ValueError(f"{len(seeds)} noise seeds for a batch of {sizes} samples")
        draws = [self.draw_all(s, [x.shape[1:] for x in latents]) for s in seeds]
        device = latents[0].device
        sigmas = torch.tensor([d[0] for d in draws], dtype=torch.float32, device=device)
        noised, targets = [], []
        for i, x in enumerate(latents):
            noise = torch.stack([d[1][i] for d in draws]).to(x.device)
            x0 = x.float()
            s = sigmas.to(x.device).view(-1, *([1] * (x.dim() - 1)))
            noised.append((s * noise + (1.0 - s) * x0).to(x.dtype))
            targets.append(noise - x0)
        return noised, sigmas, targets

    def text_kept(self, seeds: Sequence[int]) -> torch.Tensor:
        """Whether each sample keeps its text (bool [B]; all True when ``text_dropout`` is 0)."""
        if self.text_dropout == 0.0:
            return torch.ones(len(seeds), dtype=torch.bool)
        draws = []
        for seed in seeds:
            g = torch.Generator()
            g.manual_seed(int(seed) ^ TEXT_STREAM)
            draws.append(float(torch.rand((), generator=g, dtype=torch.float64)))
        return torch.tensor(draws, dtype=torch.float64) >= self.text_dropout

    def drop_text(self, embeddings: torch.Tensor, seeds: Sequence[int]) -> torch.Tensor:
        """``embeddings`` [B, ...] with the samples that drop their text set to zero (module docstring)."""
        if self.text_dropout == 0.0:
            return embeddings
        kept = self.text_kept(seeds).to(embeddings.device)
        return embeddings * kept.view(-1, *([1] * (embeddings.dim() - 1))).to(embeddings.dtype)

    def loss(self, prediction: torch.Tensor, target: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The mean over samples of each sample's weighted mean squared error (float32)."""
        per_sample = (prediction.float() - target).square().flatten(1).mean(dim=1)
        return (per_sample * self.weight(sigmas)).mean()
