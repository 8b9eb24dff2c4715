"""Control-plane benchmark: the real router (its drafters, the yield predictor, the correction
memory, the links to a verifier) driving a verifier stand-in whose step takes a modelled GPU time.

The stand-in answers as the bundled target would: each prompt's outputs were recorded from real
runs (``record``): the target's greedy output (what every lossless method commits), csd's own
output, and, per cycle, how many tokens the verifier-side drafters (the draft LM for sd and csd,
the EAGLE-3 head for the hybrids' fallback) had accepted. A router draft is checked against the
recorded output (its longest agreeing prefix, or path in a tree); a verifier-side draft replays
the recorded acceptance. So τ is the real one, and the only thing modelled is time.

The step time models an 8B target in bf16 on one H100 SXM from its datasheet (a roofline, not a
measurement): a step of b sessions feeding n tokens takes t0 + c·n, with t0 = 5.5 ms (16 GB of
weights read at 3.35 TB/s is 4.8 ms, plus launch overhead) and c = 25 µs per token (16 GFLOP
per token at 989 TFLOPS dense bf16 and 65 % utilisation). Drafting forwards on the GPU are not
modelled (their tokens count in n). The stand-in's bookkeeping (each cycle's verdict, as the
verifier's own acceptance) runs inside the modelled step and its CPU is not counted as control
plane; it sleeps for the rest of the step (as a GPU step leaves the host's CPU and GIL free).

Load: by default each session runs requests back to back and the run is measured over a window
once all are open (``--load steady``), so N sessions are N open at every moment, as a serving
benchmark holds its concurrency; ``--load burst`` gives each session one request, all at once,
measured until the last ends (its tail, with few sessions left, counted).

    python -m bench.control_plane          # make bench-control-plane
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.prefill import percentile
from services.common.types import CycleRequest, CycleResult, SessionSpec
from services.verifier.backend import run_step
from services.verifier.batcher import CycleBatcher, Pending

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench/results/control_plane"
CACHE = ROOT / ".cache/control_plane_traces.json"
T0_S, C_S = 0.0055, 0.000025
MAX_NEW = 128
SESSIONS = (1, 8, 32, 64, 128, 256)
METHODS = ("suffix", "hybrid", "hybrid-tree", "csd")
TRACES = 1024  # enough that a steady load's sessions rarely run a prompt twice at 256 sessions
MAX_BATCH = 256  # sessions one modelled step takes (embedded: the engine's max_batch; remote: the stand-in's)
DRAFTED_BY = {"draft-lm": "sd", "eagle3": "eagle3", "eagle3-tree": "eagle3"}  # verifier drafter: its trace


# -- traces ---------------------------------------------------------------------------------------
def prompts(n: int) -> list[str]:
    """HumanEval's prompts, then held-out stdlib windows: ``n`` distinct prompts."""
    from bench.workloads import humaneval, stdlib_heldout

    texts = [p.text for p in humaneval(n)]
    return texts + [p.text for p in stdlib_heldout(n - len(texts), prompt_chars=600)]


def _run(engine, ids: list[int], method: str) -> tuple[list[int], list[int]]:
    """(output tokens, tokens each cycle emitted) of a real run."""
    from services.router.engine import GenerationRequest

    out, per_cycle = [], []
    gen = engine.generate(GenerationRequest(ids, MAX_NEW, method=method))
    for step in gen:
        out += step.token_ids
        per_cycle.append(len(step.token_ids))
    if gen.finish_reason == "eos":
        out.append(engine.eos_id)
    return out, per_cycle


def record_with(engine, texts: list[str], bar=None) -> list[dict]:
    """Real runs on ``engine``, one trace per prompt: the greedy output, csd's output, and each
    verifier-side drafter's (sd's draft LM, csd's, EAGLE-3's where the engine has it) accepted
    tokens per cycle."""
    from services.common.progress import Progress

    own = bar is None
    bar = bar or Progress(len(texts), "recording traces", "prompts")
    eagle = "eagle3" in engine.methods()

    def one(text: str) -> dict:
        ids = engine.encode(text)
        greedy, _ = _run(engine, ids, "vanilla")
        sd_out, sd = _run(engine, ids, "sd")
        assert sd_out == greedy, "sd is lossless"
        csd_out, csd = _run(engine, ids, "csd")
        accepted = {"sd": [k - 1 for k in sd], "csd": [k - 1 for k in csd]}
        if eagle:
            accepted["eagle3"] = [k - 1 for k in _run(engine, ids, "eagle3")[1]]
        return {"prompt": ids, "greedy": greedy, "csd": csd_out, "accepted": accepted}

    traces = []
    with ThreadPoolExecutor(8) as pool:  # the engine batches concurrent requests' cycles
        for t in pool.map(one, texts):
            traces.append(t)
            bar.advance(len(t["greedy"]))
    if own:
        bar.close()
    return traces


def record(n: int, path: Path = CACHE) -> dict:
    """Traces of the bundled models on ``prompts(n)`` (``record_with``), cached at ``path``; a
    cache of fewer is extended (the prompts are the same list, longer), so recording resumes."""
    data = json.loads(path.read_text()) if path.exists() else {}
    if data.get("max_new_tokens") != MAX_NEW:
        data = {"max_new_tokens": MAX_NEW, "traces": []}
    if len(data["traces"]) >= n:
        return {**data, "traces": data["traces"][:n]}
    from services.common.config import EngineConfig
    from services.common.progress import Progress
    from services.router.engine import Engine

    engine = Engine(EngineConfig())
    texts = prompts(n)[len(data["traces"]) :]
    bar = Progress(len(texts), "recording traces", "prompts")
    try:
        for i in range(0, len(texts), 64):  # saved every 64 prompts
            data["traces"] += record_with(engine, texts[i : i + 64], bar)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(data))
    finally:
        bar.close()
        engine.close()
    return data


def load_traces(n: int) -> list[dict]:
    return record(n)["traces"]


# -- the stand-in ---------------------------------------------------------------------------------
@dataclass
class StandInSession:
    core: "StandInCore"
    spec: SessionSpec
    session_id: str
    output: list[int] = field(default_factory=list)
    replay: list[int] = field(default_factory=list)  # the verifier-side drafter's accepted, per cycle
    pos: int = 0
    cycles: int = 0
    closed: bool = False

    def cycle(self, req: CycleRequest) -> CycleResult:
        return self.core.batcher.submit(self, req)

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.core.sessions.discard(self.session_id)
            self.core.batcher.closed(self)

    def verdict(self, req: CycleRequest) -> tuple[CycleResult, int]:
        """This cycle's result, and the tokens it feeds the step."""
        rest = self.output[self.pos :]
        if req.draft_with and req.budget > 0:  # drafted here: replay the real drafter's acceptance
            drafted = req.budget
            accepted = min(self.replay[self.cycles % len(self.replay)] if self.replay else 0, drafted)
            source = req.draft_with
        else:
            drafted, source = len(req.draft_ids), req.draft_source
            accepted = agreed(req.draft_ids, req.draft_parents, rest)
        committed = rest[: accepted + 1]
        self.pos += len(committed)
        self.cycles += 1
        result = CycleResult(
            committed=committed,
            drafted=drafted,
            accepted=min(accepted, len(committed)),
            source=source,
            rejected=accepted < drafted and len(committed) > accepted,
        )
        fed = drafted + 1 + (len(self.spec.prompt_ids) if self.cycles == 1 else 0)
        return result, fed


def agreed(draft: tuple[int, ...], parents: tuple[int, ...], output: list[int]) -> int:
    """Draft tokens a greedy target keeps: a chain's longest prefix agreeing with ``output``; for
    a tree (``parents[i]``: the node's parent, -1 the root), its deepest agreeing path."""
    if not parents:
        n = 0
        while n < len(draft) and n < len(output) and draft[n] == output[n]:
            n += 1
        return n
    depth: dict[int, int] = {-1: 0}
    best = 0
    for i, (tok, parent) in enumerate(zip(draft, parents)):
        d = depth.get(parent)
        if d is not None and d < len(output) and tok == output[d]:
            depth[i] = d + 1
            best = max(best, d + 1)
    return best


class StandInCore:
    """The verifier's interface (as ``VerifierCore`` offers it to the router and to the verifier's
    gRPC edge) over recorded outputs and a modelled step time."""

    in_process = True  # as VerifierCore: its step (the modelled device time) blocks the caller
    split_at = 0

    def __init__(self, traces: list[dict], context_len: int, vocab_size: int, max_draft: dict[str, int]):
        self.by_prompt = {tuple(t["prompt"]): t for t in traces}
        self.context_len, self.vocab_size, self.max_draft = context_len, vocab_size, dict(max_draft)
        self.drafters = {name: None for name in max_draft}
        from services.verifier.policies import POLICIES

        self.policies = {**dict.fromkeys(POLICIES), "csd": None, "scg": None}  # the verifier's names
        self.memory = None
        self.sessions: set[str] = set()
        self.batcher = CycleBatcher(self._step, max_batch=MAX_BATCH, window_s=0.002)
        self.steps, self.cycles, self.step_s, self.step_cpu_s, self.fed = 0, 0, 0.0, 0.0, 0
        self.log: list[tuple[float, float, int, int]] = []  # per step: (its end, its modelled s, cycles, fed)
        self._ids = itertools.count()

    def open(self, spec: SessionSpec) -> StandInSession:
        trace = self.by_prompt.get(tuple(spec.prompt_ids))
        if trace is None:
            raise ValueError("stand-in: no trace for this prompt")
        csd = spec.policy == "csd"
        drafter = DRAFTED_BY.get(spec.model_drafter or "", "")
        s = StandInSession(
            self,
            spec,
            spec.session_id or f"s-{next(self._ids)}",
            output=list(trace["csd"] if csd else trace["greedy"]),
            replay=list(trace["accepted"]["csd" if csd else drafter] if (csd or drafter) else []),
        )
        self.sessions.add(s.session_id)
        self.batcher.opened(s)
        return s

    def _step(self, batch: list[Pending]) -> None:
        start, cpu0 = time.perf_counter(), time.thread_time()
        fed = 0
        for b in batch:
            b.result, n = b.session.verdict(b.request)
            fed += n
        self.step_cpu_s += time.thread_time() - cpu0
        # the modelled GPU step, from its start: the verdicts stand for the verifier's own
        # acceptance, which is part of its step; the GIL is free for the rest of it
        t = T0_S + C_S * fed
        time.sleep(max(0.0, start + t - time.perf_counter()))
        self.steps += 1
        self.cycles += len(batch)
        self.step_s += t
        self.fed += fed
        self.log.append((time.perf_counter(), t, len(batch), fed))

    def lane(self, session) -> None:
        """One device, one lane (``VerifierBackend``)."""
        return None

    def step(self, cycles, done) -> None:
        """The router's step (``VerifierBackend``), in the caller's thread."""
        run_step(self._step, cycles, done)

    def declare_capacity(self, max_sessions: int) -> None:
        pass

    def clear_prefix_cache(self) -> None:
        pass

    def close(self) -> None:
        pass

    def counters(self) -> dict:
        return {
            "steps": self.steps,
            "cycles": self.cycles,
            "step_s": self.step_s,
            "step_cpu_s": self.step_cpu_s,
            "fed": self.fed,
            "cpu_s": time.process_time(),
            "log": self.log[-4096:],  # (the clock is the host's monotonic one, shared by its processes)
        }


def standin_core(traces: list[dict]) -> StandInCore:
    """A stand-in with the bundled models' context, vocabulary and draft lengths."""
    from services.common.config import EngineConfig

    cfg = EngineConfig()
    target = json.loads((Path(cfg.target) / "config.json").read_text())
    max_draft = {"draft-lm": cfg.num_speculative_tokens, "eagle3": cfg.eagle3_k}
    if cfg.eagle3_topk > 1:
        max_draft["eagle3-tree"] = cfg.eagle3_tree_tokens
    return StandInCore(traces, target["max_position_embeddings"], target["vocab_size"], max_draft)


# -- the load -------------------------------------------------------------------------------------
@dataclass
class Run:
    tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # per token: its cycle's gap over its tokens
    errors: list[str] = field(default_factory=list)
    requests: int = 0  # begun in the measured span
    repeated: int = 0  # of those, on a prompt a client had already run in this configuration
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # every output step: (when, tokens)


@dataclass
class Load:
    """``steady``: n sessions open at every moment (each client runs requests back to back, on
    its own prompts), measured over ``window_s`` after ``warmup_s``, as a serving benchmark holds
    its concurrency; ``burst``: one request per session, all at once, measured until the last
    ends (the tail, where fewer sessions run, included)."""

    kind: str = "steady"
    warmup_s: float = 2.0
    window_s: float = 4.0
    clients: str = "loop"  # loop: every stream a coroutine on one event loop (as grpc.aio serves); threads: one each


def _stream(engine, trace: dict, method: str, seen: list[tuple[float, int, bool]]) -> None:
    """One request on ``trace``'s prompt; each output step as (arrival, tokens, first) into ``seen``."""
    from services.router.engine import GenerationRequest

    out = trace["csd"] if method == "csd" else trace["greedy"]
    req = GenerationRequest(list(trace["prompt"]), max(1, len(out)), method=method)
    first = True
    for step in engine.generate(req):
        if step.token_ids:
            seen.append((time.perf_counter(), len(step.token_ids), first))
            first = False


async def _stream_on_loop(engine, trace: dict, method: str, seen: list[tuple[float, int, bool]]) -> None:
    """``_stream`` as an event loop's consumer reads it (``Completions.stream``: the public gRPC
    and HTTP servers' path)."""
    from services.router.engine import GenerationRequest

    out = trace["csd"] if method == "csd" else trace["greedy"]
    req = GenerationRequest(list(trace["prompt"]), max(1, len(out)), method=method)
    first = True
    async for _, step in engine.generate_all(req).stream():
        if step is not None and step.token_ids:
            seen.append((time.perf_counter(), len(step.token_ids), first))
            first = False


def _tally(run: Run, seen: list[tuple[float, int, bool]], t0: float, t1: float, start: float) -> None:
    """Add the tokens that arrived in [t0, t1] and their gaps (the time to first token is no gap)."""
    last = start
    for at, n, first in seen:
        run.arrivals.append((at, n))
        if t0 <= at <= t1:
            run.tokens += n
            if not first:
                run.itl_s += [(at - last) / n] * n
        last = at


def drive(engine, traces: list[dict], n: int, method: str, load: Load, mark) -> tuple[Run, dict, dict]:
    """``n`` clients under ``load`` (coroutines on one event loop, as the gRPC and HTTP servers
    stream, or a thread each); returns what they saw in the measured span and ``mark()`` at its
    two ends."""
    done: list[tuple[int, float, list[tuple[float, int, bool]]]] = []  # (trace index, begun, its steps)
    errors: list[str] = []
    stop = threading.Event()
    start = threading.Barrier(2 if load.clients == "loop" else n + 1)  # the clients' thread(s) and this one

    async def client(i: int, stream) -> None:
        k = i  # client i runs traces i, i + n, i + 2n, ... (round again once they run out)
        while True:
            seen: list[tuple[float, int, bool]] = []
            begun = time.perf_counter()
            try:
                await stream(engine, traces[k % len(traces)], method, seen)
            except Exception as e:  # noqa: BLE001 - counted and reported, never hidden
                errors.append(f"{type(e).__name__}: {e}")
            done.append((k, begun, seen))
            k += n
            if load.kind == "burst" or stop.is_set():
                return

    async def on_loop() -> None:
        start.wait()
        await asyncio.gather(*(client(i, _stream_on_loop) for i in range(n)))

    async def blocking(*a) -> None:  # a thread's own loop, which only this client's stream runs on
        _stream(*a)

    def on_thread(i: int) -> None:
        start.wait()
        asyncio.run(client(i, blocking))

    if load.clients == "loop":
        threads = [threading.Thread(target=asyncio.run, args=(on_loop(),), name="clients")]
    else:
        threads = [threading.Thread(target=on_thread, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    start.wait()
    before = mark()
    if load.kind == "steady":
        time.sleep(load.warmup_s)
        before = mark()
        time.sleep(load.window_s)
        after = mark()
        stop.set()
    for t in threads:
        t.join()
    if load.kind == "burst":
        after = mark()
    run = Run(errors=errors)
    t0, t1 = (before["t"], after["t"]) if load.kind == "steady" else (float("-inf"), float("inf"))
    for k, begun, seen in done:
        _tally(run, seen, t0, t1, begun)
        if t0 <= begun <= t1:
            run.requests += 1
            run.repeated += k >= len(traces)
    return run, before, after


def measure(engine, place, traces: list[dict], n: int, method: str, topology: str, load: Load) -> dict:
    """One configuration: the control plane's CPU is ``place``'s (the processes that carry it,
    less the stand-in's own bookkeeping)."""

    def mark() -> dict:
        counters, cpu = place.snapshot()
        return {"t": time.perf_counter(), "c": counters, "cpu": cpu, "switches": context_switches()}

    run, m0, m1 = drive(engine, traces, n, method, load, mark)
    steps, step_s, session_cycles, fed, (e0, e1) = window_steps(m1["c"]["log"], m0["t"], m1["t"])
    if load.kind == "steady" and e1 > e0:  # the window is its steps' span; the tokens that came in it
        run = replace(run, tokens=sum(k for at, k in run.arrivals if e0 < at <= e1))
    wall = e1 - e0 if e1 > e0 else m1["t"] - m0["t"]
    share = wall / max(1e-9, m1["t"] - m0["t"])  # CPU and switches were read at the marks
    cpu, switches = share * (m1["cpu"] - m0["cpu"]), share * (m1["switches"] - m0["switches"])
    per_session_cycle_us = 1e6 * cpu / max(1, session_cycles)
    mean_step = step_s / max(1, steps)
    per_step_sessions = session_cycles / max(1, steps)
    return {
        "method": method,
        "topology": topology,
        "load": load.kind,
        "sessions": n,
        "tokens": run.tokens,
        "requests": run.requests,
        "repeated_requests": run.repeated,
        "errors": len(run.errors),
        "first_error": run.errors[0] if run.errors else None,
        "steps": steps,
        "session_cycles": session_cycles,
        "tau": run.tokens / max(1, session_cycles),
        "mean_step_ms": 1000 * mean_step,
        "control_plane_us_per_session_cycle": per_session_cycle_us,
        "share_of_step": per_session_cycle_us * 1e-6 * per_step_sessions / mean_step if steps else 0.0,
        "tokens_per_s": run.tokens / wall,
        "bound_tokens_per_s": run.tokens / step_s if step_s else 0.0,
        # the modelled device idle between steps: control-plane time not overlapped with a step
        "exposed_us_per_step": 1e6 * max(0.0, wall - step_s) / max(1, steps),
        "sessions_per_step": per_step_sessions,
        # every session in every step: its mean cycles as steps, each paying t0 once, the same tokens fed
        "full_batch_bound_tokens_per_s": run.tokens / (session_cycles / n * T0_S + C_S * fed)
        if session_cycles
        else 0.0,
        "context_switches_per_session_cycle": switches / max(1, session_cycles),
        "itl_p50_ms": 1000 * percentile(run.itl_s, 0.5) if run.itl_s else 0.0,
        "itl_p99_ms": 1000 * percentile(run.itl_s, 0.99) if run.itl_s else 0.0,
        "wall_s": wall,
    }


def window_steps(log: list, t0: float, t1: float) -> tuple[int, float, int, int, tuple[float, float]]:
    """The stand-in's steps within [t0, t1], on step boundaries: from the end of the last step
    done by t0 to the end of the last done by t1, so a step across an edge (a 256-session
    prefill lasts a second) counts wholly or not at all. Returns steps, their modelled
    seconds, cycles and fed tokens, and the span."""
    ends = [e for e, *_ in log]
    e0 = max((e for e in ends if e <= t0), default=t0)
    e1 = max((e for e in ends if e <= t1), default=t1)
    inside = [row for row in log if e0 < row[0] <= e1]
    return (
        len(inside),
        sum(r[1] for r in inside),
        sum(r[2] for r in inside),
        sum(r[3] for r in inside),
        (e0, e1),
    )


def context_switches() -> int:
    """This process's context switches so far, every thread's, voluntary or not."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_nvcsw + use.ru_nivcsw


# -- topologies -----------------------------------------------------------------------------------
def serve_standin(port: int, n: int, counters: Path) -> None:
    """The stand-in behind the real verifier gRPC edge (``--standin-port``): its counters are
    written to ``counters`` at start and on each SIGUSR1, numbered (``seq``)."""
    from services.verifier.grpc_server import build_verifier_server

    core = standin_core(load_traces(n))
    server, _, bound = build_verifier_server(core, "127.0.0.1", port, max_sessions=1024, workers=64)
    server.start()
    print(f"stand-in verifier on 127.0.0.1:{bound}", flush=True)
    seq = itertools.count()

    def write(*_) -> None:
        tmp = counters.with_suffix(".tmp")
        tmp.write_text(json.dumps({**core.counters(), "seq": next(seq)}))
        tmp.replace(counters)

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGUSR1, write)
    write()
    while True:
        signal.pause()


class Distributed:
    """The stand-in in its own process, reached over the Link as a router reaches a verifier."""

    def __init__(self, n: int, workdir: Path):
        from services.common.runtime import free_port

        self.port, self.counters_path = free_port(), workdir / "standin.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.control_plane", "--standin-port", str(self.port), "--count", str(n)]
            + ["--standin-counters", str(self.counters_path)],
        )
        deadline = time.monotonic() + 120
        while not self.counters_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the stand-in verifier did not start")
            time.sleep(0.2)

    def counters(self) -> dict:
        """The stand-in's counters now: asked for by a signal, read once written."""
        seq = json.loads(self.counters_path.read_text())["seq"]
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.001)
            try:
                c = json.loads(self.counters_path.read_text())
            except (OSError, ValueError):  # being replaced
                continue
            if c["seq"] > seq:
                return c
        raise RuntimeError("the stand-in verifier did not write its counters")

    def verifier(self):
        from services.verifier.client import RemoteVerifier

        return RemoteVerifier([f"127.0.0.1:{self.port}"], link=True)

    def snapshot(self) -> tuple[dict, float]:
        """(the stand-in's counters, the control plane's CPU seconds so far): both processes'."""
        c = self.counters()
        return c, time.process_time() + c["cpu_s"] - c["step_cpu_s"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Embedded:
    def __init__(self, n: int, workdir: Path | None = None):
        self.core = standin_core(load_traces(n))

    def counters(self) -> dict:
        return self.core.counters()

    def verifier(self):
        return self.core

    def snapshot(self) -> tuple[dict, float]:
        return self.counters(), time.process_time() - self.core.step_cpu_s

    def close(self) -> None:
        pass


def descendants_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of every live process below ``root`` (from /proc): Ray's GCS,
    raylet, Serve controller, proxy and replicas when ``root`` started Ray."""
    parent, cpu = {}, {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    below, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier} - below
        below |= frontier
    return sum(cpu[pid] for pid in below)


def standin_deployment():
    """The real Serve verifier deployment (``VerifierDeployment``: its session table, its step
    calls into the batcher) with the stand-in in place of ``VerifierCore``."""
    from ray import serve

    from services.ray_app import VerifierDeployment

    class StandInReplica(VerifierDeployment.func_or_class):  # type: ignore[name-defined,misc]
        def __init__(self, traces: list[dict], context_len: int, vocab_size: int, max_draft: dict[str, int]):
            self._standin = (traces, context_len, vocab_size, max_draft)
            super().__init__({"verifier_max_sessions": MAX_BATCH})

        def build_core(self, args: dict) -> StandInCore:
            return StandInCore(*self._standin)

        def counters(self) -> dict:
            return self.core.counters()

    return serve.deployment(StandInReplica)


class RayServe:
    """The stand-in as one Serve replica on a local Ray of 2 CPUs, reached through deployment
    handles (``RayVerifier``) as the ingress replica's router reaches its verifiers; the router
    runs in this process, as in the ingress. Control-plane CPU: this process and every Ray process
    (GCS, raylet, Serve controller and proxy, the replica), less the stand-in's bookkeeping."""

    def __init__(self, n: int, workdir: Path | None = None, core: StandInCore | None = None):
        """The stand-in of ``n`` traces of the bundled models, or one built like ``core``."""
        import ray
        from ray import serve

        core = core or standin_core(load_traces(n))
        args = ([*core.by_prompt.values()], core.context_len, core.vocab_size, core.max_draft)
        os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "180")
        ray.init(
            num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}
        )
        serve.start()
        self.handle = serve.run(
            standin_deployment().options(max_ongoing_requests=4096, ray_actor_options={"num_cpus": 1}).bind(*args),
            name="control-plane",
            route_prefix=None,
        )

    def counters(self) -> dict:
        return self.handle.counters.remote().result()

    def verifier(self):
        from services.ray_app import RayVerifier

        return RayVerifier(self.handle)

    def snapshot(self) -> tuple[dict, float]:
        c = self.counters()
        return c, time.process_time() + descendants_cpu_s(os.getpid()) - c["step_cpu_s"]

    def close(self) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


PLACES = {"embedded": Embedded, "distributed": Distributed, "ray": RayServe}


# -- report ---------------------------------------------------------------------------------------
def markdown(rows: list[dict], command: str, load: Load = Load()) -> str:
    if load.kind == "steady":
        how = (
            f"Each session runs requests back to back ({MAX_NEW} new tokens at most, each on its own prompt: "
            f"HumanEval, then held-out stdlib), so that many are open at every moment; measured over "
            f"{load.window_s:g} s after {load.warmup_s:g} s of warm-up."
        )
    else:
        how = (
            f"One request per session, all at once, {MAX_NEW} new tokens at most, each on its own prompt "
            "(HumanEval, then held-out stdlib), measured until the last ends."
        )
    how += (
        " Clients: every stream a coroutine on one event loop, reading `Completions.stream` as the public servers do."
        if load.clients == "loop"
        else " Clients: a thread per stream."
    )
    lines = [
        "# Control plane at modelled GPU speed",
        "",
        f"Command: `{command}`. Step model: t0 = {T0_S * 1e3:.1f} ms + {C_S * 1e6:.0f} µs per token in the "
        "batch (an 8B target in bf16 on one H100 SXM, from its datasheet: see bench/control_plane.py). "
        f"{how} Outputs and verifier-side acceptance replayed from real runs of the bundled "
        "models. share_of_step: the control plane's CPU per step (router, drafters, predictor, memory, "
        "links; both processes in distributed) over the step's modelled time; tokens/s against the "
        "stand-in's bound (its steps back to back).",
        "",
        "exposed: the stand-in idle between steps (wall less its steps), per step; full-batch bound: the "
        "tokens/s if every session were in every step (its mean cycles as steps, t0 paid once each), so "
        "splitting steps cannot flatter 'of full'; ctx sw: the router process's context switches per "
        "session-cycle; requests: begun in the measured span (repeated: on a prompt its session had run "
        "before, which the suffix cache may recall).",
        "",
        "| topology | method | sessions | τ | CP µs/session-cycle | share of step | exposed µs/step | sessions/step "
        "| tokens/s | bound | achieved | full-batch bound | of full | ctx sw | ITL p50 ms | ITL p99 ms | step ms "
        "| requests (repeated) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        full = r.get("full_batch_bound_tokens_per_s", 0.0)
        mb = r.get("micro_batches", 1)
        lines.append(
            f"| {r['topology']} | {r['method']}{f' x{mb}' if mb else ''} | "
            f"{r['sessions']} | {r['tau']:.2f} | {r['control_plane_us_per_session_cycle']:.0f} | {r['share_of_step']:.2f} | "
            f"{r.get('exposed_us_per_step', 0.0):.0f} | {r.get('sessions_per_step', 0.0):.1f} | {r['tokens_per_s']:.0f} | "
            f"{r['bound_tokens_per_s']:.0f} | {r['tokens_per_s'] / max(1e-9, r['bound_tokens_per_s']):.0%} | "
            f"{full:.0f} | {r['tokens_per_s'] / max(1e-9, full):.0%} | "
            f"{r.get('context_switches_per_session_cycle', 0.0):.1f} | "
            f"{r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | {r['mean_step_ms']:.1f} | "
            f"{r.get('requests', r['sessions'])} ({r.get('repeated_requests', 0)}) |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    topologies = sorted({r["topology"] for r in rows})
    fig, axes = plt.subplots(1, 2 * len(topologies), figsize=(6 * len(topologies) * 2, 4.2), squeeze=False)
    for k, topo in enumerate(topologies):
        share, achieved = axes[0][2 * k], axes[0][2 * k + 1]
        for method, mb in itertools.product(METHODS, sorted({r.get("micro_batches", 1) for r in rows})):
            pts = sorted(
                (
                    r
                    for r in rows
                    if r["topology"] == topo and r["method"] == method and r.get("micro_batches", 1) == mb
                ),
                key=lambda r: r["sessions"],
            )
            if not pts:
                continue
            xs, label, ls = (
                [r["sessions"] for r in pts],
                method + (f" x{mb}" if mb else ""),
                "-" if mb in (0, 1) else ":",
            )
            share.plot(xs, [r["share_of_step"] for r in pts], marker="o", ls=ls, label=label)
            achieved.plot(
                xs,
                [r["tokens_per_s"] / max(1e-9, r["bound_tokens_per_s"]) for r in pts],
                marker="o",
                ls=ls,
                label=label,
            )
        share.axhline(0.05, color="grey", ls=":", lw=1)
        share.axhline(0.10, color="grey", ls="--", lw=1)
        achieved.axhline(0.9, color="grey", ls="--", lw=1)
        for ax, title in ((share, "control-plane share of the step"), (achieved, "tokens/s over the bound")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent sessions")
            ax.set_title(f"{topo}: {title}", fontsize=10)
            ax.legend(fontsize=8)
        share.set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main() -> int:
    p = argparse.ArgumentParser(description="control plane at modelled GPU speed")
    p.add_argument("--sessions", default=",".join(map(str, SESSIONS)))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--topologies", default="embedded,distributed,ray")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--count",
        type=int,
        default=TRACES,
        help="traces to load (prompts; recorded once, then cached): a steady load's sessions take them in "
        "turn, and a prompt run twice in a configuration is counted as repeated",
    )
    p.add_argument(
        "--suffix-reference",
        action="store_true",
        help="the suffix cache on the Python reference tree, outputs entering the shared tree when finished "
        "(the drafter before the compiled tree, for an A/B run)",
    )
    p.add_argument(
        "--micro-batches",
        default="0",
        help="comma-separated router micro-batch counts to compare (the engine's micro_batches; 0: its auto "
        "default, unlabelled), e.g. 0,1,2",
    )
    p.add_argument(
        "--load",
        choices=("steady", "burst"),
        default="steady",
        help="steady: each session runs requests back to back, measured over --window-s after --warmup-s; "
        "burst: one request per session, all at once, until the last ends",
    )
    p.add_argument(
        "--clients",
        choices=("loop", "threads"),
        default=Load.clients,
        help="loop: the streams as coroutines on one event loop (the public servers' way); threads: a thread each",
    )
    p.add_argument("--warmup-s", type=float, default=Load.warmup_s)
    p.add_argument("--window-s", type=float, default=Load.window_s)
    p.add_argument("--standin-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--standin-counters", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.standin_port is not None:
        serve_standin(a.standin_port, a.count, a.standin_counters)
        return 0
    import tempfile

    from services.common.config import EngineConfig, SuffixConfig
    from services.common.runtime import tune_gc
    from services.router.engine import Engine

    tune_gc()  # as a server does
    sessions = [int(s) for s in a.sessions.split(",")]
    methods = a.methods.split(",")
    micro = [int(m) for m in a.micro_batches.split(",")]
    traces = load_traces(max(max(sessions), a.count))
    load = Load(a.load, a.warmup_s, a.window_s, a.clients)
    cfg = (
        EngineConfig(suffix=SuffixConfig(compiled=False, live_outputs=False)) if a.suffix_reference else EngineConfig()
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for topology in a.topologies.split(","):
            place = PLACES[topology](len(traces), Path(tmp))
            try:
                for n in sessions:
                    for method, mb in itertools.product(methods, micro):  # interleaved at each session count
                        engine = Engine(replace(cfg, micro_batches=mb, max_batch=MAX_BATCH), verifier=place.verifier())
                        row = measure(
                            engine, place, traces if a.load == "steady" else traces[:n], n, method, topology, load
                        )
                        row["micro_batches"] = mb
                        if (tuner := engine.scheduler.tuner) is not None:  # in process, auto: what it chose
                            row["tuner"] = {"chosen": tuner.chosen, "trials": tuner.trials, "rates": tuner.rates}
                        engine.close()
                        rows.append(row)
                        print(
                            f"{topology:11s} {method:11s} x{mb} {n:4d} sessions: τ {row['tau']:.2f}, share "
                            f"{row['share_of_step']:.2f}, {row['tokens_per_s']:.0f}/{row['bound_tokens_per_s']:.0f} "
                            f"tokens/s, {row['sessions_per_step']:.1f} sessions/step, exposed "
                            f"{row['exposed_us_per_step']:.0f} µs/step, errors {row['errors']}"
                            + (f", tuner chose x{row['tuner']['chosen']}" if "tuner" in row else ""),
                            flush=True,
                        )
            finally:
                place.close()
    command = "python -m bench.control_plane " + " ".join(sys.argv[1:])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    a.out.with_suffix(".md").write_text(markdown(rows, command, load))
    plot(rows, a.out.with_suffix(".png"))
    print(f"wrote {a.out}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
