"""benchmarks/results and the tables rendered from it (benchmarks/render_results.py): every
results JSON carries its run's metadata where its path says, and no generated region of the
docs or the README has drifted from the JSON."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "render_results.py"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


render_results = _load_renderer()
RESULTS = sorted((ROOT / "benchmarks" / "results").rglob("*.json"))


def test_generated_regions_match_the_json():
    problems = render_results.check(ROOT)
    assert not problems, ("\n".join(problems)
                          + "\nregenerate with: python benchmarks/render_results.py")


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_results_json_has_its_metadata(path):
    data = json.loads(path.read_text())
    assert not render_results.missing_metadata(data)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"])
    assert re.fullmatch(r"[0-9a-f]{7,40}|unknown", data["commit"])
    # <platform>/<suite>[-<variant>].json, as rope_ext.benchmark.results_path names it
    assert path.parent.name == data["platform"]
    assert path.stem == data["suite"] + (f"-{data['variant']}" if data["variant"] else "")
    assert "results" in data or "rows" in data


def test_regions_are_rewritten_between_their_markers_only():
    text = ("intro\n<!-- results:a:start -->\nstale\n<!-- results:a:end -->\nmiddle\n"
            "<!-- results:other:start -->\nkept\n<!-- results:other:end -->\n")
    new, found = render_results.replace_regions(text, {"a": lambda: "| x |"})
    assert found == {"a"}
    assert new == ("intro\n<!-- results:a:start -->\n\n| x |\n\n<!-- results:a:end -->\nmiddle\n"
                   "<!-- results:other:start -->\nkept\n<!-- results:other:end -->\n")
    assert render_results.replace_regions(new, {"a": lambda: "| x |"})[0] == new


def test_renderer_imports_no_torch():
    code = (f"import runpy, sys; runpy.run_path({str(SCRIPT)!r}); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
