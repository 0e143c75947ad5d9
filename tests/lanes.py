"""The suite's two lanes (scripts/test.sh: pytest-xdist, ``-n 2 --dist loadgroup``), hooks tests/conftest.py takes in.

Every module that reads one of the session's shared model fixtures (its servers, transformers' greedy answers,
the model's conversion or its tokenizer) runs in one worker, so each shared server starts once and the model's
heavy work stays in one lane; every other module is a unit of its own (its module-scoped servers start once), run
by whichever worker is free. The lanes are found from the fixtures each test reads, so a new module lands in the
right one by itself. On 2 cores this took the tests from 657 s in one worker to 528 s (2026-11-26). With the
conversion's readers (in-process model tests) in the other lane instead, the two lanes' torch computations ran
at once and both crawled (a tools test took 90 s instead of a few): keep the model's work in one lane.

xdist's own loadgroup names a test's group by rewriting its node id, which pytest 9 no longer lets a plugin do;
here each worker writes the module -> group table it collected into a file the controller named, and the
controller's scheduler groups by that table (its work units are the groups, the largest first).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

# the session's shared model fixtures (tests/conftest.py): the modules that read any of them share one lane
MODEL_FIXTURES = frozenset(
    {"real_server", "quantized_server", "default_server", "reference", "model_dir", "hf_tokenizer"}
)
MODEL_LANE = "embedded-model"
TABLE = pytest.StashKey[Path]()


def module_groups(items) -> dict[str, str]:
    """A module's node id -> its group: MODEL_LANE where any of its tests reads a model fixture, else itself (a
    module goes whole: its module fixtures serve all its tests)."""
    modules = defaultdict(list)
    for item in items:
        modules[item.nodeid.split("::")[0]].append(item)
    return {
        module: MODEL_LANE if any(MODEL_FIXTURES.intersection(t.fixturenames) for t in tests) else module
        for module, tests in modules.items()
    }


def pytest_collection_modifyitems(config, items):
    """On a worker: the table of what it collected, written whole (each worker writes the same)."""
    target = getattr(config, "workerinput", {}).get("lanes")
    if target:
        part = f"{target}.{config.workerinput['workerid']}"
        Path(part).write_text(json.dumps(module_groups(items)))
        os.replace(part, target)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """On the controller: where each worker writes its table."""
    node.workerinput["lanes"] = str(_table(node.config))


def _table(config) -> Path:
    if TABLE not in config.stash:
        config.stash[TABLE] = Path(tempfile.mkdtemp(prefix="pytest-lanes-")) / "groups.json"
    return config.stash[TABLE]


def pytest_unconfigure(config):
    if TABLE in config.stash:
        shutil.rmtree(config.stash[TABLE].parent, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup: xdist's load-scope scheduling over the table's groups."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    table = _table(config)

    class Lanes(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # read once every worker has collected (and written it)
                self.groups = json.loads(table.read_text())
            module = nodeid.split("::")[0]
            return self.groups.get(module, module)

    return Lanes(config, log)
