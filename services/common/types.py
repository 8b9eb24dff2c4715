"""Types shared by every component: sampling parameters, drafts, verdicts, statistics."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from services.common.token_tree import is_chain, main_chain

if TYPE_CHECKING:  # annotations only: this module is imported where torch is not
    import torch


SAMPLING_EPS = 1e-5  # temperatures below it are greedy (vLLM's _SAMPLING_EPS): dividing logits by less overflows


@dataclass(frozen=True)
class Sampling:
    """How the target's next token is chosen, as every front end's request maps into it (the
    public, vLLM-named ``SamplingParams`` is the offline API's). temperature 0 (below ``SAMPLING_EPS``) = greedy; top_k 0 = off; top_p 1.0 = off; min_p 0 = off (vLLM's: tokens
    less likely than min_p × the most likely one are dropped). Penalties (vLLM's, off at their
    defaults) change the target's logits before greedy, sampling or the CSD gate read them:
    repetition_penalty divides a positive logit (multiplies a negative one) of every token seen
    in the prompt or the output; presence_penalty is subtracted from every token that occurs
    in the output, and frequency_penalty once per occurrence. logit_bias ((token id, bias)
    pairs) is added to those tokens' logits, and with allowed_token_ids every other token's
    logit is −inf, at every position (vLLM's and OpenAI's). bad_words (token sequences, vLLM's):
    the last token of a sequence is −inf where the output ends with the tokens before it (a
    one-token sequence: everywhere)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def biased(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids)


@dataclass(frozen=True)
class Delegate:
    """A router drafter's answer when its own draft is not worth verifying (the hybrid's): draft
    with ``drafter`` (beside the verifier) instead, at most ``budget`` tokens; ``also``: the cache
    draft, to verify beside it as a branch of one token tree where the session takes trees."""

    drafter: str
    budget: int
    also: tuple[int, ...] = ()


@dataclass
class Draft:
    """Candidate continuation proposed by a drafter.

    token_ids: drafted tokens d_1..d_k.
    parents:   parent index of each token (-1 = the last committed token); a chain is
               [-1, 0, 1, ...]. A tree holds several candidates (``token_tree``); the
               lossless policies walk it, others take its ``chain()``.
    probs:     [k, V] float32, the distribution q each token was sampled from; None means
               q is one-hot on the token (greedy drafts, suffix-cache drafts).
    score:     drafter's own confidence (suffix cache: sum of token probabilities).
    match_len: length of the context suffix the draft continues (suffix cache).
    token_probs: drafter's running probability of each token (suffix cache), not a q.
    """

    token_ids: list[int]
    parents: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None
    score: float = 0.0
    source: str = "none"
    match_len: int = 0
    token_probs: list[float] = field(default_factory=list)
    features: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.parents:
            self.parents = list(range(-1, len(self.token_ids) - 1))

    def __len__(self) -> int:
        return len(self.token_ids)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(token_ids=[])

    @property
    def is_tree(self) -> bool:
        return not is_chain(self.parents)

    def chain(self) -> "Draft":
        """The tree's main chain as a draft of its own (itself when a chain)."""
        if not self.is_tree:
            return self
        keep = main_chain(self.parents)
        return replace(
            self,
            token_ids=[self.token_ids[i] for i in keep],
            parents=[],
            probs=None if self.probs is None else self.probs[keep],
            token_probs=[self.token_probs[i] for i in keep] if self.token_probs else [],
            features=dict(self.features),
        )


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft.

    accepted:        draft tokens kept, a prefix of the draft (includes rescued ones).
    tokens:          tokens emitted this cycle: the kept draft prefix, then one token from
                     the target (the correction at the first rejection, or the bonus token
                     when the whole draft passed).
    rescued_pairs:   (draft, target) of each kept draft token the target did not itself
                     choose (relaxed policies).
    first_rejection: (draft_token, target_token) at the first true rejection, if any.
    path:            a tree draft's accepted nodes (None: the first ``accepted`` of a chain).
    """

    accepted: int
    tokens: list[int]
    rescued_pairs: tuple[tuple[int, int], ...] = ()
    first_rejection: tuple[int, int] | None = None
    path: tuple[int, ...] | None = None

    @property
    def rescued(self) -> int:
        return len(self.rescued_pairs)


@dataclass
class SpecStats:
    """Per-request speculation counters (DESIGN.md §5 definitions)."""

    cycles: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    first_rejections: int = 0  # cycles ending in a true (unrescued) rejection
    generated_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_by_source: dict[str, int] = field(default_factory=dict)
    rescued_pairs: list[tuple[int, int]] = field(default_factory=list)

    def add(self, drafted: int, accepted: int, source: str, rescued_pairs=(), rejected: bool = False) -> None:
        """Count one cycle: ``accepted`` draft tokens kept of ``drafted`` (from ``source``)."""
        self.cycles += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        self.rescued_pairs.extend(rescued_pairs)
        self.first_rejections += rejected
        if drafted:
            self.drafts_by_source[source] = self.drafts_by_source.get(source, 0) + 1
        while len(self.accepted_per_position) < accepted:
            self.accepted_per_position.append(0)
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def tau(self) -> float:
        """Mean tokens per cycle (accepted drafts + the correction/bonus token)."""
        return self.generated_tokens / self.cycles if self.cycles else 0.0

    @property
    def rescued_tokens(self) -> int:
        return len(self.rescued_pairs)

    @property
    def rescue_rate(self) -> float:
        """Rescued tokens / mismatches met (rescued + true rejections)."""
        n = self.rescued_tokens + self.first_rejections
        return self.rescued_tokens / n if n else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "cycles": self.cycles,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rescued_tokens": self.rescued_tokens,
            "first_rejections": self.first_rejections,
            "rescue_rate": round(self.rescue_rate, 4),
            "generated_tokens": self.generated_tokens,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafts_by_source": dict(self.drafts_by_source),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target (raw logits) and the most likely
    alternatives at its position, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


# -- one session on a verifier, and one decoding cycle of it (router <-> verifier) ---------------
class SessionCancelled(RuntimeError):
    """The session was cancelled (its client went away) while a cycle was queued or prefilling."""


@dataclass(frozen=True)
class SessionSpec:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    policy: str = "lossless"
    model_drafter: str | None = None  # verifier-side drafter this session may use
    on_demand: bool = False  # it drafts only when a cycle asks (a hybrid): no eager catch-up
    max_draft: int = 0  # longest draft the session will see (KV capacity)
    session_id: str = ""
    deadline_s: float | None = None  # the client's remaining time; remote verifiers get it as deadline
    logprobs: int | None = None  # per committed token: its target log-probability and this many alternatives
    cache_salt: str = ""  # prefix-cache blocks are shared only among sessions of the same salt
    ignore_eos: bool = False  # commit past the end-of-sequence token
    min_tokens: int = 0  # no end-of-sequence token before this many new tokens
    generated: int = 0  # the last this many prompt_ids are output already (a re-open)
    prompt_logprobs: int | None = None  # per prompt token after the first: its log-probability and alternatives
    grammar: str | None = None  # structured output: the whole output matches this regex

    def resumed(self, committed: list[int]) -> "SessionSpec":
        """The spec that re-opens this session elsewhere after ``committed`` output tokens
        (failover): they join the prompt and count as output; the limits shrink by them, and
        the prompt's logprobs, which came with the first cycle, are not asked again."""
        n = len(committed)
        if not n:
            return self
        return replace(
            self,
            prompt_ids=self.prompt_ids + list(committed),
            max_new_tokens=max(1, self.max_new_tokens - n),
            min_tokens=max(0, self.min_tokens - n),
            generated=self.generated + n,
            prompt_logprobs=None,
        )


@dataclass(frozen=True)
class CycleRequest:
    draft_ids: tuple[int, ...] = ()  # a draft made by the router (suffix cache)
    draft_parents: tuple[int, ...] = ()  # its token tree's parents (token_tree); empty: a chain
    draft_source: str = "none"
    draft_with: str | None = None  # or: draft here with this verifier-side drafter (and, where the
    # session takes trees, verify draft_ids, a chain, beside its draft)
    budget: int = 0


@dataclass(frozen=True)
class CycleResult:
    committed: list[int]  # tokens the request keeps: the verdict's, cut after EOS
    drafted: int
    accepted: int  # draft tokens kept among ``committed``
    source: str
    rescued_pairs: tuple[tuple[int, int], ...] = ()
    rejected: bool = False  # the cycle ended at a true rejection
    draft_s: float = 0.0
    verify_s: float = 0.0  # the target's forward, the acceptance policy and the commit
    gate_s: float = 0.0  # of verify_s: the acceptance policy (a calibrated gate included)
    server_s: float = 0.0  # the verifier's time on the cycle, from its arrival to its result
    batch_size: int = 1  # sessions verified in the same target forward
    cached_tokens: int = 0  # prompt positions the prefix cache gave (a session's first cycle)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # a session's first cycle, when it asked
    logprobs: tuple[TokenLogprob, ...] = ()  # one per committed token, when the session asked


class Session(Protocol):
    """A verifier session as the router drives it, in process (``VerifierSession``), over gRPC
    (``RemoteSession``, ``LinkedSession``) or through Serve (``RaySession``)."""

    def cycle(self, req: CycleRequest) -> CycleResult: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...
