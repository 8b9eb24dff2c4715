"""Trace replay: run a drafter over recorded target generations without the target.

A trace is the prompt and the target's greedy output (plus EOS when it stopped there).
Replaying cycle by cycle with the same budget rule as the decode loop, a greedy draft
keeps its longest prefix equal to the true continuation (a tree: its longest such path)
and one more token is emitted,
so τ, acceptance and draft lengths equal those of a real run over the same prompts in the
same order (tests/sim checks this against the engine).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from services.common.token_tree import accepted_by
from services.common.types import Draft, Sampling
from services.drafter.base import Drafter


@dataclass(frozen=True)
class Trace:
    id: str
    prompt_ids: list[int]
    output_ids: list[int]  # without EOS
    max_new_tokens: int
    eos_id: int | None = None  # set when the target stopped at EOS

    @property
    def continuation(self) -> list[int]:
        return self.output_ids + ([self.eos_id] if self.eos_id is not None else [])


def load_traces(path: Path) -> list[Trace]:
    with open(path) as f:
        return [Trace(**json.loads(line)) for line in f if line.strip()]


def save_traces(path: Path, traces: list[Trace], append: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for t in traces:
            f.write(json.dumps(t.__dict__) + "\n")


@dataclass
class ReplayStats:
    cycles: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_lengths: Counter = field(default_factory=Counter)
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    index_s: float = 0.0
    index_tokens: int = 0
    speculate_s: float = 0.0
    speculate_calls: int = 0
    update_s: float = 0.0
    update_tokens: int = 0
    stop_s: float = 0.0  # ending requests (a finished output enters the global tree)

    def add_cycle(self, n_draft: int, n_accepted: int, n_emitted: int) -> None:
        self.cycles += 1
        self.drafted += n_draft
        self.accepted += n_accepted
        self.generated += n_emitted
        self.draft_lengths[n_draft] += 1
        for lst, n in ((self.drafts_per_position, n_draft), (self.accepted_per_position, n_accepted)):
            lst.extend([0] * (n - len(lst)))
            for i in range(n):
                lst[i] += 1

    def report(self) -> dict:
        us = 1e6
        return {
            "tau": round(self.generated / self.cycles, 4) if self.cycles else 0.0,
            "cycles": self.cycles,
            "generated_tokens": self.generated,
            "cycles_per_1k": round(1000 * self.cycles / self.generated, 1) if self.generated else None,
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
            "draft_length_histogram": {str(k): v for k, v in sorted(self.draft_lengths.items())},
            "acceptance_per_position": [
                round(a / d, 4) for a, d in zip(self.accepted_per_position, self.drafts_per_position)
            ],
            "us_per_speculate_call": round(us * self.speculate_s / max(1, self.speculate_calls), 2),
            "us_per_speculated_token": round(us * self.speculate_s / max(1, self.drafted), 2),
            "us_per_update_token": round(us * self.update_s / max(1, self.update_tokens), 2),
            "us_per_update_token_with_stop": round(us * (self.update_s + self.stop_s) / max(1, self.update_tokens), 2),
            "us_per_indexed_prompt_token": round(us * self.index_s / max(1, self.index_tokens), 2),
        }


def replay(drafter: Drafter, traces: list[Trace], max_draft: int, progress: bool = False) -> ReplayStats:
    st = ReplayStats()
    t_start = time.perf_counter()
    for n, tr in enumerate(traces):
        rid = f"replay-{tr.id}"
        t0 = time.perf_counter()
        drafter.start(rid, tr.prompt_ids, Sampling(), None)
        st.index_s += time.perf_counter() - t0
        st.index_tokens += len(tr.prompt_ids)
        truth = tr.continuation
        pos = 0
        while pos < len(truth):
            budget = max(0, min(max_draft, tr.max_new_tokens - pos - 1))
            t0 = time.perf_counter()
            draft = drafter.propose_batch([(rid, budget)])[0] if budget else Draft.empty()
            t1 = time.perf_counter()
            drafter.after_step()  # as the router drafts: the step's writes once it is sent
            ta = time.perf_counter()
            accepted = len(accepted_by(draft.token_ids, draft.parents, truth[pos:]))
            emitted = truth[pos : pos + accepted + 1]
            t2 = time.perf_counter()
            drafter.observe(rid, emitted)
            t3 = time.perf_counter()
            if budget:
                st.speculate_calls += 1
                st.speculate_s += t1 - t0
            st.update_s += (t3 - t2) + (ta - t1)
            st.update_tokens += len(emitted)
            st.add_cycle(len(draft), accepted, len(emitted))
            pos += len(emitted)
        t0 = time.perf_counter()
        drafter.stop(rid)
        st.stop_s += time.perf_counter() - t0
        if progress and (n + 1) % 10 == 0:
            rate = (time.perf_counter() - t_start) / (n + 1)
            print(f"[replay] {n + 1}/{len(traces)} traces, eta {rate * (len(traces) - n - 1):.0f}s", flush=True)
    return st
