"""Verifier: target model, per-session KV caches, the drafters that live beside the target
(draft LM, EAGLE-3: they need its hidden states or its accelerator), acceptance policies,
and the correction-memory side effect.

One ``VerifierSession.cycle`` = one decoding cycle on the verifier side: take the router's
draft or draft locally, verify it in one target forward, apply the policy, commit, let the
local drafter observe (with the target's fused hidden states), record the first true
rejection. The router calls it in-process (embedded topology) or over a gRPC stream
(distributed); the code is the same.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch

from services.common.config import EngineConfig
from services.common.llama import Llama
from services.common.metrics import KV_CACHE_CAPACITY, VERIFIER_SESSIONS, redis_off
from services.common.packed_linear import pack_linears
from services.common.prefix_cache import PrefixCache, kv_bytes_per_position, salt_root
from services.common.sampling import Draws, apply_bias, apply_penalties, ban_bad_words, token_logprobs
from services.common.structured import GrammarCompiler, GrammarCursor
from services.common.token_tree import graft
from services.common.types import (
    CycleRequest,
    CycleResult,
    Draft,
    Session,
    SessionCancelled,
    SessionSpec,
    TokenLogprob,
    Verdict,
)
from services.drafter.base import DRAFTERS, Drafter, ModelDrafter
from services.memory.correction_memory import LocalCorrectionMemory, SaltedMemories
from services.memory.snapshot import load_snapshot
from services.verifier import faults
from services.verifier.backend import Cycles, Done, run_step
from services.verifier.batcher import CycleBatcher, Pending
from services.verifier.policies import POLICIES, CalibratedGreedy, GreedyRows, read_greedy, rows_policy
from services.verifier.runner import StepRows, TargetRunner

log = logging.getLogger(__name__)


def _load(
    path: Path, cfg: EngineConfig, target_embed: torch.Tensor | None = None, rank: int = 0, world: int = 1
) -> Llama:
    """``target_embed``: the target's, for a draft that shares it; ``world`` > 1: rank ``rank``'s
    tensor-parallel shard."""
    model = Llama.from_pretrained(path, getattr(torch, cfg.dtype), cfg.device, target_embed)
    if world > 1:
        from services.common.tensor_parallel import shard

        shard(model, rank, world)
    if cfg.packed_gemm:
        pack_linears(model)
    if cfg.kv_pool:
        model.use_kv_pool()
    return model


class VerifierCore:
    in_process = True  # VerifierBackend: the step runs the target in the caller's thread
    split_at = 0  # VerifierBackend: one step at a time (csd at 256 sessions lost 10 % with two)

    def __init__(
        self,
        runner: TargetRunner,
        drafters: dict[str, ModelDrafter],
        max_draft: dict[str, int],
        policies: dict,
        memory,
        eos_id: int,
        max_batch: int = 16,
        batch_window_ms: float = 5.0,
        prefill_chunk: int = 0,
        tokenizer_dir: Path | None = None,
        max_model_len: int = 0,
        salted: SaltedMemories | None = None,
    ):
        """``max_model_len``: the context a request may fill, at most the target's positions (0:
        those). ``salted``: salted requests' own correction memories (None: they share ``memory``)."""
        if max_model_len > runner.max_positions:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the target's {runner.max_positions} positions "
                "(max_position_embeddings); set at most that, or 0 for it"
            )
        self.context_len = max_model_len or runner.max_positions
        self.runner, self.drafters, self.max_draft = runner, drafters, max_draft
        self.tokenizer_dir = tokenizer_dir
        self._grammars: GrammarCompiler | None = None
        self.policies, self.memory, self.eos_id = policies, memory, eos_id
        self.salted = salted
        self.prefill_chunk = prefill_chunk
        self.batcher = CycleBatcher(self._step, max_batch, batch_window_ms / 1000, faults.chunk_delay_s())
        self._ids = itertools.count()
        self.sessions: set[str] = set()  # open sessions' ids (set add/discard are atomic)

    @classmethod
    def from_config(cls, cfg: EngineConfig, eos_id: int) -> "VerifierCore":
        if cfg.threads:  # every process that runs the models: embedded, verifier role, Ray replica
            torch.set_num_threads(cfg.threads)
        dtype = getattr(torch, cfg.dtype)
        runner = target_runner(cfg)
        runner.model.batch_invariant = cfg.invariant_verification
        if cfg.static_steps:
            runner.use_static_steps(graphs=cfg.device.startswith("cuda"))
        drafters: dict[str, ModelDrafter] = {}
        max_draft: dict[str, int] = {}
        if cfg.draft is not None:
            drafters["draft-lm"] = model_drafter(
                "draft-lm",
                _load(cfg.draft, cfg, runner.model.embed_tokens.weight),
                cfg.draft_confidence,
                draft_vocabulary(cfg),
                device_drafts=cfg.drafts_on_device,
            )
            max_draft["draft-lm"] = cfg.num_speculative_tokens
        if cfg.eagle3 is not None and (Path(cfg.eagle3) / "config.json").exists():
            from services.drafter.eagle3 import Eagle3Head, HeadMismatch
            from services.drafter.eagle3_drafter import TreeShape

            try:  # a head trained for another target is left out: `eagle3` is unavailable
                head = Eagle3Head.from_pretrained(
                    cfg.eagle3, runner.model.embed_tokens.weight, dtype, cfg.device, target=runner.model.s
                )
            except HeadMismatch as e:
                log.warning("%s: eagle3 is unavailable", e)
            else:
                if cfg.packed_gemm:
                    pack_linears(head)
                runner.capture_layers = head.aux_layers
                drafters["eagle3"] = model_drafter(
                    "eagle3", head, cfg.eagle3_confidence, device_drafts=cfg.drafts_on_device
                )
                max_draft["eagle3"] = cfg.eagle3_k
                if cfg.eagle3_topk > 1:  # the same head, drafting trees
                    drafters["eagle3-tree"] = model_drafter(
                        "eagle3",
                        head,
                        tree=TreeShape(cfg.eagle3_topk, cfg.eagle3_k, cfg.eagle3_tree_min_score),
                        name="eagle3-tree",
                    )
                    max_draft["eagle3-tree"] = cfg.eagle3_tree_tokens
        if cfg.prefix_cache_mb > 0:
            share_prefix_cache(cfg, runner, [drafters[d] for d in ("draft-lm", "eagle3") if d in drafters])
            if "eagle3-tree" in drafters:  # one head: its blocks serve both
                drafters["eagle3-tree"].prefix = drafters["eagle3"].prefix
        memory = open_memory(cfg)
        policies = {
            **POLICIES,
            "csd": CalibratedGreedy(cfg.gate, memory),
            "scg": CalibratedGreedy(replace(cfg.gate, use_memory=False)),
        }
        return cls(
            runner,
            drafters,
            max_draft,
            policies,
            memory,
            eos_id,
            cfg.max_batch,
            cfg.batch_window_ms,
            cfg.prefill_chunk,
            Path(cfg.target),
            cfg.max_model_len,
            None if cfg.memory_pooled else SaltedMemories(calibration_prior(cfg)),
        )

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured-output patterns compiled over the target's tokenizer (loaded when first needed)."""
        if self._grammars is None:
            from transformers import AutoTokenizer

            if self.tokenizer_dir is None:
                raise ValueError("structured output needs the target's tokenizer (VerifierCore(tokenizer_dir=...))")
            self._grammars = GrammarCompiler(AutoTokenizer.from_pretrained(str(self.tokenizer_dir)), self.vocab_size)
        return self._grammars

    def memory_of(self, salt: str):
        """The correction memory a request of ``salt`` reads and grows: its salt's own, unless
        unsalted or pooled (``--memory-pooled``)."""
        return self.memory if not salt or self.salted is None else self.salted.of(salt)

    def policy_of(self, name: str, salt: str):
        """Policy ``name`` for a request of ``salt``: csd gates from that request's memory."""
        memory = self.memory_of(salt)
        if name != "csd" or memory is self.memory:
            return self.policies[name]
        return CalibratedGreedy(self.policies["csd"].gate, memory)

    def set_memory(self, memory) -> None:
        """Swap the correction memory; the calibrated policy gates from the new one."""
        old, self.memory = self.memory, memory
        self.policies["csd"] = CalibratedGreedy(self.policies["csd"].gate, memory)
        old.close()

    @property
    def vocab_size(self) -> int:
        return self.runner.model.s.vocab

    def open(self, spec: SessionSpec) -> "VerifierSession":
        return VerifierSession(self, spec, spec.session_id or f"v-{next(self._ids)}")

    def declare_capacity(self, max_sessions: int) -> None:
        """``specmesh_kv_cache_capacity_tokens``: the K/V positions ``max_sessions`` sessions of
        the full context would hold (the denominator of KV-cache usage)."""
        KV_CACHE_CAPACITY.set(max_sessions * self.context_len)

    def close(self) -> None:
        self.memory.close()
        if hasattr(self.runner, "shutdown"):  # a tensor-parallel replica's workers
            self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.close()

    def clear_prefix_cache(self) -> None:
        """Forget every cached prompt block (vLLM's /reset_prefix_cache). Safe while steps run:
        each cache operation holds the cache's lock, a session already attached keeps the
        blocks it copied, and blocks a session stores after the reset hang off parents that are
        gone, so no lookup reaches them and LRU eviction frees them."""
        self.runner.clear_prefix()
        for drafter in self.drafters.values():
            if drafter.prefix is not None:
                drafter.prefix.clear()

    def lane(self, session: Session) -> None:
        """One device, one lane (``VerifierBackend``)."""
        return None

    def step(self, cycles: Cycles, done: Done) -> None:
        """The router's step (``VerifierBackend``): every cycle in one batched step, in this thread."""
        run_step(self._step, cycles, done)

    def _step(self, batch: list[Pending]) -> None:
        """One step for a batch of sessions' cycles: draft, one target forward, finish each.
        Long prompts beside other sessions' cycles advance by a chunk instead (``_chunks``)."""
        t0 = time.perf_counter()
        for b in batch:  # a cancelled session's cycle (a prompt mid-prefill, say) stops here
            if b.session.cancelled:
                b.error = SessionCancelled(f"session {b.session.session_id} was cancelled")
        self._attach([b for b in batch if b.error is None])
        batch = [b for b in batch if b.error is None]
        chunks = self._chunks(batch)
        cycles = [b for b in batch if id(b) not in chunks]
        drafts = self._drafts(cycles)
        t1 = time.perf_counter()
        live = [b for b in cycles if b.error is None]
        filling = [b for b in batch if chunks.get(id(b))]
        for b in batch:  # a prompt fed a chunk, or none (out of budget), goes on next step
            b.again = id(b) in chunks
        if not live and not filling:
            return
        plain = [i for i, b in enumerate(live) if b.session.reads_greedy]  # read from the step at once
        gates = [b.session.gate_top_k for b in live]
        rows, states = self.runner.step(
            [(b.session.target, drafts[id(b)].token_ids) for b in live],
            [(b.session.target, chunks[id(b)]) for b in filling],
            [drafts[id(b)].parents if drafts[id(b)].is_tree else None for b in live],
            gates if live and len(plain) == len(live) else None,  # no session needs its rows
        )
        for b, fused in zip(filling, states):
            try:
                b.session.prefilled(fused)
            except Exception as e:  # one session's failure is its own (an item with an error ends)
                b.error = e
        reads = self._greedy_reads(live, drafts, rows, plain, gates)
        for i, b in enumerate(live):
            try:
                b.result = b.session.finish(
                    drafts[id(b)],
                    reads.get(i) or rows.host(i),
                    rows.hidden[i],
                    t1 - t0,
                    t1,
                    len(live) + len(filling),
                    b.arrived,
                )
            except Exception as e:
                b.error = e

    @staticmethod
    def _greedy_reads(
        live: list[Pending], drafts: dict[int, Draft], rows: StepRows, plain: list[int], gates: list[int]
    ) -> dict[int, GreedyRows]:
        """The greedy policies' reads of the step for the ``plain`` sessions (whose rows no per-row
        rule reshapes), taken at once (``read_greedy``); the rest read their own rows on the host."""
        if not plain:
            return {}
        reads = read_greedy(
            rows.logits,
            [rows.spans[i] for i in plain],
            [drafts[id(live[i])].token_ids for i in plain],
            [gates[i] for i in plain],
            rows.reads,  # (taken over every session, each plain: the same order)
        )
        return dict(zip(plain, reads))

    def _attach(self, batch: list[Pending]) -> None:
        """A session's first step takes what the prefix cache holds of its prompt; its drafter
        takes those positions in as it would a prefilled chunk."""
        for b in batch:
            st = b.session.target
            if st.attached:
                continue
            try:
                n, feats = self.runner.attach(st)
                if n:
                    b.session.prefilled(feats)
            except Exception as e:  # one session's failure is its own
                b.error = e

    def _chunks(self, batch: list[Pending]) -> dict[int, int]:
        """Chunked prefill. While other sessions are open on this replica (decoding, or about to
        be), the prompts a step feeds (their pending tokens) total at most ``prefill_chunk``
        tokens, so a new long prompt does not stall the sessions already decoding: each step's
        time stays bounded. Prompts take the budget in queue order (a prefill in progress is
        first); a prompt that fits finishes its cycle, one that does not feeds what is left of
        the budget (maybe none) and its cycle goes on in the next step. When the prompts' own
        sessions are all that is open, they prefill whole: no one waits on them (a session
        that merely missed this step's window does count as waiting).
        {id(item): tokens to feed} of the unfinished ones."""
        n = self.prefill_chunk
        if n <= 0:
            return {}
        prompts = [b for b in batch if len(b.session.target.pending) > 1 and not b.session.closed]
        if not prompts or self.sessions <= {b.session.session_id for b in prompts}:
            return {}
        chunks = {}
        for b in prompts:
            p = len(b.session.target.pending)
            if p > n:
                chunks[id(b)] = n
            n -= min(p, n)
        return chunks

    def _drafts(self, batch: list[Pending]) -> dict[int, Draft]:
        """Each cycle's draft: the router's, or one drafted here, one ``propose_batch`` per drafter."""
        drafts: dict[int, Draft] = {}
        groups: dict[str, list[Pending]] = {}
        for b in batch:
            r = b.request
            if r.draft_with and r.budget > 0:
                if self._can_draft(b.session, r.draft_with):
                    groups.setdefault(r.draft_with, []).append(b)
                else:
                    drafts[id(b)] = Draft.empty()
            else:
                drafts[id(b)] = Draft(list(r.draft_ids), list(r.draft_parents), source=r.draft_source)
        for name, group in groups.items():
            try:
                drafter = self.drafters[name]
                asks = [(b.session.session_id, b.request.budget) for b in group]
                drafts.update(zip(map(id, group), drafter.propose_batch(asks)))
            except Exception as e:
                for b in group:
                    b.error = e
        for b in batch:
            d = drafts.get(id(b))
            if d is None:
                continue
            if b.request.draft_with and b.request.draft_ids and b.session.takes_trees and d.probs is None:
                # the router's draft beside the model's: one tree, the model's draft its main chain (a
                # sampled draft with a q keeps rejection sampling, which accepts it more often than a walk)
                toks, parents = graft(d.token_ids, d.parents, b.request.draft_ids, b.session.spec.max_draft)
                drafts[id(b)] = d = replace(d, token_ids=toks, parents=parents, probs=None, token_probs=[])
            if d.is_tree and not b.session.takes_trees:  # a session that cannot verify a tree takes its main chain
                drafts[id(b)] = d.chain()
        return drafts

    def _can_draft(self, session: "VerifierSession", name: str) -> bool:
        """A drafter fed by the target's states (EAGLE-3) drafts from the newest verified
        position, so only once no more than the newest token is pending: not on a prompt's
        cycle, whose features it has not yet been given (they come with that cycle). An unknown
        name passes here and fails in ``_drafts``, as that cycle's error."""
        drafter = self.drafters.get(name)
        return drafter is None or not drafter.needs_target_states or len(session.target.pending) <= 1


def model_drafter(kind: str, *args, **kwargs) -> ModelDrafter:
    """The registered drafter ``kind``, one that drafts beside the verifier."""
    drafter = DRAFTERS[kind](*args, **kwargs)
    if not isinstance(drafter, ModelDrafter):
        raise TypeError(f"{kind}: a router-side drafter, not one the verifier can run")
    return drafter


def share_prefix_cache(cfg: EngineConfig, runner: TargetRunner, drafters: list[Drafter]) -> None:
    """Prefix caches for the target (K/V and EAGLE-3 features) and each drafter beside it (the
    draft LM's K/V, the EAGLE-3 head's), the budget split by their bytes per position, so
    that all keep about the same positions."""
    model = runner.model
    sizes = [kv_bytes_per_position(model.new_cache(1, 1)) * (1 + len(runner.capture_layers) / (2 * model.s.layers))]
    sizes += [d.kv_bytes_per_position() for d in drafters]
    budget = cfg.prefix_cache_mb << 20
    owners: list[TargetRunner | Drafter] = [runner, *drafters]
    for owner, size in zip(owners, sizes):
        owner.prefix = PrefixCache(cfg.prefix_block, int(budget * size / sum(sizes)))


AUTO_DRAFT_VOCAB = 4096  # FR-Spec on the bundled draft: drafting −4–7 %, τ within 1 % (bench.draft_vocab)


def draft_vocabulary(cfg: EngineConfig) -> torch.Tensor | None:
    """The draft LM's vocabulary: the ``draft_vocab`` best-ranked ids of the ranking shipped
    beside it (``training.vocab``); None for the whole vocabulary. -1 (auto) takes 4,096
    where a ranking ships, the whole vocabulary elsewhere (a user's own draft)."""
    from services.drafter.vocab import RANKING_FILE, load_ranking, top_vocabulary

    if cfg.draft is None:
        return None
    path = Path(cfg.draft) / RANKING_FILE
    size = cfg.draft_vocab
    if size < 0:
        size = AUTO_DRAFT_VOCAB if path.exists() else 0
    if size == 0:
        return None
    if not path.exists():
        raise ValueError(f"--draft-vocab {size} needs {path} (python -m training.vocab)")
    ranking = load_ranking(path)
    return top_vocabulary(ranking, size).to(cfg.device) if size < len(ranking) else None


def _load_shard(cfg: EngineConfig, rank: int, world: int) -> Llama:
    """Rank ``rank``'s shard, on its own GPU on ``cuda`` (``cuda:rank``)."""
    if cfg.device.startswith("cuda"):
        cfg = replace(cfg, device=f"cuda:{rank}")
    return _load(cfg.target, cfg, rank=rank, world=world)


def target_runner(cfg: EngineConfig) -> TargetRunner:
    """The target on this device, or split over ``tensor_parallel`` processes (this one the
    leader: services/verifier/sharded.py)."""
    if cfg.tensor_parallel <= 1:
        return TargetRunner(_load(cfg.target, cfg))
    from services.verifier import sharded

    return sharded.start(cfg.tensor_parallel, partial(_load_shard, cfg), cfg.device)


def calibration_prior(cfg: EngineConfig) -> dict | None:
    """The correction memory's calibration prior (``ocm_snapshot``), when there is one."""
    return load_snapshot(cfg.ocm_snapshot) if cfg.ocm_snapshot and Path(cfg.ocm_snapshot).exists() else None


def open_memory(cfg: EngineConfig):
    """Correction memory: through the memory service, or Redis, when configured; else in-process.
    The calibration prior is installed unless the shared store already has one."""
    prior = calibration_prior(cfg)
    if cfg.memory_addr:
        from services.memory.client import RemoteCorrectionMemory

        return RemoteCorrectionMemory(cfg.memory_addr, spill_dir=cfg.state_dir)
    if cfg.redis_url:
        from services.memory.redis_link import RedisLink
        from services.memory.redis_memory import RedisCorrectionMemory

        memory = RedisCorrectionMemory(RedisLink(cfg.redis_url, "ocm"), spill_dir=cfg.state_dir)
        if prior:
            memory.ensure_prior(prior)
        return memory
    redis_off("ocm")
    local = LocalCorrectionMemory()
    if prior:
        local.restore(prior)
    return local


@dataclass
class VerifierSession:
    core: VerifierCore
    spec: SessionSpec
    session_id: str
    rng: Draws = field(init=False)

    def __post_init__(self) -> None:
        s = self.spec
        self.rng = Draws(s.sampling.seed)
        self.rng.position = s.generated  # output tokens before this session (a failover's re-open)
        self.memory = self.core.memory_of(s.cache_salt)
        self.policy = self.core.policy_of(s.policy, s.cache_salt)
        self._rows_policy = rows_policy(self.policy)
        root = salt_root(s.cache_salt)
        self.target = self.core.runner.open(
            s.prompt_ids, len(s.prompt_ids) + s.max_new_tokens + s.max_draft + 1, root, s.prompt_logprobs
        )
        self.core.batcher.opened(self)
        self.core.sessions.add(self.session_id)
        VERIFIER_SESSIONS.set(len(self.core.sessions))
        self._closed = False
        self.cancelled = False
        self.grammar = None  # structured output: where the output so far left the grammar
        if s.grammar:
            self.grammar = GrammarCursor.after(
                self.core.grammars.compile(s.grammar), s.prompt_ids[len(s.prompt_ids) - s.generated :]
            )
        self.drafter = self.core.drafters.get(s.model_drafter) if s.model_drafter else None
        if self.drafter:
            self.drafter.start(
                self.session_id,
                s.prompt_ids,
                s.sampling,
                self.rng.stream,
                s.max_new_tokens,
                cache_root=root,
                grammar=self.grammar,
                trees=self.takes_trees,
            )

    def cycle(self, req: CycleRequest) -> CycleResult:
        """Draft (or take the router's draft), verify, commit; batched with the replica's
        other sessions that cycle at the same time."""
        return self.core.batcher.submit(self, req)

    def finish(
        self,
        draft: Draft,
        logits: torch.Tensor | GreedyRows,
        hidden: list[torch.Tensor],
        draft_s: float,
        verify_start: float,
        batch_size: int = 1,
        arrived: float | None = None,
    ) -> CycleResult:
        """Apply the policy to the verified draft, commit, let the local drafter observe.
        ``logits``: the target's rows [k+1, V] on the host, or the step's greedy reads of them
        (``reads_greedy``). ``arrived``: when the cycle reached this verifier (its ``server_s``
        counts from then)."""
        gate_start = time.perf_counter()
        verdict = self._verdict(draft, logits)
        gate_s = time.perf_counter() - gate_start
        pending = len(self.target.pending)
        kept = pending + verdict.accepted
        if verdict.path is not None:  # a tree: its accepted path's rows, in order
            if isinstance(logits, torch.Tensor):
                logits = logits[[0] + [n + 1 for n in verdict.path]]
            hidden = [h[:, list(range(pending)) + [pending + n for n in verdict.path]] for h in hidden]
        states = None  # the kept positions' fused target states, for EAGLE-3 and the prefix cache
        if hidden and (self._needs_states or self.core.runner.prefix is not None):
            states = torch.cat(hidden, dim=-1)[0, :kept]
        self.core.runner.commit(self.target, verdict, states)
        eos = self.core.eos_id
        cut = eos in verdict.tokens and not self.spec.ignore_eos
        committed = verdict.tokens[: verdict.tokens.index(eos) + 1] if cut else verdict.tokens
        self.rng.position += len(committed)
        if self.grammar is not None:
            self.grammar.advance(committed)
        if self.drafter:
            self.drafter.observe(self.session_id, committed, states if self._needs_states else None)
        if verdict.first_rejection is not None and self.spec.sampling.greedy:
            self.memory.record([verdict.first_rejection])
        accepted = min(verdict.accepted, len(committed))
        return CycleResult(
            committed=committed,
            drafted=len(draft),
            accepted=accepted,
            source=draft.source,
            # a cycle cut short by EOS keeps no rescue statistics
            rescued_pairs=verdict.rescued_pairs if accepted == verdict.accepted else (),
            rejected=verdict.first_rejection is not None and accepted < len(committed),
            draft_s=draft_s,
            verify_s=(now := time.perf_counter()) - verify_start,
            gate_s=gate_s,
            server_s=now - arrived if arrived is not None else 0.0,
            batch_size=batch_size,
            cached_tokens=self._report_cached(),
            prompt_logprobs=self._report_prompt_logprobs(),
            logprobs=token_logprobs(logits, committed, self.spec.logprobs)
            if self.spec.logprobs is not None and isinstance(logits, torch.Tensor)
            else (),
        )

    def _verdict(self, draft: Draft, logits: torch.Tensor | GreedyRows) -> Verdict:
        if isinstance(logits, GreedyRows):
            assert self._rows_policy is not None, "reads are taken for sessions that read greedily"
            return self._rows_policy(draft, logits)
        shaped = self._constrained(self._no_early_eos(self._shaped(logits, draft)), draft)
        return self.policy(draft, shaped, self.spec.sampling, self.rng)

    def _shaped(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """The request's penalties (``Sampling``), over its output so far (the re-opened
        part of the prompt, ``generated``, counts as output), then its logit bias, then its bad
        words (over the same output)."""
        sp = self.spec.sampling
        start = len(self.spec.prompt_ids) - self.spec.generated
        if sp.penalized:
            logits = apply_penalties(logits, self.target.tokens, start, draft.token_ids, sp)
        if sp.biased:
            logits = apply_bias(logits, sp)
        if sp.bad_words:
            logits = ban_bad_words(logits, self.target.tokens[start:], draft.token_ids, sp.bad_words)
        return logits

    def _no_early_eos(self, logits: torch.Tensor) -> torch.Tensor:
        """``min_tokens``: rows of positions before it get no end-of-sequence token (its logit
        is −inf), so every policy, greedy or sampling, verifies against that distribution."""
        left = self.spec.min_tokens - (len(self.target.tokens) - len(self.spec.prompt_ids))
        if left <= 0:
            return logits
        logits = logits.clone()
        logits[:left, self.core.eos_id] = float("-inf")
        return logits

    def _constrained(self, logits: torch.Tensor, draft: Draft) -> torch.Tensor:
        """Structured output: each row allows only the tokens the grammar allows after the
        output and the draft tokens before the row (``TokenGrammar.mask_rows``)."""
        if self.grammar is None:
            return logits
        return self.grammar.automaton.mask_rows(logits, self.grammar.state, draft.token_ids)

    def _report_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's log-probabilities, reported once (with the first cycle)."""
        lps, self.target.prompt_lps = self.target.prompt_lps, []
        return tuple(lps)

    def _report_cached(self) -> int:
        """The prefix cache's share of the prompt, reported once (with the first cycle)."""
        n, self.target.cached = self.target.cached, 0
        return n

    @property
    def takes_trees(self) -> bool:
        """Tree drafts are verified by the lossless policies (greedy's exact walk, sampling's
        ``_sampled_walk``), on logits no per-row rule reshapes: those read rows as a chain.
        CSD relaxes chains only."""
        return self.spec.policy in ("lossless", "exact") and not self._reshaped

    @property
    def reads_greedy(self) -> bool:
        """Its verdict needs only the step's greedy reads of its rows (argmaxes, a gate's gaps
        and ranks): a greedy request under a greedy policy, whose rows no per-row rule reshapes,
        that wants no logprobs."""
        s = self.spec
        return s.sampling.greedy and self._rows_policy is not None and not self._reshaped and s.logprobs is None

    @property
    def gate_top_k(self) -> int:
        """The calibrated gate's top-k (0: no gate), for the step's reads."""
        return self.policy.gate.top_k if isinstance(self.policy, CalibratedGreedy) else 0

    @property
    def _reshaped(self) -> bool:
        """A per-row rule reshapes its logits: penalties, bias, bad words, a grammar, or
        min_tokens still ahead."""
        s, sp = self.spec, self.spec.sampling
        return (
            sp.penalized
            or sp.biased
            or bool(sp.bad_words)
            or self.grammar is not None
            or s.min_tokens > len(self.target.tokens) - len(s.prompt_ids)
        )

    @property
    def _needs_states(self) -> bool:
        return self.drafter is not None and self.drafter.needs_target_states

    def prefilled(self, states: torch.Tensor | None) -> None:
        """Prompt positions were fed and kept (a chunk, ``TargetRunner.step``, or a prefix-cache
        hit), with their fused target states: a drafter fed by the target's states gets them,
        and the drafter takes the prompt in (``absorb``) up to where the target is, unless it
        drafts on demand (a hybrid may never ask it): then its first draft catches up."""
        if not self.drafter:
            return
        if self._needs_states and states is not None:
            self.drafter.observe(self.session_id, [], states)
        if not self.spec.on_demand:
            self.drafter.absorb(self.session_id, self.target.cache_len)

    @property
    def closed(self) -> bool:
        return self._closed

    def cancel(self) -> None:
        """The client went away: a cycle of this session still queued or prefilling fails with
        ``SessionCancelled`` at the next step instead of running on. Any thread may call it."""
        self.cancelled = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.core.batcher.closed(self)
        self.core.runner.close(self.target)
        self.core.sessions.discard(self.session_id)
        VERIFIER_SESSIONS.set(len(self.core.sessions))
        if self.drafter:
            self.drafter.stop(self.session_id)
