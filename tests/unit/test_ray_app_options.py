"""The Serve application's deployment options (services/ray_app.py ``app``), read from the
bound application without starting Ray."""

from services.ray_app import app

FLAG = "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"


def env_of(deployment) -> dict:
    return deployment.ray_actor_options.get("runtime_env", {}).get("env_vars", {})


def test_only_the_verifier_runs_its_methods_on_serves_own_loop():
    """The verifier's methods never block (a step is posted and awaited), so its replicas skip
    the user-code thread; the ingress and the predictor, which wait or compute, keep it."""
    ingress = app({})._bound_deployment
    bound = {d.name: d for d in (getattr(x, "_bound_deployment", None) for x in ingress.init_args) if d is not None}
    assert env_of(bound["VerifierDeployment"])[FLAG] == "0"
    assert FLAG not in env_of(ingress) and FLAG not in env_of(bound["PredictorDeployment"])
    assert (
        env_of(bound["VerifierDeployment"])["PROMETHEUS_MULTIPROC_DIR"] == env_of(ingress)["PROMETHEUS_MULTIPROC_DIR"]
    )
