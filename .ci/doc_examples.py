#!/usr/bin/env python
"""Runs every Python code block of README.md and docs/ as written, each as a script of its own
(`__main__`, RuntimeWarnings as errors) in a fresh process from an empty directory, so the
installed rope_ext is what it imports. Each process is a fork of this one after it has
imported torch and nothing else (about 2 s saved per block; rope_ext and everything a block
sets are new in each). A block whose first line is `# docs: needs-gpu` or
`# docs: multi-process` is listed, not run. Exit 1 on the first failure, with the block's
file, line and output."""

import os
import re
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import torch  # noqa: F401 - imported once, before the forks

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = ("# docs: needs-gpu", "# docs: multi-process")
assert not any(name == "rope_ext" or name.startswith("rope_ext.") for name in sys.modules)


def run(code: str, where: str) -> tuple[int, str]:
    """The block in a fork of this process: its exit status and its output."""
    with tempfile.TemporaryDirectory() as cwd, tempfile.TemporaryFile("w+") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                os.chdir(cwd)
                signal.alarm(600)  # a block that hangs fails CI, not holds it
                sys.path[0] = ""  # as `python -c` has it
                sys.argv = ["-c"]
                import warnings

                warnings.simplefilter("error", RuntimeWarning)
                exec(compile(code, where, "exec"), {"__name__": "__main__"})
                status = 0
            except SystemExit as e:  # as a script ends: an int is the status, text is said
                if isinstance(e.code, int) or e.code is None:
                    status = e.code or 0
                else:
                    print(e.code, file=sys.stderr)  # and the status stays 1
            except BaseException:  # noqa: BLE001 - printed, and the block fails
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, status = os.waitpid(pid, 0)
        log.seek(0)
        return os.waitstatus_to_exitcode(status), log.read()


ran, skipped = 0, []
for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
    text = path.read_text()
    for block in BLOCK.finditer(text):
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, block.start()) + 1}"
        code = block[1]
        if code.startswith(SKIP):
            skipped.append(f"{where} ({code.splitlines()[0][len('# docs: '):]})")
            continue
        status, output = run(code, where)
        if status != 0:
            sys.exit(f"{where}: the block failed (exit status {status})\n{code}\n{output}")
        ran += 1
print(f"{ran} blocks ran; not run: {', '.join(skipped) or 'none'}")
