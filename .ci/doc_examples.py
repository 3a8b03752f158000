#!/usr/bin/env python
"""Runs every Python code block of README.md and docs/ as written, each in a fresh process
from an empty directory (so the installed rope_ext is what it imports). A block whose first
line is `# docs: needs-gpu` or `# docs: multi-process` is listed, not run. Exit 1 on the
first failure, with the block's file, line and output."""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP = ("# docs: needs-gpu", "# docs: multi-process")

ran, skipped = 0, []
for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
    text = path.read_text()
    for block in BLOCK.finditer(text):
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, block.start()) + 1}"
        code = block[1]
        if code.startswith(SKIP):
            skipped.append(f"{where} ({code.splitlines()[0][len('# docs: '):]})")
            continue
        with tempfile.TemporaryDirectory() as cwd:
            run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code],
                                 cwd=cwd, capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            sys.exit(f"{where}: the block failed\n{code}\n{run.stdout}{run.stderr}")
        ran += 1
print(f"{ran} blocks ran; not run: {', '.join(skipped) or 'none'}")
