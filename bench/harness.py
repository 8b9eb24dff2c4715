"""Side-by-side benchmark: every method in one process, same prompts, interleaved runs.

For each prompt the methods run in a rotated order (prompt i starts at method i mod M), each
``--repeats`` times; per-prompt walls are medians over repeats, and the reported figures are
medians over prompts (speedup = median of per-prompt wall(vanilla) / wall(method)).
Greedy decoding, so every lossless method must reproduce `vanilla` exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.quality import parses, rescued_breakdown, token_agreement
from bench.workloads import Prompt, load

HF_PEERS = ("hf-vanilla", "hf-assisted", "hf-pld")


def workload_args(
    p: argparse.ArgumentParser,
    workload: str = "humaneval",
    limit: int = 20,
    max_new_tokens: int = 128,
    threads: bool = True,
) -> None:
    """The arguments every benchmark over a workload takes, with its own defaults."""
    p.add_argument("--workload", default=workload)
    p.add_argument("--limit", type=int, default=limit)
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if threads:
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as make bench)")
    p.add_argument("--out", type=Path, default=None, help="JSON path; .md and .png are written beside it")


def add_args(p: argparse.ArgumentParser) -> None:
    workload_args(p, threads=False)  # --threads comes with the engine's arguments
    p.add_argument("--methods", default="vanilla,sd,hf-vanilla,hf-assisted,hf-pld")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--chat", action="store_true", help="give each prompt through the chat template (bench.workloads.as_asked)"
    )


@dataclass
class Run:
    ids: list[int]
    wall: float
    stats: dict = field(default_factory=dict)
    rescued_pairs: list = field(default_factory=list)
    finish: str = ""


class HFPeers:
    """transformers `generate` on the same checkpoints: plain, assisted (draft LM), prompt lookup."""

    def __init__(self, target: Path, draft: Path | None, eos: int, device: str = "cpu", dtype: str = "float32"):
        from transformers import AutoModelForCausalLM

        def load(path):  # the engine's device and dtype, so the comparison is like for like
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()

        self.target = load(target)
        self.draft = load(draft) if draft else None
        if self.draft is not None and getattr(self.draft.config, "shares_target_embedding", False):
            # a draft cut from the target (training/draft_from_target.py) runs on the target's embedding
            # (and, tied, LM head), which its directory does not store: the same tensors as ours
            self.draft.model.embed_tokens.weight = self.target.model.embed_tokens.weight
            if self.draft.config.tie_word_embeddings:
                self.draft.lm_head.weight = self.target.model.embed_tokens.weight
        self.eos, self.device = eos, device

    @torch.inference_mode()
    def run(self, method: str, ids: list[int], max_new: int) -> Run:
        extra = {
            "hf-vanilla": {},
            "hf-assisted": {"assistant_model": self.draft},
            "hf-pld": {"prompt_lookup_num_tokens": 10},
        }[method]
        x = torch.tensor([ids], device=self.device)
        t0 = time.perf_counter()
        out = self.target.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.eos,
            **extra,
        )
        new = out[0, len(ids) :].tolist()
        wall = time.perf_counter() - t0
        if self.eos in new:
            new = new[: new.index(self.eos)]
        return Run(new, wall)


def run_ours(engine, method: str, ids: list[int], max_new: int, sampling=None, structured=None) -> Run:
    """One generation (greedy unless ``sampling``), prefilled cold: the verifier's prefix cache
    would otherwise give a method the prompt that the method before it prefilled
    (bench.prefix_cache measures it)."""
    from services.common.types import Sampling
    from services.router.engine import GenerationRequest

    getattr(engine.verifier, "clear_prefix_cache", lambda: None)()
    gen = engine.generate(
        GenerationRequest(ids, max_new, sampling=sampling or Sampling(), method=method, structured=structured)
    )
    r = gen.result()
    return Run(r["token_ids"], r["stats"]["wall_s"], r["stats"], list(gen.stats.rescued_pairs), r["finish_reason"])


@torch.inference_mode()
def target_nll(engine, prompt: list[int], out: list[int]) -> tuple[float, int]:
    """Sum of target negative log-likelihoods of ``out`` given ``prompt``, and its token count."""
    if not out:
        return 0.0, 0
    device = next(engine.verifier.runner.model.parameters()).device
    x = torch.tensor([prompt + out], device=device)
    logp = torch.log_softmax(engine.verifier.runner.model.forward_train(x)[0, len(prompt) - 1 : -1].float(), -1)
    return float(-logp[torch.arange(len(out), device=device), x[0, len(prompt) :]].sum()), len(out)


def cycle_profile(runs: list[Run], cycles: int) -> dict:
    """Where a cycle's time goes (ms): drafting, the verification forward, and the rest
    (policies, bookkeeping, detokenizing, scheduling)."""
    draft = sum(r.stats.get("draft_s", 0.0) for r in runs)
    verify = sum(r.stats.get("verify_s", 0.0) for r in runs)
    wall = sum(r.wall for r in runs)
    return {
        "draft_ms_per_cycle": round(1e3 * draft / cycles, 3),
        "verify_ms_per_cycle": round(1e3 * verify / cycles, 3),
        "other_ms_per_cycle": round(1e3 * (wall - draft - verify) / cycles, 3),
    }


def summarize(
    method: str,
    runs: list[Run],
    vanilla: list[Run] | None,
    nll: tuple[float, int],
    refs: list[str | None],
    texts: list[str],
    prompts: list[str],
    tokenizer,
    hf_vanilla: list[Run] | None = None,
) -> dict:
    tokens = [len(r.ids) for r in runs]
    row = {
        "method": method,
        "tokens_per_s": round(statistics.median(n / r.wall for n, r in zip(tokens, runs)), 2),
        "speedup_vs_vanilla": None,
        "tau": None,
        "cycles_per_1k": None,
        "acceptance_rate": None,
        "exact_match_vs_vanilla": None,
        "target_nll": round(nll[0] / nll[1], 4) if nll[1] else None,
        "median_wall_s": round(statistics.median(r.wall for r in runs), 4),
        "mean_new_tokens": round(statistics.mean(tokens), 1),
    }
    row["parse_rate"] = round(sum(parses(p, t) for p, t in zip(prompts, texts)) / len(runs), 3)
    if vanilla:
        row["speedup_vs_vanilla"] = round(statistics.median(v.wall / r.wall for v, r in zip(vanilla, runs)), 3)
        row["exact_match_vs_vanilla"] = round(sum(v.ids == r.ids for v, r in zip(vanilla, runs)) / len(runs), 3)
        row["token_agreement"] = round(statistics.mean(token_agreement(v.ids, r.ids) for v, r in zip(vanilla, runs)), 3)
    if hf_vanilla:  # transformers' own baseline: no ratio then rests on our engine's GEMM packing
        row["speedup_vs_hf_vanilla"] = round(statistics.median(v.wall / r.wall for v, r in zip(hf_vanilla, runs)), 3)
    if runs[0].stats:
        cycles = sum(r.stats["cycles"] for r in runs)
        gen = sum(r.stats["generated_tokens"] for r in runs)
        drafted = sum(r.stats["draft_tokens"] for r in runs)
        row["tau"] = round(gen / cycles, 3)
        row["cycles_per_1k"] = round(1000 * cycles / gen, 1)
        row.update(cycle_profile(runs, cycles))
        row["acceptance_rate"] = round(sum(r.stats["accepted_tokens"] for r in runs) / drafted, 3) if drafted else None
        per_pos: list[int] = []
        for r in runs:
            for i, n in enumerate(r.stats["accepted_per_position"]):
                per_pos += [0] * (i + 1 - len(per_pos))
                per_pos[i] += n
        by_source: dict[str, int] = {}
        for r in runs:
            for src, n in r.stats["drafts_by_source"].items():
                by_source[src] = by_source.get(src, 0) + n
        row["cycles_by_source"] = {**by_source, "none": cycles - sum(by_source.values())}
        n_drafts = sum(by_source.values())
        row["acceptance_per_position"] = [round(n / n_drafts, 3) for n in per_pos] if n_drafts else []
        rescued = [p for r in runs for p in r.rescued_pairs]
        if rescued:
            rejections = sum(r.stats["first_rejections"] for r in runs)
            row["rescued_tokens"] = len(rescued)
            row["rescue_rate"] = round(len(rescued) / (len(rescued) + rejections), 3)
            row["rescued_kinds"] = rescued_breakdown(tokenizer, rescued)
    if any(refs):
        row["reference_exact"] = round(
            sum(t.startswith(ref) for t, ref in zip(texts, refs) if ref) / sum(1 for ref in refs if ref), 3
        )
    return row


def past_outputs(engine, keep: bool = True):
    """The global suffix cache may hold earlier prompts' outputs, never the current prompt's
    from another method's run (that would be drafting from the answer)."""
    cache = getattr(engine, "suffix_cache", None)
    return cache.deferred(keep) if cache is not None else contextlib.nullcontext()


def benchmark(
    engine,
    prompts: list[Prompt],
    methods: list[str],
    max_new: int,
    repeats: int,
    peers: HFPeers | None,
    warmed=lambda: None,
) -> list[dict]:
    """Rows per method; ``warmed`` is called after the warm-up, before the measured runs."""

    def once(m: str, ids: list[int], n: int) -> Run:
        return peers.run(m, ids, n) if m in HF_PEERS else run_ours(engine, m, ids, n)

    encoded = [engine.encode_fit(p.text, max_new) for p in prompts]
    with past_outputs(engine, keep=False):  # warm-up: its outputs would leak into prompt 0
        for m in methods:
            once(m, encoded[0], 16)
    warmed()
    runs: dict[str, list[Run]] = {m: [] for m in methods}
    t0 = time.time()
    for i, ids in enumerate(encoded):
        order = methods[i % len(methods) :] + methods[: i % len(methods)]
        per: dict[str, list[Run]] = {m: [] for m in methods}
        with past_outputs(engine):
            for _ in range(repeats):
                for m in order:
                    per[m].append(once(m, ids, max_new))
        for m in methods:  # the repeat with the median wall, with its own stats (they share tokens)
            runs[m].append(sorted(per[m], key=lambda r: r.wall)[len(per[m]) // 2])
        done = i + 1
        rate = (time.time() - t0) / done
        print(
            f"[bench] {done}/{len(encoded)} prompts  {rate:.1f} s/prompt  eta {rate * (len(encoded) - done):.0f} s",
            file=sys.stderr,
            flush=True,
        )
    refs = [p.reference for p in prompts]
    rows = []
    for m in methods:
        nll = [0.0, 0]
        for ids, r in zip(encoded, runs[m]):
            s, n = target_nll(engine, ids, r.ids)
            nll[0] += s
            nll[1] += n
        texts = [engine.tokenizer.decode(r.ids) for r in runs[m]]
        rows.append(
            summarize(
                m,
                runs[m],
                runs.get("vanilla"),
                tuple(nll),
                refs,
                texts,
                [p.text for p in prompts],
                engine.tokenizer,
                runs.get("hf-vanilla"),
            )
        )
    return rows


def markdown(result: dict) -> str:
    cols = [
        "method",
        "tokens_per_s",
        "speedup_vs_vanilla",
        "speedup_vs_hf_vanilla",
        "tau",
        "cycles_per_1k",
        "acceptance_rate",
        "exact_match_vs_vanilla",
        "token_agreement",
        "target_nll",
        "parse_rate",
    ]
    cols += ["draft_ms_per_cycle", "verify_ms_per_cycle", "other_ms_per_cycle"]
    if any("rescue_rate" in r for r in result["rows"]):
        cols.append("rescue_rate")
    if any("reference_exact" in r for r in result["rows"]):
        cols.append("reference_exact")
    lines = [
        f"### `{result['workload']}` — {result['limit']} prompts, {result['max_new_tokens']} new tokens, greedy",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in result["rows"]:
        lines.append("| " + " | ".join("—" if r.get(c) is None else str(r.get(c)) for c in cols) + " |")
    lines += ["", f"Command: `{result['command']}`", f"Machine: {result['machine']}", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["method"] for r in rows]
    axes[0].bar(names, [r["speedup_vs_vanilla"] or 0 for r in rows], color="tab:blue")
    axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[0].set_title("speedup vs vanilla (median)")
    axes[1].bar(names, [r["tokens_per_s"] for r in rows], color="tab:green")
    axes[1].set_title("tokens/s (median)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['workload']}: {result['limit']} prompts × {result['max_new_tokens']} tokens")
    write_figure(fig, path)


def main(args: argparse.Namespace) -> dict:
    from services.cli import engine_config
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    cfg = engine_config(args)
    engine = Engine(cfg)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in engine.methods() and m not in HF_PEERS]
    if unknown:
        sys.exit(f"error: unknown or unavailable methods {unknown}; available: {engine.methods() + list(HF_PEERS)}")
    peers = (
        HFPeers(cfg.target, cfg.draft, engine.eos_id, cfg.device, cfg.dtype)
        if any(m in HF_PEERS for m in methods)
        else None
    )
    prompts = load(args.workload, args.limit, engine.tokenizer if args.chat else None)  # instruct: as users ask
    freeze_startup_heap()  # as a serving process does (services.common.grpc_server.run_until_signal)
    rows = benchmark(engine, prompts, methods, args.max_new_tokens, args.repeats, peers)
    result = {
        "workload": args.workload,
        "limit": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "chat": args.chat,
        "num_speculative_tokens": cfg.num_speculative_tokens,
        "threads": torch.get_num_threads(),
        "device": cfg.device,
        "machine": machine(),
        "command": command("bench", None),
        "rows": rows,
    }
    print(markdown(result))
    if args.out:
        save(args.out, result, markdown, plot)
    return result


def machine() -> str:
    """Architecture, threads, torch, and the host's speed (``speed_probe``): hosts of one kind
    differ by 2× between sessions here, so results are comparable only beside their probe."""
    gemm, op = speed_probe()
    return (
        f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"probe: GEMM {gemm:.3f} ms, op {op:.1f} µs"
    )


def speed_probe(reps: int = 300) -> tuple[float, float]:
    """Medians of a 1×256 by 256×8192 fp32 GEMM (the bundled target's LM head shape; memory
    bound), ms, and of one small elementwise op (dispatch bound, as decoding's many small ops
    are), µs."""
    x, w, v = torch.randn(1, 256), torch.randn(8192, 256), torch.randn(256)

    def median_s(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.inference_mode():
        return 1e3 * median_s(lambda: torch.nn.functional.linear(x, w)), 1e6 * median_s(lambda: v * v)


def command(module: str, argv: list[str] | None) -> str:
    """The command line that made a result (``argv`` as main() got it; None = this process's)."""
    return f"python -m {module} " + shlex.join(argv if argv is not None else sys.argv[1:])


def bench_engine(args: argparse.Namespace):
    """An in-process engine from ``add_engine_args`` flags, one torch thread unless set, its
    start-up heap frozen as a serving process's is."""
    from services.cli import engine_config
    from services.common.runtime import freeze_startup_heap
    from services.router.engine import Engine

    if not args.threads:
        args.threads = 1
    engine = Engine(engine_config(args))
    freeze_startup_heap()
    return engine


def pyplot():
    """matplotlib.pyplot on the Agg backend: benchmarks write PNGs and need no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def table_markdown(title: str, columns: list[str], rows: list[list], command: str, notes: tuple[str, ...] = ()) -> str:
    """A result as markdown: title, one table row per ``rows`` item, notes, the command that made it."""
    lines = [title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    for note in notes:
        lines += ["", note]
    return "\n".join(lines + ["", f"Command: `{command}`", ""])


def write_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: dict, out: Path | None, markdown_fn, plot_fn=None) -> None:
    """Print a result's markdown; with ``out``, save it there too (``save``)."""
    print(markdown_fn(result))
    if out:
        save(out, result, markdown_fn, plot_fn)


def save(out: Path, result: dict, markdown_fn, plot_fn=None) -> None:
    """A benchmark's result as JSON at ``out``, with its markdown (.md) and plot (.png) beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown_fn(result))
    if plot_fn is not None:
        plot_fn(result, out.with_suffix(".png"))


def run_settings(
    engine,
    methods: list[str],
    prompts: dict[str, list[list[int]]],
    options: dict[str, dict],
    max_new: int,
    repeats: int,
    tag: str,
) -> dict[tuple[str, str], list[Run]]:
    """Every (setting, method) cell on each prompt, ``repeats`` times in rotated order, in one
    process: setting s runs its own encoding of the prompt, ``prompts[s][i]``, with
    ``run_ours(**options[s])``. (setting, method) → per-prompt runs (each prompt's median-wall
    repeat), with a progress line per prompt."""
    cells = [(s, m) for s in prompts for m in methods]
    with past_outputs(engine, keep=False):  # warm-up; its outputs would leak into prompt 0
        for s, m in cells:
            run_ours(engine, m, prompts[s][0], 16, **options[s])
    runs: dict[tuple[str, str], list[Run]] = {c: [] for c in cells}
    n = len(next(iter(prompts.values())))
    t0 = time.time()
    for i in range(n):
        per: dict[tuple[str, str], list[Run]] = {c: [] for c in cells}
        with past_outputs(engine):  # no cell drafts from another cell's output of this prompt
            for _ in range(repeats):
                for s, m in cells[i % len(cells) :] + cells[: i % len(cells)]:
                    per[(s, m)].append(run_ours(engine, m, prompts[s][i], max_new, **options[s]))
        for c in cells:
            runs[c].append(sorted(per[c], key=lambda r: r.wall)[len(per[c]) // 2])
        rate = (time.time() - t0) / (i + 1)
        print(
            f"[{tag}] {i + 1}/{n} prompts  {rate:.1f} s/prompt  eta {rate * (n - i - 1):.0f} s",
            file=sys.stderr,
            flush=True,
        )
    return runs


def grouped_bars(ax, groups: list, series: list, value, label=str) -> None:
    """One group of bars per item of ``groups`` (labelled on the x axis), one bar per item of
    ``series`` in each, of height ``value(series_item, group)``, in a legend as ``label(item)``."""
    width = 0.8 / len(series)
    for j, s in enumerate(series):
        ax.bar(
            [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))],
            [value(s, g) for g in groups],
            width,
            label=label(s),
        )
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)


def setting_bars(result: dict, settings, ylabel: str, path: Path, label=str) -> None:
    """Speedup bars: one group per method (`vanilla` left out), one bar per setting."""
    plt = pyplot()
    methods = [m for m in result["args"]["methods"].split(",") if m != "vanilla"]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    speedup = {(r["setting"], r["method"]): r["speedup_vs_vanilla"] for r in result["rows"]}
    grouped_bars(ax, methods, list(settings), lambda s, m: speedup[(s, m)], label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(ylabel=ylabel)
    write_figure(fig, path)


def settings_main(
    module: str, doc: str, argv: list[str] | None, settings: dict, run_fn, rows_fn, markdown_fn, plot_fn
) -> dict:
    """The command line of a benchmark of methods under settings (``bench.penalties``,
    ``bench.structured``): `vanilla` first, the baseline of each setting."""
    from services.cli import add_engine_args

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    add_engine_args(p)
    workload_args(p, threads=False)  # --threads comes with the engine's arguments
    p.add_argument("--methods", default="vanilla,sd,suffix,eagle3,hybrid")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    if methods[0] != "vanilla":
        raise SystemExit("--methods must start with vanilla (the baseline of each setting)")
    engine = bench_engine(args)
    result = {
        "args": {k: getattr(args, k) for k in ("workload", "limit", "max_new_tokens", "repeats", "methods")},
        "settings": settings,
        "machine": machine(),
        "command": command(module, argv),
        "rows": rows_fn(engine, run_fn(engine, args), methods),
    }
    report(result, args.out, markdown_fn, plot_fn)
    return result
