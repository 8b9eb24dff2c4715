"""Drive a drafter through every public method of the ``Drafter`` base class (listed from the
class itself, so a method added there is exercised here too)."""

import inspect

import torch

from services.common.types import Delegate, Draft, Sampling
from services.drafter.base import Drafter

METHODS = sorted(name for name, _ in inspect.getmembers(Drafter, inspect.isfunction) if not name.startswith("_"))


def fits(d, budget: int) -> bool:
    """A draft of at most ``budget`` tokens, or a hybrid's hand-over to a model drafter."""
    return isinstance(d, Delegate) and d.budget <= budget or isinstance(d, Draft) and len(d.token_ids) <= budget


def exercise(drafter: Drafter, prompt: list[int], states_dim: int = 0) -> set[str]:
    """One request's whole lifecycle, twice over (two requests in one batch); returns the
    methods called. ``states_dim``: the fused target states' width for drafters that need them."""
    assert isinstance(drafter, Drafter)
    called: set[str] = set()

    def states(n: int):
        return torch.zeros(n, states_dim) if drafter.needs_target_states else None

    for rid in ("a", "b"):
        drafter.start(rid, list(prompt), Sampling(), None, 16)
        # a prefill chunk of all but the prompt's last position: their states, taken in
        drafter.observe(rid, [], states(len(prompt) - 1))
        drafter.absorb(rid, len(prompt) - 1)
    called |= {"start", "absorb"}
    assert fits(drafter.propose("a", 4), 4)
    batch = drafter.propose_batch([("a", 3), ("b", 2)])
    assert len(batch) == 2 and all(fits(d, k) for d, k in zip(batch, (3, 2)))
    drafter.after_step()  # (the router's, once the step is sent)
    called |= {"propose", "propose_batch", "after_step"}
    for rid, d in zip(("a", "b"), batch):
        drafter.verified(rid, min(1, len(getattr(d, "token_ids", []))))
        committed = list(getattr(d, "token_ids", [])[:1]) + [prompt[-1]]
        drafter.observe(rid, committed, states(len(committed)))
    called |= {"verified", "observe"}
    assert drafter.kv_bytes_per_position() >= 0
    called.add("kv_bytes_per_position")
    for rid in ("a", "b"):
        drafter.stop(rid)
    called.add("stop")
    return called
