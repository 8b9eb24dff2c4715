"""A property-based fuzzer over every RPC of every specmesh service: messages built field by field
from each method's descriptor (extreme numbers, NaN, long and odd strings, nested messages,
several per stream) and raw bytes. Property: each call ends OK or with a status that names the
client's problem (never INTERNAL or UNKNOWN), and afterwards every server still serves and holds
no session. Examples are derandomized: CI replays the same ones."""

import math

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common.config import SuffixConfig
from services.drafter.grpc_server import build_drafter_server
from services.drafter.suffix import SuffixDrafter
from services.memory.correction_memory import LocalCorrectionMemory
from services.memory.grpc_server import build_memory_server
from services.predictor.grpc_server import build_predictor_server
from services.predictor.mlp import YieldMLP
from services.router.engine import GenerationRequest
from services.router.grpc_server import build_server
from services.verifier.grpc_server import build_verifier_server
from specmesh.v1 import drafter_pb2, generate_pb2, memory_pb2, predictor_pb2, verifier_pb2

CLEAR = {  # statuses that tell the client what happened; INTERNAL and UNKNOWN are our bugs
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ALREADY_EXISTS,
}
MODULES = {
    "Generation": generate_pb2,
    "Verifier": verifier_pb2,
    "Drafter": drafter_pb2,
    "Predictor": predictor_pb2,
    "Memory": memory_pb2,
}
METHODS = [(svc, m) for svc, mod in MODULES.items() for m in mod.DESCRIPTOR.services_by_name[svc].methods]
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)

_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar(f, depth: int):
    """A strategy for one value of field ``f``: small values mostly (they reach deep code),
    extremes sometimes (they test the limits)."""
    if f.type in _INTS:
        lo, hi = _INTS[f.type]
        return st.one_of(st.integers(max(lo, -3), min(hi, 300)), st.integers(lo, hi))
    if f.type in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
        return st.one_of(st.floats(-2, 2), st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -0.0]))
    if f.type == F.TYPE_BOOL:
        return st.booleans()
    if f.type == F.TYPE_STRING:
        return st.one_of(st.text(max_size=24), st.sampled_from(["sd", "vanilla", "hybrid", "suffix", "csd", "a+", "{"]))
    if f.type == F.TYPE_BYTES:
        return st.binary(max_size=32)
    if f.type == F.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), st.integers(-5, 50))
    return message(f.message_type, depth + 1)


def is_map(f) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def field_values(f, depth: int):
    """A strategy for the whole value of field ``f``: a scalar or message, a list, or a map."""
    if is_map(f):
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.dictionaries(scalar(key, depth), scalar(value, depth), max_size=6)
    one = scalar(f, depth)
    return st.lists(one, max_size=6) if f.is_repeated else one


def build(desc, values: dict, into=None):
    """A message of ``desc`` with ``values`` set (over a copy of ``into`` when given)."""
    msg = message_factory.GetMessageClass(desc)()
    if into is not None:
        msg.CopyFrom(into)
    for name, v in values.items():
        f, field = desc.fields_by_name[name], getattr(msg, name)
        if is_map(f):
            field.clear()
            for k, x in v.items():
                if f.message_type.fields_by_name["value"].message_type:
                    field[k].CopyFrom(x)
                else:
                    field[k] = x
        elif f.is_repeated:
            del field[:]
            for x in v:
                field.add().CopyFrom(x) if f.type == F.TYPE_MESSAGE else field.append(x)
        elif f.type == F.TYPE_MESSAGE:
            field.CopyFrom(v)
        else:
            setattr(msg, name, v)
    return msg


def message(desc, depth: int = 0):
    """A strategy for messages of ``desc``: any subset of its fields set (a oneof: the last set wins)."""
    if depth > 3:
        return st.just(build(desc, {}))
    fields = {f.name: field_values(f, depth) for f in desc.fields}
    return st.fixed_dictionaries({}, optional=fields).map(lambda values: build(desc, values))


def mutated(valid):
    """A strategy for ``valid`` with one or two of its fields set to anything: past the first
    checks, into the code behind them."""
    desc = valid.DESCRIPTOR
    patch = st.sampled_from(list(desc.fields)).flatmap(lambda f: field_values(f, 1).map(lambda v: (f.name, v)))
    return st.lists(patch, min_size=1, max_size=2).map(lambda kvs: build(desc, dict(kvs), into=valid))


V, G, D, P, M = verifier_pb2, generate_pb2, drafter_pb2, predictor_pb2, memory_pb2
VALID = {  # a call each method answers OK, the base of its mutations
    "Generation.Generate": [G.GenerateRequest(prompt="def f(x):", max_new_tokens=8, method="sd")],
    "Verifier.Session": [
        V.SessionRequest(open=V.Open(prompt_ids=[5, 6, 7], max_new_tokens=4, max_draft=4)),
        V.SessionRequest(cycle=V.Cycle(draft_ids=[8, 9])),
    ],
    "Verifier.Link": [
        V.LinkRequest(
            items=[V.LinkItem(session_id="a", open=V.Open(prompt_ids=[5, 6], max_new_tokens=3, max_draft=4))]
        ),
        V.LinkRequest(items=[V.LinkItem(session_id="a", cycle=V.Cycle(draft_ids=[8]))]),
    ],
    "Drafter.Start": [D.DrafterStart(session_id="r", prompt_ids=[5, 6, 7, 5, 6], max_new_tokens=8)],
    "Drafter.Propose": [D.DrafterPropose(session_id="r", budget=4)],
    "Drafter.Observe": [D.DrafterObserve(session_id="r", tokens=[7, 5])],
    "Drafter.Step": [
        D.DrafterStep(
            observed=[D.DrafterObserve(session_id="r", tokens=[7])], asks=[D.DrafterPropose(session_id="r", budget=4)]
        )
    ],
    "Memory.RecordPairs": [M.RecordPairsRequest(pairs=[M.PairCount(draft=5, target=6, count=1)])],
}


def requests_for(svc: str, method):
    """Lists of request messages for ``method``: built at random, or a valid call mutated."""
    n = 3 if method.client_streaming else 1
    random = st.lists(message(method.input_type), min_size=1, max_size=n)
    valid = VALID.get(f"{svc}.{method.name}")
    if valid is None:
        return random
    one = st.integers(0, len(valid) - 1).flatmap(
        lambda i: mutated(valid[i]).map(lambda m: [*valid[:i], m, *valid[i + 1 :]])
    )
    return st.one_of(random, one)


@pytest.fixture(scope="module")
def fleet(tiny_engine):
    """Every service on loopback, over the tiny pair: (address by service name, the engine)."""
    from services.common.config import ServerConfig

    vocab = tiny_engine.verifier.vocab_size
    servers = {
        "Generation": build_server(tiny_engine, ServerConfig(port=0, max_sessions=8, metrics_port=0))[::2],
        "Verifier": build_verifier_server(tiny_engine.verifier, "127.0.0.1", 0)[::2],
        "Drafter": build_drafter_server(SuffixDrafter(SuffixConfig()), vocab, "127.0.0.1", 0)[::2],
        "Predictor": build_predictor_server(YieldMLP(), "127.0.0.1", 0),
        "Memory": build_memory_server(LocalCorrectionMemory(), vocab, "127.0.0.1", 0)[::2],
    }
    for server, _ in servers.values():
        server.start()
    yield {svc: f"127.0.0.1:{port}" for svc, (_, port) in servers.items()}, tiny_engine
    for server, _ in servers.values():
        server.stop(0)


def call(addr: str, svc: str, method, requests: list, raw: bool = False) -> grpc.StatusCode:
    """Send ``requests`` (messages, or bytes with ``raw``) to ``method``; the status it ended with."""
    path = f"/specmesh.v1.{svc}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    ser = (lambda b: b) if raw else (lambda m: m.SerializeToString())
    kind = ("stream" if method.client_streaming else "unary") + "_" + ("stream" if method.server_streaming else "unary")
    with grpc.insecure_channel(addr) as ch:
        rpc = getattr(ch, kind)(path, request_serializer=ser, response_deserializer=out_cls.FromString)
        arg = iter(requests) if method.client_streaming else requests[0]
        try:
            result = rpc(arg, timeout=20)
            for reply in result if method.server_streaming else ():
                for r in getattr(reply, "replies", ()):  # a Link answers each session alone
                    if r.WhichOneof("kind") == "error":
                        code = next(c for c in grpc.StatusCode if c.value[0] == r.error.code)
                        if code not in CLEAR:
                            return code
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("svc,method", METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_every_typed_message_gets_a_clear_status(fleet, svc, method):
    addrs, _ = fleet

    @FUZZ
    @given(requests_for(svc, method))
    def prop(requests):
        code = call(addrs[svc], svc, method, requests)
        assert code in CLEAR, (code, requests)

    prop()


@pytest.mark.parametrize("svc,method", METHODS, ids=[f"{s}.{m.name}" for s, m in METHODS])
def test_every_run_of_raw_bytes_gets_a_clear_status(fleet, svc, method):
    addrs, _ = fleet

    @FUZZ
    @given(st.lists(st.binary(max_size=64), min_size=1, max_size=3 if method.client_streaming else 1))
    def prop(blobs):
        code = call(addrs[svc], svc, method, blobs, raw=True)
        assert code in CLEAR, (code, blobs)

    prop()


def test_after_the_fuzzing_every_service_serves_and_holds_no_session(fleet):
    from specmesh.v1 import generate_pb2_grpc

    addrs, engine = fleet
    ref = engine.generate(GenerationRequest(engine.encode("def f(x):"), 16, method="vanilla")).result()
    stub = generate_pb2_grpc.GenerationStub(grpc.insecure_channel(addrs["Generation"]))
    req = generate_pb2.GenerateRequest(prompt="def f(x):", max_new_tokens=16, method="sd")
    assert [t for m in stub.Generate(req, timeout=60) for t in m.token_ids] == ref["token_ids"]
    assert not engine.verifier.sessions
