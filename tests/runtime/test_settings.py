"""One source of settings: phalanx.settings reads every PHALANX_* variable, nothing else does; the
table of docs/settings.md is the code's; every variable a launcher writes is one the settings know."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from phalanx import settings
from phalanx.settings.__main__ import markdown

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "phalanx"
KNOWN = {row[1] for row in settings.table()}  # every variable the settings read


def _literal(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _names_env(node) -> bool:
    """A PHALANX_* literal, or a name/attribute spelled like an env-name constant (``*_ENV``)."""
    text = _literal(node)
    if text is not None:
        return text.startswith("PHALANX_")
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name.endswith("_ENV") or name == "ENV"


def _reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for every read of an environment variable named like a phalanx setting."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("get", "getenv") and _names_env(node.args[0]):
                found.append((node.lineno, ast.unparse(node)[:80]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _names_env(node.slice):
            found.append((node.lineno, ast.unparse(node)[:80]))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and _names_env(node.left):
            found.append((node.lineno, ast.unparse(node)[:80]))
    return found


def _library_files():
    for path in sorted(PKG.rglob("*.py")):
        if "settings" not in path.relative_to(PKG).parts[:1]:
            yield path


def test_no_phalanx_variable_is_read_outside_the_settings():
    """The rule of issue 38: ``os.environ`` is read for a PHALANX_* name only in phalanx/settings/
    (the launcher writes them; reading goes through ``Area.read`` / ``Area.one`` / ``current``)."""
    offenders = []
    for path in _library_files():
        for line, what in _reads(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offenders, "read through phalanx.settings instead:\n" + "\n".join(offenders)


def test_the_scan_finds_the_reads_it_is_for():
    """The scan itself: each way of reading a variable is caught, a write is not."""
    code = ("import os\nos.environ.get('PHALANX_X')\nos.getenv('PHALANX_X')\nenv['PHALANX_X']\n"
            "'PHALANX_X' in os.environ\nos.environ.get(inprocess.STORE_ENV)\nenv['PHALANX_Y'] = '1'\n"
            "os.environ.get('HOME')\n")
    assert [line for line, _ in _reads(ast.parse(code))] == [2, 3, 4, 5, 6]


def test_every_variable_written_or_named_is_a_known_setting():
    """A variable the launcher writes (or a doc names) that the settings do not know is a typo or a
    setting nobody validates."""
    unknown = set()
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            text = _literal(node) or ""
            for name in re.findall(r"\bPHALANX_[A-Z0-9_]*[A-Z0-9]\b", text):
                if name not in KNOWN:
                    unknown.add(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, sorted(unknown)


def test_every_setting_has_its_line_and_docs_settings_md_is_the_table():
    for name, env, _flag, _default, who, doc in settings.table():
        assert env.startswith("PHALANX_") and doc and who in ("you", "the launcher"), name
    assert len(KNOWN) == len(settings.table()), "two settings share a variable"
    assert (ROOT / "docs" / "settings.md").read_text() == markdown(), \
        "docs/settings.md is stale: python -m phalanx.settings > docs/settings.md"


def test_areas_read_and_one_agree_and_bad_values_name_the_variable():
    env = {"PHALANX_WORKER_HOSTS": "a:2,b:2", "PHALANX_HOST_INDEX": "1", "PHALANX_ELASTIC_JOIN": "1",
           "HOROVOD_FUSION_THRESHOLD": str(8 * 2**20), "PHALANX_PREEMPT_SIGNAL": "USR1, USR2"}
    job = settings.load(env)
    assert (job.launcher.worker_hosts, job.launcher.host_index) == ("a:2,b:2", 1)
    assert job.elastic.join is True and job.preemption.signals == ("USR1", "USR2")
    assert job.data_parallel.bucket_mb == 8.0  # Horovod's bytes, when PHALANX_BUCKET_MB is unset
    assert settings.load({**env, "PHALANX_BUCKET_MB": "2"}).data_parallel.bucket_mb == 2.0
    assert settings.LauncherSettings.one("host_index", env) == 1
    assert settings.var("elastic.store") == "PHALANX_ELASTIC_STORE"
    with pytest.raises(settings.SettingsError, match=r"PHALANX_HOST_INDEX='x' is not a whole number"):
        settings.LauncherSettings.read({"PHALANX_HOST_INDEX": "x"})
    with pytest.raises(settings.SettingsError, match=r"PHALANX_REQUEUE='maybe' is not accepted; accepted: auto"):
        settings.load({"PHALANX_REQUEUE": "maybe"})
    with pytest.raises(KeyError, match="no setting 'elastic.nope'"):
        settings.var("elastic.nope")
