"""The files in deploy/ parse: ServeConfigs, the Serve config, the autoscaling policies (no Ray cluster)."""

from pathlib import Path

import yaml

from cluster.serving.config import load_serve_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_serve_configs_validate():
    for f in sorted(DEPLOY.glob("shapeserve*.yaml")):
        load_serve_config(f)


def test_gpu_config_places_pools_on_tagged_nodes():
    cfg = load_serve_config(DEPLOY / "shapeserve.yaml")
    assert cfg.prefill.resources == {"prefill": 1} and cfg.decode.resources == {"decode": 1}
    nodes = yaml.safe_load((DEPLOY / "cluster-gpu.yaml").read_text())["available_node_types"]
    assert nodes["prefill_gpu"]["resources"]["prefill"] == 1 and nodes["decode_gpu"]["resources"]["decode"] == 1


def test_serve_app_yaml_and_autoscaling_policies():
    # One source of truth: the policies and their thresholds come from the ServeConfig's autoscaling blocks (and
    # its pool_ratio, which rides along for the application-level policy the Serve configs name).
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy
    from ray.serve.schema import ServeDeploySchema

    from cluster.serving.autoscaling import (
        DecodeAutoscalingPolicy,
        PrefillAutoscalingPolicy,
        read_policy_kwargs,
        serve_autoscaling_config,
    )

    for name in ("serve-app.yaml", "serve-app-local.yaml"):
        (app,) = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / name).read_text())).applications
        # What Serve's controller does with it: import it, pickle it by value, instantiate it once.
        policy = AutoscalingPolicy(**app.autoscaling_policy).get_policy()
        assert policy.__name__ == "ApplicationAutoscalingPolicy" and callable(policy())
    cfg = load_serve_config(DEPLOY / "shapeserve.yaml")
    assert cfg.pool_ratio is not None
    for pool, policy_class in (("prefill", PrefillAutoscalingPolicy), ("decode", DecodeAutoscalingPolicy)):
        thresholds = getattr(cfg, pool).autoscaling
        serve_config = AutoscalingConfig(**serve_autoscaling_config(pool, thresholds, cfg.pool_ratio))
        assert serve_config.policy.get_policy() is policy_class
        assert read_policy_kwargs(serve_config.policy.policy_kwargs) == (thresholds, cfg.pool_ratio)
        assert serve_config.max_replicas == thresholds.max_replicas
        assert serve_config.look_back_period_s == cfg.pool_ratio.mix_window_s  # Serve keeps the mix window
    assert sorted(p.name for p in DEPLOY.glob("*.yaml")) == [
        "cluster-gpu.yaml",
        "serve-app-local.yaml",
        "serve-app.yaml",
        "shapeserve-local.yaml",
        "shapeserve.yaml",
    ]  # every file here is read by something (tests/unit/test_validate.py validates each)


def test_app_builder_builds_the_graph():
    from cluster.app import app_builder

    app = app_builder({"config": str(DEPLOY / "shapeserve.yaml"), "overrides": {"port": 9001}})
    assert type(app).__name__ == "Application"


def test_pool_options_follow_the_placement():
    from cluster.app import _pool_options
    from cluster.serving.placement import place_pools
    from router.replica_choice import DecodeRequestRouter

    cfg = load_serve_config(DEPLOY / "shapeserve.yaml")
    placement = place_pools(cfg, cluster_cpus=64, cluster_gpus=8)
    opts = _pool_options("DecodeWorker", cfg.decode, placement.decode, cfg, DecodeRequestRouter)
    assert opts["ray_actor_options"] == {
        "num_cpus": 4,
        "num_gpus": 1,
        "resources": {"decode": 1},
        # an autoscaled pool's replicas push their load every second, not Serve's 10 s (a sample a second over the
        # 30 s mix window of pool_ratio)
        "runtime_env": {
            "env_vars": {
                "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1.0",
                "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": str(1 / 30),
            }
        },
    }
    assert opts["request_router_config"].request_router_kwargs == {"block_size": 16}
    assert "autoscaling_config" in opts and "num_replicas" not in opts
    local = load_serve_config(DEPLOY / "shapeserve-local.yaml")
    placement = place_pools(local, cluster_cpus=2, cluster_gpus=0)
    opts = _pool_options("DecodeWorker", local.decode, placement.decode, local, DecodeRequestRouter)
    assert opts["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 0.0,
        "runtime_env": {"env_vars": {"MALLOC_ARENA_MAX": "1"}},
    }
    assert opts["num_replicas"] == 1


def test_every_node_of_the_cluster_config_replaces_unusable_request_ids():
    """Serve's proxies read the callback from their node's environment: each ``ray start`` sets it, to a path
    that imports and gives Serve its middlewares."""
    import importlib

    from router.request_ids import SERVE_HTTP_CALLBACK

    cluster = yaml.safe_load((DEPLOY / "cluster-gpu.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in cluster[key] if "ray start" in c]
        assert f"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH={SERVE_HTTP_CALLBACK} ray start" in start, key
    module, _, name = SERVE_HTTP_CALLBACK.rpartition(".")
    assert getattr(importlib.import_module(module), name)()  # Serve calls it for the middleware list
