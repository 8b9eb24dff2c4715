import torch

from services.common.sampling import probs_from_logits
from services.common.types import SamplingParams


def test_temperature_top_k_top_p():
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs_from_logits(x, SamplingParams(temperature=1.0))
    assert torch.allclose(p, torch.softmax(x, -1))
    pk = probs_from_logits(x, SamplingParams(temperature=1.0, top_k=2))
    assert (pk[2:] == 0).all() and torch.isclose(pk.sum(), torch.tensor(1.0))
    # top_p keeps the smallest prefix reaching the mass: p = [.64, .24, .09, ...] → top_p .8 keeps 2
    pp = probs_from_logits(x, SamplingParams(temperature=1.0, top_p=0.8))
    assert (pp[:2] > 0).all() and (pp[2:] == 0).all()
    # tiny top_p always keeps the most likely token
    assert probs_from_logits(x, SamplingParams(temperature=1.0, top_p=1e-6))[0] == 1.0
    cold = probs_from_logits(x, SamplingParams(temperature=0.1))
    assert cold[0] > 0.99
