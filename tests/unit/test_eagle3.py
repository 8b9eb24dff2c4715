"""EAGLE-3 head: checkpoint format, feature catch-up (rollback), lossless eagle3 decoding."""

import json

import pytest
import torch

from services.common.llama import Llama
from services.common.types import Sampling
from services.drafter.eagle3 import Eagle3Head
from services.drafter.eagle3_drafter import Eagle3Drafter
from services.router.engine import GenerationRequest


def test_checkpoint_roundtrip_and_published_names(tiny_dirs, tiny_eagle3, tmp_path):
    from safetensors.torch import load_file

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    keys = set(load_file(str(tiny_eagle3 / "model.safetensors")))
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= keys and not any(k.startswith("embed_tokens") for k in keys)
    cfg = json.loads((tiny_eagle3 / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 1] and cfg["draft_vocab_size"] == 8192
    assert head.midlayer.self_attn.q_proj.weight.shape[1] == 2 * 64 and head.fc.weight.shape == (64, 192)
    head.save_pretrained(tmp_path / "again", dtype=torch.float32)
    again = Eagle3Head.from_pretrained(tmp_path / "again", target.embed_tokens.weight)
    h, toks = torch.randn(1, 6, 64), torch.randint(0, 8192, (1, 6))
    with torch.no_grad():
        a, _ = head.step(h, toks, 0, head.new_cache(16))
        b, _ = again.step(h, toks, 0, again.new_cache(16))
    assert torch.equal(a, b)


def test_loader_rejects_non_eagle_config(tiny_dirs):
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        Eagle3Head.from_pretrained(tiny_dirs[0])


def features(target: Llama, tokens: list[int], layers) -> torch.Tensor:
    with torch.no_grad():
        _, hidden = target(torch.tensor([tokens]), 0, target.new_cache(capacity=len(tokens)), layers)
    return torch.cat(hidden, -1)[0]


def test_incremental_features_equal_one_shot(tiny_dirs, tiny_eagle3):
    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = list(range(300, 340))
    f = features(target, seq, head.aux_layers)  # features of positions 0..39
    a = Eagle3Drafter(head)
    a.start("r", seq[:10], Sampling(), None)
    a.observe("r", [], f[:9])  # prefill cycle: 9 positions verified
    a.propose("r", 4)
    pos = 9
    for chunk in (3, 1, 5):  # cycles committing `chunk` tokens each
        a.observe("r", seq[10 + pos - 9 : 10 + pos - 9 + chunk], f[pos : pos + chunk])
        pos += chunk
        a.propose("r", 4)
    a.propose("r", 4)  # a dropped draft, proposed again
    b = Eagle3Drafter(head)
    b.start("r", seq[: pos + 1], Sampling(), None)
    b.observe("r", [], f[:pos])
    assert a.states["r"].tokens == b.states["r"].tokens
    assert a.propose("r", 5).token_ids == b.propose("r", 5).token_ids


def test_absorbing_prompt_chunks_drafts_what_the_whole_prompt_drafts(tiny_dirs, tiny_eagle3):
    """A chunked prefill hands the head a prompt's features a chunk at a time and ``absorb``
    runs the head over each; the drafts that follow are those of the prompt given at once."""
    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = list(range(300, 340))
    f = features(target, seq, head.aux_layers)
    a, b = Eagle3Drafter(head), Eagle3Drafter(head)
    for d in (a, b):
        d.start("r", seq[:30], Sampling(), None)
    for lo, hi in ((0, 8), (8, 16), (16, 27)):  # three chunks; 3 prompt tokens still pending
        a.observe("r", [], f[lo:hi])
        a.absorb("r", hi)
        assert a.states["r"].real_len == hi and not a.states["r"].feats  # taken in now, not at the draft
    a.observe("r", [], f[27:29])  # the prompt's last cycle
    b.observe("r", [], f[:29])
    assert a.propose("r", 4).token_ids == b.propose("r", 4).token_ids
    for d in (a, b):  # and the next cycle
        d.observe("r", seq[30:32], f[29:31])
    assert a.propose("r", 4).token_ids == b.propose("r", 4).token_ids


def test_eagle3_equals_vanilla(tiny_eagle_engine):
    eng = tiny_eagle_engine
    for text in ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    def f(self", "x = [1, 2"]:
        ids = eng.encode(text)
        van = eng.generate(GenerationRequest(ids, 40, method="vanilla")).result()
        e3 = eng.generate(GenerationRequest(ids, 40, method="eagle3")).result()
        assert e3["token_ids"] == van["token_ids"]
        assert e3["stats"]["draft_tokens"] > 0 and e3["stats"]["drafts_by_source"].get("eagle3", 0) > 0
    out = eng.generate(GenerationRequest(eng.encode("x ="), 20, Sampling(0.8, 0.9, 0, 3), method="eagle3"))
    assert len(out.result()["token_ids"]) == 20


def test_ttt_unroll_matches_inference_chain(tiny_dirs, tiny_eagle3):
    """Step j at index i of training equals chain step j of a draft started at position i."""
    from training.eagle3 import ttt_loss, ttt_unroll

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = list(range(500, 530))
    ids = torch.tensor([seq])
    with torch.no_grad():
        logits, hidden = target.forward_train(ids, capture=head.aux_layers)
        f = torch.cat(hidden, -1)
        steps = {j: lg for j, lg in ttt_unroll(head, f, ids, 4)}
        for i in (3, 11, 20):
            cache = head.new_cache(64)
            lg, out = head.step(head.fc(f[:, : i + 1]), ids[:, 1 : i + 2], 0, cache)
            assert torch.allclose(lg[0, -1], steps[0][0, i], atol=1e-4)
            h = out[:, -1:]
            for j in (1, 2, 3):  # teacher-forced chain: token x_{i+1+j} at position i+j
                lg, h = head.step(h, ids[:, i + 1 + j : i + 2 + j], i + j, cache)
                assert torch.allclose(lg[0, -1], steps[j][0, i], atol=1e-4), (i, j)
        loss, per_step = ttt_loss(head, f, torch.softmax(logits, -1), ids, torch.tensor([30]), 4)
    assert loss.item() > 0 and len(per_step) == 4


def test_batched_proposals_equal_one_at_a_time(tiny_dirs, tiny_eagle3):
    """propose_batch over requests at different points (fresh, mid-catch-up, nothing new,
    no features yet) drafts what propose drafts for each alone, cycle after cycle."""
    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seqs = {"a": list(range(300, 340)), "b": list(range(500, 520)), "c": [7, 8, 9, 10, 11, 12]}
    feats = {k: features(target, s, head.aux_layers) for k, s in seqs.items()}
    one, many = Eagle3Drafter(head), Eagle3Drafter(head)
    for d in (one, many):
        for k, s in seqs.items():
            d.start(k, s[:5], Sampling(), None)
        d.observe("a", [], feats["a"][:4])
        d.observe("b", [], feats["b"][:4])  # "c" has no features yet: an empty draft
    budgets = {"a": 4, "b": 3, "c": 4}
    pos = {"a": 4, "b": 4}
    for cycle in range(3):
        singles = {k: one.propose(k, b).token_ids for k, b in budgets.items()}
        batched = dict(zip(budgets, (d.token_ids for d in many.propose_batch(list(budgets.items())))))
        assert batched == singles, cycle
        assert len(singles["a"]) == 4 and len(singles["b"]) == 3 and singles["c"] == []
        n = 2 if cycle != 1 else 0  # cycle 1 commits nothing to "b": recompute path
        for d in (one, many):
            d.observe("a", seqs["a"][pos["a"] + 1 : pos["a"] + 3], feats["a"][pos["a"] : pos["a"] + 2])
            if n:
                d.observe("b", seqs["b"][pos["b"] + 1 : pos["b"] + 1 + n], feats["b"][pos["b"] : pos["b"] + n])
        pos["a"] += 2
        pos["b"] += n


def test_dynamic_chain_length_cuts_after_first_doubted_token(tiny_dirs, tiny_eagle3):
    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = list(range(300, 320))
    f = features(target, seq, head.aux_layers)

    def drafter(min_confidence: float) -> Eagle3Drafter:
        d = Eagle3Drafter(head, min_confidence)
        d.start("r", seq, Sampling(), None)
        d.observe("r", [], f[: len(seq) - 1])
        return d

    full, picks = drafter(1e-9), []  # a cut this low never fires; it makes _pick report max q
    pick = full._pick
    full._pick = lambda st, lg, drafted, state=None: picks.append(pick(st, lg, drafted, state)) or picks[-1]
    chain = full.propose("r", 8).token_ids
    p_max = [p for _, _, p in picks]
    threshold = sorted(p_max)[len(p_max) // 2]
    cut = next(i for i, p in enumerate(p_max) if p < threshold) + 1
    assert len(chain) == 8 and 1 <= cut < 8
    assert drafter(threshold).propose("r", 8).token_ids == chain[:cut]


def test_heldout_agreement_compares_each_chain_position_with_the_targets_next_greedy_token(tiny_dirs, tiny_eagle3):
    """Chain position j at index i predicts x_{i+2+j}, whose greedy choice is the target's argmax at
    i+1+j. A target that always agrees with the head's first chain position scores 1.0 there."""
    from training.eagle3 import heldout_agreement, ttt_unroll

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = [(37 * i) % 900 + 100 for i in range(30)]
    ids = torch.tensor([seq])
    with torch.no_grad():
        _, hidden = target.forward_train(ids, capture=head.aux_layers)
        steps = {j: lg[0].argmax(-1) for j, lg in ttt_unroll(head, torch.cat(hidden, -1), ids, 3)}
    agreeing = torch.full((1, 30, 8192), -1.0)
    agreeing[0, torch.arange(1, 30), steps[0][:29]] = 1.0  # argmax at i+1 = the head's step-0 token at i

    class Agreeing:
        def forward_train(self, x, capture=()):
            return agreeing, hidden

    got = heldout_agreement(head, Agreeing(), [seq], 3)
    assert got[0] == 1.0
    for j in (1, 2):  # later positions: the head's step-j tokens against the same shifted argmax
        want = (steps[j][: 29 - j] == steps[0][j:29]).float().mean().item()
        assert got[j] == round(want, 4)


def test_corpus_windows_are_evenly_spaced_slices_of_the_training_stream(monkeypatch):
    import numpy as np

    import training.pretrain as pt
    from training.sequences import corpus_windows

    stream = np.arange(10_000, dtype=np.uint16)
    monkeypatch.setattr(pt, "encode_corpus", lambda tok, work, packages=None: (stream, stream[:10]))
    wins = corpus_windows(2048, width=512)
    assert [len(w) for w in wins] == [512] * 4
    assert [w[0] for w in wins] == [0, 2372, 4744, 7116] and all(w == list(range(w[0], w[0] + 512)) for w in wins)
    assert corpus_windows(0) == []
    shifted = corpus_windows(2048, width=512, offset=0.5)  # halfway between the unshifted windows
    assert [w[0] for w in shifted] == [1186, 3558, 5930, 8302] and len(shifted[-1]) == 512


def test_evenly_keeps_an_evenly_spaced_share():
    from training.sequences import evenly

    assert evenly(list(range(10)), 0.5) == [1, 3, 5, 7, 9]
    assert evenly(list(range(10)), 1.0) == list(range(10))
    assert len(evenly(list(range(100)), 0.25)) == 25


def test_lm_agreement_is_one_for_the_target_itself_and_lower_for_another_model(tiny_dirs):
    from training.eagle3 import lm_agreement

    target, draft = (Llama.from_pretrained(d) for d in tiny_dirs)
    seqs = [[(31 * i + r) % 700 + 50 for i in range(n)] for r, n in ((0, 40), (3, 25))]
    assert lm_agreement(target, target, seqs) == 1.0
    assert 0.0 <= lm_agreement(draft, target, seqs) < 1.0


def test_a_head_trained_for_another_target_is_refused_by_the_loader(tiny_dirs, tiny_eagle3, tmp_path):
    import shutil

    from services.drafter.eagle3 import HeadMismatch

    target = Llama.from_pretrained(tiny_dirs[0])
    Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight, target=target.s)
    shutil.copy(tiny_eagle3 / "model.safetensors", tmp_path)
    other = json.loads((tiny_eagle3 / "config.json").read_text())
    other.update(target_hidden_size=256, hidden_size=256)
    (tmp_path / "config.json").write_text(json.dumps(other))
    with pytest.raises(HeadMismatch, match="hidden 256"):
        Eagle3Head.from_pretrained(tmp_path, target.embed_tokens.weight, target=target.s)


def test_an_engine_leaves_a_mismatched_head_out(tiny_dirs, tiny_eagle3, tmp_path):
    from services.common.config import EngineConfig
    from services.router.engine import Engine

    other = json.loads((tiny_eagle3 / "config.json").read_text())
    other["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 9]
    (tmp_path / "config.json").write_text(json.dumps(other))
    eng = Engine(EngineConfig(target=tiny_dirs[0], draft=None, eagle3=tmp_path, predictor=None, ocm_snapshot=None))
    assert "eagle3" not in eng.methods() and "vanilla" in eng.methods()


def test_card_calls_a_head_data_limited_only_when_it_fits_its_training_traces_clearly_better():
    from training.cards import data_limited

    assert "14 points" in data_limited([0.41, 0.39], [0.55, 0.52], 334_941)
    assert data_limited([0.41], [0.43], 1000) == "" and data_limited([0.41], [], 1000) == ""


def test_card_lists_every_training_stage_of_a_continued_head():
    from training.cards import recipe_row, staged, stages

    first = {"epochs": 2, "ttt_steps": 4, "lr": 1e-3, "tokens": 1000}
    second = {"epochs": 1, "ttt_steps": 4, "lr": 5e-4, "tokens": 3000, "init": first}
    assert stages(second) == [first, second] and stages(first) == [first]
    cell = staged(stages(second), recipe_row)
    assert cell.startswith("**stage 1**: 2 epochs, 4 TTT steps") and "**stage 2**: 1 epoch, 4 TTT" in cell
    assert "stage" not in staged([first], recipe_row)


def test_card_counts_the_data_of_stages_that_reran_it_once():
    """A stage over the same trace files, or over them and more, counts its data once."""
    from training.cards import distinct_tokens

    first = {"traces": "a.jsonl", "corpus_tokens": 500, "tokens": 1000}
    again = {**first, "epochs": 2, "init": first}  # more epochs over the same data
    more = {"traces": "b.jsonl", "corpus_tokens": 0, "tokens": 400, "init": again}
    assert distinct_tokens([first, again, more]) == 1400 and distinct_tokens([first]) == 1000
    wider = {"traces": "b.jsonl,c.jsonl", "corpus_tokens": 0, "tokens": 900, "init": more}  # b again, and c
    assert distinct_tokens([first, again, more, wider]) == 1900


def test_chain_acceptance_is_a_running_conjunction(tiny_dirs, tiny_eagle3, tmp_path):
    """training.ablation: position 1's chain acceptance is its agreement; later positions need
    every earlier one, so chain acceptance never rises and never exceeds agreement."""
    from training.ablation import table
    from training.eagle3 import chain_agreement

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seqs = [list(range(300, 340)), [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7], list(range(900, 960, 2))]
    agree, chain = chain_agreement(head, target, seqs, 4)
    assert len(agree) == len(chain) == 4 and chain[0] == agree[0]
    assert all(a >= b for a, b in zip(chain, chain[1:])) and all(c <= a for c, a in zip(chain, agree))
    row = {
        "head": "h",
        "ttt_steps": 4,
        "train_tokens": 10,
        "agreement_per_position": agree,
        "chain_acceptance_per_position": chain,
        "mean_accepted_length": sum(chain),
    }
    assert "| `h` | 4 | — | 10 |" in table([row], "x", 3, "cmd")
    row.update(draft_vocab=2048, corpus_tokens=6, train_tokens=16)
    assert "| `h` | 4 | 2,048 | 16 (6) |" in table([row], "x", 3, "cmd")


def test_draft_vocabulary_is_the_most_frequent_next_tokens():
    from training.eagle3 import draft_vocabulary

    seqs = [[9, 5, 5, 5, 7, 7, 3], [5, 4, 4, 3]]  # next tokens: 5×3, then 3, 4, 7 ×2 (first tokens are no labels)
    assert draft_vocabulary(seqs, 2, 16).tolist() == [3, 5]  # ties go to the lower id
    assert draft_vocabulary(seqs, 3, 16).tolist() == [3, 4, 5]
    assert draft_vocabulary(seqs, 5, 16).tolist() == [0, 3, 4, 5, 7]  # an unseen id fills the last place


def test_reduced_draft_vocabulary_maps_to_target_ids_and_stays_lossless(tiny_dirs, tmp_path):
    """A head over 600 of the 8192 tokens: d2t/t2d survive a save, its greedy and sampled
    drafts are target ids inside its vocabulary, and eagle3 still equals vanilla."""
    from services.common.config import EngineConfig
    from services.router.engine import Engine
    from training.eagle3 import new_head

    target = Llama.from_pretrained(tiny_dirs[0])
    seqs = [list(range(1000 + 7 * i, 1000 + 7 * i + 50)) for i in range(30)]
    head, ids = new_head(target, (0, 1, 1), seqs, 600, "cpu")
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() > 1 and "embed" not in name and "lm_head" not in name:
                p.normal_(0.0, 0.2)
    assert len(ids) == 600 and torch.equal(head.lm_head.weight, target.lm_head.weight[ids])
    head.save_pretrained(tmp_path / "h", dtype=torch.float32)
    again = Eagle3Head.from_pretrained(tmp_path / "h", target.embed_tokens.weight)
    assert again.remaps_vocab and again.draft_vocab == 600 and int(again.t2d.sum()) == 600
    assert torch.equal(again.to_target_ids(torch.arange(600)), ids)
    logits = torch.randn(600)
    assert again.greedy(logits) == int(ids[logits.argmax()])
    full = again.target_logits(logits)
    assert int(full.argmax()) == again.greedy(logits) and torch.isinf(full[~again.t2d]).all()
    eng = Engine(
        EngineConfig(target=tiny_dirs[0], draft=None, eagle3=tmp_path / "h", eagle3_k=3, max_new_tokens_limit=200)
    )
    allowed = set(ids.tolist())
    for text in ["def add(a, b):\n", "x = [1, 2"]:
        p = eng.encode(text)
        van = eng.generate(GenerationRequest(p, 30, method="vanilla")).result()
        e3 = eng.generate(GenerationRequest(p, 30, method="eagle3")).result()
        assert e3["token_ids"] == van["token_ids"] and e3["stats"]["draft_tokens"] > 0
    drafter = eng.verifier.drafters["eagle3"]
    p = eng.encode("import os\n")
    f = features(target, p, again.aux_layers)
    drafter.start("s", p, Sampling(0.9, 1.0, 0, 5), torch.Generator().manual_seed(0))
    drafter.observe("s", [], f[: len(p) - 1])
    d = drafter.propose("s", 3)
    assert d.token_ids and set(d.token_ids) <= allowed
    assert float(d.probs[:, ~again.t2d].sum()) == 0.0  # q lives on the draft vocabulary


def test_packed_head_equals_fp32_head(tiny_dirs, tiny_eagle3):
    """pack_linears fuses the head's q|k|v like the target's; a step's logits stay the fp32 path's."""
    from services.common.packed_linear import pack_linears

    target = Llama.from_pretrained(tiny_dirs[0])
    ref = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    packed = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    for m in (ref, packed):
        for p in m.parameters():
            p.data = p.data.half().float()  # what an fp16 checkpoint loads as
    assert pack_linears(packed) > 0 and packed.midlayer.self_attn.qkv is not None
    h, toks = torch.randn(1, 5, 64), torch.randint(0, 8192, (1, 5))
    with torch.no_grad():
        a, ha = ref.step(h, toks, 2, ref.new_cache(16))
        b, hb = packed.step(h, toks, 2, packed.new_cache(16))
    assert torch.allclose(a, b, atol=1e-4) and torch.allclose(ha, hb, atol=1e-4)


def test_fused_rms_norm_equals_the_formula():
    from services.common.llama import RMSNorm

    n = RMSNorm(64, 1e-5)
    with torch.no_grad():
        n.weight.normal_()
    x = torch.randn(3, 7, 64) * 5
    h = x.float()
    assert torch.equal(n(x), n.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)))


def test_embedding_table_follows_the_weights(tiny_dirs, tiny_eagle3):
    """The step's normed-embedding table equals input_layernorm(embed(tokens)) exactly and is
    re-made when the norm's weight changes in place (as an optimizer step changes it)."""
    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    toks = torch.tensor([[3, 900, 8191]])
    with torch.no_grad():
        assert torch.equal(head.embed_in(toks), head.midlayer.input_layernorm(head.embed_tokens(toks)))
        h = torch.randn(1, 3, 64)
        before, _ = head.step(h, toks, 0, head.new_cache(16))
        head.midlayer.input_layernorm.weight.mul_(3.0)
        assert torch.equal(head.embed_in(toks), head.midlayer.input_layernorm(head.embed_tokens(toks)))
        after, _ = head.step(h, toks, 0, head.new_cache(16))
    assert not torch.allclose(before, after)


def test_draft_tree_children_are_the_heads_topk_along_each_branch(tiny_dirs, tiny_eagle3):
    """Each expanded node's children are the head's top-k after the node's own branch, as a
    chain step-by-step along that branch computes them: tree attention in the head (slots
    after the real prefix, depth positions, ancestor masks) equals running the branch alone.
    The tree keeps at most ``budget`` nodes, its main chain is the greedy chain's prefix, and
    a request started without trees gets the chain."""
    from services.common.token_tree import check_tree, main_chain
    from services.drafter.eagle3_drafter import TreeShape

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seq = list(range(300, 330))
    f = features(target, seq, head.aux_layers)
    tree = Eagle3Drafter(head, tree=TreeShape(topk=3, steps=4), name="eagle3-tree")
    chain = Eagle3Drafter(head)
    for d in (tree, chain):
        d.start("r", seq[:20], Sampling(), None, trees=True)
        d.observe("r", [], f[:19])
    tree.start("plain", seq[:20], Sampling(), None)
    tree.observe("plain", [], f[:19])
    greedy = chain.propose("r", 4).token_ids
    assert tree.propose("plain", 4).token_ids == greedy
    draft = tree.propose("r", 10)
    check_tree(draft.parents)
    assert draft.is_tree and len(draft) == 10
    main = [draft.token_ids[i] for i in main_chain(draft.parents)]
    assert main == greedy[: len(main)] and len(main) >= 2
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(draft.parents):
        kids.setdefault(p, []).append(i)

    def branch(node: int) -> list[int]:
        out = []
        while node >= 0:
            out.insert(0, draft.token_ids[node])
            node = draft.parents[node]
        return out

    with torch.no_grad():
        for node, children in kids.items():
            # the head along this branch alone: catch-up on the real prefix, then one step per token
            cache = head.new_cache(64)
            h = head.fc(f[:19])
            logits, out = head.step(h[None], torch.tensor([seq[1:20]]), 0, cache)
            for depth, tok in enumerate(branch(node), start=1):
                logits, out = head.step(out, torch.tensor([[tok]]), 18 + depth, cache)
            top = torch.topk(logits[0, -1], 3).indices.tolist()
            assert [draft.token_ids[c] for c in children] == top[: len(children)], node


def test_tree_methods_equal_vanilla_tiny(tiny_eagle_engine):
    """eagle3-tree and suffix-tree on the tiny models (an untrained head: its trees branch
    where it doubts) commit exactly vanilla's tokens, and trees really were verified."""
    eng = tiny_eagle_engine
    assert {"eagle3-tree", "suffix-tree"} <= set(eng.methods())
    drafted = 0
    for text in ["def add(a, b):\n", "import os\nimport sys\n", "class A:\n    def f(self", "x = [1, 2" * 3]:
        ids = eng.encode(text)
        van = eng.generate(GenerationRequest(ids, 40, method="vanilla")).result()
        for method in ("eagle3-tree", "suffix-tree"):
            out = eng.generate(GenerationRequest(ids, 40, method=method)).result()
            assert out["token_ids"] == van["token_ids"], (method, text)
        drafted += out["stats"]["draft_tokens"]
    assert drafted > 0
    sampled = eng.generate(GenerationRequest(eng.encode("x ="), 20, Sampling(0.8, 0.9, 0, 3), method="eagle3-tree"))
    assert len(sampled.result()["token_ids"]) == 20  # a sampled request verifies its trees by sampling


def test_batched_draft_trees_equal_one_at_a_time(tiny_dirs, tiny_eagle3):
    """Trees of several requests grown in lockstep (one head step per depth for all of them,
    attention per request) are the trees each grows alone, cycle after cycle, budgets and
    prefix lengths differing."""
    from services.drafter.eagle3_drafter import TreeShape

    target = Llama.from_pretrained(tiny_dirs[0])
    head = Eagle3Head.from_pretrained(tiny_eagle3, target.embed_tokens.weight)
    seqs = {"a": list(range(300, 340)), "b": list(range(500, 520)), "c": list(range(700, 760))}
    feats = {k: features(target, s, head.aux_layers) for k, s in seqs.items()}
    shape = TreeShape(topk=2, steps=4)
    one, many = (Eagle3Drafter(head, tree=shape, name="eagle3-tree") for _ in range(2))
    start = {"a": 5, "b": 9, "c": 30}
    for d in (one, many):
        for k, s in seqs.items():
            d.start(k, s[: start[k]], Sampling(), None, trees=True)
            d.observe(k, [], feats[k][: start[k] - 1])
    budgets = {"a": 8, "b": 3, "c": 6}
    pos = {k: start[k] - 1 for k in seqs}
    for cycle in range(3):
        singles = {k: one.propose(k, b) for k, b in budgets.items()}
        batched = dict(zip(budgets, many.propose_batch(list(budgets.items()))))
        for k in budgets:
            assert (batched[k].token_ids, batched[k].parents) == (singles[k].token_ids, singles[k].parents), (cycle, k)
            assert len(singles[k]) == budgets[k]
        assert singles["a"].is_tree
        for d in (one, many):
            for k in seqs:
                d.observe(k, seqs[k][pos[k] + 1 : pos[k] + 3], feats[k][pos[k] : pos[k] + 2])
        pos = {k: p + 2 for k, p in pos.items()}


def test_the_corpus_is_cached_per_tokenizer_so_another_vocabularys_ids_are_never_read_as_ours(tmp_path, monkeypatch):
    from pathlib import Path

    from training.sequences import BUNDLED_TOKENIZER, corpus_cache

    monkeypatch.setenv("SPECMESH_TRAIN_DIR", str(tmp_path))
    assert corpus_cache(BUNDLED_TOKENIZER) == tmp_path / "corpus"  # pre-training's stream, shared
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    mine = corpus_cache(other)
    assert mine.parent == tmp_path and mine.name.startswith("corpus-")
    (other / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    assert corpus_cache(other) not in (mine, tmp_path / "corpus")
    assert corpus_cache(Path("models/target")) == tmp_path / "corpus"  # the bundled target's tokenizer is ours
