#!/usr/bin/env python
"""Markdown tables rendered from benchmarks/results/<platform>/<suite>[-<variant>].json.

    python benchmarks/render_results.py          # rewrite the generated regions
    python benchmarks/render_results.py --check  # print a diff and exit 1 where one differs

A generated region is the text between the lines `<!-- results:NAME:start -->` and
`<!-- results:NAME:end -->`; REGIONS says which region a file may hold: docs/benchmarks.md's
"tables" (a section per platform and suite, render_tables; the file must hold it) and
README.md's "headline" (the core suite's bf16 ratios on each machine, headline_table). A
region is rewritten only where its two markers are; the rest of the file is left as it is.
The output depends on the JSON alone (files in sorted order, fixed float formats), and this
script imports nothing outside the standard library: no torch, no rope_ext.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks/results")

# What every results JSON says of its run (rope_ext.benchmark.run_metadata writes them):
# "unknown" where an old run's header, README or git log did not say.
META_KEYS = ("platform", "suite", "variant", "date", "commit", "torch", "cpu_model_name",
             "cpu_family", "cpu_model", "cpu_isa", "cpu_kernel", "cpu_kernel_forced", "threads",
             "heap", "streaming_stores", "gpu", "command")

COPY, CLONE = "copy_ (bound, in-place)", "clone (bound, out-of-place)"
MET = {None: "", True: "yes", False: "**no**"}


@dataclasses.dataclass(frozen=True)
class Run:
    """One results JSON: its path from the repository root and its content."""

    path: Path
    data: dict

    @property
    def key(self) -> tuple[str, str, str]:
        return self.data["platform"], self.data["suite"], self.data["variant"]

    @property
    def name(self) -> str:
        """The file's name without .json: the suite and the variant."""
        return self.data["suite"] + (f"-{self.data['variant']}" if self.data["variant"] else "")


def missing_metadata(data: dict) -> list[str]:
    """META_KEYS that `data` lacks."""
    return [key for key in META_KEYS if key not in data]


def load_runs(root: Path) -> list[Run]:
    """Every results JSON under root, sorted by platform, suite and variant."""
    runs = []
    for path in sorted((root / RESULTS).rglob("*.json")):
        data = json.loads(path.read_text())
        missing = missing_metadata(data)
        if missing:
            raise ValueError(f"{path.relative_to(root)} lacks {', '.join(missing)}")
        runs.append(Run(path.relative_to(root), data))
    return sorted(runs, key=lambda run: run.key)


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}" if num and den else "-"


def _times(rows: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """provider -> ms, and provider -> us in a CUDA graph for those that have one."""
    return ({r["provider"]: r["ms"] for r in rows},
            {r["provider"]: r["graph_us"] for r in rows if r.get("graph_us") not in (None, "")})


def caption(run: Run) -> list[str]:
    """The machine, its settings, the date, commit and torch version, and the command."""
    d = run.data
    name = d["cpu_model_name"] if d["cpu_model_name"] != "unknown" else "CPU of unknown name"
    cpu = f"{name} (family {d['cpu_family']}, model {d['cpu_model']}, {d['cpu_isa']})"
    machine = f"{d['gpu']}, host {cpu}" if d["gpu"] != "none" else cpu
    forced = " (forced by ROPE_EXT_CPU_KERNEL)" if d["cpu_kernel_forced"] else ""
    return [f"**{run.name}**: {machine}; CPU kernel {d['cpu_kernel']}{forced}, {d['threads']} CPU "
            f"threads, heap: {d['heap']}, streaming stores: {d['streaming_stores']}. Run on "
            f"{d['date']} at commit {d['commit']}, torch {d['torch']}; `{run.path.as_posix()}`.",
            "", f"Command: `{d['command']}`", ""]


def provider_tables(run: Run) -> list[str]:
    """bench_rope.py's rows: per case, each provider's ms, GB/s and time over copy_'s and
    clone's (ratios of the medians), CUDA-graph times where the run has them, then the case's
    target ratios (paired, as the run computed them)."""
    rows, lines = run.data["results"], []
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        ms, graph = _times(mine)
        head = "| provider | ms | GB/s | time / copy_ | time / clone |"
        rule = "|---|---:|---:|---:|---:|"
        if graph:
            head, rule = head + " GPU us, CUDA graph | graph time / copy_'s |", rule + "---:|---:|"
        lines += [f"*{case}*", "", head, rule]
        for r in mine:
            line = (f"| {r['provider']} | {r['ms']:.3f} | {r['gbps']:.1f} | "
                    f"{_ratio(r['ms'], ms.get(COPY))} | {_ratio(r['ms'], ms.get(CLONE))} |")
            if graph:
                g = graph.get(r["provider"])
                line += f" {'-' if g is None else f'{g:.1f}'} | {_ratio(g, graph.get(COPY))} |"
            lines.append(line)
        lines.append("")
        targets = [t for t in run.data.get("targets", []) if t["case"] == case]
        if targets:
            lines += ["| ratio (time / time, paired) | value | target | met |",
                      "|---|---:|---:|---|"]
            lines += [f"| {t['ratio']} | {t['value']:.2f} | {t['target'] or '-'} | "
                      f"{MET[t['met']]} |" for t in targets]
            lines.append("")
    return lines


def layout_table(run: Run) -> list[str]:
    """bench_compile_inplace.py's rows: per layout and provider, us, GB/s and time over copy_'s
    and eager's. Layouts are code: `x[:, :, i]` would otherwise read as a markdown link."""
    lines = ["| layout | dtype | provider | us | GB/s | time / copy_ | time / eager |",
             "|---|---|---|---:|---:|---:|---:|"]
    lines += [f"| `{r['layout']}` | {r['dtype']} | {r['provider']} | {r['us']:.1f} | "
              f"{r['gbps']:.1f} | {r['ratio_to_copy']:.2f} | {r['ratio_to_eager']:.2f} |"
              for r in run.data["rows"]]
    return lines + [""]


def layer_table(run: Run) -> list[str]:
    """bench_layer.py's rows: per model, pass and provider, ms and time over transformers' own
    compiled layer (paired by round), and the largest difference from that layer's outputs."""
    d = run.data
    lines = [f"One decoder layer, {d['shape']}, {d['dtype']}, sdpa; transformers "
             f"{d['transformers']}.", "",
             "| model | pass | provider | ms | time / transformers' | max error |",
             "|---|---|---|---:|---:|---:|"]
    for r in d["layers"]:
        ms = "not timed" if r["ms"] is None else f"{r['ms']:.2f}"
        ratio = "-" if r["ratio_to_hf"] is None else f"{r['ratio_to_hf']:.3f}"
        error = "-" if r["max_error"] is None else f"{r['max_error']:.2g}"
        lines.append(f"| {r['model']} | {r['pass_']} | {r['provider']} | {ms} | {ratio} | "
                     f"{error} |")
    return lines + [""]


def render_tables(root: Path) -> str:
    """A section per platform, a subsection per suite, and under it each variant's caption and
    tables; files in a platform's directory with no JSON (notes, reports) are listed."""
    runs = load_runs(root)
    platforms = sorted({run.data["platform"] for run in runs}
                       | {p.name for p in (root / RESULTS).iterdir() if p.is_dir()})
    lines = []
    for platform in platforms:
        lines += [f"## {platform}", ""]
        mine = [run for run in runs if run.data["platform"] == platform]
        for suite in dict.fromkeys(run.data["suite"] for run in mine):
            lines += [f"### {suite} on {platform}", ""]
            for run in (r for r in mine if r.data["suite"] == suite):
                lines += caption(run)
                lines += (layout_table(run) if "rows" in run.data
                          else layer_table(run) if "layers" in run.data
                          else provider_tables(run))
                png = root / run.path.with_suffix(".png")
                if png.exists():
                    lines += [f"Plot: `{png.relative_to(root).as_posix()}`.", ""]
        others = sorted(p for p in (root / RESULTS / platform).glob("*.md")
                        if not p.with_suffix(".json").exists())
        if others:
            lines += ["Not rendered (no JSON): " + ", ".join(
                f"`{p.relative_to(root).as_posix()}`" for p in others) + ".", ""]
    return "\n".join(lines)


def headline_runs(runs: list[Run]) -> list[Run]:
    """The runs README's headline shows: every GPU's core suite, and the newest core suite of
    a CPU with the kernel the CPU picks itself (none forced)."""
    core = [run for run in runs if run.data["suite"] == "core" and not run.data["variant"]]
    gpus = [run for run in core if run.data["gpu"] != "none"]
    cpus = [run for run in core if run.data["gpu"] == "none"]
    return gpus + sorted(cpus, key=lambda run: run.data["date"])[-1:]


def headline_table(root: Path) -> str:
    """README's headline: per machine and bf16 case of the core suite, rope_ext's in-place
    time and GB/s, its time over copy_'s (the bound), and how many times faster it is than
    LLaMA's eager complex path, Hugging Face's eager rotate_half and torch.compile of
    rotate_half (the faster compiled path). GPU rows use CUDA-graph times where every provider
    of the row has one."""
    lines = ["| machine | bf16 case | rope_ext in place | / copy_ | vs eager LLaMA | vs eager HF "
             "| vs compiled HF | run |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for run in headline_runs(load_runs(root)):
        d = run.data
        machine = (d["gpu"] if d["gpu"] != "none"
                   else f"{d['platform']} ({d['cpu_isa']}, {d['threads']} threads)")
        for case in dict.fromkeys(r["case"] for r in d["results"] if " bfloat16 " in r["case"]):
            ms, graph = _times([r for r in d["results"] if r["case"] == case])
            names = ("rope_ext in-place", COPY, "eager complex (LLaMA)", "eager rotate_half (HF)",
                     "compiled rotate_half (HF)")
            times = graph if all(n in graph for n in names) else ms
            scale, unit = (1e-3, "us") if all(n in graph for n in names) else (1.0, "ms")
            ours = times["rope_ext in-place"]
            gbps = next(r["bytes"] for r in d["results"] if r["case"] == case) / (
                ours * scale * 1e-3) / 1e9
            faster = [f"{times[n] / ours:.1f}x" for n in names[2:]]
            lines.append(f"| {machine} | {case.rsplit(' ', 2)[0]} | {ours:.3g} {unit}, "
                         f"{gbps:.0f} GB/s | {ours / times[COPY]:.2f} | {' | '.join(faster)} | "
                         f"{d['date']}, `{run.path.as_posix()}` |")
    return "\n".join(lines)


# file -> region name -> what renders it; the regions a file must hold.
REGIONS: dict[str, dict[str, Callable[[Path], str]]] = {
    "docs/benchmarks.md": {"tables": render_tables},
    "README.md": {"headline": headline_table},
}
REQUIRED = {("docs/benchmarks.md", "tables")}

_REGION = re.compile(r"(?P<start>^<!-- results:(?P<name>[\w-]+):start -->\n).*?"
                     r"(?P<end>^<!-- results:(?P=name):end -->$)", re.S | re.M)


def replace_regions(text: str, renderers: dict[str, Callable[[], str]]) -> tuple[str, set[str]]:
    """text with each region that `renderers` names rewritten (a blank line either side of the
    rendered text), and the names of the regions found."""
    found = set()

    def body(match: re.Match) -> str:
        name = match["name"]
        if name not in renderers:
            return match[0]
        found.add(name)
        return f"{match['start']}\n{renderers[name]().strip()}\n\n{match['end']}"

    return _REGION.sub(body, text), found


def render(root: Path) -> tuple[dict[Path, tuple[str, str]], list[str]]:
    """Each file of REGIONS that exists -> (its text, the text with its regions rendered), and
    the REQUIRED regions that are missing."""
    texts, missing = {}, []
    for name, regions in REGIONS.items():
        path = root / name
        if not path.exists():
            missing += [f"{name}: missing (it must hold results:{region})"
                        for file, region in sorted(REQUIRED) if file == name]
            continue
        old = path.read_text()
        new, found = replace_regions(old, {region: (lambda f=f: f(root))
                                           for region, f in regions.items()})
        missing += [f"{name}: no <!-- results:{region}:start --> ... end --> region"
                    for file, region in sorted(REQUIRED) if file == name and region not in found]
        texts[path] = (old, new)
    return texts, missing


def check(root: Path) -> list[str]:
    """A unified diff for each file whose regions differ from what the JSON gives, and a line
    for each missing REQUIRED region; empty when everything matches."""
    texts, problems = render(root)
    for path, (old, new) in texts.items():
        if old != new:
            name = path.relative_to(root).as_posix()
            problems.append("".join(difflib.unified_diff(
                old.splitlines(keepends=True), new.splitlines(keepends=True),
                fromfile=name, tofile=f"{name} (rendered from {RESULTS.as_posix()})")))
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="rewrite nothing; print a diff and exit 1 where a region differs")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the repository (default: the one holding this script)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.root)
        sys.stdout.write("".join(p if p.endswith("\n") else p + "\n" for p in problems))
        return 1 if problems else 0
    texts, missing = render(args.root)
    for path, (old, new) in texts.items():
        if old != new:
            path.write_text(new)
            print(f"rewrote {path.relative_to(args.root).as_posix()}")
    if missing:
        print("\n".join(missing), file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
