"""CPU decoding GEMMs on fp16-stored weights (FBGEMM's fp16-weight kernel).

Decoding multiplies 1–16 rows by each weight matrix, so it is bound by reading weights.
On this kind of CPU, MKL's fp32 GEMM runs far from the memory limit at such small row
counts: the 8192×256 LM head took 0.28 ms for 1 row and 1.3 ms for 5. FBGEMM's kernel
reads fp16 weights (half the bytes) and handles small row counts well: 0.14 and 0.32 ms.
It computes in fp32 on fp16 weights, so it equals the fp32 path, up to summation order,
exactly when the weights are fp16 values. Our checkpoints are stored in fp16. A layer is
packed only when its weights are fp16-exact; any other layer keeps nn.Linear.

Packing also fuses each attention's q|k|v projections and each MLP's gate|up projections
into one GEMM apiece. At these sizes a GEMM call's fixed cost is a large part of its time.
Fusing took the target's 1-token forward from 6.4 to 5.4 ms here, with bit-identical logits.

Packing is for inference only: packed layers carry no gradients.
"""

from __future__ import annotations

import torch
from torch import nn


def fp16_gemm_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_prepack_fp16") and any(
        e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm")
    )


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W prepacked in fp16. ``weight``/``bias`` stay as buffers, so
    ``state_dict`` keys and checkpoint export are unchanged."""

    def __init__(self, lin: nn.Linear, persistent: bool = True):
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.register_buffer("weight", lin.weight.detach(), persistent)
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach(), persistent)
        self._packed = torch.ops.quantized.linear_prepack_fp16(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, self.in_features), self._packed)
        return y.view(*x.shape[:-1], self.out_features)


def _packable(lin: nn.Linear) -> bool:
    w = lin.weight
    exact = lambda t: torch.equal(t, t.half().float())  # noqa: E731
    return w.device.type == "cpu" and w.dtype == torch.float32 and exact(w) and (lin.bias is None or exact(lin.bias))


def _fused(*parts: nn.Linear) -> PackedLinear:
    """One packed GEMM computing the parts' outputs side by side; its buffers stay out of
    ``state_dict`` (the parts keep theirs)."""
    lin = nn.Linear(
        parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None, device="meta"
    )
    lin.weight = nn.Parameter(torch.cat([p.weight for p in parts]))
    if lin.bias is not None:
        lin.bias = nn.Parameter(torch.cat([p.bias for p in parts]))
    return PackedLinear(lin, persistent=False)


@torch.no_grad()
def pack_linears(model: nn.Module) -> int:
    """Replace every fp16-exact fp32 CPU ``nn.Linear`` in ``model`` by a ``PackedLinear`` and
    fuse q|k|v and gate|up where all parts are packable; returns how many layers were
    packed (0 when FBGEMM is unavailable)."""
    from services.common.llama import MLP, Attention

    if not fp16_gemm_available():
        return 0
    for m in list(model.modules()):
        if isinstance(m, Attention) and all(map(_packable, (m.q_proj, m.k_proj, m.v_proj))):
            m.qkv = _fused(m.q_proj, m.k_proj, m.v_proj)
        elif isinstance(m, MLP) and all(map(_packable, (m.gate_proj, m.up_proj))):
            m.gate_up = _fused(m.gate_proj, m.up_proj)
    packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and _packable(child):
                setattr(parent, name, PackedLinear(child))
                packed += 1
    return packed
