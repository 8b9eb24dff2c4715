"""Pre-training helpers: resumable batches, the LR schedule, and warm start from published weights."""

import json

import numpy as np
import torch

from training.pretrain import batch_at, budgeted_total, lr_at


def test_batches_are_a_pure_function_of_step():
    stream = np.arange(5000, dtype=np.uint16)
    assert torch.equal(batch_at(stream, 7, 2, seed=1), batch_at(stream, 7, 2, seed=1))
    assert not torch.equal(batch_at(stream, 7, 2, seed=1), batch_at(stream, 8, 2, seed=1))


def test_lr_warmup_then_cosine_to_ten_percent():
    assert lr_at(0, 1000, 1.0) < lr_at(50, 1000, 1.0) < lr_at(99, 1000, 1.0) <= 1.0
    assert abs(lr_at(1000, 1000, 1.0) - 0.1) < 1e-9


def test_time_budget_shortens_the_schedule_never_lengthens_it():
    assert budgeted_total(1000, 40, seconds_per_step=0.5, seconds_left=100) == 240
    assert budgeted_total(1000, 40, seconds_per_step=0.01, seconds_left=100) == 1000
    assert budgeted_total(1000, 40, seconds_per_step=1.0, seconds_left=-5) == 41


def test_warm_start_continues_from_published_weights(tmp_path, tiny_dirs, monkeypatch):
    """The code path a new machine takes: no checkpoint, published fp16 weights + their step."""
    import training.pretrain as pt

    published = tmp_path / "published"
    from services.common.llama import Llama

    model = Llama.from_pretrained(tiny_dirs[0])
    model.save_pretrained(published)
    (published / "training_state.json").write_text(json.dumps({"step": 42, "train_minutes": 3.0}))
    seen = {}

    def fake_encode(tokenizer_dir, work, packages=None):
        return np.arange(3000, dtype=np.uint16) % 8192, np.arange(3000, dtype=np.uint16) % 8192

    def fake_build(p, vocab, eos):
        seen["built"] = True
        return Llama(model.hf_config)

    monkeypatch.setattr(pt, "encode_corpus", fake_encode)
    monkeypatch.setattr(pt, "build_model", fake_build)
    monkeypatch.setattr(pt, "SEQ_LEN", 64)
    args = pt.argparse.Namespace(
        preset="draft",
        tokens=64 * 8 * 44,
        threads=1,
        work_dir=tmp_path / "work",
        tokenizer=tiny_dirs[0],
        out=tmp_path / "out",
        ckpt_minutes=100,
        log_every=1,
        compile=False,
        warm_start=published,
        device="cpu",
        packages=None,
        batch=8,
        max_minutes=0.0,
        bf16="auto",
    )
    pt.train(args)
    state = json.loads((tmp_path / "out" / "training_state.json").read_text())
    assert seen["built"] and state["step"] == 44  # continued at 42, ran the last 2 steps
    # A published model already at (or past) the budget, or distilled since, is left alone.
    for published_state in (
        {"step": 44, "train_minutes": 3.0},
        {"step": 10, "train_minutes": 1.0, "distill": {}},
        {"step": 10, "train_minutes": 1.0, "final": True},
    ):
        (published / "training_state.json").write_text(json.dumps(published_state))
        pt.train(pt.argparse.Namespace(**{**vars(args), "out": tmp_path / "untouched", "work_dir": tmp_path / "w2"}))
        assert not (tmp_path / "untouched").exists()
