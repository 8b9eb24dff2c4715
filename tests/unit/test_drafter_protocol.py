"""Every drafter the router or the verifier can hold implements the whole ``Drafter`` protocol,
so the decode loop calls its methods without asking which drafter it has."""

import inspect

import pytest

from services.drafter.base import Drafter
from services.drafter.client import RemoteDrafter
from services.drafter.draft_lm import DraftLMDrafter
from services.drafter.eagle3_drafter import Eagle3Drafter
from services.drafter.hybrid import HybridDrafter
from services.drafter.suffix import SuffixDrafter

PROTOCOL = [name for name, _ in inspect.getmembers(Drafter, inspect.isfunction) if not name.startswith("_")]


def test_the_protocol_names_the_lifecycle():
    assert {"start", "propose", "verified", "observe", "stop"} <= set(PROTOCOL)


@pytest.mark.parametrize("cls", [SuffixDrafter, RemoteDrafter, DraftLMDrafter, Eagle3Drafter, HybridDrafter])
def test_every_drafter_implements_every_protocol_method(cls):
    """Each method exists and takes the protocol's arguments: positionally (self included),
    keyword-only ones by name."""
    for name in PROTOCOL:
        theirs = inspect.signature(getattr(Drafter, name)).parameters.values()
        named = [p.name for p in theirs if p.kind is p.KEYWORD_ONLY]
        inspect.signature(getattr(cls, name)).bind(*[None] * (len(theirs) - len(named)), **dict.fromkeys(named))


def test_a_cut_suffix_draft_is_what_the_drafter_remembers():
    from services.common.types import Sampling

    d = SuffixDrafter()
    d.start("r", [1, 2, 3, 1, 2, 3, 1, 2], Sampling())
    assert len(d.propose("r", 4).token_ids) >= 2
    d.verified("r", 1)
    assert len(d.states["r"].drafted) == 1


def test_the_protocol_defaults_serve_drafters_without_batched_kernels():
    """A drafter without batched kernels answers ``propose_batch`` one request at a time, has
    nothing to ``absorb`` and no K/V for the prefix cache; the model drafters size theirs."""
    from services.common.types import Sampling

    d = SuffixDrafter()
    for r, prompt in (("a", [1, 2, 3, 1, 2, 3, 1, 2]), ("b", [5, 6, 5, 6, 5])):
        d.start(r, prompt, Sampling())
    batch = d.propose_batch([("a", 4), ("b", 2)])
    assert [x.token_ids for x in batch] == [d.propose("a", 4).token_ids, d.propose("b", 2).token_ids]
    assert batch[0].token_ids and len(batch[1].token_ids) <= 2
    d.absorb("a", 8)
    assert d.kv_bytes_per_position() == 0 and d.prefix is None and not d.needs_target_states
    assert Eagle3Drafter.needs_target_states and not DraftLMDrafter.needs_target_states


def test_a_model_drafter_counts_its_kv_bytes(tiny_dirs):
    from services.common.llama import Llama

    model = Llama.from_pretrained(tiny_dirs[1])
    s = model.s
    assert DraftLMDrafter(model).kv_bytes_per_position() == 2 * s.layers * s.kv_heads * s.head_dim * 4  # K and V, fp32
