"""Every claim cites a test CI runs (issues 36, 55): a test named anywhere in README.md or docs/ --
``tests/x.py::name``, or ``tests/x.py`` followed by backticked names (`` (`name`: ...; `other`: ...) ``) up to the
next citation, the paragraph's or the table row's end (across wrapped lines), or a backticked ``test_...`` name with
no file before it -- exists, every name of a citation, and is not a ``long`` test unless "long" (the word) is said
beside that name (CI runs ``-m 'not long'``): a waiver per citation, not a word anywhere in the row. Long is what
CI leaves out: a ``@pytest.mark.long`` test, a long module, or one that tests/dist/conftest.py's ``LONG`` marks on
every release it runs on; a test with some of its parameters long runs in CI with the others. A file cited
without a name must hold a test CI runs. Static: the tests are read, not run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
CITE = re.compile(r"(tests/[\w/]+\.py)(?:::(\w+))?")
NAME = re.compile(r"`(test_\w+)")
END = re.compile(r"\n\s*\n|\n\||\n- |\n\d+\. ")  # (a paragraph's, a table row's, a list item's end)
LONG_WORD = re.compile(r"\blong\b")
NEAR = 120  # characters after a cited name (80 before) where its "long" waiver must be said
def _releases() -> set[str]:
    """The Megatron-LM checkouts a release-parametrized test runs on (tests/dist/test_megatron_lm_dist.py's RELEASES)."""
    tree = ast.parse((ROOT / "tests" / "dist" / "test_megatron_lm_dist.py").read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "RELEASES"
                                                                        for t in n.targets)]
    return {k.value for k in node.value.keys}


RELEASES = _releases()


def _conftest_long() -> dict[tuple[str, str], set[str]]:
    """tests/dist/conftest.py's LONG: (file, test) -> the parameter ids it marks long."""
    tree = ast.parse((ROOT / "tests" / "dist" / "conftest.py").read_text())
    marked: dict[tuple[str, str], set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LONG" for t in node.targets):
            for key in ast.literal_eval(node.value):
                path, test = key.split("::")
                name, _, ids = test.partition("[")
                marked.setdefault((path, name), set()).add(ids.rstrip("]"))
    return marked


DYNAMIC = _conftest_long()


def _tests(path: Path) -> dict[str, bool]:
    """Each test function of ``path``: whether it is long (a ``@pytest.mark.long`` decorator, the whole module, or
    conftest's LONG on every release; a parametrization with some long parameters runs the others in CI)."""
    src = path.read_text()
    tree = ast.parse(src)
    module_long = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "long" in ast.unparse(n.value) for n in tree.body)
    return {n.name: module_long or any(ast.unparse(d) == "pytest.mark.long" for d in n.decorator_list)
            or RELEASES <= DYNAMIC.get((path.name, n.name), set())
            for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


ALL = {p.relative_to(ROOT).as_posix(): _tests(p) for p in (ROOT / "tests").rglob("test_*.py")}


def _full(name: str, after: str, tests: dict) -> str:
    """A name cut short in the text (`` `test_tp_skips_then_rolls_back...` ``): the one test of ``tests`` it begins."""
    if not after.lstrip("_").startswith("..."):
        return name
    whole = [t for t in tests if t.startswith(name)]
    return whole[0] if len(whole) == 1 else name


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def _problems(doc: str, text: str) -> list[str]:
    wrong, handled = [], set()  # (handled: the positions of the names a citation's segment checked)
    found = list(CITE.finditer(text))
    for k, m in enumerate(found):
        f, name = m.group(1), m.group(2)
        where = f"{doc}:{_line(text, m.start())}"
        if not (ROOT / f).is_file():
            wrong.append(f"{where}: {f} does not exist")
            continue
        tests = ALL.get(f) or _tests(ROOT / f)
        stop = found[k + 1].start() if k + 1 < len(found) else len(text)
        end = END.search(text, m.end(), stop)
        segment_end = end.start() if end else stop
        if name:
            handled.add(m.start())  # (not a backticked name: the global pass would not see it anyway)
            cited = [(name, m.start(), m.end())]
        else:
            cited = [(x.group(1), x.start(), x.end()) for x in NAME.finditer(text, m.end(), segment_end)]
        if not cited and tests and all(tests.values()) and not LONG_WORD.search(text[m.start():m.end() + NEAR]):
            wrong.append(f"{where}: every test of {f} is long (CI runs none of it): say so beside it")
        for n, a, b in cited:
            n = _full(n, text[b:b + 4], tests)
            if n not in tests:
                start, end = text.rfind("\n\n", 0, a), text.find("\n\n", b)
                beside = {c.group(1) for c in CITE.finditer(text, max(0, start), end if end >= 0 else len(text))}
                if not any(n in ALL.get(other, {}) for other in beside - {f}):
                    wrong.append(f"{where}: {f} has no {n}")
                    handled.add(a)
                continue  # (the test of another file cited in the same paragraph: the pass below checks it)
            handled.add(a)
            near = text[max(0, m.start() - 80):m.end() + NEAR] if name else text[max(0, a - 80):b + NEAR]
            if tests[n] and not LONG_WORD.search(near):
                wrong.append(f"{where}: {f}::{n} is a long test (CI does not run it): say so beside it")
    for m in NAME.finditer(text):  # (a name with no file before it: any test file's, long only if said)
        if m.start() in handled:
            continue
        where = f"{doc}:{_line(text, m.start())}"
        homes = {}
        for f, tests in ALL.items():
            n = _full(m.group(1), text[m.end():m.end() + 4], tests)
            if n in tests:
                homes[f] = tests[n]
        if not homes:
            wrong.append(f"{where}: no test file has {m.group(1)}")
        elif all(homes.values()) and not LONG_WORD.search(text[max(0, m.start() - 80):m.end() + NEAR]):
            wrong.append(f"{where}: {m.group(1)} ({', '.join(homes)}) is a long test (CI does not run it): say so "
                         "beside it")
    return wrong


def test_every_cited_test_exists_and_runs_in_ci_or_says_long_beside_it():
    assert len(DOCS) > 10 and "docs/detection.md" in DOCS and "docs/liveness.md" in DOCS
    wrong = [w for doc in DOCS for w in _problems(doc, (ROOT / doc).read_text())]
    assert not wrong, "\n".join(wrong)


def test_the_checker_reads_names_across_lines_names_without_a_file_and_the_word_long():
    """The rules above bite: a name wrapped onto the next line, a name cited alone, "along" is no waiver, a file
    whose every test is long, conftest's LONG on every release."""
    unit = "tests/unit/test_claims.py"
    assert _problems("x", f"see {unit},\n`test_no_such_one` for it") == [f"x:1: {unit} has no test_no_such_one"]
    assert _problems("x", "a name alone: `test_no_such_one_either`") == ["x:1: no test file has test_no_such_one_either"]
    assert _problems("x", f"{unit} (`test_a_figure_in_the_text_is_the_kept_runs`)") == \
        [f"x:1: {unit} has no test_a_figure_in_the_text_is_the_kept_runs"]  # (test_figures.py's: cited under another)
    long_one = next((f, n) for f, tests in ALL.items() for n, is_long in tests.items() if is_long)
    assert _problems("x", f"{long_one[0]}::{long_one[1]} along the way") and \
        not _problems("x", f"{long_one[0]}::{long_one[1]} (`long`)")
    assert ALL["tests/dist/test_megatron_lm_dist.py"]["test_sigkill_and_restart_resume_once_from_the_newest_snapshot"]
    assert not _problems("x", f"{unit} (`test_every_cited_test_exists_and_runs_in_ci_or_says_long_beside_it`)\n\n"
                              "`test_the_checker_reads_names_across_lines_names_without_a_file_and_the_word_long`")
