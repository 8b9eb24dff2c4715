"""bf16 autocast for training: where it is used, and what it changes."""

import pytest
import torch

from training.precision import autocast, bf16_native, use_bf16


def test_auto_follows_the_hardware_and_on_off_override_it():
    cpu = torch.device("cpu")
    assert use_bf16("auto", cpu) is bf16_native(cpu)
    assert use_bf16("on", cpu) and not use_bf16("off", cpu)
    assert bf16_native(torch.device("cuda"))
    with pytest.raises(ValueError, match="auto, on or off"):
        use_bf16("yes", cpu)


def test_autocast_runs_matmuls_in_bf16_only_when_enabled():
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with autocast(torch.device("cpu"), True):
        assert (a @ b).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), False):
        assert (a @ b).dtype == torch.float32
