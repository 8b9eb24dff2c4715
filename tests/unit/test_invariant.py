"""Batch-invariant verification (services/common/invariant.py): in bfloat16 a position's target
logits and K/V are bit for bit the same whether it is decoded alone, verified inside a chain,
verified beside another session, or reached through a token tree."""

import pytest
import torch

from services.common import invariant
from services.common.invariant import Linear as InvariantLinear
from services.common.invariant import ancestry, bucket_len, needs_invariant
from services.common.invariant import linear as invariant_linear
from services.common.llama import Llama
from tests.conftest import BUNDLED_TARGET, make_tiny


def decode(m: Llama, ids: list[int], p: int, steps: int) -> tuple[list[torch.Tensor], object]:
    """Prefill ids[:p], then decode ids[p:p + steps] one at a time → the logits predicting
    positions p..p + steps (the prefill's last row first) and the cache."""
    cache = m.new_cache(1, p + steps + 8)
    lg, _ = m.forward_ragged([ids[:p]], [0], [cache], tails=[1])
    rows = [lg[0][-1]]
    for i in range(p, p + steps):
        lg, _ = m.forward_ragged([ids[i : i + 1]], [i], [cache], tails=[1])
        rows.append(lg[0][-1])
    return rows, cache


def verify(m: Llama, ids: list[int], p: int, steps: int, beside: bool, tree: list[int] | None = None, toks=None):
    """Prefill ids[:p - 1] (a cache of another capacity), then one forward feeding ids[p - 1]
    and a draft (the chain ids[p:p + steps], or ``toks`` on ``tree``), optionally beside a
    second session's prompt."""
    cache = m.new_cache(1, p + steps + 40)
    m.forward_ragged([ids[: p - 1]], [0], [cache], tails=[1])
    fed = [ids[p - 1]] + (toks if tree else ids[p : p + steps])
    seqs, starts, caches, tails = [fed], [p - 1], [cache], [len(fed)]
    trees: list[list[int] | None] = [tree]
    if beside:
        seqs, starts, caches, tails = seqs + [ids[:23]], starts + [0], caches + [m.new_cache(1, 30)], tails + [3]
        trees.append(None)
    lg, _ = m.forward_ragged(seqs, starts, caches, tails=tails, trees=trees)
    return lg[0], cache


@pytest.fixture(scope="module")
def bf16_target() -> Llama:
    m = Llama.from_pretrained(BUNDLED_TARGET, torch.bfloat16)
    m.batch_invariant = True
    return m


@pytest.fixture(scope="module")
def bf16_gqa(tmp_path_factory) -> Llama:
    m = Llama.from_pretrained(make_tiny(tmp_path_factory.mktemp("gqa") / "t", seed=5, kv_heads=2), torch.bfloat16)
    m.batch_invariant = True
    return m


@pytest.fixture(scope="module")
def bf16_smollm2() -> Llama:
    """The real target (9 query / 3 K/V heads, a 1,536-wide MLP input: `make setup` converts it)."""
    m = Llama.from_pretrained("build/models/smollm2", torch.bfloat16)
    m.batch_invariant = True
    return m


def test_invariant_linear_rows_equal_one_row_calls():
    """Linears over 1,536 and 576 inputs in bfloat16: every row of a call of 1-80 rows equals that
    row alone through ``invariant.linear`` (``F.linear`` here rounds row 13 of 14-16 differently
    over 1,536 inputs, and with AMX every row count from 33 on over 576)."""
    torch.manual_seed(0)
    for k in (1536, 576):
        w, x = torch.randn(576, k).bfloat16(), torch.randn(80, k).bfloat16()
        alone = torch.cat([invariant_linear(x[j : j + 1], w) for j in range(80)])
        for m in range(1, 81):
            assert torch.equal(invariant_linear(x[:m], w), alone[:m]), (k, m)
    model = Llama.from_pretrained("build/models/smollm2", torch.bfloat16)
    names = dict(model.named_parameters())
    needs = {n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and needs_invariant(mod)}
    assert {f"layers.{i}.mlp.down_proj" for i in range(model.s.layers)} <= needs  # over K_CHUNK inputs
    model.batch_invariant = True  # those linears, the same parameters under the same names
    assert {n for n, mod in model.named_modules() if isinstance(mod, InvariantLinear)} == needs
    assert {k: id(v) for k, v in model.named_parameters()} == {k: id(v) for k, v in names.items()}
    model.batch_invariant = False
    assert not any(isinstance(mod, InvariantLinear) for mod in model.modules())


def test_row_block_finds_where_a_gemm_sums_rows_differently(monkeypatch):
    """The probe finds the row count from which a GEMM sums a row differently (faked: from 5
    rows on, in two halves, each rounded to the dtype before they are added), and ``linear``
    then computes in blocks of 4 rows. (Not the inputs back to front: a CPU that accumulates
    bf16 in fp32 rounds that order to the same bf16 results.)"""
    real = torch.nn.functional.linear

    def reordered(x, w, b=None):  # from 5 rows: two half sums, each rounded, then added
        if x.reshape(-1, x.shape[-1]).shape[0] < 5:
            return real(x, w, b)
        h = x.shape[-1] // 2
        return real(x[..., :h], w[:, :h], b) + real(x[..., h:], w[:, h:])

    monkeypatch.setattr(invariant.F, "linear", reordered)
    invariant.row_block.cache_clear()
    try:
        assert invariant.row_block(96, 64, torch.bfloat16, "cpu") == 4
        w, x = torch.randn(96, 64).bfloat16(), torch.randn(11, 64).bfloat16()
        alone = torch.cat([invariant_linear(x[j : j + 1], w) for j in range(11)])
        assert torch.equal(invariant_linear(x, w), alone)
        module = InvariantLinear(torch.nn.Linear(64, 96, bias=False).bfloat16())
        with torch.no_grad():
            module.weight.copy_(w)
            assert torch.equal(module(x), alone)  # the block it looked up once
            assert torch.equal(module(x[None]), alone[None])
    finally:
        invariant.row_block.cache_clear()


@pytest.mark.parametrize(
    "model,p",
    [(m, p) for m in ("bf16_target", "bf16_gqa") for p in (40, 63, 64, 86, 125, 190)]
    + [("bf16_smollm2", p) for p in (40, 63, 125)],
)
def test_chain_verification_equals_decoding_bit_for_bit(request, model, p):
    """Positions p - 1.. straddle a key bucket for some p (63, 125): the rows of one draft then
    attend over different padded lengths, each its own position's."""
    m = request.getfixturevalue(model)
    torch.manual_seed(p)
    ids = torch.randint(1, m.s.vocab, (p + 8,)).tolist()
    with torch.inference_mode():
        ref, ref_cache = decode(m, ids, p, 6)
        for beside in (False, True):
            got, cache = verify(m, ids, p, 6, beside)
            for j in range(7):
                assert torch.equal(got[j], ref[j]), (p, j, beside)
            for (k0, v0), (k1, v1) in zip(ref_cache.layers, cache.layers):
                assert torch.equal(k0[:, :, : p + 6], k1[:, :, : p + 6]) and torch.equal(
                    v0[:, :, : p + 6], v1[:, :, : p + 6]
                )


# (parents, the true branch's nodes): the decoded continuation runs along that branch, decoys
# sit beside it; the second is an EAGLE-3 tree's shape (top-2 children, 8 nodes)
TREES = [([-1, 0, -1, 2, 3, 2], (2, 3, 4)), ([-1, -1, 0, 0, 1, 1, 2, 2], (0, 2, 6))]


@pytest.mark.parametrize("tree,branch", TREES)
@pytest.mark.parametrize("p", [40, 62, 130, 142, 143])
def test_tree_nodes_equal_decoding_their_path_bit_for_bit(bf16_target, p, tree, branch):
    """Nodes on the true branch give the decoded logits and K/V, whatever sits beside them
    among the keys and in the call."""
    m = bf16_target
    torch.manual_seed(p)
    ids = torch.randint(1, m.s.vocab, (p + 8,)).tolist()
    toks = [7 + j for j in range(len(tree))]
    for depth, node in enumerate(branch):
        toks[node] = ids[p + depth]
    with torch.inference_mode():
        ref, ref_cache = decode(m, ids, p, 3)
        got, cache = verify(m, ids, p, 3, beside=True, tree=tree, toks=toks)
    assert torch.equal(got[0], ref[0])  # row 0: the pending token; row 1 + j follows node j
    for depth, node in enumerate(branch):
        assert torch.equal(got[1 + node], ref[1 + depth]), (p, node)
        for (k0, v0), (k1, v1) in zip(ref_cache.layers, cache.layers):
            assert torch.equal(k0[:, :, p + depth], k1[:, :, p + node]), (p, node)
            assert torch.equal(v0[:, :, p + depth], v1[:, :, p + node]), (p, node)


def test_buckets_and_ancestry():
    assert [bucket_len(n) for n in (1, 64, 65, 128, 129)] == [64, 64, 128, 128, 192]
    assert ancestry([-1, 0, -1, 2, 3, 2]) == [[0], [0, 1], [2], [2, 3], [2, 3, 4], [2, 5]]
