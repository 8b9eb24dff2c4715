"""Embedded engine: tokenizer, target runner, drafters, and the speculative decode loop.

One cycle = draft → verify (one target forward) → policy verdict → commit → observe.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

import torch

from services.common.config import EngineConfig
from services.common.metrics import REQUESTS, MethodMetrics
from services.common.llama import Llama
from services.common.sampling import make_rng
from services.common.types import Draft, SamplingParams, SpecStats
from services.drafter.base import DRAFTERS, Drafter
from services.router.detok import Detokenizer
from services.memory.correction_memory import LocalCorrectionMemory
from services.memory.snapshot import load_snapshot
from services.verifier.policies import POLICIES, CalibratedGreedy
from services.verifier.runner import TargetRunner

from services.drafter.suffix import GlobalSuffixCache, SuffixConfig, SuffixDrafter



@dataclass(frozen=True)
class MethodSpec:
    name: str
    drafter: str | None      # name in DRAFTERS; None = target only
    policy: str              # name in POLICIES
    description: str


METHODS: dict[str, MethodSpec] = {m.name: m for m in (
    MethodSpec("vanilla", None, "lossless", "target model alone, one token per forward"),
    MethodSpec("sd", "draft-lm", "lossless", "draft LM chain drafts, lossless verification"),
    MethodSpec("suffix", "suffix", "lossless", "suffix-cache drafts (prompt + past outputs), lossless verification"),
    MethodSpec("eagle3", "eagle3", "lossless", "EAGLE-3 head chain drafts on the target's hidden states, lossless"),
    MethodSpec("hybrid", "hybrid", "lossless", "HVD: suffix draft when its predicted yield > tau, else EAGLE-3"),
    MethodSpec("hybrid-csd", "hybrid", "csd", "HVD drafting + calibrated verification (the full system)"),
    MethodSpec("hybrid-rule", "hybrid-rule", "lossless", "baseline hybrid: suffix draft when its score >= threshold"),
    MethodSpec("csd", "draft-lm", "csd", "draft LM + calibrated verification (correction memory + gate), greedy"),
    MethodSpec("scg", "draft-lm", "scg", "ablation of csd: the gate without the correction memory"),
)}


class InvalidRequest(ValueError):
    """A request field is out of range; the message names the field and what to fix."""


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    method: str = "sd"
    request_id: str = ""


@dataclass
class StepOutput:
    token_ids: list[int]
    text: str


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
    def __init__(self, cfg: EngineConfig = EngineConfig()):
        from transformers import AutoTokenizer

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        dtype = getattr(torch, cfg.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(str(cfg.target))
        self.eos_id = self.tokenizer.eos_token_id
        self.runner = TargetRunner(Llama.from_pretrained(cfg.target, dtype, cfg.device))
        self.drafters: dict[str, Drafter] = {}
        self.max_draft: dict[str, int] = {}
        if cfg.draft is not None:
            self.drafters["draft-lm"] = DRAFTERS["draft-lm"](Llama.from_pretrained(cfg.draft, dtype, cfg.device))
            self.max_draft["draft-lm"] = cfg.num_speculative_tokens
        self.suffix_cache = GlobalSuffixCache(cfg.suffix.max_depth, cfg.suffix.max_cached_requests)
        self.suffix_feed = None
        if cfg.redis_url:
            from services.memory.redis_link import RedisLink
            from services.memory.suffix_feed import SuffixFeed

            self.suffix_feed = SuffixFeed(RedisLink(cfg.redis_url, "suffix_feed"), self.suffix_cache).start()
        self.drafters["suffix"] = SuffixDrafter(cfg.suffix, self.suffix_cache,
                                                self.suffix_feed.publish if self.suffix_feed else None)
        self.max_draft["suffix"] = cfg.suffix.spec.max_spec_tokens
        if cfg.eagle3 is not None and (Path(cfg.eagle3) / "config.json").exists():
            from services.drafter.eagle3 import Eagle3Head

            head = Eagle3Head.from_pretrained(cfg.eagle3, self.runner.model.embed_tokens.weight, dtype, cfg.device)
            self.runner.capture_layers = head.aux_layers
            self.drafters["eagle3"] = DRAFTERS["eagle3"](head)
            self.max_draft["eagle3"] = cfg.eagle3_k
        self._add_hybrids(cfg)
        self.memory = self._open_memory(cfg)
        self.policies = {**POLICIES, "csd": CalibratedGreedy(cfg.gate, self.memory),
                         "scg": CalibratedGreedy(replace(cfg.gate, use_memory=False))}
        self._ids = itertools.count()

    def _add_hybrids(self, cfg: EngineConfig) -> None:
        """hybrid / hybrid-rule: suffix cache + a model drafter (EAGLE-3, else the draft LM)."""
        from services.router.hybrid import HybridDrafter, PredictorRule, ScoreRule

        fallback = "eagle3" if "eagle3" in self.drafters else "draft-lm" if "draft-lm" in self.drafters else None
        if fallback is None:
            return
        suffix, model = self.drafters["suffix"], self.drafters[fallback]
        limits = (self.max_draft["suffix"], self.max_draft[fallback])
        rules = {"hybrid-rule": ScoreRule(cfg.hybrid.score_threshold)}
        if cfg.predictor is not None and (Path(cfg.predictor) / "config.json").exists():
            from services.predictor.features import TokenFlags
            from services.predictor.mlp import YieldMLP

            rules["hybrid"] = PredictorRule(YieldMLP.load(cfg.predictor), TokenFlags(self.tokenizer), cfg.hybrid.tau)
        for name, rule in rules.items():
            self.drafters[name] = HybridDrafter(name, suffix, model, rule, *limits)
            self.max_draft[name] = max(limits)

    @staticmethod
    def _open_memory(cfg: EngineConfig):
        """Correction memory: Redis-shared when configured, else in-process; calibration prior loaded."""
        prior = load_snapshot(cfg.ocm_snapshot) if cfg.ocm_snapshot and Path(cfg.ocm_snapshot).exists() else None
        if cfg.redis_url:
            from services.memory.redis_link import RedisLink
            from services.memory.redis_memory import RedisCorrectionMemory

            memory = RedisCorrectionMemory(RedisLink(cfg.redis_url, "ocm"))
            if prior:
                memory.ensure_prior(prior)
            return memory
        memory = LocalCorrectionMemory()
        if prior:
            memory.restore(prior)
        return memory

    def close(self) -> None:
        """Flush state shared with other replicas (pending suffix-feed outputs)."""
        if self.suffix_feed is not None:
            self.suffix_feed.close()
        self.memory.close()

    @property
    def context_len(self) -> int:
        return self.runner.max_positions

    def methods(self) -> list[str]:
        return [m.name for m in METHODS.values() if m.drafter is None or m.drafter in self.drafters]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_fit(self, text: str, max_new_tokens: int) -> list[int]:
        """Encode for offline tools (bench, trace, calibrate): keep the prompt's last tokens so
        prompt + max_new_tokens fits the context. The public API rejects long prompts instead."""
        ids = self.encode(text)
        return ids[-(self.context_len - max_new_tokens):]

    def validate(self, req: GenerationRequest) -> None:
        sp = req.sampling
        if not req.prompt_ids:
            raise InvalidRequest("prompt: must not be empty (set `prompt` or `prompt_token_ids`)")
        if any(not 0 <= t < self.runner.model.s.vocab for t in req.prompt_ids):
            raise InvalidRequest(f"prompt_token_ids: every id must be in [0, {self.runner.model.s.vocab})")
        if not 0 < req.max_new_tokens <= self.cfg.max_new_tokens_limit:
            raise InvalidRequest(f"max_new_tokens: must be in [1, {self.cfg.max_new_tokens_limit}], got {req.max_new_tokens}")
        if len(req.prompt_ids) + req.max_new_tokens > self.context_len:
            raise InvalidRequest(
                f"prompt: {len(req.prompt_ids)} prompt tokens + max_new_tokens {req.max_new_tokens} exceed "
                f"the context of {self.context_len} tokens; shorten the prompt or lower max_new_tokens")
        if not sp.temperature >= 0 or sp.temperature != sp.temperature:
            raise InvalidRequest(f"temperature: must be >= 0, got {sp.temperature}")
        if not 0 < sp.top_p <= 1:
            raise InvalidRequest(f"top_p: must be in (0, 1], got {sp.top_p}")
        if sp.top_k < 0:
            raise InvalidRequest(f"top_k: must be >= 0 (0 disables it), got {sp.top_k}")
        if req.method not in self.methods():
            raise InvalidRequest(f"method: unknown method {req.method!r}; choose one of {', '.join(self.methods())}")

    def generate(self, req: GenerationRequest) -> "Generation":
        self.validate(req)
        return Generation(self, req, req.request_id or f"req-{next(self._ids)}")


class Generation:
    """One request's decode loop; iterate for per-cycle outputs. Closing it frees the session."""

    def __init__(self, engine: Engine, req: GenerationRequest, req_id: str):
        self.engine, self.req, self.req_id = engine, req, req_id
        self.method = METHODS[req.method]
        self.policy = engine.policies[self.method.policy]
        self.drafter = engine.drafters[self.method.drafter] if self.method.drafter else None
        self.max_draft = engine.max_draft[self.method.drafter] if self.method.drafter else 0
        self.rng = make_rng(req.sampling.seed)
        self.stats = SpecStats()
        self.timings = Timings()
        self.metrics = MethodMetrics.of(req.method)
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self._detok = Detokenizer(engine.tokenizer)
        self._raw = ""  # all detokenized output; ``text`` is the part already streamed
        self._stop_window = max((len(s) for s in req.stop), default=1)

    def __iter__(self) -> Iterator[StepOutput]:
        eng, req = self.engine, self.req
        capacity = len(req.prompt_ids) + req.max_new_tokens + self.max_draft + 1
        session = eng.runner.open(req.prompt_ids, capacity)
        if self.drafter:
            self.drafter.start(self.req_id, req.prompt_ids, req.sampling, self.rng, req.max_new_tokens)
        try:
            while self.finish_reason is None:
                out = self._cycle(session)
                if out.token_ids or out.text:
                    yield out
        finally:
            self.timings.end = time.perf_counter()
            if self.drafter:
                self.drafter.stop(self.req_id)
            self.metrics.e2e.observe(self.timings.wall_s)
            REQUESTS.labels(self.req.method, self.finish_reason or "cancelled").inc()

    def _budget(self, session) -> int:
        remaining = self.req.max_new_tokens - len(self.output_ids)
        room = session.cache.capacity - len(session.tokens) - 1
        return max(0, min(self.max_draft, remaining - 1, room))

    def _cycle(self, session) -> StepOutput:
        t0 = time.perf_counter()
        budget = self._budget(session)
        draft = self.drafter.propose(self.req_id, budget) if self.drafter and budget > 0 else Draft.empty()
        t1 = time.perf_counter()
        n_pending = len(session.pending)
        logits, hidden = self.engine.runner.verify(session, draft.token_ids)
        verdict = self.policy(draft, logits, self.req.sampling, self.rng)
        self.engine.runner.commit(session, verdict)
        eos = self.engine.eos_id
        # The request commits nothing past EOS; drafters and statistics see the same tokens.
        committed = verdict.tokens[:verdict.tokens.index(eos) + 1] if eos in verdict.tokens else verdict.tokens
        if self.drafter:
            states = None
            if getattr(self.drafter, "needs_target_states", False):  # fused features of the verified positions
                states = torch.cat(hidden, dim=-1)[0, :n_pending + verdict.accepted]
            self.drafter.observe(self.req_id, committed, states)
        t2 = time.perf_counter()
        self.timings.draft_s += t1 - t0
        self.timings.verify_s += t2 - t1
        self.stats.add(draft, verdict, len(committed))
        if verdict.first_rejection is not None and self.req.sampling.greedy:
            self.engine.memory.record([verdict.first_rejection])
        out = self._emit(committed)
        accepted = min(verdict.accepted, len(committed))
        self.metrics.cycle(draft.source, len(draft), accepted, len(out.token_ids), verdict.rescued,
                           verdict.first_rejection is not None and accepted < len(committed), t2 - t0)
        return out

    def _emit(self, tokens: list[int]) -> StepOutput:
        """Append tokens one by one, stopping at EOS, the length limit or a stop string.

        With stop strings, the last ``len(longest stop) - 1`` characters are held back until
        the request ends, so a stop string is never partly streamed; it is never emitted.
        """
        new_ids = []
        for tok in tokens:
            if tok == self.engine.eos_id:
                self.finish_reason = "eos"
                break
            new_ids.append(tok)
            self.output_ids.append(tok)
            before = len(self._raw)
            self._raw += self._detok.push(tok)
            if self._find_stop(before):
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.req.max_new_tokens:
                self.finish_reason = "length"
                break
        self.stats.generated_tokens = len(self.output_ids) + (self.finish_reason == "eos")
        safe = len(self._raw) if self.finish_reason else max(0, len(self._raw) - self._stop_window + 1)
        delta = self._raw[len(self.text):max(safe, len(self.text))]
        self.text += delta
        if new_ids and self.timings.first_token is None:
            self.timings.first_token = time.perf_counter()
            self.metrics.ttft.observe(self.timings.ttft_s)
        return StepOutput(new_ids, delta)

    def _find_stop(self, before: int) -> bool:
        """Truncate the raw text at the first stop string that ends in the new characters."""
        cut = None
        for s in self.req.stop:
            i = self._raw.find(s, max(0, before - len(s) + 1))
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self._raw = self._raw[:cut]
        return cut is not None

    def result(self) -> dict:
        """Run to completion (if not yet) and return the `generate --json` object."""
        for _ in self:
            pass
        t = self.timings
        stats = self.stats.to_dict()
        stats.update(wall_s=round(t.wall_s, 4), ttft_s=round(t.ttft_s or 0.0, 4),
                     verify_s=round(t.verify_s, 4), draft_s=round(t.draft_s, 4))
        return {"text": self.text, "token_ids": list(self.output_ids), "finish_reason": self.finish_reason,
                "method": self.req.method, "prompt_tokens": len(self.req.prompt_ids), "stats": stats}
