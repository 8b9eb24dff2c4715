"""Mixed precision for training: bf16 autocast where the hardware multiplies bf16 natively.

On a CUDA device, and on a CPU with AMX tiles or AVX-512 BF16 (oneDNN's bf16 GEMMs), matmuls
under autocast take bf16 inputs and accumulate in fp32; weights, optimizer state and losses
stay fp32 (``bench/results/train_precision.md`` measures both on this CPU). Elsewhere bf16
would be emulated, slower than fp32, so autocast stays off.
"""

from __future__ import annotations

import torch


def bf16_native(device: torch.device) -> bool:
    """bf16 matmuls run natively on ``device``."""
    if device.type == "cuda":
        return True
    cpu = torch.cpu
    return device.type == "cpu" and any(
        getattr(cpu, f, lambda: False)() for f in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )


def use_bf16(choice: str, device: torch.device) -> bool:
    """``choice``: "auto" (where native), "on" or "off"."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"bf16 must be auto, on or off, not {choice!r}")
    return choice == "on" or (choice == "auto" and bf16_native(device))


def autocast(device: torch.device, enabled: bool):
    """The bf16 autocast context for ``device`` (a no-op context when not ``enabled``)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
