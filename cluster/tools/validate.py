"""``shapeserve validate FILE...``: deployment files checked before they reach a cluster.

Each file is recognised by its top-level keys and checked by its own authority:

- a Ray cluster file (``ray up``; ``available_node_types`` / ``provider``): Ray's own
  ``validate_config(prepare_config(...))``, plus ``min_workers <= max_workers`` per node type;
- a Serve config (``serve deploy`` / ``serve run``; ``applications``): Serve's ``ServeDeploySchema``,
  then for every application built by ``cluster.app:app_builder`` its ``args`` (``config`` and
  ``overrides``) as the builder reads them, no ``deployments`` entry that would override what the
  ServeConfig decides (replica counts, autoscaling), no application-level ``autoscaling_policy`` but
  ours, and ours where the ServeConfig sets a ``pool_ratio`` (only it applies one);
- a ServeConfig (``shapeserve serve --config``; ``shapeserve:`` or its fields at the top): its pydantic model.

Given a cluster file and a ServeConfig together (directly or through a Serve config's ``args.config``), each
pool must fit some node type (custom resources, GPUs, CPUs), and its ``autoscaling.max_replicas`` must fit the
node types' ``max_workers``; a path on the nodes is mapped back to this machine through the cluster file's
``file_mounts``. Every problem is one line ``FILE: KEY: what is wrong``; the exit status is 1 when any file
has one, 0 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cluster.errors import ConfigError

#: The Serve application builder whose ``args`` this validator understands.
APP_BUILDER = "cluster.app:app_builder"
#: Deployment options the ServeConfig owns: setting them in a Serve config would make two sources of truth.
_OWNED_DEPLOYMENT_OPTIONS = ("num_replicas", "autoscaling_config", "ray_actor_options", "max_ongoing_requests")
_POOL_DEPLOYMENTS = {"PrefillWorker": "prefill", "DecodeWorker": "decode"}
#: The application-level autoscaling policy that decides both pools from the ServeConfig.
APP_POLICY = "cluster.serving.autoscaling:ApplicationAutoscalingPolicy"


@dataclass
class Problem:
    file: str
    key: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.key or '(top level)'}: {self.message}"


@dataclass
class Checked:
    """What was learnt from the files, for the checks across files."""

    problems: list[Problem] = field(default_factory=list)
    #: (file, cluster config) of every valid cluster file.
    clusters: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: (file the ServeConfig came from, ServeConfig) of every valid one.
    serve_configs: list[tuple[str, Any]] = field(default_factory=list)
    #: (file, key, path on the nodes, application key, whether it sets our application-level policy) of
    #: ServeConfigs named by a Serve config that are not on this machine.
    remote_paths: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    summaries: dict[str, str] = field(default_factory=dict)


def kind_of(data: dict[str, Any]) -> str:
    if "applications" in data:
        return "serve"
    if "available_node_types" in data or "provider" in data or "cluster_name" in data:
        return "cluster"
    return "shapeserve"


def validate_files(paths: list[str]) -> Checked:
    out = Checked()
    for path in paths:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            out.problems.append(Problem(path, "", f"cannot read it: {e.strerror or e}"))
            continue
        except yaml.YAMLError as e:
            out.problems.append(Problem(path, "", f"not valid YAML: {e}"))
            continue
        if not isinstance(data, dict):
            out.problems.append(Problem(path, "", f"expected a mapping at the top level, got {type(data).__name__}"))
            continue
        {"cluster": _check_cluster, "serve": _check_serve_app, "shapeserve": _check_shapeserve}[kind_of(data)](
            path, data, out
        )
    _check_across(out)
    return out


# ---- Ray cluster files ---------------------------------------------------------------------------------------


def _check_cluster(path: str, data: dict[str, Any], out: Checked) -> None:
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    before = len(out.problems)
    try:
        validate_config(prepare_config(copy.deepcopy(data)))
    except jsonschema.ValidationError as e:
        out.problems.append(Problem(path, ".".join(str(p) for p in e.absolute_path), e.message))
    except (ValueError, KeyError, TypeError) as e:
        out.problems.append(Problem(path, _key_named_in(str(e), data), str(e).strip("'\"")))
    for name, node in (data.get("available_node_types") or {}).items():
        if not isinstance(node, dict):
            continue
        lo, hi = node.get("min_workers", 0), node.get("max_workers")
        if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
            out.problems.append(
                Problem(path, f"available_node_types.{name}.min_workers", f"{lo} is above max_workers {hi}")
            )
    if len(out.problems) == before:
        out.clusters.append((path, data))
        out.summaries[path] = f"Ray cluster config ({len(data.get('available_node_types') or {})} node types)"


def _key_named_in(message: str, data: dict[str, Any]) -> str:
    """The top-level key a Ray ``ValueError`` message names first in backquotes (Ray's messages do), if any."""
    named = [(message.find(f"`{key}`"), str(key)) for key in data if f"`{key}`" in message]
    return min(named)[1] if named else ""


# ---- Serve config files ----------------------------------------------------------------------------------------


def _check_serve_app(path: str, data: dict[str, Any], out: Checked) -> None:
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        schema = ServeDeploySchema.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            out.problems.append(Problem(path, ".".join(str(p) for p in err["loc"]), err["msg"]))
        return
    before = len(out.problems)
    for i, app in enumerate(schema.applications):
        where = f"applications.{i}"
        if app.import_path != APP_BUILDER:
            continue
        policy = (app.autoscaling_policy or {}).get("policy_function")
        if policy is not None and policy != APP_POLICY:
            out.problems.append(
                Problem(
                    path,
                    f"{where}.autoscaling_policy.policy_function",
                    f"an application-level policy replaces the pools' own, whose thresholds come from the "
                    f"ServeConfig; use {APP_POLICY} (it reads them) or none",
                )
            )
        config = serve_config_from_app_args(dict(app.args or {}), path, where, out, policy == APP_POLICY)
        if config is not None:
            out.serve_configs.append((f"{path} ({where})", config))
            out.problems.extend(_pool_ratio_needs_app_policy(path, where, config, policy == APP_POLICY))
        for j, deployment in enumerate(app.deployments or []):
            pool = _POOL_DEPLOYMENTS.get(deployment.name)
            owned = [k for k in _OWNED_DEPLOYMENT_OPTIONS if k in deployment.model_fields_set] if pool else []
            for option in owned:
                out.problems.append(
                    Problem(
                        path,
                        f"{where}.deployments.{j}.{option}",
                        f"the {pool} pool's {option} comes from the ServeConfig ({pool}: in the file args.config "
                        "names); set it there, so that one file decides",
                    )
                )
    if len(out.problems) == before:
        out.summaries[path] = f"Serve config ({len(schema.applications)} application(s))"


def serve_config_from_app_args(
    args: dict[str, Any], path: str, where: str, out: Checked, app_policy: bool = False
) -> Any | None:
    """The ServeConfig the builder makes of ``args``, or None after noting why not in ``out``. A ``config`` that
    is a path on the cluster's nodes (not on this machine) is left for the cluster files' ``file_mounts``; a
    ``config`` file here has its own problems reported under its own name. ``app_policy``: the application sets
    our application-level policy (checked against the ServeConfig once it is read)."""
    from cluster.serving.config import serve_config_from_app_args as build

    config_path = args.get("config")
    if isinstance(config_path, str):
        if not Path(config_path).is_file():
            out.remote_paths.append((path, f"{where}.args.config", config_path, where, app_policy))
            return None
        own = Checked()
        _check_shapeserve_file(config_path, own)
        if own.problems:
            out.problems.extend(own.problems)
            return None
    try:
        return build(args, f"{where}.args")
    except ConfigError as e:
        key = e.param or f"{where}.args"
        out.problems.append(Problem(path, key, e.message.removeprefix(f"{key}: ")))
        return None


def _pool_ratio_needs_app_policy(path: str, where: str, config: Any, app_policy: bool) -> list[Problem]:
    if config.pool_ratio is None or app_policy:
        return []
    message = (
        f"the ServeConfig's pool_ratio is applied only by the application-level policy; set autoscaling_policy: "
        f"{{policy_function: {APP_POLICY}}}"
    )
    return [Problem(path, f"{where}.autoscaling_policy", message)]


# ---- ServeConfig files -----------------------------------------------------------------------------------------


def _check_shapeserve(path: str, data: dict[str, Any], out: Checked) -> None:
    from pydantic import ValidationError

    from cluster.serving.config import ServeConfig, config_problems

    nested = isinstance(data.get("shapeserve"), dict)
    try:
        config = ServeConfig.model_validate(data["shapeserve"] if nested else data)
    except ValidationError as e:
        for key, message in config_problems(e):
            out.problems.append(Problem(path, f"shapeserve.{key}" if nested else key, message))
        return
    out.serve_configs.append((path, config))
    out.summaries[path] = "shapeserve ServeConfig"


def _check_shapeserve_file(path: str, out: Checked) -> None:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        out.problems.append(Problem(path, "", f"cannot read it as YAML: {e}"))
        return
    if not isinstance(data, dict):
        out.problems.append(Problem(path, "", f"expected a mapping at the top level, got {type(data).__name__}"))
        return
    _check_shapeserve(path, data, out)


# ---- across files ------------------------------------------------------------------------------------------------


def _check_across(out: Checked) -> None:
    # ServeConfigs named by a Serve config by their path on the nodes: found through a cluster file's mounts.
    for app_file, key, remote, where, app_policy in out.remote_paths:
        local = _through_file_mounts(remote, out.clusters)
        if local is None:
            hint = (
                "no file_mounts entry of the cluster file(s) given maps it here"
                if out.clusters
                else "it is read on the cluster's nodes: pass the cluster file too, whose file_mounts map it here"
            )
            out.problems.append(Problem(app_file, key, f"{remote!r} is not on this machine; {hint}"))
            continue
        own = Checked()
        _check_shapeserve_file(str(local), own)
        out.problems.extend(own.problems)
        out.serve_configs.extend((f"{file} (as {remote})", config) for file, config in own.serve_configs)
        for _, config in own.serve_configs:
            out.problems.extend(_pool_ratio_needs_app_policy(app_file, where, config, app_policy))
    for cluster_file, cluster in out.clusters:
        for config_file, config in out.serve_configs:
            out.problems.extend(_pools_fit(config_file, config, cluster_file, cluster))


def _through_file_mounts(remote: str, clusters: list[tuple[str, dict[str, Any]]]) -> Path | None:
    for _, cluster in clusters:
        for node_dir, local_dir in (cluster.get("file_mounts") or {}).items():
            node_dir = str(node_dir).rstrip("/")
            if remote == node_dir or remote.startswith(node_dir + "/"):
                # ``ray up`` resolves local paths from where it runs; a repo's cluster file is run from the repo root.
                candidate = Path(str(local_dir)) / remote[len(node_dir) :].lstrip("/")
                if candidate.is_file():
                    return candidate
    return None


def _pools_fit(config_file: str, config: Any, cluster_file: str, cluster: dict[str, Any]) -> list[Problem]:
    problems = []
    node_types: dict[str, dict[str, Any]] = cluster.get("available_node_types") or {}
    head = cluster.get("head_node_type")
    pools = ["decode"] + (["prefill"] if config.disaggregation != "off" else [])
    for pool_name in pools:
        pool = getattr(config, pool_name)
        need: dict[str, float] = dict(pool.resources)
        if pool.num_gpus:
            need["GPU"] = pool.num_gpus
        if pool.num_cpus:
            need["CPU"] = pool.num_cpus
        if not need:
            continue
        per_node = {name: _replicas_per_node(need, node.get("resources") or {}) for name, node in node_types.items()}
        hosts = {name: n for name, n in per_node.items() if n > 0}
        wanted = ", ".join(f"{k}: {v:g}" for k, v in need.items())
        if not hosts:
            problems.append(
                Problem(
                    config_file,
                    f"{pool_name}.resources" if pool.resources else f"{pool_name}.num_gpus",
                    f"no node type of {cluster_file} can host a {pool_name} replica ({wanted}); node types: "
                    + ", ".join(f"{n} {t.get('resources') or {}}" for n, t in node_types.items()),
                )
            )
            continue
        max_replicas = pool.autoscaling.max_replicas if pool.autoscaling else pool.num_replicas
        capacity = sum(
            n * (1 if name == head else int(node_types[name].get("max_workers", cluster.get("max_workers", 0))))
            for name, n in hosts.items()
        )
        if max_replicas > capacity:
            key = f"{pool_name}.autoscaling.max_replicas" if pool.autoscaling else f"{pool_name}.num_replicas"
            problems.append(
                Problem(
                    config_file,
                    key,
                    f"{max_replicas} replicas need more nodes than {cluster_file} allows: at most {capacity} fit "
                    f"({', '.join(f'{n} per {name} node' for name, n in hosts.items())}; raise max_workers there or "
                    "lower this",
                )
            )
    return problems


def _replicas_per_node(need: dict[str, float], offered: dict[str, Any]) -> int:
    fits = []
    for resource, amount in need.items():
        have = float(offered.get(resource, 0))
        fits.append(math.floor(have / amount + 1e-9) if amount > 0 else math.inf)
    n = min(fits) if fits else 0
    return 0 if n == math.inf else int(n)


# ---- CLI -----------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE", help="Ray cluster, Serve config or ServeConfig YAML files")


def run(args: argparse.Namespace) -> int:
    checked = validate_files(args.files)
    for problem in checked.problems:
        print(problem)
    bad = {p.file.split(" (")[0] for p in checked.problems}
    for path in args.files:
        if path not in bad:
            print(f"{path}: ok ({checked.summaries.get(path, 'valid')})")
    return 1 if checked.problems else 0
