"""Host round-trips per decoding cycle, counted per method: on a GPU each one stalls the device
until the queue drains, so a cycle of any method may make no more than its budget.

A round-trip is a tensor read by the host: ``.item()``, ``.tolist()``, ``.cpu()``, ``.nonzero()``,
``bool()``/``int()``/``float()``/``index`` of a tensor, and boolean-mask indexing. The budgets are
what each method's cycle makes today (the maximum over a request's cycles), as a function of k,
the longest draft-LM chain: the draft LM reads each drafted token to feed its next forward. The
GPU-shaped goal is one (the accepted tokens' copy): lowering a count lowers its budget here."""

import collections
import contextlib

import pytest
import torch

from services.common.types import Sampling
from services.router.engine import GenerationRequest
from services.router.scheduler import Scheduler

SYNCS = ("item", "tolist", "cpu", "nonzero", "__bool__", "__int__", "__float__", "__index__")
BUDGET = {
    "vanilla": lambda k: 1,
    "suffix": lambda k: 1,
    "suffix-tree": lambda k: 1,
    "ngram": lambda k: 1,
    "sd": lambda k: k + 1,
    "csd": lambda k: k + 1,
    "scg": lambda k: k + 1,
}


@contextlib.contextmanager
def counted_syncs(counts: collections.Counter):
    originals = {name: getattr(torch.Tensor, name) for name in (*SYNCS, "__getitem__")}

    def counting(name):
        def f(self, *a, **k):
            counts[name] += 1
            return originals[name](self, *a, **k)

        return f

    def getitem(self, idx):
        if isinstance(idx, torch.Tensor) and idx.dtype == torch.bool:
            counts["bool-index"] += 1
        return originals["__getitem__"](self, idx)

    try:
        for name in SYNCS:
            setattr(torch.Tensor, name, counting(name))
        torch.Tensor.__getitem__ = getitem
        yield
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)


# methods that need the bundled models' EAGLE-3 head and yield predictor (k: --eagle3-k)
BUNDLED_BUDGET = {
    "eagle3": lambda k: k + 1,  # a confidence per chain token
    "eagle3-tree": lambda k: k + 1,  # one per tree level
    "hybrid": lambda k: k + 1,
    "hybrid-tree": lambda k: k + 1,
}


def worst_cycle(engine, method: str, monkeypatch) -> dict:
    """The host reads of the request's cycle that made most of them, once the process has set
    up what it makes once (the predictor's numpy weights, a head's vocabulary map)."""
    return max(cycle_reads(engine, method, monkeypatch), key=lambda c: sum(c.values()))


def cycle_reads(engine, method: str, monkeypatch, sampling: Sampling = Sampling()) -> list[dict]:
    """Each cycle's host reads, by kind, of a 32-token request after a first one has set up
    what the process makes once. A lone request's cycle is the scheduler's step: from taking
    it (the router's draft) to settling its outcome (the router drafters observe)."""
    counts: collections.Counter = collections.Counter()
    per_cycle: list[dict] = []
    take, settle = Scheduler._take, Scheduler._settle

    def counted_take(self):
        counts.clear()
        return take(self)

    def counted_settle(self, gen, outcome):
        settle(self, gen, outcome)
        per_cycle.append(dict(counts))

    monkeypatch.setattr(Scheduler, "_take", counted_take)
    monkeypatch.setattr(Scheduler, "_settle", counted_settle)
    ids = engine.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n")
    for _ in engine.generate(GenerationRequest(ids, 16, sampling=sampling, method=method)):  # set-up first
        pass
    per_cycle.clear()
    with counted_syncs(counts):
        for _ in engine.generate(GenerationRequest(ids, 32, sampling=sampling, method=method, ignore_eos=True)):
            pass
    monkeypatch.setattr(Scheduler, "_take", take)
    monkeypatch.setattr(Scheduler, "_settle", settle)
    assert len(per_cycle) > 1
    return per_cycle


@pytest.mark.parametrize("method", sorted(BUDGET))
def test_a_cycle_makes_no_more_host_round_trips_than_its_budget(tiny_engine, method, monkeypatch):
    worst = worst_cycle(tiny_engine, method, monkeypatch)
    budget = BUDGET[method](tiny_engine.cfg.num_speculative_tokens)
    assert sum(worst.values()) <= budget, f"{method}: a cycle read the device {worst}, budget {budget}"


@pytest.mark.parametrize("method", sorted(BUNDLED_BUDGET))
def test_a_cycle_of_the_eagle3_and_hybrid_methods_stays_within_its_budget(bundled_engine, method, monkeypatch):
    worst = worst_cycle(bundled_engine, method, monkeypatch)
    budget = BUNDLED_BUDGET[method](bundled_engine.cfg.eagle3_k)
    assert sum(worst.values()) <= budget, f"{method}: a cycle read the device {worst}, budget {budget}"


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix-tree"])
def test_batch_invariant_verification_adds_no_host_round_trip(tiny_engine, method, monkeypatch):
    """The invariant plan (services/common/invariant.py) is built from host lists and read by
    index on the device: chains and trees stay within the same budgets."""
    monkeypatch.setattr(tiny_engine.verifier.runner.model, "batch_invariant", True)
    worst = worst_cycle(tiny_engine, method, monkeypatch)
    budget = BUDGET[method](tiny_engine.cfg.num_speculative_tokens)
    assert sum(worst.values()) <= budget, f"{method}: a cycle read the device {worst}, budget {budget}"


# With device drafts (EngineConfig.device_drafts, on for CUDA) a greedy chain or an EAGLE tree is
# read once per draft: a cycle reads its draft and then its target logits, whatever k or depth.
DEVICE_DRAFT_BUDGET = {"sd": 2, "csd": 2, "scg": 2, "eagle3": 2, "hybrid": 2, "eagle3-tree": 2, "hybrid-tree": 2}


@pytest.mark.parametrize("method", sorted(DEVICE_DRAFT_BUDGET))
def test_device_drafts_read_a_draft_once(tiny_engine, bundled_engine, method, monkeypatch):
    engine = tiny_engine if method in ("sd", "csd", "scg") else bundled_engine
    for drafter in engine.verifier.drafters.values():
        monkeypatch.setattr(drafter, "device_drafts", True, raising=False)
    worst = worst_cycle(engine, method, monkeypatch)
    budget = DEVICE_DRAFT_BUDGET[method]
    assert sum(worst.values()) <= budget, f"{method}: a cycle read the device {worst}, budget {budget}"


@pytest.mark.parametrize("method", ["vanilla", "sd", "suffix-tree"])
def test_static_steps_add_no_host_round_trip(tiny_engine, method, monkeypatch):
    """Static steps (services/common/graphs.py) take their positions as a device tensor made
    from host ints: the same budgets."""
    from services.common.graphs import StaticSteps

    model = tiny_engine.verifier.runner.model
    monkeypatch.setattr(model, "static_steps", StaticSteps(model, graphs=False))
    worst = worst_cycle(tiny_engine, method, monkeypatch)
    budget = BUDGET[method](tiny_engine.cfg.num_speculative_tokens)
    assert sum(worst.values()) <= budget, f"{method}: a cycle read the device {worst}, budget {budget}"


@pytest.mark.parametrize("method", ["sd", "eagle3"])
def test_sampled_device_drafts_copy_to_the_host_twice_a_cycle(tiny_engine, bundled_engine, method, monkeypatch):
    """A sampled sd or eagle3 cycle with device drafts copies to the host twice: its draft (tokens,
    confidences and the q rows it drew from, in one blob) and the target's logits. The other
    reads counted here are of those host copies (rejection sampling runs on them), which on a
    GPU wait for nothing; with the host loop every drafted token is one more copy."""
    engine = tiny_engine if method == "sd" else bundled_engine
    drafter = engine.verifier.drafters["draft-lm" if method == "sd" else "eagle3"]

    def copies(device_drafts: bool) -> list[int]:
        monkeypatch.setattr(drafter, "device_drafts", device_drafts)
        reads = cycle_reads(engine, method, monkeypatch, Sampling(temperature=0.8))
        return [c.get("cpu", 0) + c.get("tolist", 0) for c in reads]

    assert max(copies(True)) == 2
    assert max(copies(False)) > 2  # the host loop copies each q: the test can tell them apart
