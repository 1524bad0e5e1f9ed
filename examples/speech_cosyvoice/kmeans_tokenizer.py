"""The example's own speech tokenizer: k-means over pairs of consecutive log-mel frames (25 Hz tokens).

CosyVoice3 turns speech into 25 Hz tokens with its supervised ``speech_tokenizer_v3`` (an FSQ codebook of
6561 codes trained with an ASR objective), an official file this offline example cannot download. In its place
this module learns a small codebook from the example's own training speech: every pair of consecutive
50 Hz log-mel frames (:func:`mm_data_audio.cosyvoice.audio.log_mel`, 2 × 80 values, one 25 Hz token's worth)
is a 160-d point, and k-means (scikit-learn's ``KMeans``, seeded) places ``K`` centroids among the training
utterances' points. A token is the index of the nearest centroid (Euclidean), so a wave of ``960 · S``
samples gives ``S`` tokens and the store's ``T = 2 S`` holds by construction.

Because the centroids live in log-mel space, :meth:`KMeansSpeechTokenizer.decode` can also turn tokens back
into a (coarse) mel: the centroid's two frames. The mean distance between that and the true mel is the
quantisation floor of this tokenizer, the error a flow model that only copied centroids would make.

Unlike the official tokenizer, these tokens are acoustic (they also encode pitch and loudness, and the
boundaries of the 40 ms grid), not phonetic; real runs use the official codec, whose tokens are written
into the same store format.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

#: mel frames per token (the store's ``token_mel_ratio``)
FRAMES_PER_TOKEN = 2
N_MELS = 80


def frame_pairs(mel: npt.NDArray[np.floating] | torch.Tensor) -> npt.NDArray[np.float32]:
    """``[T, 80]`` log-mel (``T`` even) -> ``[T / 2, 160]``: each token's two frames side by side."""
    array = np.asarray(mel, dtype=np.float32)
    if array.ndim != 2 or array.shape[1] != N_MELS or array.shape[0] % FRAMES_PER_TOKEN:
        raise ValueError(f"expected a log-mel [T, {N_MELS}] with T even, got shape {list(array.shape)}")
    return array.reshape(-1, FRAMES_PER_TOKEN * N_MELS)


class KMeansSpeechTokenizer:
    """``K`` centroids ``[K, 160]`` in log-mel space (module docstring)."""

    def __init__(self, centroids: npt.NDArray[np.floating]) -> None:
        centroids = np.asarray(centroids, dtype=np.float32)
        if centroids.ndim != 2 or centroids.shape[1] != FRAMES_PER_TOKEN * N_MELS or not len(centroids):
            raise ValueError(
                f"centroids must be [K, {FRAMES_PER_TOKEN * N_MELS}], got {list(centroids.shape)}"
            )
        self.centroids = centroids

    @property
    def vocab_size(self) -> int:
        return int(self.centroids.shape[0])

    @classmethod
    def fit(
        cls, mels: list[npt.NDArray[np.floating]], k: int, seed: int
    ) -> tuple[KMeansSpeechTokenizer, float]:
        """Fit ``k`` centroids to the frame pairs of ``mels``; the tokenizer and the mean squared distance of
        a point to its centroid (per dimension)."""
        from sklearn.cluster import KMeans  # type: ignore[import-untyped]

        points = np.concatenate([frame_pairs(m) for m in mels])
        if len(points) < k:
            raise ValueError(f"k-means: {len(points)} frame pairs for {k} centroids; use fewer centroids")
        km = KMeans(n_clusters=k, n_init=3, max_iter=200, random_state=seed).fit(points)
        return cls(km.cluster_centers_), float(km.inertia_) / points.size

    def encode(self, mel: npt.NDArray[np.floating] | torch.Tensor) -> npt.NDArray[np.int64]:
        """``[T, 80]`` -> int64 ``[T / 2]``: the nearest centroid of every frame pair."""
        points = torch.from_numpy(frame_pairs(mel))
        distances = torch.cdist(points, torch.from_numpy(self.centroids))
        return distances.argmin(dim=1).numpy().astype(np.int64)

    def decode(self, tokens: npt.NDArray[np.integer] | torch.Tensor) -> npt.NDArray[np.float32]:
        """int ``[S]`` -> ``[2 S, 80]``: each token's centroid as two mel frames."""
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.ndim != 1 or (len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size)):
            raise ValueError(f"tokens must be a 1-D array of ids in [0, {self.vocab_size})")
        return self.centroids[ids].reshape(-1, N_MELS)

    def save(self, path: str | Path) -> None:
        np.save(Path(path), self.centroids)

    @classmethod
    def load(cls, path: str | Path) -> KMeansSpeechTokenizer:
        return cls(np.load(Path(path), allow_pickle=False))
