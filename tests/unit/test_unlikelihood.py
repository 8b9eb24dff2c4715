"""Sequence-level unlikelihood fine-tuning: which tokens are penalised, batched greedy
continuations, and that the loss lowers the probability of a looping token."""

import pytest
import torch

from services.common.llama import Llama
from training.evaluate import greedy, unlikelihood_row
from training.unlikelihood import (
    AlreadyTuned,
    cycle_mask,
    greedy_batch,
    loop_masks,
    round_state,
    stack_left_truncated,
    ul_loss,
)


def test_cycle_mask_marks_the_second_repeat_of_a_period():
    assert not any(cycle_mask(list(range(40))))
    seq = list(range(100, 110)) + [1, 2, 3, 4, 5] * 4  # period 5: max(2·5, 8) = 10 tokens needed
    mask = cycle_mask(seq)
    assert mask.index(True) == 10 + 10 - 1  # the 10th token of the cycle completes 2 periods
    assert all(mask[19:])


def test_cycle_mask_short_periods_need_eight_tokens():
    seq = [9, 8] + [7] * 8
    assert cycle_mask(seq) == [False] * 9 + [True]  # seven matches with period 1 = eight equal tokens
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


def _round(step, total, lr, final, **extra):
    return {
        "step": step,
        "total_steps": total,
        "lr": lr,
        "alpha": 1.0,
        "ul_batch": 16,
        "mle_batch": 8,
        "continuation": 128,
        "monitor_prompts": 40,
        "train_minutes": 10.0,
        "final": final,
        "history": [{"step": 0, "monitor_loop_rate": 0.5}, {"step": step, "monitor_loop_rate": 0.2}],
        **extra,
    }


def test_rounds_start_resume_and_skip(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    pre = {"preset": "target"}
    base, earlier, src = round_state(pre, tmp_path, 1)
    assert base == pre and earlier == [] and len(src) == 16
    r1 = _round(300, 300, 1e-4, True)
    with pytest.raises(AlreadyTuned):
        round_state({**pre, "unlikelihood": r1}, tmp_path, 1)
    with pytest.raises(ValueError, match="run round 2 first"):
        round_state({**pre, "unlikelihood": r1}, tmp_path, 3)
    base, earlier, src2 = round_state({**pre, "unlikelihood": r1}, tmp_path, 2)
    assert base == pre and earlier == [r1] and src2 == src
    # an export made mid-round 2 resumes round 2 from the weights that round started from
    mid = _round(40, 150, 5e-5, False, source="start-of-r2", previous=[r1])
    assert round_state({**pre, "unlikelihood": mid}, tmp_path, 2) == (pre, [r1], "start-of-r2")
    done = {**mid, "step": 150, "final": True}
    with pytest.raises(AlreadyTuned):
        round_state({**pre, "unlikelihood": done}, tmp_path, 2)
    _, earlier, _ = round_state({**pre, "unlikelihood": done}, tmp_path, 3)
    assert [r["lr"] for r in earlier] == [1e-4, 5e-5] and all("previous" not in r for r in earlier)


def test_card_row_sums_the_rounds():
    r2 = _round(150, 150, 5e-5, True, previous=[_round(300, 300, 1e-4, True)])
    row = unlikelihood_row({"unlikelihood": r2})
    assert "300/300 (LR 0.0001) + 150/150 (LR 5e-05) steps (20.0 min)" in row
    assert "50.0% → 20.0%" in row and "in progress" not in row


def test_loop_row_reports_the_standard_error_and_the_file_heads():
    from training.evaluate import loop_row

    ev = {
        "loop_rate": 0.15,
        "loop_prompts": 200,
        "loop_rate_stderr": 0.025,
        "loop_rate_file_heads": 0.275,
        "file_heads": 40,
    }
    row = loop_row(ev)
    assert row.startswith("**15.0%** of 200") and "standard error 2.5%" in row and "40 windows at file heads" in row
    assert "27.5%" in row and "standard error" not in loop_row({"loop_rate": 0.3, "loop_prompts": 40})
