"""vLLM's --speculative-config read into the engine's configuration (services/common/speculative_config.py)."""

import json
import subprocess
import sys

import pytest

from services.common.config import EngineConfig, models_dir
from services.common.speculative_config import apply_speculative_config
from services.router.engine import METHODS

BASE = EngineConfig()


def apply(spec: dict) -> EngineConfig:
    return apply_speculative_config(BASE, spec, METHODS)


def test_vllm_methods_map_to_ours_and_set_their_drafter():
    c = apply({"method": "eagle3", "model": str(models_dir() / "eagle3"), "num_speculative_tokens": 3})
    assert (c.default_method, c.eagle3, c.eagle3_k, c.num_speculative_tokens) == (
        "eagle3",
        models_dir() / "eagle3",
        3,
        BASE.num_speculative_tokens,
    )
    c = apply({"method": "draft_model", "model": str(models_dir() / "draft"), "num_speculative_tokens": 6})
    assert (c.default_method, c.draft, c.num_speculative_tokens, c.eagle3_k) == (
        "sd",
        models_dir() / "draft",
        6,
        BASE.eagle3_k,
    )
    c = apply({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5})
    assert (c.default_method, c.ngram.min_n, c.ngram.max_n, c.ngram.k) == ("ngram", 1, 5, 3)
    c = apply(
        {
            "method": "suffix",
            "num_speculative_tokens": 24,
            "suffix_decoding_max_tree_depth": 32,
            "suffix_decoding_max_spec_factor": 2.0,
            "suffix_decoding_min_token_prob": 0.2,
            "suffix_decoding_max_cached_requests": 0,
            "disable_by_batch_size": 8,
        }
    )
    assert (
        c.default_method,
        c.suffix.spec.max_spec_tokens,
        c.suffix.max_depth,
        c.suffix.spec.max_spec_factor,
        c.suffix.spec.min_token_prob,
        c.suffix.max_cached_requests,
        c.spec_disable_batch,
    ) == ("suffix", 24, 32, 2.0, 0.2, 0, 8)


def test_specmesh_methods_pass_through_and_a_hybrid_takes_the_eagle3_keys():
    c = apply({"method": "hybrid-csd", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.05})
    assert (c.default_method, c.eagle3_k, c.suffix.spec.min_token_prob) == ("hybrid-csd", 2, 0.05)
    assert apply({"method": "vanilla"}).default_method == "vanilla"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"method": "medusa"}, r"method: 'medusa' is not supported; choose vLLM's eagle3"),
        ({"method": "eagle"}, r"method: 'eagle' is not supported"),
        ({"num_speculative_tokens": 3}, r"method: None is not supported"),
        ({"method": "eagle3", "draft_tensor_parallel_size": 1}, r"unsupported key\(s\) draft_tensor_parallel_size"),
        ({"method": "eagle3", "num_speculative_tokens": 0}, r"num_speculative_tokens: must be an integer >= 1, got 0"),
        ({"method": "eagle3", "num_speculative_tokens": "4"}, r"num_speculative_tokens: must be an integer >= 1"),
        ({"method": "eagle3", "model": "/nonexistent"}, r"model: /nonexistent holds no config.json"),
        ({"method": "ngram", "model": "x"}, r"model: method 'ngram' drafts with no model"),
        ({"method": "vanilla", "num_speculative_tokens": 2}, r"method 'vanilla' drafts nothing"),
        ({"method": "eagle3", "prompt_lookup_min": 2}, r"prompt_lookup_min/max: only with method ngram"),
        (
            {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            r"prompt_lookup_max: must be an integer >= 3",
        ),
        (
            {"method": "eagle3", "suffix_decoding_max_tree_depth": 8},
            r"suffix_decoding_\*: only with methods that draft",
        ),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, r"min_token_prob: must be in \[0, 1\]"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        apply(spec)


def test_serve_refuses_a_bad_speculative_config_before_loading_models():
    for arg, message in (
        ('{"method": "medusa"}', "speculative_config.method: 'medusa' is not supported"),
        ("{method: eagle3}", "--speculative-config: not valid JSON"),
        (json.dumps(["eagle3"]), "--speculative-config: must be a JSON object"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "services.cli", "serve", "--speculative-config", arg],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and message in out.stderr, out.stderr[-500:]


def test_the_ray_app_takes_it_as_a_mapping_or_its_json():
    from services.ray_app import engine_config

    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, '{"method": "ngram", "num_speculative_tokens": 3}'):
        c = engine_config({"speculative_config": spec})
        assert (c.default_method, c.ngram.k) == ("ngram", 3)
    assert engine_config({}).default_method == EngineConfig().default_method
    with pytest.raises(ValueError, match="unsupported key"):
        engine_config({"speculative_config": {"method": "ngram", "quantization": "fp8"}})


def test_an_engine_says_once_when_its_default_method_cannot_run(tiny_dirs, caplog):
    from services.router.engine import Engine

    target, draft = tiny_dirs
    with caplog.at_level("WARNING", logger="specmesh.engine"):
        engine = Engine(
            EngineConfig(
                target=target, draft=draft, eagle3=None, predictor=None, ocm_snapshot=None, default_method="eagle3"
            )
        )
    assert engine.default_method == "sd"
    assert [r.getMessage() for r in caplog.records if r.name == "specmesh.engine"] == [
        "default method eagle3 cannot run on these models (a drafter is missing); requests that name no method get sd"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="specmesh.engine"):
        Engine(
            EngineConfig(
                target=target, draft=draft, eagle3=None, predictor=None, ocm_snapshot=None, default_method="suffix"
            )
        )
    assert not [r for r in caplog.records if r.name == "specmesh.engine"]


def test_options_set_fields_of_nested_configs_and_default_to_them():
    from services.common.config import OPTIONS, EngineConfig

    assert OPTIONS["hybrid_tau"].fallback() == EngineConfig.hybrid.tau
    assert OPTIONS["suffix_live_outputs"].fallback() is True
    cfg = EngineConfig.from_mapping({"hybrid_tau": 3.5, "suffix_live_outputs": False, "target": "/t"})
    assert cfg.hybrid.tau == 3.5 and cfg.hybrid.cost_aware == EngineConfig.hybrid.cost_aware
    assert cfg.suffix.live_outputs is False and cfg.suffix.max_depth == EngineConfig.suffix.max_depth


def test_options_set_fields_of_nested_configs_at_any_depth():
    """suffix_max_draft sets suffix.spec.max_spec_tokens, beside suffix_max_depth (suffix) and
    hybrid_tau (hybrid); the rest of each nested config keeps its defaults."""
    c = EngineConfig.from_mapping({"suffix_max_draft": 7, "suffix_max_depth": 32, "hybrid_tau": 3.0})
    assert (c.suffix.spec.max_spec_tokens, c.suffix.max_depth, c.hybrid.tau) == (7, 32, 3.0)
    assert c.suffix.spec.min_token_prob == BASE.suffix.spec.min_token_prob
    assert c.suffix.live_outputs == BASE.suffix.live_outputs and c.hybrid.cost_aware == BASE.hybrid.cost_aware
    with pytest.raises(ValueError, match="suffix_max_draft"):
        EngineConfig.from_mapping({"suffix_max_draft": 0})


@pytest.mark.parametrize(
    "values,invariant",
    [
        ({}, False),  # float32 on the CPU: the fast path
        ({"dtype": "bfloat16"}, True),
        ({"dtype": "float16"}, True),
        ({"dtype": "bfloat16", "batch_invariant": "false"}, False),
        ({"batch_invariant": "true"}, True),
    ],
)
def test_batch_invariant_verification_is_on_in_reduced_precision_unless_set(values, invariant):
    assert EngineConfig.from_mapping({"device": "cpu", **values}).invariant_verification is invariant


@pytest.mark.parametrize(
    "values,on",
    [
        ({}, False),  # the CPU: a read costs nothing there, and the confidence cut saves steps
        ({"device": "cuda"}, True),
        ({"device": "cuda:1"}, True),
        ({"device": "cuda", "device_drafts": "false"}, False),
        ({"device_drafts": True}, True),
    ],
)
def test_device_drafts_are_on_for_cuda_unless_set(values, on):
    assert EngineConfig.from_mapping({"device": "cpu", **values}).drafts_on_device is on


def test_server_options_come_from_one_table_for_the_cli_and_the_ray_app():
    """`specmesh serve`'s server flags and the Ray app's ingress args are SERVER_OPTIONS: the same
    names build the same ServerConfig, defaults included; a bad value is refused naming it."""
    from services.cli import build_parser
    from services.common.config import SERVER_OPTIONS, ServerConfig
    from services.ray_app import engine_config, server_config

    assert ServerConfig.from_mapping({}) == ServerConfig()
    flags = ["--max-sessions", "3", "--max-queue", "0", "--served-model-name", "a", "b"]
    flags += ["--health-check-timeout", "2.5", "--no-vllm-metric-names", "--allowed-origins", "https://x.example"]
    ns = vars(build_parser().parse_args(["serve", *flags]))
    args = {
        "max_sessions": 3,
        "max_queue": 0,
        "served_model_name": ["a", "b"],
        "health_check_timeout": 2.5,
        "vllm_metric_names": False,
        "allowed_origins": "https://x.example",
    }
    from_cli, from_ray = ServerConfig.from_mapping(ns), server_config(args)
    assert from_cli == from_ray
    assert (from_ray.max_sessions, from_ray.served_model_name, from_ray.health_check_timeout_s) == (3, ("a", "b"), 2.5)
    assert set(SERVER_OPTIONS) <= set(ns)  # every server option is a flag
    for bad, message in (({"max_sessions": 0}, "max_sessions"), ({"health_check_timeout": -1}, "health_check_timeout")):
        with pytest.raises(ValueError, match=message):
            server_config(bad)
    engine_config(args)  # the app takes server options beside engine ones
    with pytest.raises(ValueError, match="max_streams is now max_sessions"):
        engine_config({"max_streams": 8})
    with pytest.raises(ValueError, match="unknown arg"):
        engine_config({"max_sesions": 8})


def test_the_topology_comes_from_its_option_table_with_environment_variables_and_choices(monkeypatch):
    """`specmesh serve`'s layout flags are TOPOLOGY_OPTIONS: each has its environment variable,
    a flag's comma-separated verifiers split as the env's do, and a value outside a fixed few is
    refused naming the option and the choices."""
    from services.cli import build_parser
    from services.common.config import TOPOLOGY_OPTIONS, Topology

    assert Topology.from_mapping({}) == Topology()
    ns = vars(
        build_parser().parse_args(["serve", "--role", "router", "--verifiers=a:1,b:2", "--verifier-link", "stream"])
    )
    topo = Topology.from_mapping(ns)
    assert (topo.role, topo.verifiers, topo.verifier_link, topo.kind) == (
        "router",
        ("a:1", "b:2"),
        "stream",
        "embedded",
    )
    assert set(TOPOLOGY_OPTIONS) <= set(ns)  # every topology option is a flag
    monkeypatch.setenv("SPECMESH_TOPOLOGY", "distributed")
    monkeypatch.setenv("SPECMESH_VERIFIER_TIMEOUT", "2.5")
    topo = Topology.from_mapping({})
    assert (topo.kind, topo.verifier_timeout_s) == ("distributed", 2.5)
    with pytest.raises(ValueError, match="role: 'routr' is not one of all, router"):
        Topology.from_mapping({"role": "routr"})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--topology", "mesh"])
