"""Every drafter the router or the verifier can hold implements the whole ``Drafter`` protocol,
so the decode loop calls its methods without asking which drafter it has."""
import inspect

import pytest

from services.drafter.base import Drafter
from services.drafter.draft_lm import DraftLMDrafter
from services.drafter.eagle3_drafter import Eagle3Drafter
from services.drafter.server import RemoteDrafter
from services.drafter.suffix import SuffixDrafter
from services.router.hybrid import HybridDrafter

PROTOCOL = [name for name, _ in inspect.getmembers(Drafter, inspect.isfunction) if not name.startswith("_")]


def test_the_protocol_names_the_lifecycle():
    assert {"start", "propose", "verified", "observe", "stop"} <= set(PROTOCOL)


@pytest.mark.parametrize("cls", [SuffixDrafter, RemoteDrafter, DraftLMDrafter, Eagle3Drafter, HybridDrafter])
def test_every_drafter_implements_every_protocol_method(cls):
    """Each method exists and takes the protocol's arguments positionally (self included)."""
    for name in PROTOCOL:
        theirs = inspect.signature(getattr(Drafter, name)).parameters.values()
        inspect.signature(getattr(cls, name)).bind(*[None] * len(theirs))


def test_a_cut_suffix_draft_is_what_the_drafter_remembers():
    from services.common.types import SamplingParams

    d = SuffixDrafter()
    d.start("r", [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams())
    assert len(d.propose("r", 4).token_ids) >= 2
    d.verified("r", 1)
    assert len(d.states["r"].drafted) == 1
