"""Sequence-level unlikelihood fine-tuning: which tokens are penalised, batched greedy
continuations, and that the loss lowers the probability of a looping token."""
import torch

from services.common.llama import Llama
from training.evaluate import greedy
from training.unlikelihood import cycle_mask, greedy_batch, loop_masks, stack_left_truncated, ul_loss


def test_cycle_mask_marks_the_second_repeat_of_a_period():
    assert not any(cycle_mask(list(range(40))))
    seq = list(range(100, 110)) + [1, 2, 3, 4, 5] * 4   # period 5: max(2·5, 8) = 10 tokens needed
    mask = cycle_mask(seq)
    assert mask.index(True) == 10 + 10 - 1               # the 10th token of the cycle completes 2 periods
    assert all(mask[19:])


def test_cycle_mask_short_periods_need_eight_tokens():
    seq = [9, 8] + [7] * 8
    assert cycle_mask(seq) == [False] * 9 + [True]       # seven matches with period 1 = eight equal tokens
    assert not any(cycle_mask([9, 8] + [7] * 7))


def test_loop_masks_ignore_tokens_from_the_first_eos_on():
    cont = torch.tensor([[5] * 12, [5] * 9 + [0] + [5] * 2])
    m = loop_masks(cont, eos=0)
    assert m[0].tolist() == [0.0] * 7 + [1.0] * 5
    assert m[1].sum() == 2 and m[1, 9:].sum() == 0


def test_left_truncation_keeps_the_most_recent_tokens():
    assert stack_left_truncated([[1, 2, 3, 4], [5, 6, 7]]).tolist() == [[2, 3, 4], [5, 6, 7]]


def test_greedy_batch_equals_one_row_at_a_time(tiny_dirs):
    model = Llama.from_pretrained(tiny_dirs[0])
    prompts = torch.tensor([[11, 12, 13, 14, 15, 16], [40, 41, 42, 43, 44, 45], [7, 7, 7, 7, 7, 7]])
    batch = greedy_batch(model, prompts, 20).tolist()
    for row, out in zip(prompts.tolist(), batch):
        assert greedy(model, row, 20, eos=-1) == out


def test_unlikelihood_lowers_the_probability_of_penalised_tokens(tiny_dirs):
    torch.manual_seed(0)
    model = Llama.from_pretrained(tiny_dirs[0]).train()
    prompts = torch.tensor([[11, 12, 13, 14, 15, 16]])
    cont = greedy_batch(model, prompts, 12)
    mask = torch.zeros(1, 12)
    mask[0, 6:] = 1.0

    def prob_of_penalised() -> float:
        with torch.no_grad():
            logits = model.forward_train(torch.cat([prompts, cont], 1))[:, 5:-1]
            return float(torch.softmax(logits, -1).gather(-1, cont[..., None])[0, 6:].mean())

    before = prob_of_penalised()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(10):
        opt.zero_grad()
        ul_loss(model, prompts, cont, mask).backward()
        opt.step()
    assert prob_of_penalised() < 0.5 * before


def test_lr_warms_up_holds_then_decays_to_ten_percent():
    from training.unlikelihood import lr_at

    assert lr_at(0, 300, 1.0) < lr_at(10, 300, 1.0) < lr_at(19, 300, 1.0) == 1.0
    assert lr_at(150, 300, 1.0) == lr_at(199, 300, 1.0) == 1.0
    assert 0.1 < lr_at(250, 300, 1.0) < 1.0 and abs(lr_at(300, 300, 1.0) - 0.1) < 1e-9


def test_seq_rep_counts_repeated_four_grams_including_near_loops():
    from training.evaluate import ends_in_loop, seq_rep

    assert seq_rep(list(range(50))) == 0.0
    near = []
    for k in range(8):  # a cycle that grows by one token each time: no exact period
        near += [1, 2, 3, 4] + [5] * (k % 3) + [6]
    assert not ends_in_loop(near) and seq_rep(near) > 0.5
