"""Link hop: what one decoding cycle pays to cross to a verifier process and back.

The router's side of a cycle is ``session.cycle(request)``. In the embedded topology it calls
the ``VerifierCore`` in its own process; in the distributed one it crosses to a verifier
process (``specmesh serve --role verifier``) over the multiplexed ``Link`` or a per-session
``Session`` stream. Both run the same sessions (same prompts, same cycles, interleaved per
prompt) on the same checkpoints, one thread each. Per cycle, the time outside model work is
the round trip less the drafting and verification the verifier reports; the hop is
(remote − embedded) of that, median over cycles.

This isolates the hop from the public ``Generate`` stream and its client, which
``bench.serving`` includes (and which cost the same in both topologies).

The floor beside it: a bare gRPC bidirectional echo between two processes (raw bytes, no
protobuf, no threads of ours), whose server computes, message by message, for as long as the
embedded session's cycles took before it answers, run after each prompt's sessions. Its
round trip less that time is what gRPC Python itself costs for a message each way on this
machine after an idle wait as long as a step; the hop less the floor is what our code adds.

    python -m bench.link_hop --limit 12 --cycles 48 --out bench/results/link_hop.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.workloads import load
from services.assembly import verifier_command
from services.common.config import EngineConfig, models_dir
from services.common.runtime import free_port, freeze_startup_heap, stop_processes
from services.common.types import CycleRequest, SessionSpec
from services.verifier.client import RemoteVerifier
from services.verifier.core import VerifierCore

ECHO = "/specmesh.bench.Echo/Chat"


def echo_serve(port: int) -> None:
    """Answer each message after computing for the seconds it names (a float, as text)."""
    from concurrent import futures

    import grpc

    def chat(requests, context):
        for m in requests:
            end = time.perf_counter() + float(m)
            while time.perf_counter() < end:
                pass
            yield m

    handler = grpc.method_handlers_generic_handler(
        "specmesh.bench.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(chat)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


class Echo:
    """A bare gRPC bidi echo in its own process, the floor beside the verifier's paths."""

    def __init__(self):
        import queue

        import grpc

        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.link_hop", "--echo-serve", str(port)])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(self.channel).result(timeout=60)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.call = self.channel.stream_stream(ECHO)(iter(self.q.get, None))

    def replay(self, work: list[float]) -> list[tuple[float, float]]:
        """One round trip per cycle, its server computing for that cycle's model time: per
        cycle, the round trip less that time, and the time."""
        out = []
        for w in work:
            t0 = time.perf_counter()
            self.q.put(repr(w).encode())
            next(self.call)
            out.append((time.perf_counter() - t0 - w, w))
        return out

    def close(self) -> None:
        self.q.put(None)
        self.channel.close()
        stop_processes([self.proc])


def start_verifier(args, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A verifier process, of this checkout's code or of the checkout at ``cwd``."""
    port = free_port()
    cmd = verifier_command(
        port,
        {
            "target": args.target,
            "draft": args.draft,
            "eagle3": "none",
            "threads": 1,
            "prefix_cache_mb": 0,
            "device": args.device,
            "dtype": args.dtype,
        },
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return proc, f"127.0.0.1:{port}"


def run_session(verifier, prompt_ids: list[int], method: str, cycles: int) -> list[tuple[float, float]]:
    """Per cycle: seconds outside model work (round trip − reported draft and verify), and
    seconds of model work."""
    drafter = "draft-lm" if method == "sd" else None
    spec = SessionSpec(
        prompt_ids=prompt_ids,
        max_new_tokens=cycles * 5 + 1,
        model_drafter=drafter,
        max_draft=4 if drafter else 0,
        ignore_eos=True,
    )
    req = CycleRequest(draft_with=drafter, budget=4) if drafter else CycleRequest()
    session = verifier.open(spec)
    try:
        session.cycle(req)  # the prefill
        out = []
        for _ in range(cycles):
            t0 = time.perf_counter()
            res = session.cycle(req)
            model = res.draft_s + res.verify_s
            out.append((time.perf_counter() - t0 - model, model))
        return out
    finally:
        session.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--cycles", type=int, default=48, help="timed cycles per session (after its prefill)")
    ap.add_argument("--methods", default="vanilla,sd")
    ap.add_argument("--target", type=Path, default=models_dir() / "target")
    ap.add_argument("--draft", type=Path, default=models_dir() / "draft")
    ap.add_argument("--device", default="cpu", help="the models' device, in both processes (cpu or cuda)")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        metavar="DIR",
        help="also a Link to a verifier running DIR's code (a checkout of another commit, e.g. "
        "`git worktree add DIR REV`), interleaved with the others: an A/B of the verifier's side",
    )
    ap.add_argument("--echo-serve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.echo_serve:
        return echo_serve(args.echo_serve)

    from services.assembly import eos_id

    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    cfg = EngineConfig(
        target=args.target,
        draft=args.draft,
        eagle3=None,
        threads=1,
        prefix_cache_mb=0,
        device=args.device,
        dtype=args.dtype,
    )
    core = VerifierCore.from_config(cfg, eos_id(cfg))
    proc, addr = start_verifier(args)
    remote = {"link": RemoteVerifier([addr], link=True), "stream": RemoteVerifier([addr], link=False)}
    procs = [proc]
    if args.baseline:
        base, base_addr = start_verifier(args, cwd=args.baseline)
        procs.append(base)
        remote["link (baseline)"] = RemoteVerifier([base_addr], link=True)
    echo = Echo()
    try:
        freeze_startup_heap()
        paths = {"embedded": core, **remote}
        methods = args.methods.split(",")
        prompts = [encode(args.target, p.text) for p in load(args.workload, args.limit)]
        cycles = {(t, m): [] for t in [*paths, "echo"] for m in methods}
        n, done, t_start = len(prompts) * len(methods), 0, time.perf_counter()
        for i, ids in enumerate(prompts):
            for m in methods:
                order = list(paths.items())  # interleaved, each prompt in a rotated order
                for t, v in order[i % len(order) :] + order[: i % len(order)]:
                    cycles[t, m] += run_session(v, ids, m, args.cycles)
                # the floor: the embedded session's model times, replayed as busy time by the echo
                cycles["echo", m] += echo.replay([w for _, w in cycles["embedded", m][-args.cycles :]])
                done += 1
                el = time.perf_counter() - t_start
                print(
                    f"[link_hop] {done}/{n} prompt×method, {done / el:.2f}/s, ETA {(n - done) * el / done:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for v in remote.values():
            v.close()
        echo.close()
        stop_processes(procs)
        core.close()
    from bench.harness import report

    report(summarize(args, cycles), args.out, markdown, plot)


def encode(target: Path, text: str) -> list[int]:
    """A prompt as the API encodes it (special tokens included), its last 256 tokens."""
    from transformers import AutoTokenizer

    tok = encode.tok = getattr(encode, "tok", None) or AutoTokenizer.from_pretrained(str(target))
    return tok(text)["input_ids"][-256:]


def summarize(args, cycles: dict) -> dict:
    """Medians per (path, method); the hops are over embedded, and over the echo (the floor)."""
    from bench.harness import machine

    med = {k: statistics.median(x for x, _ in v) * 1e3 for k, v in cycles.items()}
    rows = []
    for (path, m), v in cycles.items():
        hop = None if path == "embedded" else med[path, m] - med["embedded", m]
        floor = med["echo", m] - med["embedded", m]
        rows.append(
            {
                "path": "bare gRPC echo" if path == "echo" else path,
                "method": m,
                "cycles": len(v),
                "model_ms": round(statistics.median(x for _, x in v) * 1e3, 3),
                "outside_ms": round(med[path, m], 3),
                "hop_ms": None if hop is None else round(hop, 3),
                "hop_over_floor_ms": None if hop is None else round(hop - floor, 3),
            }
        )
    return {
        "workload": args.workload,
        "limit": args.limit,
        "cycles_per_session": args.cycles,
        "rows": rows,
        "command": "python -m bench.link_hop " + " ".join(sys.argv[1:]),
        "machine": machine(),
        "baseline": _revision(args.baseline) if args.baseline else None,
    }


def _revision(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip() or str(checkout)


def markdown(r: dict) -> str:
    from bench.harness import table_markdown

    dash = lambda v: "—" if v is None else v  # noqa: E731
    return table_markdown(
        f"### Link hop — {r['workload']}, {r['limit']} prompts × {r['cycles_per_session']} cycles",
        [
            "path",
            "method",
            "cycles",
            "model ms / cycle",
            "outside model, ms / cycle",
            "hop over embedded, ms",
            "hop − echo floor, ms",
        ],
        [
            [
                x["path"],
                x["method"],
                x["cycles"],
                x["model_ms"],
                dash(x["outside_ms"]),
                dash(x["hop_ms"]),
                dash(x["hop_over_floor_ms"]),
            ]
            for x in r["rows"]
        ],
        r["command"],
        (
            "Medians. Outside model: a cycle's round trip on the router's side less the drafting and verification "
            "the verifier reports (for the echo: its round trip less the time its server computed). The echo rows "
            "are a bare gRPC bidi echo between two processes (raw bytes, no protobuf, no threads of ours) whose "
            "server computes, message by message, for as long as the embedded session's cycles took before "
            "answering, run beside each prompt's sessions: the transport's own cost on this machine after an "
            "idle wait as long as a step (the floor). Hop − floor is what our code adds to it.",
            f"Machine: {r['machine']}",
        )
        + (
            (
                f"`link (baseline)`: the Link to a verifier running commit {r['baseline']}'s code, beside this "
                "checkout's, interleaved.",
            )
            if r.get("baseline")
            else ()
        ),
    )


def plot(r: dict, path: Path) -> None:
    from bench.harness import pyplot, write_figure

    rows = [x for x in r["rows"] if x["hop_ms"] is not None]
    fig, ax = pyplot().subplots(figsize=(6.5, 3.6))
    ax.barh([f"{x['path']} {x['method']}" for x in rows], [x["hop_ms"] for x in rows], color="tab:blue")
    ax.axvline(1.0, color="tab:red", linestyle="--", label="goal: 1 ms")
    ax.set_xlabel("ms per cycle over embedded (median)")
    ax.set_title("specmesh: what crossing to a verifier process costs")
    ax.legend(fontsize=8)
    write_figure(fig, path)


if __name__ == "__main__":
    main()
