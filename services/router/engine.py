"""Router side of decoding: request validation, the method registry, router-side drafters
(suffix cache, hybrid decision) and the decode loop over a verifier session.

One cycle = draft (here, or delegated to a verifier-side drafter) → ``session.cycle`` (one
target forward, policy, commit) → router drafters observe → stream the new text. The
verifier is in-process (embedded) or remote (distributed); the loop is the same.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Generator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from services.common.config import EngineConfig
from services.common.metrics import REQUESTS, MethodMetrics, redis_off
from services.common.prefix_cache import MAX_CACHE_SALT
from services.common.refusals import Invalid
from services.common.sampling import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGPROBS, banned_tokens, sampling_error
from services.common.structured import GrammarCompiler, GrammarCursor, GrammarError, StructuredOutput
from services.common.types import (
    CycleRequest,
    CycleResult,
    Delegate,
    Draft,
    Sampling,
    Session,
    SessionSpec,
    SpecStats,
    TokenLogprob,
)
from services.drafter.base import Drafter
from services.drafter.ngram import NgramDrafter
from services.drafter.suffix import GlobalSuffixCache, SuffixDrafter
from services.router.detok import Detokenizer
from services.router.scheduler import Scheduler
from services.verifier.core import VerifierCore

log = logging.getLogger("specmesh.engine")
MODEL = "model"  # a hybrid's fallback: the verifier's EAGLE-3 head, else its draft LM


@dataclass(frozen=True)
class MethodSpec:
    name: str
    router_drafter: str | None  # drafter run by the router (suffix cache, hybrid decision)
    model_drafter: str | None  # drafter run beside the target (draft-lm, eagle3, or MODEL)
    policy: str  # acceptance policy, see services.verifier.policies
    description: str


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("vanilla", None, None, "lossless", "target model alone, one token per forward"),
        MethodSpec("sd", None, "draft-lm", "lossless", "draft LM chain drafts, lossless verification"),
        MethodSpec("suffix", "suffix", None, "lossless", "suffix-cache drafts (prompt + past outputs), lossless"),
        MethodSpec(
            "suffix-tree",
            "suffix-tree",
            None,
            "lossless",
            "suffix-cache speculation trees (SuffixDecoding), verified by walking the tree",
        ),
        MethodSpec(
            "ngram",
            "ngram",
            None,
            "lossless",
            "prompt lookup (vLLM's ngram): the tokens after the last n-gram's earliest match in the prompt and output",
        ),
        MethodSpec("eagle3", None, "eagle3", "lossless", "EAGLE-3 head chain drafts on the target's hidden states"),
        MethodSpec("eagle3-tree", None, "eagle3-tree", "lossless", "EAGLE-3 head draft trees (EAGLE-2's dynamic tree)"),
        MethodSpec(
            "hybrid", "hybrid", MODEL, "lossless", "HVD: suffix draft when its predicted yield > tau, else EAGLE-3"
        ),
        MethodSpec("hybrid-csd", "hybrid", MODEL, "csd", "HVD drafting + calibrated verification (the full system)"),
        MethodSpec(
            "hybrid-rule", "hybrid-rule", MODEL, "lossless", "baseline hybrid: suffix draft when score >= threshold"
        ),
        MethodSpec(
            "hybrid-tree",
            "hybrid-tree",
            "eagle3-tree",
            "lossless",
            "HVD on trees: suffix-cache speculation trees, else EAGLE-3 draft trees",
        ),
        MethodSpec("hybrid-lm", "hybrid-lm", "draft-lm", "lossless", "HVD with the draft LM as its model fallback"),
        MethodSpec("csd", None, "draft-lm", "csd", "draft LM + calibrated verification (correction memory + gate)"),
        MethodSpec("scg", None, "draft-lm", "scg", "ablation of csd: the gate without the correction memory"),
    )
}


MAX_REQUEST_ID = 256  # characters of a client-chosen request id (logs, aborts, metrics)


class InvalidRequest(Invalid):
    """A request field is out of range; the message names the field and what to fix."""


MAX_STOPS, MAX_STOP_CHARS = 16, 256  # stop strings (and stop token ids) per request; characters per string
MAX_N = 16  # completions per request


def validate_sampling(sp: Sampling) -> None:
    if (err := sampling_error(sp)) is not None:
        raise InvalidRequest(err)


def validate_token_ids(sp: Sampling, vocab: int) -> None:
    for name, ids in (("logit_bias", [i for i, _ in sp.logit_bias]), ("allowed_token_ids", sp.allowed_token_ids)):
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"{name}: every token id must be in [0, {vocab})")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # generation ends after any of these (kept in the output)
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None  # per prompt token after the first: its log-probability and alternatives
    method: str = ""  # "": the engine's default_method (one default for every front end)
    request_id: str = ""
    deadline_s: float | None = None  # time the client allows, from the request's arrival
    logprobs: int | None = None  # per generated token: its target log-probability and this many alternatives
    cache_salt: str = ""  # prefix-cache blocks are shared only among requests of the same salt
    ignore_eos: bool = False  # generate max_new_tokens tokens; EOS is a token like any other
    min_tokens: int = 0  # no end-of-sequence token before this many new tokens
    structured: StructuredOutput | None = None  # the output must match this schema, regex or choice
    n: int = 1  # independent completions of the prompt (vLLM's n)
    priority: int = 0  # admission order: lower first (vLLM's), then arrival
    skip_special_tokens: bool = True  # the tokenizer's special tokens add no text (vLLM's default)
    log_metrics: bool = True  # False: kept out of the request metrics (a health probe)


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asked


@dataclass
class Timings:
    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    end: float | None = None
    verify_s: float = 0.0
    draft_s: float = 0.0

    @property
    def wall_s(self) -> float:
        return (self.end or time.perf_counter()) - self.start

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start


class Engine:
    def __init__(self, cfg: EngineConfig = EngineConfig(), verifier=None):
        """``verifier``: a VerifierCore or a remote one with the same interface; default: load in-process."""
        from transformers import AutoTokenizer

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.tokenizer = AutoTokenizer.from_pretrained(str(cfg.target))
        self.eos_id = self.tokenizer.eos_token_id
        self.verifier = verifier if verifier is not None else VerifierCore.from_config(cfg, self.eos_id)
        self.remote_verifier = not self.verifier.in_process  # its cycles cross a network
        # a remote replica's step takes all its ready sessions (it caps its batch itself); in process
        # a step takes max_batch of them
        self.scheduler = Scheduler(
            self.verifier,
            prepare_step,
            0 if self.remote_verifier else cfg.max_batch,
            cfg.micro_batches,
            offload=self.verifier.in_process,
            lane=self.verifier.lane,
            split_at=self.verifier.split_at,
        )
        self.suffix_cache = GlobalSuffixCache.of(cfg.suffix, background=True)
        self.suffix_feed = None
        if cfg.redis_url:
            from services.memory.redis_link import RedisLink
            from services.memory.suffix_feed import SuffixFeed

            self.suffix_feed = SuffixFeed(
                RedisLink(cfg.redis_url, "suffix_feed"), self.suffix_cache, vocab=self.verifier.vocab_size
            ).start()
        else:
            redis_off("suffix_feed")
        if cfg.drafter_addr:
            from services.drafter.client import RemoteDrafter

            self.drafters: dict[str, Drafter] = {
                "suffix": RemoteDrafter(cfg.drafter_addr),
                "suffix-tree": RemoteDrafter(cfg.drafter_addr, "suffix-tree", tree=True),
            }
        else:
            publish = self.suffix_feed.publish if self.suffix_feed else None
            self.drafters = {
                "suffix": SuffixDrafter(replace(cfg.suffix, tree=False), self.suffix_cache, publish),
                "suffix-tree": SuffixDrafter(replace(cfg.suffix, tree=True), self.suffix_cache, publish),
            }
        self.drafters["ngram"] = NgramDrafter(cfg.ngram)
        self.max_draft = {
            **self.verifier.max_draft,
            "suffix": cfg.suffix.spec.max_spec_tokens,
            "suffix-tree": cfg.suffix.spec.max_spec_tokens,
            "ngram": cfg.ngram.k,
        }
        self.model_fallback = next((d for d in ("eagle3", "draft-lm") if d in self.verifier.max_draft), None)
        self._add_hybrids(cfg)
        self._grammars: GrammarCompiler | None = None
        if self.default_method != cfg.default_method:  # said once, not per request
            log.warning(
                "default method %s cannot run on these models (a drafter is missing); requests that "
                "name no method get %s",
                cfg.default_method,
                self.default_method,
            )

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output patterns over the tokenizer: the in-process verifier's compiler, so
        each pattern compiles once per process."""
        if self._grammars is None:
            self._grammars = (
                self.verifier.grammars
                if isinstance(self.verifier, VerifierCore)
                else GrammarCompiler(self.tokenizer, self.verifier.vocab_size)
            )
        return self._grammars

    def _add_hybrids(self, cfg: EngineConfig) -> None:
        """hybrid / hybrid-rule: the suffix cache + the verifier's model drafter as fallback."""
        from services.drafter.hybrid import DecisionRule, PredictorRule, ScoreRule

        if self.model_fallback is None:
            return
        rules: dict[str, DecisionRule] = {"hybrid-rule": ScoreRule(cfg.hybrid.score_threshold)}
        from services.predictor.features import TokenFlags

        if cfg.predictor_addr:
            from services.predictor.client import RemotePredictor

            rules["hybrid"] = PredictorRule(
                RemotePredictor(cfg.predictor_addr), TokenFlags(self.tokenizer), cfg.hybrid.tau
            )
        elif cfg.predictor is not None and (Path(cfg.predictor) / "config.json").exists():
            from services.predictor.mlp import YieldMLP

            rules["hybrid"] = PredictorRule(YieldMLP.load(cfg.predictor), TokenFlags(self.tokenizer), cfg.hybrid.tau)
        for name, rule in rules.items():
            self.add_hybrid(name, rule, cost_aware=cfg.hybrid.cost_aware and name == "hybrid")
        if "hybrid" in rules and "suffix-tree" in self.drafters and "eagle3-tree" in self.verifier.max_draft:
            self.add_hybrid(
                "hybrid-tree",
                rules["hybrid"],
                cfg.hybrid.cost_aware,
                cache="suffix-tree",
                fallback="eagle3-tree",
                both=True,
            )
        if "hybrid" in rules and self.model_fallback != "draft-lm" and "draft-lm" in self.verifier.max_draft:
            self.add_hybrid("hybrid-lm", rules["hybrid"], cfg.hybrid.cost_aware, fallback="draft-lm")

    def add_hybrid(
        self,
        name: str,
        rule,
        cost_aware: bool = False,
        fallback: str | None = None,
        cache: str = "suffix",
        both: bool = False,
    ) -> None:
        """A hybrid of the suffix cache (drafter ``cache``) and ``fallback`` (default: the EAGLE-3
        head, else the draft LM); ``both``: its model cycles verify the cache draft too."""
        from services.drafter.hybrid import CycleCosts, HybridDrafter

        model = fallback or self.model_fallback
        assert model is not None, "a hybrid needs a model drafter"
        limits = (self.max_draft["suffix"], self.max_draft[model])
        self.drafters[name] = HybridDrafter(
            name, self.drafters[cache], model, rule, *limits, costs=CycleCosts() if cost_aware else None, both=both
        )
        self.max_draft[name] = max(limits)

    def close(self) -> None:
        """Flush state shared with other replicas (suffix-feed outputs, correction memory)."""
        self.scheduler.close()
        if self.suffix_feed is not None:
            self.suffix_feed.close()
        self.verifier.close()
        if self._grammars is not None:
            self._grammars.close()

    @property
    def context_len(self) -> int:
        return self.verifier.context_len

    @property
    def default_method(self) -> str:
        """The configured default when its models are loaded, else the best available method."""
        available = self.methods()
        for m in (self.cfg.default_method, "hybrid", "eagle3", "sd", "vanilla"):  # lossless fallbacks only
            if m in available:
                return m
        return available[0]

    def model_drafter(self, method: MethodSpec) -> str | None:
        return self.model_fallback if method.model_drafter == MODEL else method.model_drafter

    def methods(self) -> list[str]:
        def available(m: MethodSpec) -> bool:
            model = self.model_drafter(m)
            return (m.router_drafter is None or m.router_drafter in self.drafters) and (
                m.model_drafter is None or model in self.verifier.max_draft
            )

        return [m.name for m in METHODS.values() if available(m)]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; a client's text prompt takes the tokenizer's special tokens
        (its BOS token, where it adds one), as vLLM's and SGLang's do, pieces of text do not."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_fit(self, text: str, max_new_tokens: int) -> list[int]:
        """Encode for offline tools (bench, trace, calibrate) as the API encodes a text prompt
        (with the tokenizer's special tokens), then keep its last tokens so prompt +
        max_new_tokens fits the context, and a leading special token (BOS) before them. The
        public API rejects long prompts instead."""
        ids = self.encode(text, add_special_tokens=True)
        room = self.context_len - max_new_tokens
        if len(ids) <= room:
            return ids
        lead = ids[:1] if ids[0] in self.tokenizer.all_special_ids else []
        return lead + ids[len(ids) - room + len(lead) :]

    def bad_word_ids(self, words) -> tuple[tuple[int, ...], ...]:
        """vLLM's bad_words as token sequences: each word as written and with one leading space
        (how it reads after another word)."""
        words = [w for w in words if w.strip()]
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
        seqs = {tuple(self.encode(p + w.lstrip())) for w in words for p in ("", " ")}
        if any(len(s) > MAX_BAD_WORD_TOKENS for s in seqs):
            raise InvalidRequest(f"bad_words: each word at most {MAX_BAD_WORD_TOKENS} tokens")
        return tuple(sorted(s for s in seqs if s))

    def truncate(self, ids: list[int], keep: int | None, max_new_tokens: int) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last ``keep`` tokens; -1 keeps what fits
        the context beside max_new_tokens; None keeps all."""
        if keep is None:
            return ids
        if keep == -1:
            keep = max(1, self.context_len - max_new_tokens)
        if keep < 1:
            raise InvalidRequest(
                f"truncate_prompt_tokens: must be >= 1 (tokens kept from the prompt's end), or -1 "
                f"(keep what fits the context), got {keep}"
            )
        return ids[-keep:]

    def validate(self, req: GenerationRequest) -> None:
        if len(req.request_id) > MAX_REQUEST_ID:
            raise InvalidRequest(f"request_id: at most {MAX_REQUEST_ID} characters, got {len(req.request_id)}")
        if not req.prompt_ids:
            raise InvalidRequest("prompt: must not be empty (set `prompt` or `prompt_token_ids`)")
        vocab = self.verifier.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            raise InvalidRequest(f"prompt_token_ids: every id must be in [0, {vocab})")
        if not 0 < req.max_new_tokens <= self.cfg.max_new_tokens_limit:
            raise InvalidRequest(
                f"max_new_tokens: must be in [1, {self.cfg.max_new_tokens_limit}], got {req.max_new_tokens}"
            )
        if len(req.prompt_ids) + req.max_new_tokens > self.context_len:
            raise InvalidRequest(
                f"prompt: {len(req.prompt_ids)} prompt tokens + max_new_tokens {req.max_new_tokens} exceed "
                f"the context of {self.context_len} tokens; shorten the prompt or lower max_new_tokens"
            )
        validate_sampling(req.sampling)
        validate_token_ids(req.sampling, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(req, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise InvalidRequest(f"{name}: must be in [0, {MAX_LOGPROBS}] (alternatives per token), got {n}")
        if not 0 <= req.min_tokens <= req.max_new_tokens:
            raise InvalidRequest(
                f"min_tokens: must be in [0, max_new_tokens={req.max_new_tokens}], got {req.min_tokens}"
            )
        if len(req.stop) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in req.stop):
            raise InvalidRequest(f"stop: at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters")
        if len(req.stop_token_ids) > MAX_STOPS or any(not 0 <= t < vocab for t in req.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids: at most {MAX_STOPS} ids, each in [0, {vocab})")
        if len(req.cache_salt) > MAX_CACHE_SALT:
            raise InvalidRequest(f"cache_salt: at most {MAX_CACHE_SALT} characters, got {len(req.cache_salt)}")
        if (req.method or self.default_method) not in self.methods():
            raise InvalidRequest(f"method: unknown method {req.method!r}; choose one of {', '.join(self.methods())}")
        if not 1 <= req.n <= MAX_N:
            raise InvalidRequest(f"n: must be in [1, {MAX_N}] (completions of the prompt), got {req.n}")
        if req.structured is not None:
            self._validate_structured(req)

    def _validate_structured(self, req: GenerationRequest) -> None:
        """What can be told without compiling (``StructuredOutput.check``), and that nothing but
        the grammar decides where the output ends. (The pattern compiles once the request is
        admitted: ``compile_grammar``.)"""
        assert req.structured is not None, "called for a structured request"
        if req.ignore_eos or req.min_tokens:
            raise InvalidRequest(
                "structured_output: cannot be combined with ignore_eos or min_tokens "
                "(the grammar decides where the output may end)"
            )
        try:
            req.structured.check()
        except GrammarError as e:
            raise InvalidRequest(str(e)) from None

    def compile_grammar(self, req: GenerationRequest) -> tuple[str, GrammarCursor] | None:
        """The request's structured-output pattern and a cursor at its start (None: none asked),
        compiled in the grammar workers (``GrammarCompiler``: a bounded pool, each pattern once).
        A front end calls it only once the request holds its session slots, so requests refused
        for load compile nothing. InvalidRequest for a pattern that cannot be used, Overloaded
        while every worker stays busy."""
        if req.structured is None:
            return None
        try:
            pattern = req.structured.pattern(self.grammars.schema_regex)
            return pattern, GrammarCursor.after(self.grammars.compile(pattern), [])
        except GrammarError as e:
            raise InvalidRequest(str(e)) from None

    def with_method(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` naming its method: one that names none gets ``default_method``."""
        return req if req.method else replace(req, method=self.default_method)

    def generate(self, req: GenerationRequest) -> "Generation":
        req = self.with_method(req)
        self.validate(req)
        if req.n != 1:
            raise InvalidRequest("n: one Generation is one completion; use generate_all for n > 1")
        return Generation(self, req, req.request_id or f"req-{uuid.uuid4().hex}")

    def generate_all(self, req: GenerationRequest) -> "Completions":
        """The request's ``n`` completions, each its own session (vLLM's n): completion i of a
        seeded request samples with seed + i, so each equals the single request with that seed."""
        req = self.with_method(req)
        self.validate(req)
        rid = req.request_id or f"req-{uuid.uuid4().hex}"
        if req.n == 1:
            return Completions([Generation(self, req, rid)])
        sp = req.sampling
        gens = [
            Generation(
                self, replace(req, n=1, sampling=sp if sp.seed is None else replace(sp, seed=sp.seed + i)), f"{rid}-{i}"
            )
            for i in range(req.n)
        ]
        for g in gens[1:]:
            g.prompt_repeat = True  # the same prompt: its tokens count once in usage (OpenAI's, vLLM's)
        return Completions(gens)


def prepare_step(gens: list[Generation]) -> list[CycleRequest | BaseException]:
    """One step's cycle requests, one per generation (its router draft or the drafter to ask).
    Each router drafter is asked once for all of its sessions in the step
    (``Drafter.propose_batch``: a hybrid consults its predictor once over them, a remote drafter
    answers in one call); a drafter that fails fails its sessions' cycles, and only theirs.
    What a drafter left for later (``Drafter.after_step``) runs once the step is sent."""
    t0 = time.perf_counter()
    budgets = [g._budget() for g in gens]
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gens):
        if g.drafter is not None and budgets[i] > 0:
            groups.setdefault(id(g.drafter), []).append(i)
    choices: list[Draft | Delegate | BaseException | None] = [None] * len(gens)
    for idx in groups.values():
        drafter = gens[idx[0]].drafter
        assert drafter is not None, "grouped by their router drafter"
        try:
            drafts: list = drafter.propose_batch([(gens[i].session_id, budgets[i]) for i in idx])
        except Exception as e:
            drafts = [e] * len(idx)
        for i, d in zip(idx, drafts):
            choices[i] = d
        gens[idx[0]].engine.scheduler.defer(drafter.after_step)  # once the step is sent
    t1 = time.perf_counter()
    out: list[CycleRequest | BaseException] = []
    for g, budget, choice in zip(gens, budgets, choices):
        g._t0, g._t1 = t0, t1  # the step's drafting is every session's wait for its draft
        try:
            out.append(choice if isinstance(choice, BaseException) else g._request(budget, choice))
        except Exception as e:
            out.append(e)
    return out


class LoopOutbox:
    """What the engine's threads hand to one event loop's queues, delivered in batches: a put
    wakes the loop only when no delivery is pending, so a step's outputs to every stream on the
    loop cost one wake-up (a write to its self-pipe), not one each. Each queue gets its items
    in the order they were put. After the loop closed (its consumers gone) puts are dropped."""

    _of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    _made = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop, self._lock = weakref.ref(loop), threading.Lock()  # (a box must not keep its loop)
        self._items: list[tuple[asyncio.Queue, Any]] = []

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopOutbox":
        with cls._made:
            box = cls._of.get(loop)
            if box is None:
                box = cls._of[loop] = cls(loop)
            return box

    def put(self, q: asyncio.Queue, item) -> None:
        with self._lock:
            self._items.append((q, item))
            if len(self._items) > 1:  # a delivery is already on its way
                return
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: no one reads these any more
            with self._lock:
                self._items.clear()

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for q, item in items:
            q.put_nowait(item)


class LoopQueue:
    """The outputs of a request whose consumer runs on an event loop: the engine's threads put
    (through the loop's ``LoopOutbox``), the loop's coroutine awaits."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._box, self._queue = LoopOutbox.of(loop), asyncio.Queue()  # type: ignore[var-annotated]

    def put(self, item) -> None:
        self._box.put(self._queue, item)

    async def get(self):
        return await self._queue.get()


class Completions:
    """A request's completions, streamed together: iterate for ``(index, step)`` pairs and
    ``(index, None)`` when completion ``index`` has finished. The engine's scheduler steps them
    with every other session; their outputs meet in one queue."""

    def __init__(self, gens: list["Generation"]):
        self.gens = gens
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        for i, g in enumerate(gens):
            g.out, g.index = self._out, i

    def cancel(self) -> None:
        for g in self.gens:
            g.cancel()

    def prepare(self) -> None:
        """Each completion's grammar compiled (``Generation.prepare``): after admission."""
        for g in self.gens:
            g.prepare()

    def __iter__(self) -> Generator[tuple[int, "StepOutput | None"], None, None]:
        try:
            for g in self.gens:
                g.start()
            left = len(self.gens)
            while left:
                i, item = self._out.get()
                if isinstance(item, BaseException):
                    raise item
                left -= item is None
                yield i, item
        finally:
            self.close()

    def close(self) -> None:
        """Stop every completion still running and wait for their sessions to close."""
        for g in self.gens:
            g.stop()

    async def stream(self) -> AsyncGenerator[tuple[int, "StepOutput | None"], None]:
        """``__iter__`` for a consumer on an event loop. Opening the sessions (which may wait on
        a remote verifier) runs in a worker thread, in the caller's context; the outputs come
        to the loop itself (``LoopQueue``): no thread waits for them, so any number of streams
        share the loop's few workers. If the consumer stops early (cancelled: its client went
        away), every completion is cancelled at once, a prompt mid-prefill included; the
        scheduler closes their sessions."""
        left = len(self.gens)
        out = LoopQueue(asyncio.get_running_loop())
        for g in self.gens:
            g.out = out
        try:
            await asyncio.to_thread(self._start)
            while left:
                i, item = await out.get()
                if isinstance(item, BaseException):
                    raise item
                left -= item is None
                yield i, item
        finally:
            if left:
                self.cancel()

    def _start(self) -> None:
        for g in self.gens:
            g.start()


class Generation:
    """One request's decode loop; iterate for per-cycle outputs. Closing it frees the session."""

    def __init__(self, engine: Engine, req: GenerationRequest, req_id: str):
        self.engine, self.req, self.req_id = engine, req, req_id
        # The key of its verifier session and drafter state, made here: the client's request id is
        # only a label (logs, metrics, replies, aborts), so two requests that share one run apart.
        self.session_id = uuid.uuid4().hex
        self.prompt_repeat = False  # another completion of a prompt already counted (n > 1)
        self.method = METHODS[req.method]
        self.drafter = engine.drafters[self.method.router_drafter] if self.method.router_drafter else None
        self.model_drafter = engine.model_drafter(self.method)
        self.max_draft = max(
            engine.max_draft.get(self.method.router_drafter, 0), engine.max_draft.get(self.model_drafter, 0)
        )
        self.stats = SpecStats()
        self.timings = Timings()
        self.metrics = MethodMetrics.of(req.method, req.log_metrics)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.matched: int | str | None = None  # what stopped it: the EOS or stop token id, or the stop string
        self._detok = Detokenizer(engine.tokenizer, req.skip_special_tokens)
        self._raw = ""  # all detokenized output; ``text`` is the part already streamed
        self._detokenized = 0  # output tokens in ``_raw``
        self._stop_window = max((len(s) for s in req.stop), default=1)
        self._batch = 1  # sessions in the verifier step of the last cycle
        self.cached_tokens = 0  # prompt tokens the verifier's prefix cache gave
        self.logprobs: list[TokenLogprob] = []  # per output token, when the request asked
        self.prompt_logprobs: list[TokenLogprob] = []  # per prompt token after the first, when asked
        self._session: Session | None = None
        self._cancelled = self._aborted = False
        # (index, StepOutput | error | None at the end); a LoopQueue for a consumer on an event loop
        self.out: queue.SimpleQueue | LoopQueue = queue.SimpleQueue()
        self.index = 0  # its place among the request's completions
        self._released = threading.Event()
        self._t0 = self._t1 = 0.0  # the cycle in flight: when it began, when its draft was ready
        self.pattern: str | None = None  # the structured-output pattern, once compiled (``prepare``)
        self.grammar: GrammarCursor | None = None
        self._prepared = False

    @property
    def stop_reason(self) -> int | str | None:
        """vLLM's stop_reason: the stop string or stop token id that ended the completion; None
        for the end-of-sequence token, the length limit, or one still running."""
        return self.matched if self.finish_reason == "stop" else None

    def abort(self) -> None:
        """End the completion before its next cycle as a finished one, finish_reason "abort"
        (SGLang's /abort_request; any thread): its client gets what was generated so far."""
        self._aborted = True

    def cancel(self) -> None:
        """The client went away (any thread): the cycle in flight ends with ``SessionCancelled``
        and the verifier stops it at its next step, a prompt mid-prefill included
        (``VerifierSession.cancel`` in process, ``RemoteSession.cancel`` over the network,
        ``RaySession.cancel`` through Serve)."""
        self._cancelled = True
        if self._session is not None:
            self._session.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def aborted(self) -> bool:
        return self._aborted

    @property
    def session(self) -> Session:
        assert self._session is not None, "the generation has started"
        return self._session

    def __iter__(self) -> Generator[StepOutput, None, None]:
        try:
            self.start()
            assert isinstance(self.out, queue.SimpleQueue), "an event loop's consumer reads Completions.stream"
            while (item := self.out.get()[1]) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stop()

    def prepare(self) -> None:
        """Compile the request's grammar (``Engine.compile_grammar``), once; ``start`` does it if
        no one has. A front end calls it right after admission, so a bad pattern is refused with
        the request's own status before its stream starts."""
        if not self._prepared:
            compiled = self.engine.compile_grammar(self.req)
            if compiled is not None:
                self.pattern, self.grammar = compiled
            self._prepared = True

    def start(self) -> None:
        """Open the verifier session (in the caller's thread: a refusal reaches it as raised)
        and hand the generation to the engine's scheduler."""
        self.prepare()
        req = self.req
        self._session = self.engine.verifier.open(
            SessionSpec(
                prompt_ids=req.prompt_ids,
                max_new_tokens=req.max_new_tokens,
                sampling=req.sampling,
                policy=self.method.policy,
                model_drafter=self.model_drafter,
                max_draft=self.max_draft,
                on_demand=self.drafter is not None and self.model_drafter is not None,
                session_id=self.session_id,
                deadline_s=req.deadline_s,
                logprobs=req.logprobs,
                cache_salt=req.cache_salt,
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
                prompt_logprobs=req.prompt_logprobs,
                grammar=self.pattern,
            )
        )
        if self._cancelled:
            self.cancel()
        if not self.prompt_repeat:
            self.metrics.prompt.inc(len(req.prompt_ids))
        try:
            if self.drafter:
                self.drafter.start(
                    self.session_id,
                    req.prompt_ids,
                    req.sampling,
                    None,
                    req.max_new_tokens,
                    scope=req.cache_salt or None,
                )
            self.engine.scheduler.add(self)
        except BaseException:
            self.release()  # nothing will step it: its session closes here
            raise

    def stop(self, wait_s: float = 120.0) -> None:
        """Cancel the generation unless it has ended, and wait until its session is closed."""
        if self._session is None or self._released.is_set():
            return
        self.cancel()
        if not self._released.wait(wait_s):
            log.warning("request %r: its session was not closed within %.0f s", self.req_id, wait_s)

    def emit(self, item: "StepOutput | BaseException | None") -> None:
        """To the consumer: an output, the error that ended the generation, or None at its end;
        once the next step is sent, in order (``Scheduler.defer``)."""
        self.engine.scheduler.defer(partial(self.out.put, (self.index, item)))

    def release(self) -> None:
        """Close the session and the router drafter's state; count the request (the scheduler's
        thread, once the generation has ended)."""
        self.timings.end = time.perf_counter()
        try:
            self.session.close()
        finally:
            if self.drafter:
                self.drafter.stop(self.session_id)
            self.metrics.e2e.observe(self.timings.wall_s)
            if self.req.log_metrics:
                REQUESTS.labels(self.req.method, self.finish_reason or "cancelled").inc()
            self._released.set()

    def end_by_abort(self) -> None:
        """Finish now; the text held back for stop strings follows as the last output, after
        the outputs still waiting to be published."""
        self.finish_reason = "abort"
        self.engine.scheduler.defer(self._publish_rest)

    def _publish_rest(self) -> None:
        if delta := self._delta():
            self.out.put((self.index, StepOutput([], delta)))

    def _request(self, budget: int, choice: Draft | Delegate | None) -> CycleRequest:
        """What the verifier should verify this cycle, given the router drafter's ``choice``
        (None: no router drafter, or no budget)."""
        if budget <= 0:
            return CycleRequest()
        if choice is None:
            return CycleRequest(draft_with=self.model_drafter, budget=budget) if self.model_drafter else CycleRequest()
        assert self.drafter is not None, "a choice comes from the router drafter"
        if isinstance(choice, Delegate):  # the cache draft beside it, unless a grammar or bad words must vet it
            also = choice.also if self.grammar is None and not self.req.sampling.bad_words else ()
            return CycleRequest(
                draft_with=choice.drafter,
                budget=min(budget, choice.budget),
                draft_ids=also,
                draft_source="suffix" if also else "none",
            )
        tree = choice.is_tree
        if tree and (self.grammar is not None or self.req.sampling.bad_words):
            choice, tree = choice.chain(), False  # the checks below read a chain
        if tree:
            return CycleRequest(
                draft_ids=tuple(choice.token_ids), draft_parents=tuple(choice.parents), draft_source=choice.source
            )
        draft = self._without_bad_words(self._grammatical(choice.token_ids))
        if len(draft) < len(choice.token_ids):
            self.drafter.verified(self.session_id, len(draft))
        return CycleRequest(draft_ids=tuple(draft), draft_source=choice.source)

    def _grammatical(self, draft: list[int]) -> list[int]:
        """A router draft up to its first token the grammar forbids (it would be rejected)."""
        if self.grammar is None:
            return draft
        state: int | None = self.grammar.state
        for i, t in enumerate(draft):
            state = self.grammar.automaton.next(state, t)
            if state is None:
                return draft[:i]
        return draft

    def _without_bad_words(self, draft: list[int]) -> list[int]:
        """A router draft up to its first token that completes a bad word (the target bans it)."""
        words = self.req.sampling.bad_words
        if not words:
            return draft
        keep = max(len(w) for w in words) - 1  # the context a word's match can reach back
        context = self.output_ids[max(0, len(self.output_ids) - keep) :] if keep else []
        for i, t in enumerate(draft):
            if t in banned_tokens(context, words):
                return draft[:i]
            context = (context + [t])[max(0, len(context) + 1 - keep) :] if keep else []
        return draft

    def _budget(self) -> int:
        """Draft tokens this cycle may verify: none past the length limit, and none while the
        verifier batches more sessions than ``spec_disable_batch`` (vLLM's
        speculative_disable_by_batch_size): a loaded step is compute-bound, and verifying
        drafts that get rejected then slows every session in it."""
        limit = self.engine.cfg.spec_disable_batch
        if limit and self._batch > limit:
            return 0
        return max(0, min(self.max_draft, self.req.max_new_tokens - len(self.output_ids) - 1))

    def apply(self, res: CycleResult) -> None:
        """The verifier's outcome of this cycle. What the next step needs happens now (router
        drafters observe, the tokens are taken up to where the request stops); the rest (text,
        counts, metrics, the output to its queue) once that step is sent (``_publish``)."""
        t2 = time.perf_counter()
        self._batch = res.batch_size
        # usage counts the prompt's own tokens (a failover's re-open may hit on tokens generated since)
        self.cached_tokens = min(len(self.req.prompt_ids), self.cached_tokens + res.cached_tokens)
        self.prompt_logprobs += res.prompt_logprobs
        if self.drafter:
            self.drafter.observe(self.session_id, res.committed)
        if self.grammar is not None:
            self.grammar.advance(res.committed)
        new_ids = self._take(res.committed)
        # the cycle's clock as of now: the next prepare restarts it before this is published
        self.engine.scheduler.defer(partial(self._publish, res, new_ids, (self._t0, self._t1, t2)))

    def _publish(self, res: CycleResult, new_ids: list[int], clock: tuple[float, float, float]) -> None:
        """A cycle's output to the consumer, with its text, and its counts (after ``apply``);
        ``clock``: when the cycle began, when its draft was ready, when its outcome came."""
        t0, t1, t2 = clock
        if self.stats.cycles == 0:  # the first cycle reads the prompt
            self.metrics.prefill.observe(t2 - t0)
        draft_s = (t1 - t0) + res.draft_s
        self.timings.draft_s += draft_s
        self.timings.verify_s += res.verify_s
        self.stats.add(res.drafted, res.accepted, res.source, res.rescued_pairs, res.rejected)
        out = StepOutput(new_ids, self._delta())
        if new_ids and self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.timings.ttft_s)
        if self.req.logprobs is not None:  # the emitted tokens are a prefix of the committed ones
            out.logprobs = list(res.logprobs[: len(new_ids)])
            self.logprobs += out.logprobs
        waited = t2 - t1  # for the verifier's answer
        self.metrics.cycle(
            res.source,
            res.drafted,
            res.accepted,
            len(new_ids),
            len(res.rescued_pairs),
            res.rejected,
            t2 - t0,
            draft_s,
            res.verify_s,
            res.gate_s,
            max(0.0, waited - res.server_s) if self.engine.remote_verifier else 0.0,
        )
        if out.token_ids or out.text:
            self.out.put((self.index, out))

    def _take(self, tokens: list[int]) -> list[int]:
        """Append tokens one by one, stopping at EOS, the length limit, a stop token (kept) or a
        stop string; the tokens taken. Text is detokenized here only when stop strings need it
        (else later, in ``_delta``)."""
        new_ids = []
        for tok in tokens:
            if tok == self.engine.eos_id and not self.req.ignore_eos:
                self.finish_reason, self.matched = "eos", tok
                break
            new_ids.append(tok)
            self.output_ids.append(tok)
            if self.req.stop and self._find_stop(self._detokenize()):
                self.finish_reason = "stop"
                break
            if tok in self.req.stop_token_ids:
                self.finish_reason, self.matched = "stop", tok
                break
            if len(self.output_ids) >= self.req.max_new_tokens:
                self.finish_reason = "length"
                break
        self.stats.generated_tokens = len(self.output_ids) + (self.finish_reason == "eos")
        return new_ids

    def _detokenize(self) -> int:
        """Bring the raw text up to the tokens taken; its length before."""
        before = len(self._raw)
        while self._detokenized < len(self.output_ids):
            self._raw += self._detok.push(self.output_ids[self._detokenized])
            self._detokenized += 1
        return before

    def _delta(self) -> str:
        """The text not yet streamed. With stop strings, the last ``len(longest stop) - 1``
        characters are held back until the request ends, so a stop string is never partly
        streamed; it is emitted only with ``include_stop_str_in_output``."""
        self._detokenize()
        safe = len(self._raw) if self.finish_reason else max(0, len(self._raw) - self._stop_window + 1)
        delta = self._raw[len(self.text) : max(safe, len(self.text))]
        self.text += delta
        return delta

    def _find_stop(self, before: int) -> bool:
        """Truncate the raw text at the first stop string that ends in the new characters (after
        it, with ``include_stop_str_in_output``)."""
        first = None
        for s in self.req.stop:
            i = self._raw.find(s, max(0, before - len(s) + 1))
            if i != -1 and (first is None or i < first[0]):
                first = (i, len(s))
        if first is not None:
            self.matched = self._raw[first[0] : first[0] + first[1]]
            self._raw = self._raw[: first[0] + first[1] * self.req.include_stop_str_in_output]
        return first is not None

    def result(self) -> dict:
        """Run to completion (if not yet: a generation that has run, alone or among its request's
        completions, is not run again) and return the `generate --json` object."""
        if not self._released.is_set():
            for _ in self:
                pass
        t = self.timings
        stats = self.stats.to_dict()
        stats.update(
            wall_s=round(t.wall_s, 4),
            ttft_s=round(t.ttft_s or 0.0, 4),
            verify_s=round(t.verify_s, 4),
            draft_s=round(t.draft_s, 4),
        )
        out: dict[str, object] = {
            "text": self.text,
            "token_ids": list(self.output_ids),
            "finish_reason": self.finish_reason,
            "method": self.req.method,
            "prompt_tokens": len(self.req.prompt_ids),
            "cached_prompt_tokens": self.cached_tokens,
            "stats": stats,
        }
        for name, lps in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if getattr(self.req, name) is not None:
                out[name] = [
                    {
                        "token_id": x.token_id,
                        "logprob": round(x.logprob, 6),
                        "top": [[i, round(v, 6)] for i, v in x.top],
                    }
                    for x in lps
                ]
        return out
