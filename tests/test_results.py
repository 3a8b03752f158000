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
    assert "results" in data or "rows" in data or "layers" in data


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


def test_layer_rows_render_with_their_ratio_and_error():
    # bench_layer.py's JSON ("layers"): a timed row, the baseline, and one not timed.
    data = dict(shape="[1, 512] hidden 1024", dtype="bfloat16", transformers="5.0.0", layers=[
        dict(model="Llama", pass_="fwd", provider="compiled, transformers' RoPE", ms=2.0,
             ratio_to_hf=1.0, max_error=None),
        dict(model="Llama", pass_="fwd", provider="compiled, rope_ext.hf.enable()", ms=1.5,
             ratio_to_hf=0.75, max_error=0.004),
        dict(model="Qwen3", pass_="fwd+bwd", provider="compiled, rope_ext.hf.enable()",
             ms=None, ratio_to_hf=None, max_error=1.5)])
    lines = render_results.layer_table(render_results.Run(Path("x.json"), data))
    assert lines[0].startswith("One decoder layer, [1, 512] hidden 1024, bfloat16, sdpa")
    assert "| Llama | fwd | compiled, transformers' RoPE | 2.00 | 1.000 | - |" in lines
    assert "| Llama | fwd | compiled, rope_ext.hf.enable() | 1.50 | 0.750 | 0.004 |" in lines
    assert "| Qwen3 | fwd+bwd | compiled, rope_ext.hf.enable() | not timed | - | 1.5 |" in lines
