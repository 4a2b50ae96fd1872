"""deploy/grafana/shapeserve.json is a well-formed Grafana dashboard over shapeserve's series (that each series
it charts is on a live /metrics page is checked in tests/integration/test_cli_server.py)."""

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "shapeserve.json"
METRIC = re.compile(r"\b(shapeserve_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def dashboard_metrics() -> set[str]:
    """Every series name the dashboard's queries read."""
    data = json.loads(DASHBOARD.read_text())
    return {m for panel in data["panels"] for t in panel.get("targets", []) for m in METRIC.findall(t["expr"])}


def test_dashboard_is_well_formed():
    data = json.loads(DASHBOARD.read_text())
    assert data["uid"] == "shapeserve" and data["templating"]["list"][0]["type"] == "datasource"
    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids))
    charts = [p for p in data["panels"] if p["type"] == "timeseries"]
    assert len(charts) >= 15
    for panel in charts:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for target in panel["targets"]:
            assert METRIC.search(target["expr"]), target
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"], target


def test_dashboard_covers_what_an_operator_watches():
    names = dashboard_metrics()
    for wanted in (
        "shapeserve_time_to_first_token_seconds_bucket",
        "shapeserve_time_per_output_token_seconds_bucket",
        "shapeserve_goodput_requests_total",
        "shapeserve_pool_kv_usage",
        "shapeserve_kv_transfer_bytes_total",
        "shapeserve_batch_num_seqs",
        "shapeserve_pool_kv_blocks_total",  # pool sizes: the autoscaling decisions
    ):
        assert wanted in names
