"""The package layout is the request's path (CONTRIBUTING.md, "Where things go"): every import runs downward.

Layers, top to bottom: the entry points (``python -m inference_api`` and the package's lazy exports), the offline
API (``offline/``, which takes the OpenAI dialect's fields), the HTTP edge (``web/``: app, serving, streaming, the
dialects), the request model (``request/``), the engine (``engine/``: its client, plan, pre-flight, scheduler,
runner, sampler), the model (``model/``: the family table, GGUF reading, tokenizer, the compact model; ``mock/``
beside it), the kernels (``kernels/``), and the two leaves everything may use (``config``, ``request_errors``). A
module imports its own package and the layers below it, never a layer above or a sibling in its own layer. The
proxy and the server share only ``lifecycle/``, which imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = (
    ("inference_api", "inference_api.__main__"),
    ("inference_api.offline",),
    ("inference_api.web",),
    ("inference_api.request",),
    ("inference_api.engine",),
    ("inference_api.model", "inference_api.mock"),
    ("inference_api.kernels",),
    ("inference_api.config", "inference_api.request_errors"),
)


def unit_of(module: str) -> tuple[int, str] | None:
    """The layer and the unit (package or leaf module) a module belongs to: the longest unit that holds it."""
    best = None
    for rank, units in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (rank, unit)
    return best


def imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Every module a file imports, at any depth in it (a function's lazy import counts), resolved to its name."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            if node.module is None or node.level:  # "from . import x": x may be a module
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def graph(top: str) -> dict[str, set[str]]:
    """{module: the first-party modules it imports} for every module of a top-level package."""
    edges = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        edges[module] = {
            name
            for name in imports(path, module, is_package)
            if name.split(".")[0] in ("inference_api", "proxy", "lifecycle")
        }
    return edges


def upward(edges: dict[str, set[str]]) -> list[str]:
    """The imports that break the layering, as 'importer -> imported'."""
    wrong = []
    for module, targets in edges.items():
        here = unit_of(module)
        for target in targets:
            if target.split(".")[0] != "inference_api":
                continue
            there = unit_of(target)
            if here is None or there is None:
                wrong.append(f"{module} -> {target} (outside the layer table)")
            elif there[1] != here[1] and there[0] <= here[0]:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


def test_every_server_import_runs_downward():
    edges = graph("inference_api")
    assert len(edges) > 80  # the walk found the package
    assert upward(edges) == []


def test_the_proxy_and_lifecycle_share_nothing_with_the_server_but_lifecycle():
    for top, allowed in (("proxy", {"proxy", "lifecycle"}), ("lifecycle", {"lifecycle"})):
        outside = {f"{m} -> {t}" for m, ts in graph(top).items() for t in ts if t.split(".")[0] not in allowed}
        assert not outside, top
    server = {t.split(".")[0] for ts in graph("inference_api").values() for t in ts}
    assert "proxy" not in server


def test_the_check_sees_an_upward_import_and_a_sibling():
    assert upward({"inference_api.engine.plan": {"inference_api.web.serving"}}) == [
        "inference_api.engine.plan -> inference_api.web.serving"
    ]
    assert upward({"inference_api.mock.runner": {"inference_api.model.families"}})  # siblings in one layer
    assert upward({"inference_api.web.app": {"inference_api.engine.client", "inference_api.web.errors"}}) == []
