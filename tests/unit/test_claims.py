"""Every claim cites a test CI runs (issues 36, 55): a test named anywhere in README.md or docs/ --
``tests/x.py::name``, or ``tests/x.py`` followed by backticked names (`` (`name`: ...; `other`: ...) ``) up to the
next citation -- exists, every name of a citation, and is not a ``long`` test unless "long" is said beside that
name (CI runs ``-m 'not long'``): a waiver per citation, not a word anywhere in the row. A test with some of its
parameters long runs in CI with the others. Static: the tests are read, not run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
CITE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")
NEAR = 120  # characters after a cited name (80 before) where its "long" waiver must be said


def _tests(path: Path) -> dict[str, bool]:
    """Each test function of ``path``: whether it is long (a ``@pytest.mark.long`` decorator, or the whole module;
    a parametrization with some long parameters runs the others in CI)."""
    src = path.read_text()
    tree = ast.parse(src)
    module_long = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "long" in ast.unparse(n.value) for n in tree.body)
    return {n.name: module_long or any(ast.unparse(d) == "pytest.mark.long" for d in n.decorator_list)
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_every_cited_test_exists_and_runs_in_ci_or_says_long_beside_it():
    assert len(DOCS) > 10 and "docs/detection.md" in DOCS and "docs/liveness.md" in DOCS
    wrong = []
    for doc in DOCS:
        for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
            found = list(CITE.finditer(line))
            for k, m in enumerate(found):
                f, name = m.group(1), m.group(2)
                if not (ROOT / f).is_file():
                    wrong.append(f"{doc}:{i}: {f} does not exist")
                    continue
                tests = _tests(ROOT / f)
                segment = line[m.end():found[k + 1].start() if k + 1 < len(found) else len(line)]
                names = [name] if name else re.findall(r"`(test_\w+)", segment)
                for n in names:
                    if n not in tests:
                        wrong.append(f"{doc}:{i}: {f} has no {n}")
                        continue
                    at = 0 if name else segment.find(n)
                    near = (line[max(0, m.start() - 80):m.end() + NEAR] if name else
                            segment[max(0, at - 80):at + len(n) + NEAR])
                    if tests[n] and "long" not in near:
                        wrong.append(f"{doc}:{i}: {f}::{n} is a long test (CI does not run it): say so beside it")
    assert not wrong, "\n".join(wrong)
