"""The in-process micro-batch tuner (``services/router/overlap.py``) on a fake clock: one
micro-batch below its session floor, a trial of one, two and one again, the faster kept (two
only by the margin; a drifting load favours neither), held until the hold runs out or the load
changes."""

from services.router.overlap import OverlapTuner, TunerConfig

CFG = TunerConfig(min_sessions=4, settle_s=0.1, trial_s=0.5, hold_s=10.0, load_change=1.5, margin=0.05)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(tuner, clock, rate: dict[int, float], seconds: float, sessions: int = 8, drift: float = 0.0) -> list[int]:
    """Turns every 10 ms for ``seconds``, each committing what ``rate[mode]`` tokens/s makes,
    grown by ``drift`` (a share) per second."""
    modes = []
    for _ in range(round(seconds / 0.01)):
        clock.t += 0.01
        modes.append(tuner.observe(round(rate[tuner.mode] * (1 + drift * clock.t) * 0.01), sessions))
    return modes


def test_below_the_session_floor_one_micro_batch_and_no_trial():
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    assert set(run(tuner, clock, {1: 1000, 2: 5000}, 3.0, sessions=3)) == {1}
    assert tuner.trials == 0 and tuner.chosen is None


def test_a_trial_runs_one_two_and_one_again_and_keeps_the_faster():
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    modes = run(tuner, clock, {1: 1000, 2: 1200}, 3.0)
    assert modes[:50] == [1] * 50 and 2 in modes[60:120] and 1 in modes[130:190]  # one, two, one
    assert tuner.trials == 1 and tuner.chosen == 2 and modes[-1] == 2
    assert abs(tuner.rates[1] - 1000) < 30 and abs(tuner.rates[2] - 1200) < 30  # the settle span unmeasured


def test_two_must_win_by_the_margin():
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    run(tuner, clock, {1: 1000, 2: 1030}, 3.0)  # 3 % faster: within the 5 % margin
    assert tuner.chosen == 1 and tuner.mode == 1


def test_a_load_that_grows_during_the_trial_does_not_favour_two():
    """Tokens/s rising 20 % a second (a burst's prompts read, then decoding): two, measured
    after one's first span, would look 12 % faster; against one's two spans it does not."""
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    run(tuner, clock, {1: 1000, 2: 1000}, 3.0, drift=0.2)
    assert tuner.trials == 1 and tuner.chosen == 1


def test_a_choice_holds_until_its_time_is_up_or_the_load_changes():
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    run(tuner, clock, {1: 1000, 2: 1200}, 3.0)
    assert tuner.trials == 1
    run(tuner, clock, {1: 1000, 2: 1200}, 5.0, sessions=10)  # within 1.5x of 8: held
    assert tuner.trials == 1
    run(tuner, clock, {1: 1500, 2: 1200}, 3.0, sessions=16)  # doubled: a new trial, now one wins
    assert tuner.trials == 2 and tuner.chosen == 1
    run(tuner, clock, {1: 1000, 2: 1200}, 11.0, sessions=16)  # the hold ran out: tried again
    assert tuner.trials == 3 and tuner.chosen == 2


def test_spans_are_whole_turns_and_at_least_min_turns_long():
    """Turns of 100 ms under one micro-batch and 50 ms under two, both at 1,000 tokens/s: each
    span is measured over whole turns, at least 8 of them (0.8 s of one's), and both rates come
    out true, so neither mode is favoured by its turns' size."""
    clock = Clock()
    tuner = OverlapTuner(CFG, clock)
    spans: list[tuple[int, float]] = []  # (mode, when it began)
    while tuner.trials == 0 and clock.t < 20:
        turn = 0.1 if tuner.mode == 1 else 0.05
        clock.t += turn
        tuner.observe(round(1000 * turn), 8)
        if not spans or spans[-1][0] != tuner.mode:
            spans.append((tuner.mode, clock.t))
    assert tuner.trials == 1 and tuner.chosen == 1
    assert abs(tuner.rates[1] - 1000) < 1 and abs(tuner.rates[2] - 1000) < 1
    first_two = next(t for m, t in spans if m == 2)
    assert first_two >= 0.1 + 0.1 + 8 * 0.1 - 1e-9  # settle, the turn it starts from, then 8 turns of one
