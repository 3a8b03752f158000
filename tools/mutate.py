#!/usr/bin/env python
"""Mutation testing of rope_ext: does the test suite notice a plausible one-line bug?

Each mutant changes one node of one file: a comparison (< <=, > >=, == !=, is / is not,
in / not in), arithmetic (+ -, * /, a negation removed), a boolean (and / or, a `not`
removed, True / False), an integer constant off by one, a write dropped (`x.copy_(out)`
-> `out`, `out.index_add_(...)` -> `out`) or a check removed (`raise ...` or a statement
calling a function named *check* -> `pass`). Each runs against the fast tests of its file,
stopping at the first failure (pytest -x), with a time limit; a mutant no test fails
*survives*. Mutants are applied to a copy of the checkout in a temporary folder (the
tracked files and the built library), never to the checkout itself.

With --rope-math, csrc/rope_math.h instead (the torch-free rotation arithmetic): each mutant
is rebuilt (CPU kernels only, `setup.py build_ext --inplace` in the copy: minutes apiece)
and run against the kernel tests; a mutant that does not compile is reported as such.

Examples:
  python tools/mutate.py rope_ext/reference.py            # every mutant of one file
  python tools/mutate.py --list rope_ext/_checks.py       # the mutants, without running them
  python tools/mutate.py --every 4 rope_ext/api.py        # every 4th mutant (a sample)
  python tools/mutate.py --function row_positions rope_ext/reference.py
  python tools/mutate.py --rope-math --every 10           # C++ header, every 10th mutant
  python tools/mutate.py --json out.json --resume ...     # record results; skip those done
  python tools/mutate.py --survivors-of out.json ...      # again, only what survived there
  python tools/mutate.py --all-tests ...                  # every test of the list per mutant

Each mutant runs the tests that run its statement, found by one run of the list under
coverage (the coverage package), with each test's lines recorded apart.

Run it from the checkout with the extension built (`pip install --no-build-isolation -e .`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The tests that exercise each file, fastest killers first (pytest -x stops at the first
# failure, so a survivor costs the whole list and a killed mutant a few seconds). Slow
# compile tests (test_compile*.py) and the subprocess-heavy ones are left out; name others
# with --tests.
TESTS = {
    "rope_ext/reference.py": ["test_apply.py", "test_fallback.py", "test_autograd.py",
                              "test_mrope.py", "test_qk_norm.py", "test_precompute.py"],
    # (test_properties.py calls only the native CPU op, where no Python check runs.)
    "rope_ext/_checks.py": ["test_errors.py", "test_overlap.py", "test_kv_cache.py",
                            "test_mrope.py", "test_qk_norm.py", "test_precompute.py",
                            "test_fallback.py", "test_apply.py"],
    "rope_ext/_autograd.py": ["test_autograd.py", "test_mrope.py", "test_qk_norm.py"],
    "rope_ext/api.py": ["test_apply.py", "test_errors.py", "test_fallback.py",
                        "test_precompute.py", "test_autograd.py", "test_mrope.py",
                        "test_qk_norm.py"],
    "rope_ext/qk_norm.py": ["test_qk_norm.py", "test_fallback.py", "test_apply.py"],
    "rope_ext/_meta.py": ["test_errors.py", "test_overlap.py", "test_mrope.py",
                          "test_qk_norm.py", "test_precompute.py"],
    "csrc/rope_math.h": ["test_apply.py", "test_precompute.py", "test_mrope.py",
                         "test_qk_norm.py", "test_cuda_emulation.py", "test_errors.py",
                         "test_overlap.py"],
}


@dataclasses.dataclass
class Mutant:
    file: str  # relative to the checkout
    line: int
    column: int
    operator: str  # compare, arithmetic, boolean, constant, drop-write, drop-check
    function: str  # the enclosing function (Class.method), or "" at module level
    start: int  # byte offsets of the replaced source
    end: int
    before: str
    after: str

    @property
    def key(self) -> str:
        return f"{self.file}:{self.start}:{self.end}:{self.after}"

    def describe(self) -> str:
        where = f" in {self.function}" if self.function else ""
        return (f"{self.file}:{self.line}:{self.column} {self.operator}{where}: "
                f"{_one_line(self.before)!r} -> {_one_line(self.after)!r}")


def _what(record: dict) -> tuple[str, str, str, str]:
    """A mutant as what it changes, for matching the records of an earlier run."""
    return record["file"], record["function"], record["before"], record["after"]


def match_records(records: list[dict], mutants: list["Mutant"]) -> list[str | None]:
    """For each record of an earlier run, the key of the mutant it is now (None: its code
    changed), matched by what they change, not by byte offset, which an edit elsewhere in the
    file moves. Equal mutants (a `1` -> `0` repeated in one function) are matched in order:
    of the ways that keep the records' order, the one that moves them least in all, so that an
    edit shifting them alike still finds each."""
    found: list[str | None] = [None] * len(records)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(_what(r), []).append(i)
    for what, indices in groups.items():
        rs = sorted(indices, key=lambda i: records[i]["start"])
        ms = sorted((m for m in mutants if _what(dataclasses.asdict(m)) == what),
                    key=lambda m: m.start)
        if not ms:
            continue
        if len(rs) > len(ms):  # fewer now: keep the records nearest to one
            rs = sorted(sorted(rs, key=lambda i: min(abs(m.start - records[i]["start"])
                                                     for m in ms))[:len(ms)],
                        key=lambda i: records[i]["start"])
        # cost[a][b]: records rs[:a] matched in order to some of ms[:b], least total shift.
        inf = float("inf")
        cost = [[0.0] * (len(ms) + 1)] + [[inf] * (len(ms) + 1) for _ in rs]
        for a in range(1, len(rs) + 1):
            for b in range(a, len(ms) + 1):
                cost[a][b] = min(cost[a][b - 1], cost[a - 1][b - 1]
                                 + abs(ms[b - 1].start - records[rs[a - 1]]["start"]))
        b = len(ms)
        for a in range(len(rs), 0, -1):  # back through the table
            while cost[a][b] == cost[a][b - 1]:
                b -= 1
            found[rs[a - 1]] = ms[b - 1].key
            b -= 1
    return found


def _one_line(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


# ----------------------------------------------------------------------------- Python mutants

_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
            ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
            ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                               and isinstance(node.value, (str, bytes)))


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


class _Finder(ast.NodeVisitor):
    """Collects (node, operator, replacement node or text, is_statement) for one module."""

    def __init__(self):
        self.found: list[tuple[ast.AST, str, object, str]] = []
        self.scope: list[str] = []

    def add(self, node, operator, replacement):
        self.found.append((node, operator, replacement, ".".join(self.scope)))

    def _scoped(self, node):
        self.scope.append(node.name)
        for decorator in node.decorator_list:
            self.visit(decorator)
        args = getattr(node, "args", None)
        if args is not None:  # defaults, not annotations
            for default in (*args.defaults, *args.kw_defaults):
                if default is not None:
                    self.visit(default)
        for statement in node.body:
            self.visit(statement)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_AnnAssign(self, node):  # the annotation is not code
        if node.value is not None:
            self.visit(node.value)

    def visit_JoinedStr(self, node):  # error messages
        return

    def visit_Expr(self, node):
        value = node.value
        if isinstance(value, ast.Call) and "check" in _called_name(value).lower():
            self.add(node, "drop-check", "pass")
        self.generic_visit(node)

    def visit_Raise(self, node):
        self.add(node, "drop-check", "pass")
        self.generic_visit(node)

    def visit_Compare(self, node):
        for i, op in enumerate(node.ops):
            swapped = _COMPARE.get(type(op))
            if swapped is not None:
                ops = list(node.ops)
                ops[i] = swapped()
                self.add(node, "compare", ast.Compare(node.left, ops, node.comparators))
        self.generic_visit(node)

    def visit_BinOp(self, node):
        swapped = _ARITHMETIC.get(type(node.op))
        if swapped is not None and not (_is_text(node.left) or _is_text(node.right)):
            self.add(node, "arithmetic", ast.BinOp(node.left, swapped(), node.right))
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        swapped = _ARITHMETIC.get(type(node.op))
        if swapped is not None:
            self.add(node, "arithmetic", ast.AugAssign(node.target, swapped(), node.value))
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.USub) and not isinstance(node.operand, ast.Constant):
            self.add(node, "arithmetic", node.operand)
        elif isinstance(node.op, ast.Not):
            self.add(node, "boolean", node.operand)
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        swapped = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.add(node, "boolean", ast.BoolOp(swapped, node.values))
        self.generic_visit(node)

    def visit_Constant(self, node):
        if isinstance(node.value, bool):
            self.add(node, "boolean", ast.Constant(not node.value))
        elif isinstance(node.value, int):
            for changed in (node.value + 1, node.value - 1):
                self.add(node, "constant", ast.Constant(changed))

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr.endswith("_") \
                and not func.attr.startswith("_"):
            # An in-place tensor method: copy_(src) -> src (the value, never written);
            # out.index_add_(...) and the like -> out (as it was).
            if func.attr == "copy_" and node.args:
                self.add(node, "drop-write", node.args[0])
            else:
                self.add(node, "drop-write", func.value)
        self.generic_visit(node)


def _byte_offset(line_starts: list[int], line: int, column: int) -> int:
    return line_starts[line - 1] + column


def python_mutants(path: Path) -> list[Mutant]:
    """Every mutant of one Python file, in source order."""
    source = path.read_bytes()
    tree = ast.parse(source)
    original = ast.dump(tree)
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))
    finder = _Finder()
    finder.visit(tree)
    relative = str(path.resolve().relative_to(ROOT))
    mutants, seen = [], set()
    for node, operator, replacement, function in finder.found:
        start = _byte_offset(line_starts, node.lineno, node.col_offset)
        end = _byte_offset(line_starts, node.end_lineno, node.end_col_offset)
        if isinstance(replacement, str):  # a statement
            text = replacement
        else:  # an expression, parenthesised so that it binds as the node did
            text = ast.unparse(replacement)
            text = text if isinstance(node, ast.stmt) else f"({text})"
        mutated = source[:start] + text.encode() + source[end:]
        try:
            changed = ast.dump(ast.parse(mutated)) != original
        except SyntaxError:
            continue
        key = (start, end, text)
        if not changed or key in seen:
            continue
        seen.add(key)
        mutants.append(Mutant(relative, node.lineno, node.col_offset, operator, function, start,
                              end, source[start:end].decode(), text))
    return mutants


# ----------------------------------------------------------------------------- C++ mutants

# Spaced binary operators, as the header writes them (templates' <> are never spaced).
_CPP_SWAPS = [(" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" >= ", " > "),
              (" == ", " != "), (" != ", " == "), (" + ", " - "), (" - ", " + "),
              (" * ", " / "), (" / ", " * "), (" && ", " || "), (" || ", " && "),
              (" += ", " -= "), (" -= ", " += "), ("++", "--"), ("--", "++")]
_CPP_OPERATOR = {" < ": "compare", " <= ": "compare", " > ": "compare", " >= ": "compare",
                 " == ": "compare", " != ": "compare", " && ": "boolean", " || ": "boolean"}
_CPP_INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
_CPP_NEGATION = re.compile(r"(?<=[(,\s])-(?=[A-Za-z_(])")


def cpp_mutants(path: Path) -> list[Mutant]:
    """Mutants of a C++ header, line by line, outside comments and preprocessor lines."""
    source = path.read_bytes().decode()
    relative = str(path.resolve().relative_to(ROOT))
    mutants, offset = [], 0
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        code = line.split("//", 1)[0]
        if code.lstrip().startswith("#") or not code.strip():
            offset += len(line.encode())
            continue
        edits = []
        for old, new in _CPP_SWAPS:
            for match in re.finditer(re.escape(old), code):
                if old in ("++", "--") and code[match.start():match.start() + 3] in ("+++", "---"):
                    continue
                edits.append((match.start(), match.end(), new,
                              _CPP_OPERATOR.get(old, "arithmetic")))
        for match in _CPP_INTEGER.finditer(code):
            value = int(match.group())
            for changed in (value + 1, value - 1):
                if changed >= 0:
                    edits.append((match.start(), match.end(), str(changed), "constant"))
        for match in _CPP_NEGATION.finditer(code):
            edits.append((match.start(), match.end(), "", "arithmetic"))
        for begin, stop, text, operator in sorted(edits):
            start = offset + len(line[:begin].encode())
            end = offset + len(line[:stop].encode())
            column = begin + len(line[begin:stop]) - len(line[begin:stop].lstrip())
            mutants.append(Mutant(relative, number, column, operator, "", start, end,
                                  line[begin:stop], text))
        offset += len(line.encode())
    return mutants


# ----------------------------------------------------------------------------- running

def make_copy(workdir: Path) -> Path:
    """The checkout's tracked files and its built library, in workdir/src."""
    copy = workdir / "src"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    built = [p.relative_to(ROOT) for p in (ROOT / "rope_ext").glob("_C*")]
    for name in [f for f in files if f] + [str(p) for p in built]:
        source = ROOT / name
        if source.is_file():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return copy


def preload() -> None:
    """What every test run imports and no mutant changes, imported once here: each run is a
    fork of this process (a second or three of imports saved per mutant)."""
    import hypothesis  # noqa: F401
    import numpy  # noqa: F401
    import pytest  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401
    import torch._subclasses.fake_tensor  # noqa: F401

    assert "rope_ext" not in sys.modules


class _PerTest:
    """pytest plugin for the coverage run: each test's lines under a context of its own
    ("<node id>|setup", "|call", "|teardown"; lines run at import keep the empty context), the
    node ids in collection order, and the tests that start a subprocess (whose lines
    coverage does not see)."""

    def __init__(self, cov):
        self.cov, self.order, self.spawning, self.current = cov, [], set(), ""

    def pytest_collection_modifyitems(self, items):
        self.order = [item.nodeid for item in items]

    def _phase(self, item, phase):
        self.current = item.nodeid
        self.cov.switch_context(f"{item.nodeid}|{phase}")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        self._phase(item, "setup")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item):
        self._phase(item, "call")

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_teardown(self, item):
        self._phase(item, "teardown")

    def pytest_runtest_logfinish(self):
        self.cov.switch_context("(between tests)")


class TestRun:
    """pytest -x on a copy, in a fork of this process, started when made; poll says when it
    ends."""

    def __init__(self, copy: Path, tests: list[str], inductor: Path,
                 measure: str | None = None, threads: int | None = None):
        """Start the run. With measure (a file of the copy), the whole list instead, under
        coverage of that file, each test's lines recorded (see per_test_lines). With threads,
        torch's intra-op threads (one per job where jobs share the machine)."""
        shutil.rmtree(inductor, ignore_errors=True)  # no graph compiled against another mutant
        self.log = inductor.parent / "pytest.log"
        self.began = time.monotonic()
        self.pid = os.fork()
        if self.pid == 0:
            _child(copy, tests, inductor, self.log, measure, threads)

    def poll(self, timeout: float) -> tuple[str, str, float] | None:
        """None while it runs; then (outcome, detail, seconds), outcome passed, failed or
        timeout (the run, its subprocesses included, killed after timeout seconds)."""
        done, status = os.waitpid(self.pid, os.WNOHANG)
        seconds = time.monotonic() - self.began
        if not done:
            if seconds < timeout:
                return None
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet a group of its own
                os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            return "timeout", f"over {timeout:.0f} s", seconds
        output = self.log.read_text(errors="replace")
        if os.waitstatus_to_exitcode(status) == 0:
            return "passed", "", seconds
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
        crashed = re.findall(r"^Fatal Python error: .*", output, re.M)  # a native crash
        detail = (failed[0] if failed else crashed[0] if crashed
                  else (output.strip().splitlines() or ["?"])[-1])
        return "failed", detail, seconds


def _child(copy: Path, tests: list[str], inductor: Path, log: Path, measure: str | None,
           threads: int | None) -> None:
    """The forked test run: a process group of its own (its subprocesses included)."""
    code = 3
    try:
        os.setpgid(0, 0)  # a group, not a session: the caller's scheduling group and nice
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.chdir(copy)
        sys.path.insert(0, str(copy))
        sys.dont_write_bytecode = True  # a mutant's .pyc must never outlive it
        os.environ.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1",
                          PYTHONHASHSEED="0", TORCHINDUCTOR_CACHE_DIR=str(inductor))
        if threads:
            import torch

            torch.set_num_threads(threads)
        plugins, cov = [], None
        if measure:
            import coverage

            cov = coverage.Coverage(data_file=str(inductor.parent / "coverage"),
                                    include=[str(copy / measure)])
            cov.start()
            plugins.append(_PerTest(cov))
            _record_spawns(plugins[0])
            importlib.import_module(measure.removesuffix(".py").replace("/", "."))
        import pytest
        import rope_ext

        if not rope_ext.__file__.startswith(str(copy)):
            print(f"rope_ext imported from {rope_ext.__file__}, not the copy {copy}")
        else:
            code = int(pytest.main([*([] if measure else ["-x"]), "-q", "-p",
                                    "no:cacheprovider", *_test_args(tests)],
                                   plugins=plugins))
        if cov is not None:
            cov.stop()
            cov.save()
            (inductor.parent / "tests.json").write_text(json.dumps(
                dict(order=plugins[0].order, spawning=sorted(plugins[0].spawning))))
    except BaseException:  # noqa: BLE001 - said in the log, and the run fails
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_tests(copy: Path, tests: list[str], timeout: float, inductor: Path,
              measure: str | None = None) -> tuple[str, str, float]:
    """A TestRun, waited for."""
    run = TestRun(copy, tests, inductor, measure)
    while (result := run.poll(timeout)) is None:
        time.sleep(0.05)
    return result


def _test_args(tests: list[str]) -> list[str]:
    """Test files (test_x.py) or node ids (tests/test_x.py::...) as pytest arguments."""
    return [t if t.startswith("tests/") else f"tests/{t}" for t in tests]


def _record_spawns(plugin: _PerTest) -> None:
    """Note each test that starts a subprocess: coverage does not follow it there."""
    popen_init = subprocess.Popen.__init__

    def init(self, *args, **kwargs):
        plugin.spawning.add(plugin.current)
        popen_init(self, *args, **kwargs)

    subprocess.Popen.__init__ = init


@dataclasses.dataclass
class Coverage:
    """Which tests run each line of one file, from one run of its test list under coverage."""
    by_line: dict[int, set[str]]  # line -> contexts ("<node id>|<phase>", "" at import)
    order: list[str]  # every node id, in collection order
    spawning: set[str]  # tests that start a subprocess: always run

    def tests_for(self, lines: range, files: list[str]) -> list[str] | None:
        """The tests to run for a mutant on these lines, in collection order: the node ids
        that run them (every test of a file whose setup or teardown does, since a fixture
        may serve more than one test), and the tests that start subprocesses. Whole files
        where that is most of a file, or where the lines run at import. None where no test
        runs them."""
        contexts = set().union(*(self.by_line.get(line, set()) for line in lines))
        if not contexts:
            return None
        if contexts & {"", "(between tests)"}:  # at import: every test depends on it
            return files
        whole = {c.split("::")[0] for c in contexts if not c.endswith("|call")}
        ids = {c.rsplit("|", 1)[0] for c in contexts} | self.spawning
        chosen = []
        for name in files:
            path = f"tests/{name}"
            mine = [i for i in self.order if i.split("::")[0] == path]
            picked = [i for i in mine if i in ids]
            if path in whole or len(picked) > len(mine) // 2:
                chosen.append(name)
            else:
                chosen += picked
        return chosen


def per_test_lines(copy: Path, name: str, tests: list[str],
                   inductor: Path) -> tuple[Coverage, float]:
    """Run name's tests once under coverage: which tests run which line of name, and the
    run's seconds."""
    import coverage

    outcome, detail, seconds = run_tests(copy, tests, 3600, inductor, measure=name)
    if outcome != "passed":
        raise SystemExit(f"{name}: the tests fail under coverage ({detail})")
    data = coverage.CoverageData(basename=str(inductor.parent / "coverage"))
    data.read()
    by_line = {line: set(contexts) for line, contexts in
               data.contexts_by_lineno(str(copy / name)).items()}
    recorded = json.loads((inductor.parent / "tests.json").read_text())
    return Coverage(by_line, recorded["order"], set(recorded["spawning"]) - {""}), seconds


def statement_lines(source: bytes, m: "Mutant") -> range:
    """The lines a mutant's statement runs up to the mutant's end, in the unmutated source:
    from the innermost statement holding it (its header, for an if or a loop) to the mutated
    node's last line. Any of them run means the statement ran."""
    end_line = source[:m.end].count(b"\n") + 1
    end_column = m.end - (source.rfind(b"\n", 0, m.end) + 1)
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and (node.lineno, node.col_offset) <= (m.line, m.column) \
                and (node.end_lineno, node.end_col_offset) >= (end_line, end_column):
            if best is None or (node.lineno, node.col_offset) >= (best.lineno, best.col_offset):
                best = node
    return range(best.lineno if best else m.line, end_line + 1)


def build(copy: Path, log: Path) -> bool:
    """The CPU kernels of the copy, built in place (only what changed is recompiled)."""
    env = dict(os.environ, ROPE_EXT_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "1"))
    if "avx512f" not in Path("/proc/cpuinfo").read_text(errors="ignore"):
        env["ROPE_EXT_AVX512"] = "0"  # kernels this processor cannot run: half the build
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                              cwd=copy, env=env, stdout=out, stderr=subprocess.STDOUT).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("files", nargs="*", help="rope_ext/*.py files (default: every file "
                        "with a test list here, csrc/rope_math.h aside)")
    parser.add_argument("--rope-math", action="store_true",
                        help="mutate csrc/rope_math.h, rebuilding the CPU kernels per mutant")
    parser.add_argument("--tests", nargs="+", help="test files to run (default: the file's list)")
    parser.add_argument("--timeout", type=float,
                        help="seconds per mutant (default: 3x the unmutated run, at least 60)")
    parser.add_argument("--every", type=int, default=1, help="run every Nth mutant of a file")
    parser.add_argument("--offset", type=int, default=0, help="...starting with this one")
    parser.add_argument("--function", help="only mutants in functions matching this regex")
    parser.add_argument("--operator", nargs="+", help="only these operators")
    parser.add_argument("--survivors-of", type=Path, metavar="JSON",
                        help="only the mutants that survived in this --json record (after "
                        "adding tests, or with other --tests)")
    parser.add_argument("--untried-in", type=Path, nargs="+", metavar="JSON",
                        help="only the mutants that none of these --json records holds "
                        "(what earlier runs or samples left out)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutants run at once, each in a copy of its own with 1 / jobs of "
                        "the cores' threads (Python files only; default 1)")
    parser.add_argument("--all-tests", action="store_true",
                        help="run the whole test list for every mutant (default: only the "
                        "tests that run the mutated statement, from one run under coverage)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--json", type=Path, help="write every result here as it comes")
    parser.add_argument("--resume", action="store_true",
                        help="with --json: skip the mutants that file already holds")
    args = parser.parse_args()
    if args.jobs < 1 or (args.jobs > 1 and args.rope_math):
        raise SystemExit("--jobs: 1 or more, and 1 with --rope-math (each mutant is a build)")

    if args.rope_math:
        files = ["csrc/rope_math.h"]
    else:
        files = args.files or [f for f in TESTS if f.endswith(".py")]
    selected: dict[str, list[Mutant]] = {}
    for name in files:
        path = (ROOT / name).resolve()
        if not path.is_file():
            raise SystemExit(f"no such file: {name}")
        name = str(path.relative_to(ROOT))
        if not args.tests and name not in TESTS:
            raise SystemExit(f"no test list for {name}: name the tests with --tests")
        mutants = cpp_mutants(path) if path.suffix == ".h" else python_mutants(path)
        if args.function:
            mutants = [m for m in mutants if re.search(args.function, m.function)]
        if args.operator:
            mutants = [m for m in mutants if m.operator in args.operator]
        selected[name] = mutants[args.offset::args.every]
        if args.survivors_of:
            # Matched with every record of that run (killed ones too), so that equal mutants
            # keep their order; then the survivors.
            records = [r for r in json.loads(args.survivors_of.read_text()) if r["file"] == name]
            keys = match_records(records, mutants)
            survived = [k for r, k in zip(records, keys) if r["outcome"] == "survived"]
            chosen = {k for k in survived if k is not None}
            selected[name] = [m for m in mutants if m.key in chosen]
            if None in survived:
                print(f"{name}: {survived.count(None)} of {len(survived)} survivors in "
                      f"{args.survivors_of} are no longer there (their code changed)")
        if args.untried_in:
            tried = set()
            for record_file in args.untried_in:
                records = [r for r in json.loads(record_file.read_text()) if r["file"] == name]
                tried.update(match_records(records, mutants))
            selected[name] = [m for m in selected[name] if m.key not in tried]
        print(f"{name}: {len(mutants)} mutants, {len(selected[name])} selected")
    if args.list:
        for mutants in selected.values():
            for m in mutants:
                print(f"  {m.describe()}")
        return 0

    results = []
    if args.json and args.resume and args.json.exists():
        results = json.loads(args.json.read_text())
    done = {r["key"] for r in results}

    def record(m: Mutant, outcome: str, detail: str, seconds: float) -> None:
        results.append(dict(key=m.key, **dataclasses.asdict(m), outcome=outcome, detail=detail,
                            seconds=round(seconds, 1)))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    preload()
    began = time.monotonic()
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    with tempfile.TemporaryDirectory(prefix="rope-mutate-") as tmp:
        # One copy per job: a mutant is written into its job's copy while it runs.
        copies = [make_copy(Path(tmp) / f"job{j}") for j in range(args.jobs)]
        copy, inductor = copies[0], copies[0].parent / "inductor"
        for name, mutants in selected.items():
            tests = args.tests or TESTS[name]
            target = copy / name
            original = target.read_bytes()
            native = name.endswith(".h")
            # The copy is made after the mutants were listed: an edit in between would apply
            # them at the wrong offsets (a syntax error then reads as a kill).
            stale = [m for m in mutants if original[m.start:m.end].decode(errors="replace")
                     != m.before]
            if stale:
                raise SystemExit(f"{name} changed while its mutants were listed (first: "
                                 f"{stale[0].describe()}): run again")
            if all(m.key in done for m in mutants):  # --resume: nothing left of this file
                continue
            if native and not build(copy, copy.parent / "build.log"):
                raise SystemExit(f"the unmutated copy does not build: {copy.parent / 'build.log'}")
            covered = None
            if not native and not args.all_tests:
                # One run under coverage: it proves the unmutated tests pass, and its time
                # (slower than a plain run) bounds a mutant's.
                covered, seconds = per_test_lines(copy, name, tests, inductor)
                print(f"{name}: {len(covered.order)} tests, {len(covered.by_line)} lines run; "
                      f"each mutant runs the tests that run its statement")
            else:
                outcome, detail, seconds = run_tests(copy, tests, 3600, inductor)
                if outcome != "passed":
                    raise SystemExit(f"{name}: the tests fail without a mutant ({detail})")
            timeout = args.timeout or max(60.0, 3 * seconds)
            print(f"{name}: unmutated tests pass in {seconds:.0f} s ({', '.join(tests)}); "
                  f"{timeout:.0f} s per mutant at most"
                  + (f", {args.jobs} at once" if args.jobs > 1 else ""))
            queue = [(i, m) for i, m in enumerate(mutants, 1) if m.key not in done]
            running: dict[int, tuple[int, Mutant, TestRun]] = {}  # job -> what it runs

            def report(i: int, m: Mutant, outcome: str, detail: str, seconds: float) -> None:
                outcome = {"passed": "survived", "failed": "killed"}.get(outcome, outcome)
                record(m, outcome, detail, seconds)
                print(f"[{i}/{len(mutants)}] {outcome:9s} {seconds:5.1f} s  {m.describe()}"
                      + (f"  <- {detail}" if detail else ""), flush=True)

            while queue or running:
                for job in [j for j in range(args.jobs) if j not in running]:
                    if not queue:
                        break
                    i, m = queue.pop(0)
                    chosen = tests if covered is None else \
                        covered.tests_for(statement_lines(original, m), tests)
                    if chosen is None:
                        report(i, m, "passed", "no test runs it", 0.0)
                        continue
                    mine = copies[job] / name
                    mine.write_bytes(original[:m.start] + m.after.encode() + original[m.end:])
                    if native and not build(copy, copy.parent / "build.log"):
                        mine.write_bytes(original)
                        report(i, m, "not built", "does not compile", 0.0)
                        continue
                    running[job] = i, m, TestRun(copies[job], chosen,
                                                 copies[job].parent / "inductor",
                                                 threads=threads)
                for job, (i, m, run) in list(running.items()):
                    result = run.poll(timeout)
                    if result is not None:
                        (copies[job] / name).write_bytes(original)
                        del running[job]
                        report(i, m, *result)
                time.sleep(0.05)
            if native:
                build(copy, copy.parent / "build.log")  # back to the unmutated library

    print(f"\nmutation score ({(time.monotonic() - began) / 60:.1f} min):")
    for name in selected:
        mine = [r for r in results if r["file"] == name]
        killed = sum(r["outcome"] in ("killed", "timeout") for r in mine)
        tried = sum(r["outcome"] != "not built" for r in mine)
        print(f"  {name}: {killed} / {tried} killed"
              + (f" ({sum(r['outcome'] == 'timeout' for r in mine)} by timeout)"
                 if any(r["outcome"] == "timeout" for r in mine) else ""))
    survivors = [r for r in results if r["outcome"] == "survived"]
    if survivors:
        print("\nsurvivors:")
        for r in survivors:
            print(f"  {Mutant(**{k: r[k] for k in Mutant.__dataclass_fields__}).describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
