"""CPU decoding GEMMs on fp16-stored weights (FBGEMM's fp16-weight kernel).

Decoding multiplies 1–16 rows by each weight matrix, so it is bound by reading weights.
On this kind of CPU, MKL's fp32 GEMM runs far from the memory limit at such small row
counts: the 8192×256 LM head took 0.28 ms for 1 row and 1.3 ms for 5. FBGEMM's kernel
reads fp16 weights (half the bytes) and handles small row counts well: 0.14 and 0.32 ms.
It computes in fp32 on fp16 weights, so it equals the fp32 path, up to summation order,
exactly when the weights are fp16 values. Our checkpoints are stored in fp16. A layer is
packed only when its weights are fp16-exact; any other layer keeps nn.Linear.

Packing is for inference only: packed layers carry no gradients.
"""
from __future__ import annotations

import torch
from torch import nn


def fp16_gemm_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_prepack_fp16") and \
        any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm"))


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W prepacked in fp16. ``weight``/``bias`` stay as buffers, so
    ``state_dict`` keys and checkpoint export are unchanged."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("weight", lin.weight.detach())
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach())
        self._packed = torch.ops.quantized.linear_prepack_fp16(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self._packed)
        return y.view(*x.shape[:-1], self.out_features)


def _packable(lin: nn.Linear) -> bool:
    w = lin.weight
    exact = lambda t: torch.equal(t, t.half().float())  # noqa: E731
    return (w.device.type == "cpu" and w.dtype == torch.float32 and exact(w)
            and (lin.bias is None or exact(lin.bias)))


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every fp16-exact fp32 CPU ``nn.Linear`` in ``model`` by a ``PackedLinear``;
    returns how many were packed (0 when FBGEMM is unavailable)."""
    if not fp16_gemm_available():
        return 0
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and _packable(child):
                setattr(parent, name, PackedLinear(child))
                packed += 1
    return packed
