import torch

from services.common.sampling import probs_from_logits
from services.common.types import Sampling


def test_temperature_top_k_top_p():
    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = probs_from_logits(x, Sampling(temperature=1.0))
    assert torch.allclose(p, torch.softmax(x, -1))
    pk = probs_from_logits(x, Sampling(temperature=1.0, top_k=2))
    assert (pk[2:] == 0).all() and torch.isclose(pk.sum(), torch.tensor(1.0))
    # top_p keeps the smallest prefix reaching the mass: p = [.64, .24, .09, ...] → top_p .8 keeps 2
    pp = probs_from_logits(x, Sampling(temperature=1.0, top_p=0.8))
    assert (pp[:2] > 0).all() and (pp[2:] == 0).all()
    # tiny top_p always keeps the most likely token
    assert probs_from_logits(x, Sampling(temperature=1.0, top_p=1e-6))[0] == 1.0
    cold = probs_from_logits(x, Sampling(temperature=0.1))
    assert cold[0] > 0.99


def test_min_p_drops_tokens_below_its_share_of_the_most_likely_after_temperature():
    """p = softmax([3, 2, 1, 0, -1]) ≈ [.64, .24, .09, .03, .01]: min_p .2 keeps p ≥ .128 (two
    tokens), and at temperature 2 the flatter p keeps four; min_p 1 keeps the top token alone."""
    from services.common.sampling import sampling_error

    x = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    for temperature, kept in ((1.0, 2), (2.0, 4)):
        p = probs_from_logits(x, Sampling(temperature=temperature, min_p=0.2))
        full = torch.softmax(x / temperature, -1)
        assert (p[:kept] > 0).all() and (p[kept:] == 0).all()
        assert torch.allclose(p[:kept], full[:kept] / full[:kept].sum())
    assert probs_from_logits(x, Sampling(temperature=1.0, min_p=1.0))[0] == 1.0
    both = probs_from_logits(x, Sampling(temperature=2.0, min_p=0.2, top_k=3))  # then top-k
    assert (both[:3] > 0).all() and (both[3:] == 0).all()
    assert sampling_error(Sampling(min_p=0.5)) is None
    for bad in (-0.1, 1.5, float("nan")):
        assert sampling_error(Sampling(min_p=bad)).startswith("min_p: must be in [0, 1]")


def test_temperature_must_be_finite_and_not_negative():
    """An infinite temperature turns the -inf of masked logits into nan (it crashed sampling,
    UNKNOWN to the client); it is refused with the field's name, as nan and negatives are."""
    from services.common.sampling import sampling_error

    for bad in (-1.0, float("inf"), float("nan")):
        assert sampling_error(Sampling(temperature=bad)).startswith("temperature: must be a finite number >= 0")
    assert sampling_error(Sampling(temperature=1e6)) is None


def test_temperatures_below_vllms_epsilon_are_greedy():
    """Dividing logits by a denormal temperature overflows to inf (and nan after softmax): as
    vLLM, any temperature below 1e-5 decodes greedily, and one at it still samples, finitely."""
    from services.common.types import SAMPLING_EPS

    assert Sampling(temperature=1e-45).greedy and Sampling(temperature=9e-6).greedy
    assert not Sampling(temperature=SAMPLING_EPS).greedy
    p = probs_from_logits(torch.tensor([30.0, 29.9999, -float("inf")]), Sampling(temperature=SAMPLING_EPS))
    assert torch.isfinite(p).all() and p[2] == 0


def test_penalties_per_verification_row_equal_a_plain_step_on_that_rows_context():
    """Row i of a verification is penalized as a decoding step after the output plus draft[:i]
    would be: HF's repetition-penalty processor over prompt and output, then presence and
    frequency (vLLM's, OpenAI's formula) over the output alone."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from services.common.sampling import apply_penalties

    torch.manual_seed(0)
    vocab, prompt, output, draft = 12, [1, 2, 2], [3, 3, 4], [4, 5, 1]
    logits = torch.randn(len(draft) + 1, vocab) * 3
    sp = Sampling(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    got = apply_penalties(logits, prompt + output, len(prompt), draft, sp)
    for i in range(len(draft) + 1):
        out = output + draft[:i]
        ref = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt + out]), logits[i : i + 1].clone())[0]
        counts = torch.bincount(torch.tensor(out), minlength=vocab).float()
        ref = ref - 0.25 * counts - 0.5 * (counts > 0).float()
        assert torch.allclose(got[i], ref), i
    assert torch.equal(apply_penalties(logits, prompt + output, len(prompt), draft, Sampling()), logits)


def test_penalties_on_a_draft_vocabulary_follow_its_columns():
    """A drafter's logits cover a draft vocabulary (FR-Spec, EAGLE-3's d2t): each column is
    penalized as its token's would be over the whole vocabulary."""
    from services.common.sampling import apply_penalties

    torch.manual_seed(1)
    full = torch.randn(1, 12) * 3
    columns = torch.tensor([1, 3, 4, 7, 11])
    sp = Sampling(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    tokens, prompt_len = [1, 2, 3, 3, 4, 11], 2
    whole = apply_penalties(full, tokens, prompt_len, [], sp)
    assert torch.allclose(apply_penalties(full[:, columns], tokens, prompt_len, [], sp, columns), whole[:, columns])


def test_apply_bias_adds_and_masks_by_token_id_also_over_draft_columns():
    from services.common.sampling import apply_bias

    sp = Sampling(logit_bias=((3, 2.0), (7, -1.0)), allowed_token_ids=(1, 3, 7))
    x = apply_bias(torch.zeros(2, 8), sp)
    assert x[0].tolist() == [float("-inf"), 0.0, float("-inf"), 2.0, float("-inf"), float("-inf"), float("-inf"), -1.0]
    assert torch.equal(x[0], x[1])
    cols = torch.tensor([3, 5, 7])  # a draft vocabulary: its columns are these token ids
    assert apply_bias(torch.zeros(3), sp, cols).tolist() == [2.0, float("-inf"), -1.0]


def test_banned_tokens_and_ban_columns_on_a_draft_vocabulary():
    from services.common.sampling import ban_columns, banned_tokens

    words = ((5,), (7, 8), (2, 7, 9))
    assert banned_tokens([1, 7], words) == [5, 8]
    assert banned_tokens([2, 7], words) == [5, 8, 9]
    assert banned_tokens([], words) == [5]
    row = ban_columns(torch.zeros(4), [8, 5, 3], torch.tensor([1, 5, 8, 9]))  # columns' target ids
    assert row.tolist() == [0.0, float("-inf"), float("-inf"), 0.0]
    assert ban_columns(torch.zeros(6), [2, 4], None).isinf().nonzero().flatten().tolist() == [2, 4]


def test_bad_words_ban_a_words_last_token_where_the_context_ends_with_the_rest():
    """Row r follows output + draft[:r]: (5,) is banned everywhere, (7, 8) only after a 7."""
    import torch

    from services.common.sampling import ban_bad_words

    out = ban_bad_words(torch.zeros(4, 10), [1, 7], [2, 7, 3], ((5,), (7, 8), (2, 7, 9)))
    banned = {
        (r, c) for r, c in zip(*torch.nonzero(out == float("-inf"), as_tuple=True)) for r, c in [(int(r), int(c))]
    }
    assert banned == {(0, 5), (1, 5), (2, 5), (3, 5), (0, 8), (2, 8), (2, 9)}  # rows 0 and 2 follow a 7
    assert torch.equal(ban_bad_words(torch.zeros(2, 10), [1], [2], ((7, 8),)), torch.zeros(2, 10))
