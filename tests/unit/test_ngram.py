"""The prompt-lookup (ngram) drafter: vLLM's rule, against a brute-force search."""

import random

import pytest

from services.common.config import NgramConfig
from services.drafter.ngram import NgramDrafter


def brute(tokens: list[int], cfg: NgramConfig, budget: int) -> list[int]:
    """The longest suffix n-gram (min_n ≤ n ≤ max_n) with an earlier occurrence: the k tokens
    after its earliest one."""
    end = len(tokens)
    for n in range(min(cfg.max_n, end - 1), cfg.min_n - 1, -1):
        suffix = tokens[end - n :]
        for i in range(end - n):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + min(cfg.k, budget)]
    return []


def test_vllms_example():
    """vLLM's docstring: [1,2,3,4,2,3], min 2, max 3, k 4 → [4, 2, 3]."""
    d = NgramDrafter(NgramConfig(min_n=2, max_n=3, k=4))
    d.start("r", [1, 2, 3, 4, 2, 3])
    assert d.propose("r", 8).token_ids == [4, 2, 3]
    d.start("s", [1, 2, 3, 4])
    assert d.propose("s", 8).token_ids == []


@pytest.mark.parametrize("cfg", [NgramConfig(), NgramConfig(1, 3, 4), NgramConfig(3, 5, 8)])
def test_equals_brute_force_as_tokens_arrive(cfg):
    rng = random.Random(7)
    d = NgramDrafter(cfg)
    tokens = [rng.randrange(6) for _ in range(20)]
    d.start("r", tokens)
    for step in range(200):
        budget = rng.randrange(1, 9)
        assert d.propose("r", budget).token_ids == brute(tokens, cfg, budget), step
        new = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        tokens += new
        d.observe("r", new)
    d.stop("r")
    assert "r" not in d.states


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramDrafter(NgramConfig(min_n=3, max_n=2))
