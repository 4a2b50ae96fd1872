"""``shapeserve validate``: every file in deploy/ passes; broken variants fail naming the file and the key."""

import copy
from pathlib import Path

import pytest
import yaml

from cluster.errors import ConfigError
from cluster.tools.cli import main

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPO = DEPLOY.parent


def validate(capsys, *files) -> tuple[int, str]:
    code = main(["validate", *map(str, files)])
    return code, capsys.readouterr().out


def test_every_shipped_file_validates(capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # as an operator runs it, from the repository root (relative paths in the files)
    files = sorted(p.relative_to(REPO) for p in DEPLOY.glob("*.yaml"))
    code, out = validate(capsys, *files)
    assert code == 0, out
    assert out.count(": ok (") == len(files)


def test_gpu_app_is_checked_against_the_cluster_through_its_file_mounts(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out = validate(capsys, "deploy/serve-app.yaml")
    assert code == 1
    assert "applications.0.args.config: '/home/ray/shapeserve/deploy/shapeserve.yaml' is not on this machine" in out
    code, out = validate(capsys, "deploy/cluster-gpu.yaml", "deploy/serve-app.yaml")
    assert code == 0, out


def write(tmp_path, name, data) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def shipped(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def mutate(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[last] = value
    return data


@pytest.mark.parametrize(
    "dotted, value, key, says",
    [
        ("shapeserve.decode.max_num_sequences", 8, "shapeserve.decode.max_num_sequences", "Extra inputs"),
        ("shapeserve.decode.max_num_seqs", "many", "shapeserve.decode.max_num_seqs", "valid integer"),
        ("shapeserve.prefill.autoscaling.min_replicas", 9, "shapeserve.prefill.autoscaling.min_replicas", "above"),
        (
            "shapeserve.prefill.autoscaling.min_replica_startup_s",
            500,
            "shapeserve.prefill.autoscaling.min_replica_startup_s",
            "above max_replica_startup_s",
        ),
        ("shapeserve.pool_ratio.min_prefill_per_decode", 3, "shapeserve.pool_ratio.min_prefill_per_decode", "above"),
        ("shapeserve.block_size", 12, "shapeserve.block_size", "power of two"),
        ("shapeserve.transport", "carrier-pigeon", "shapeserve.transport", "'auto'"),
    ],
)
def test_broken_serve_config_names_the_key(capsys, tmp_path, dotted, value, key, says):
    path = write(tmp_path, "shapeserve.yaml", mutate(shipped("shapeserve.yaml"), dotted, value))
    code, out = validate(capsys, path)
    assert code == 1
    line = next(line for line in out.splitlines() if line.startswith(f"{path}: {key}: "))
    assert says in line


@pytest.mark.parametrize(
    "dotted, value, key, says",
    [
        ("autoscaler_flavour", "fast", "", "'autoscaler_flavour' was unexpected"),
        ("available_node_types.prefill_gpu.resources", "lots", "available_node_types.prefill_gpu.resources", "object"),
        ("head_node_type", "nope", "head_node_type", "must be one of"),
        ("available_node_types.decode_gpu.min_workers", 6, "available_node_types.decode_gpu.min_workers", "above"),
    ],
)
def test_broken_cluster_file_names_the_key(capsys, tmp_path, dotted, value, key, says):
    path = write(tmp_path, "cluster.yaml", mutate(shipped("cluster-gpu.yaml"), dotted, value))
    code, out = validate(capsys, path)
    assert code == 1
    assert any(line.startswith(f"{path}: {key or '(top level)'}: ") and says in line for line in out.splitlines()), out


def test_a_pool_no_node_type_can_host_is_rejected(capsys, tmp_path):
    cluster = write(tmp_path, "cluster.yaml", shipped("cluster-gpu.yaml"))
    config = write(tmp_path, "c.yaml", mutate(shipped("shapeserve.yaml"), "shapeserve.decode.resources", {"h200": 1}))
    code, out = validate(capsys, cluster, config)
    assert code == 1
    assert f"{config}: decode.resources: no node type of {cluster} can host a decode replica (h200: 1" in out
    # Four GPUs per replica: no node type has them either.
    config = write(tmp_path, "c.yaml", mutate(shipped("shapeserve.yaml"), "shapeserve.prefill.num_gpus", 4))
    code, out = validate(capsys, cluster, config)
    assert code == 1 and f"{config}: prefill.resources: no node type of {cluster}" in out


def test_more_replicas_than_the_cluster_can_start_are_rejected(capsys, tmp_path):
    cluster = write(tmp_path, "cluster.yaml", shipped("cluster-gpu.yaml"))
    config = write(
        tmp_path, "c.yaml", mutate(shipped("shapeserve.yaml"), "shapeserve.decode.autoscaling.max_replicas", 9)
    )
    code, out = validate(capsys, cluster, config)
    assert code == 1
    key = "decode.autoscaling.max_replicas"
    assert f"{config}: {key}: 9 replicas need more nodes than {cluster} allows: at most 4" in out


def test_serve_app_args_and_owned_deployment_options(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    app = shipped("serve-app-local.yaml")
    path = write(tmp_path, "a.yaml", mutate(app, "applications.0.args.conifg", "x.yaml"))
    code, out = validate(capsys, path)
    assert code == 1 and f"{path}: applications.0.args.conifg: unknown argument" in out
    path = write(tmp_path, "a.yaml", mutate(app, "applications.0.args.overrides", {"dtype": "float64"}))
    code, out = validate(capsys, path)
    assert code == 1 and f"{path}: applications.0.args.overrides.dtype: " in out
    path = write(
        tmp_path, "a.yaml", mutate(app, "applications.0.deployments", [{"name": "DecodeWorker", "num_replicas": 3}])
    )
    code, out = validate(capsys, path)
    assert code == 1 and f"{path}: applications.0.deployments.0.num_replicas: the decode pool's num_replicas" in out
    path = write(tmp_path, "a.yaml", mutate(app, "applications.0.route_prefix", 5))
    code, out = validate(capsys, path)
    assert code == 1 and f"{path}: applications.0.route_prefix: " in out


def test_the_application_level_policy_is_ours_and_there_where_the_config_keeps_a_ratio(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    other = "my.module:policy"
    app = mutate(shipped("serve-app-local.yaml"), "applications.0.autoscaling_policy", {"policy_function": other})
    path = write(tmp_path, "a.yaml", app)
    code, out = validate(capsys, path)
    assert code == 1 and f"{path}: applications.0.autoscaling_policy.policy_function: an application-level" in out
    # The GPU app without it: its ServeConfig (read through the cluster file's mounts) keeps a pool_ratio that
    # only the application-level policy applies.
    app = shipped("serve-app.yaml")
    del app["applications"][0]["autoscaling_policy"]
    path = write(tmp_path, "a.yaml", app)
    code, out = validate(capsys, "deploy/cluster-gpu.yaml", path)
    assert code == 1
    assert f"{path}: applications.0.autoscaling_policy: the ServeConfig's pool_ratio is applied only by" in out
    # A ratio needs both pools autoscaled.
    config = mutate(shipped("shapeserve.yaml"), "shapeserve.prefill.autoscaling", None)
    code, out = validate(capsys, write(tmp_path, "c.yaml", config))
    assert code == 1 and "shapeserve.pool_ratio: needs both pools autoscaled" in out


def test_unreadable_and_missing_files(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    code, out = validate(capsys, bad, tmp_path / "missing.yaml")
    assert code == 1
    assert f"{bad}: (top level): not valid YAML" in out and "missing.yaml: (top level): cannot read it" in out


def test_app_builder_refuses_what_validate_refuses(monkeypatch):
    from cluster.app import app_builder

    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="args.conifg: unknown argument"):
        app_builder({"conifg": "deploy/shapeserve-local.yaml"})
    assert type(app_builder(dict(shipped("serve-app-local.yaml")["applications"][0]["args"]))).__name__ == "Application"
