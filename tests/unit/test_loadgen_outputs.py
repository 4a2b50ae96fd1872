"""``shapeserve bench`` says a bad --output-json / --plot-dir before it sends any load (a run's measurements are
written at its end, so a path found bad then would lose them), and makes missing directories."""

from __future__ import annotations

import json

import pytest

from cluster.tools.cli import main as cli_main
from tests.helpers import free_port


@pytest.fixture()
def argv(tmp_path) -> list[str]:
    workload = tmp_path / "tiny.json"
    workload.write_text(
        json.dumps(
            {
                "name": "tiny",
                "seed": 1,
                "num_requests": 2,
                "arrival": {"kind": "burst"},
                "classes": [
                    {
                        "name": "all",
                        "weight": 1.0,
                        "prompt_tokens": {"dist": "fixed", "value": 8},
                        "output_tokens": {"dist": "fixed", "value": 2},
                    }
                ],
            }
        )
    )
    # Nothing listens there: had the run got as far as sending, it would fail on the connection instead.
    base_url = f"http://127.0.0.1:{free_port()}/v1"
    return ["bench", "--base-url", base_url, "--workload", str(workload), "--vocab-size", "64", "--no-progress"]


def test_output_json_under_a_file_is_refused_before_any_request(tmp_path, argv):
    (tmp_path / "taken").write_text("a file, not a directory")
    with pytest.raises(SystemExit, match=r"--output-json: cannot create .*taken.*writable directory"):
        cli_main([*argv, "--output-json", str(tmp_path / "taken" / "report.json")])


def test_output_json_naming_a_directory_is_refused(tmp_path, argv):
    with pytest.raises(SystemExit, match="--output-json: .* is a directory; give a file name"):
        cli_main([*argv, "--output-json", str(tmp_path)])


def test_plot_dir_under_a_file_is_refused_before_any_request(tmp_path, argv):
    pytest.importorskip("matplotlib")
    (tmp_path / "taken").write_text("a file, not a directory")
    with pytest.raises(SystemExit, match=r"--plot-dir: cannot create .*taken"):
        cli_main([*argv, "--plot-dir", str(tmp_path / "taken" / "plots")])


def test_missing_report_directories_are_made_before_the_run(tmp_path, argv):
    target = tmp_path / "reports" / "run1"
    # The run itself fails (no server), but only after the directories were made.
    with pytest.raises(Exception):  # noqa: B017 - whichever error the missing server gives
        cli_main([*argv, "--output-json", str(target / "report.json"), "--plot-dir", str(tmp_path / "plots")])
    assert target.is_dir() and (tmp_path / "plots").is_dir()
