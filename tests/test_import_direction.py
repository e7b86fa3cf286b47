"""The arrows point one way: ``paged_kernels`` <- ``lab`` <- ``simulator`` <- ``pages``/``app.py``, and no module imports
one that (directly or through others) imports it back. Every import statement counts, at module level or inside a
function: a deferred import is still an arrow."""
import ast
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"paged_kernels": 0, "lab": 1, "simulator": 2, "app_pages": 3, "app": 3}


def _modules() -> dict[str, Path]:
    modules = {"app": ROOT / "app.py"}
    for package in ("paged_kernels", "lab", "simulator", "app_pages"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _known(name: str) -> str | None:
    """The module of ours that ``name`` (a module or an attribute of one) lives in."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.Import):
        return {m for alias in node.names if (m := _known(alias.name))}
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    base = node.module or ""
    if node.level:
        parts = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    # ``from package import name``: the submodule when ``name`` is one, else the package (or module) itself
    return {m for alias in node.names
            if (m := (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else _known(base)))}


def import_graph() -> nx.DiGraph:
    graph = nx.DiGraph()
    graph.add_nodes_from(MODULES)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph.add_edges_from((module, target) for target in _imported(module, node) - {module})
    return graph


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert graph.has_edge("simulator.cli", "simulator.cli_twin")  # inside a function
    assert graph.has_edge("paged_kernels.cupy_backend", "paged_kernels.validate")  # from . import module
    assert graph.has_edge("lab.engine", "lab.scheduler")  # from .module import name
    assert graph.has_edge("app_pages.sweeps", "simulator")  # import package


def test_arrows_point_down_the_layers():
    upward = [f"{a} -> {b}" for a, b in import_graph().edges if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert not upward, upward


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(import_graph()) if len(c) > 1]
    assert not cycles, cycles


@pytest.mark.parametrize("module", ["lab.model_runner"])
def test_the_model_runner_does_not_know_the_block_manager(module):
    assert "lab.block_manager" not in nx.descendants(import_graph(), module)


def test_the_engine_step_reads_like_nano_vllm_s():
    """schedule -> copies -> runner -> sampler -> postprocess (stop checks in the scheduler's) -> end of step."""
    import inspect

    from lab.engine import LLMEngine

    body = [line for line in inspect.getsource(LLMEngine._step).splitlines()[1:] if line.strip()]
    assert len(body) <= 12, body
    assert "self.scheduler.postprocess(" in inspect.getsource(LLMEngine._postprocess)


def test_the_simulator_s_commands_and_pages_do_not_load_torch():
    """A simulation needs no model: the simulator's commands and the Memory simulator, Sweeps and Paper pages' imports
    start in well under a second without torch (the error boundary once pulled it in through ``paged_kernels``)."""
    import subprocess
    import sys

    code = ("import sys, simulator, simulator.cli, simulator.cli_sweep, simulator.sweep, simulator.plan, "
            "simulator.paper, simulator.charts, simulator.report, lab.errors, lab.cli_args; "
            "print(sorted(m for m in ('torch', 'paged_kernels', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"
