"""Every runnable ```python example in the ops docs (a block with an import; signature blocks are
not programs) runs as written, so a doc example that rots fails here."""

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
FILES = [DOCS / "ops.md", *sorted((DOCS / "ops").glob("*.md"))]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_python_examples_run(path):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S) if "import " in b]
    assert blocks, f"{path.name} has no runnable python example"
    for code in blocks:
        exec(compile(code, str(path), "exec"), {})
