"""The auto micro-batch choice for an in-process verifier, by measurement (``OverlapTuner``).

Two alternating micro-batches let the router draft for one half while the device runs the
other's step, but every step pays the step's fixed cost again (the weights read once per step).
Which wins depends on what nobody here knows in advance: the model's fixed cost against the
router's work per session (bench/results/control_plane_overlap_tuner/: with an 8B-on-H100 step,
one at 64 sessions, two at 256 for the suffix drafters, one for csd). So the scheduler measures
both on the live load: committed tokens per second over a short trial of each, then keeps the
faster until the load changes or the hold runs out, and tries again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class TunerConfig:
    min_sessions: int = 32  # fewer running: one micro-batch, no trial (halves of a few sessions)
    settle_s: float = 0.15  # after a switch, not measured (the steps in flight end in the old shape)
    trial_s: float = 0.5  # each mode's measured span, at least
    min_turns: int = 8  # ... and at least this many turns (settled steps) in it
    hold_s: float = 30.0  # a choice stands this long at most
    load_change: float = 1.5  # ... or until the running sessions change by this factor
    margin: float = 0.03  # two must beat one by this share (one is the simpler shape)


class OverlapTuner:
    """Rule: below ``min_sessions`` one micro-batch. Otherwise a trial runs one, two, then one
    again, each for ``settle_s`` unmeasured, then measured from a turn to a turn at least
    ``trial_s`` and ``min_turns`` later (whole turns: a turn's tokens were made before it, and
    two micro-batches settle half as many a turn; one's rate the mean of its two spans, so a
    load that drifts during the trial, as it does while a burst's prompts are read, favours
    neither), and the faster (two only by ``margin``) holds until ``hold_s`` has passed or the
    running sessions changed by ``load_change``; then a trial again."""

    def __init__(self, cfg: TunerConfig = TunerConfig(), clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.mode = 1
        self.chosen: int | None = None  # the last trial's choice (None: none yet)
        self.rates: dict[int, float] = {}  # the last trial's tokens/s per mode (mean of its spans)
        self._spans: dict[int, list[float]] = {}
        self.trials = 0
        self._trying: list[int] = []  # modes of the trial still to run, the current first
        self._since = 0.0  # when the current mode began
        self._tokens = 0  # measured in the current trial span
        self._turns = 0
        self._from: float | None = None  # the turn the current span's measure starts from
        self._held_until = 0.0
        self._held_at = 0  # running sessions when the choice was made

    def observe(self, tokens: int, sessions: int) -> int:
        """A turn's committed ``tokens`` with ``sessions`` running; the micro-batches to use now."""
        now = self.clock()
        if sessions < self.cfg.min_sessions:
            self._trying, self.mode = [], 1
            self._held_until = 0.0  # a trial when the load is back
            return self.mode
        if self._trying:
            self._measure(now, tokens)
        elif now >= self._held_until or not self._steady(sessions):
            self._start(now, sessions)
        return self.mode

    def _steady(self, sessions: int) -> bool:
        held = max(1, self._held_at)
        return held / self.cfg.load_change <= sessions <= held * self.cfg.load_change

    def _start(self, now: float, sessions: int) -> None:
        self._trying, self._spans, self._held_at = [1, 2, 1], {}, sessions
        self._switch(now)

    def _switch(self, now: float) -> None:
        self.mode, self._since, self._tokens, self._turns, self._from = self._trying[0], now, 0, 0, None

    def _measure(self, now: float, tokens: int) -> None:
        if self._from is None:
            if now > self._since + self.cfg.settle_s:
                self._from = now  # this turn's tokens were made before it: not counted
            return
        self._tokens += tokens
        self._turns += 1
        if now - self._from < self.cfg.trial_s or self._turns < self.cfg.min_turns:
            return
        self._spans.setdefault(self.mode, []).append(self._tokens / (now - self._from))
        self._trying.pop(0)
        if self._trying:
            self._switch(now)
            return
        self.trials += 1
        self.rates = {m: sum(r) / len(r) for m, r in self._spans.items()}
        self.chosen = 2 if self.rates[2] > self.rates[1] * (1 + self.cfg.margin) else 1
        self.mode, self._held_until = self.chosen, now + self.cfg.hold_s
