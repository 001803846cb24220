"""The zoo sweep (benchmarks/zoo.py) on one small model, so the script cannot rot: Llama under tp and
1F1B trains exact against single, the JSON and the Markdown table say so, and the figures count a
WRONG cell as WRONG (a cell within the tolerance of single is exact, beyond it, or NaN, it is not)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.dist]

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / "zoo.py"


def _zoo():
    spec = importlib.util.spec_from_file_location("zoo_sweep", ZOO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sweep_runs_llama_under_tp_and_1f1b_exact(tmp_path: Path) -> None:
    out, md = tmp_path / "zoo.json", tmp_path / "zoo.md"
    cmd = [sys.executable, str(ZOO), "--models", "llama", "--cells", "tp", "1F1B", "--json", str(out), "--markdown", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ZOO.parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["tp_plan"] and row["pp_plan"] and not row["moe"], row
    assert row["moved"] > 1e-4, "training moved nothing: a parity of untrained weights proves nothing"
    assert {c: v["outcome"] for c, v in row["cells"].items()} == {"tp": "exact", "1F1B": "exact"}, row["cells"]
    assert max(v["diff"] for v in row["cells"].values()) <= 1e-9
    assert data["summary"]["tp"] == {"exact": 1, "of": 1, "percent": 100.0} and data["summary"]["wrong"] == 0
    table = md.read_text()
    assert "| llama | yes | yes | - |" in table and "tp exact: 1 of 1 models declaring a tp plan (100.0%)" in table


def test_a_cell_off_single_is_wrong_and_counted() -> None:
    zoo = _zoo()
    assert zoo.outcome(1e-12, 1e-9) == "exact"
    assert zoo.outcome(3e-2, 1e-9) == "WRONG" and zoo.outcome(float("nan"), 1e-9) == "WRONG"
    rows = [
        {
            "model": "a",
            "tp_plan": True,
            "pp_plan": True,
            "moe": [],
            "floor": 0.0,
            "cells": {"tp": {"outcome": "exact", "diff": 0.0}, "1F1B": {"outcome": "WRONG", "diff": 1e-2}},
        },
        {"model": "b", "tp_plan": True, "pp_plan": False, "moe": [], "floor": 0.0, "cells": {"tp": {"outcome": "refused", "message": "style 'x'"}}},
        {"model": "c", "build_error": "timed out", "cells": {}},
    ]
    fig = zoo.summary(rows)
    assert fig["tp"] == {"exact": 1, "of": 2, "percent": 50.0} and fig["1F1B"] == {"exact": 0, "of": 1, "percent": 0.0}
    assert (fig["wrong"], fig["refused"], fig["built"], fig["models"]) == (1, 1, 2, 3)
