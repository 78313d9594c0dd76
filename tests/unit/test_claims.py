"""Every claim cites a test CI runs (issue 36): a test named in docs/capabilities.md, README.md or docs/megatron.md
-- ``tests/x.py::name`` or ``tests/x.py (`name` ...)`` -- exists, and is not a ``long`` test unless its row says
"long" (CI runs ``-m 'not long'``). Static: the tests are read, not run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/capabilities.md", "README.md", "docs/megatron.md", "docs/checkpoints.md")
CITE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")


def _tests(path: Path) -> dict[str, bool]:
    """Each test function of ``path``: whether it is marked long (by a decorator, or the whole module)."""
    src = path.read_text()
    tree = ast.parse(src)
    module_long = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "long" in ast.unparse(n.value) for n in tree.body)
    return {n.name: module_long or any("mark.long" in ast.unparse(d) for d in n.decorator_list)
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_every_cited_test_exists_and_runs_in_ci_or_its_row_says_long():
    wrong = []
    for doc in DOCS:
        for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            for m in CITE.finditer(line):
                f, name = m.group(1), m.group(2)
                if not (ROOT / f).is_file():
                    wrong.append(f"{doc}:{i}: {f} does not exist")
                    continue
                tests = _tests(ROOT / f)
                names = [name] if name else re.findall(r"^\s*\(`(test_\w+)`", line[m.end():])
                for n in names:
                    if n not in tests:
                        wrong.append(f"{doc}:{i}: {f} has no {n}")
                    elif tests[n] and "long" not in line:
                        wrong.append(f"{doc}:{i}: {f}::{n} is a long test (CI does not run it): say so in the row")
    assert not wrong, "\n".join(wrong)
