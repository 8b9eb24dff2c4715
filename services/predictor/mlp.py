"""g_θ: MLP regression of a cache draft's accepted length from φ_t, MSE. HVD starts from 2 × 256;
the bundled predictor is 2 × 64, which matched 2 × 256 on held-out traces at a quarter of the
per-cycle cost (bench/results/predictor_width.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from services.predictor.features import FEATURES


class YieldMLP(nn.Module):
    def __init__(self, n_features: int = len(FEATURES), hidden: int = 256, layers: int = 2):
        super().__init__()
        dims = [n_features] + [hidden] * layers
        mods: list[nn.Module] = []
        for a, b in zip(dims, dims[1:]):
            mods += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*mods, nn.Linear(dims[-1], 1))
        self.register_buffer("mean", torch.zeros(n_features))
        self.register_buffer("std", torch.ones(n_features))

    mean: torch.Tensor  # buffers: the features' normalisation, fitted with the weights
    std: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1)

    def predict(self, phi: np.ndarray) -> np.ndarray:
        """[N, F] or [F] features → predicted accepted lengths. Runs in numpy on a copy of
        the weights (refreshed whenever a parameter changes): the router calls it once per
        cycle on one row, where torch's per-op overhead made it ~5× slower."""
        layers = self._np()
        h = np.atleast_2d(phi).astype(np.float32, copy=False)
        for i, (w, b) in enumerate(layers):
            h = h @ w
            h += b
            if i < len(layers) - 1:
                np.maximum(h, 0.0, out=h)
        return h[:, 0]

    def _np(self) -> list:
        """numpy [(Wᵀ, b)] per layer with the input normalisation folded into the first
        ((x − μ)/σ · W = x · W/σ − μ/σ · W), re-made when a tensor changed in place
        (optimizer steps, load_state_dict: both bump the tensor's version)."""
        if getattr(self, "_np_tensors", None) is None:
            self._np_tensors = (*self.parameters(), self.mean, self.std)
        key = tuple(t._version for t in self._np_tensors)
        if getattr(self, "_np_key", None) != key:
            arr = lambda t: t.detach().cpu().numpy().copy()  # noqa: E731
            lin = [m for m in self.net if isinstance(m, nn.Linear)]
            layers = [(arr(m.weight).T.copy(), arr(m.bias)) for m in lin]
            mean, std = arr(self.mean), arr(self.std)
            w0, b0 = layers[0]
            layers[0] = (w0 / std[:, None], b0 - (mean / std) @ w0)
            self._np_cache = layers
            self._np_key = key
        return self._np_cache

    def save(self, path: Path, meta: dict) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
        hidden = self.net[0].out_features
        layers = sum(isinstance(m, nn.Linear) for m in self.net) - 1
        (path / "config.json").write_text(
            json.dumps({"features": list(FEATURES), "hidden": hidden, "layers": layers, **meta}, indent=2) + "\n"
        )

    @classmethod
    def load(cls, path: Path) -> "YieldMLP":
        from safetensors.torch import load_file

        cfg = json.loads((Path(path) / "config.json").read_text())
        if tuple(cfg["features"]) != FEATURES:
            raise ValueError(f"{path}: predictor was trained on features {cfg['features']}, this build has {FEATURES}")
        model = cls(len(FEATURES), cfg["hidden"], cfg["layers"])
        model.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
        return model.eval()
