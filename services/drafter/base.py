"""The one drafter protocol, and the registry drafters are looked up in by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from services.common.prefix_cache import ROOT, PrefixCache
from services.common.structured import GrammarCursor
from services.common.types import Draft, Sampling


class Drafter(ABC):
    """Request lifecycle: start → (propose → observe)* → stop.

    ``observe`` receives the tokens committed in the cycle (accepted drafts + the target's
    token); a drafter compares them with what it proposed to roll back its own state.
    Drafters with ``needs_target_states = True`` (EAGLE-3) also get the target's fused
    hidden states of the positions the cycle verified, from the same forward pass.
    ``verified`` comes between propose and observe when the cycle checks only the first
    ``n`` tokens of the proposal (the router cut it before a token that a grammar or a bad
    word forbids): a drafter that costs its cycles by draft length counts that length.

    Every drafter subclasses this base and implements the lifecycle (``start``, ``propose``,
    ``observe``, ``stop``); it inherits defaults for what only some of them do: ``verified``
    (nothing to count),
    ``propose_batch`` (one call per request unless batched kernels make one call for all),
    ``after_step`` (nothing left for after a step is sent),
    ``absorb`` (nothing to take in without a model of its own) and ``kv_bytes_per_position``
    (0 without a K/V cache, so no share of the prefix-cache budget; a drafter with one keeps
    its blocks in ``prefix`` once the verifier gives it a share).
    """

    name: str
    needs_target_states: bool = False
    prefix: PrefixCache | None = None

    @abstractmethod
    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling,
        rng: torch.Generator | None,
        max_new_tokens: int = 0,
        *,
        scope: str | None = None,
    ) -> None:
        """``scope``: the tenant whose outputs the request may draft from and adds to (its
        ``cache_salt``; None: the shared pool); drafters that learn from outputs keep scopes apart."""

    @abstractmethod
    def propose(self, req_id: str, budget: int) -> Draft:
        """This cycle's draft, at most ``budget`` tokens (the hybrid may answer a ``Delegate``:
        the verifier-side drafter to use instead)."""

    def verified(self, req_id: str, n: int) -> None:
        """Only the first ``n`` tokens of the last proposal are checked this cycle."""
        return None

    @abstractmethod
    def observe(self, req_id: str, tokens: list[int], target_states: torch.Tensor | None = None) -> None: ...

    @abstractmethod
    def stop(self, req_id: str) -> list[int] | None: ...

    def propose_batch(self, asks: list[tuple[str, int]]) -> list[Draft]:
        """Drafts for several ``(req_id, budget)`` asks of one verifier step."""
        return [self.propose(req_id, budget) for req_id, budget in asks]

    def after_step(self) -> None:
        """Work a step's drafts left for later, run by the router once the step is sent (the
        suffix cache's lagged global writes); any call that needs it done does it first."""
        return None

    def absorb(self, req_id: str, upto: int) -> None:
        """Take in the prompt positions before ``upto`` that the target has fed (a prefill
        chunk), without drafting, so the first draft does not catch up over the whole prompt."""
        return None

    def kv_bytes_per_position(self) -> int:
        """K/V bytes the drafter keeps per position of a request."""
        return 0


class ModelDrafter(Drafter):
    """A drafter beside the verifier (the draft LM, the EAGLE-3 head): a session's start also
    names its prefix-cache root (the cache salt's), its grammar cursor (structured output) and
    whether it drafts token trees."""

    @abstractmethod
    def start(
        self,
        req_id: str,
        prompt: list[int],
        sp: Sampling,
        rng: torch.Generator | None,
        max_new_tokens: int = 0,
        cache_root: bytes = ROOT,
        grammar: GrammarCursor | None = None,
        trees: bool = False,
        *,
        scope: str | None = None,
    ) -> None: ...


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def deco(factory):
        DRAFTERS[name] = factory
        return factory

    return deco


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


Link = tuple[int, float, torch.Tensor | None]  # a chain's token, its draft confidence, and q when sampled


def read_chains(picks: list[tuple[list, torch.Tensor, torch.Tensor]], qs: list[torch.Tensor]) -> dict[int, list[Link]]:
    """The one read of chains drafted on the device: ``picks`` per step (the rows still
    drafting, their tokens and confidences, on the device) and ``qs`` (the q rows sampled rows
    drew from, in order: the rows whose request samples, step by step) → each row's chain, by
    ``id``. Everything crosses in one copy (float64 holds every token id exactly)."""
    meta = torch.cat([torch.stack([t.double(), p.double()]) for _, t, p in picks], 1)
    blob = torch.cat([meta.reshape(-1), *(q.double() for q in qs)]).cpu().numpy()
    width = meta.shape[1]
    toks, confs = blob[:width].tolist(), blob[width : 2 * width].tolist()
    q_rows = list(torch.from_numpy(blob[2 * width :]).float().reshape(len(qs), -1)) if qs else []
    chains: dict[int, list[Link]] = {}
    col = drawn = 0
    for live, _, _ in picks:
        for r in live:
            q = None if r.st.sp.greedy else q_rows[drawn]
            drawn += q is not None
            chains.setdefault(id(r), []).append((int(toks[col]), confs[col], q))
            col += 1
    return chains


def confident_length(chain: list[Link], min_confidence: float) -> int:
    """How much of a chain drafted whole the host loop would have drafted: up to and including
    its first token below ``min_confidence``."""
    return next((i + 1 for i, (_, p, _) in enumerate(chain) if p < min_confidence), len(chain))


def device_generator(rng: torch.Generator | None, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for a request's draft draws made there, seeded once from its
    own (``rng``; None: the global one). A seeded request's tokens do not depend on its drafts'
    draws (its cycles take vanilla's draws, ``policies._sampled_walk``); an unseeded one's need
    only be random."""
    return torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,), generator=rng)))


def draw_on_device(st, q: torch.Tensor, tokens: torch.Tensor, p_max: torch.Tensor, j: int, qs: list) -> None:
    """A sampled row's step of a device chain: row ``j``'s token drawn from its ``q`` where q
    lies (the request state ``st`` keeps the generator, made once from its own) and its max q
    as the confidence; ``q`` joins ``qs``, the draws' q rows in order (``read_chains``)."""
    st.device_rng = st.device_rng or device_generator(st.rng, q.device)
    tokens[j] = torch.multinomial(q, 1, generator=st.device_rng)[0]
    p_max[j] = q.max()
    qs.append(q)


def kept(chain: list[Link], min_confidence: float) -> tuple[list[int], list[torch.Tensor]]:
    """The tokens and q rows of a device chain that the host loop would have drafted
    (``confident_length``)."""
    n = confident_length(chain, min_confidence)
    return [t for t, _, _ in chain[:n]], [q for _, _, q in chain[:n] if q is not None]
