"""g_θ: MLP regression of a cache draft's accepted length from φ_t (HVD: 2 × 256, MSE)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std).squeeze(-1)

    @torch.inference_mode()
    def predict(self, phi: np.ndarray) -> np.ndarray:
        """[N, F] or [F] features → predicted accepted lengths."""
        x = torch.from_numpy(np.atleast_2d(phi).astype(np.float32))
        return self(x).numpy()

    def save(self, path: Path, meta: dict) -> None:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(path / "model.safetensors"))
        hidden = self.net[0].out_features
        layers = sum(isinstance(m, nn.Linear) for m in self.net) - 1
        (path / "config.json").write_text(json.dumps(
            {"features": list(FEATURES), "hidden": hidden, "layers": layers, **meta}, indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "YieldMLP":
        from safetensors.torch import load_file

        cfg = json.loads((Path(path) / "config.json").read_text())
        if tuple(cfg["features"]) != FEATURES:
            raise ValueError(f"{path}: predictor was trained on features {cfg['features']}, this build has {FEATURES}")
        model = cls(len(FEATURES), cfg["hidden"], cfg["layers"])
        model.load_state_dict(load_file(str(Path(path) / "model.safetensors")))
        return model.eval()
