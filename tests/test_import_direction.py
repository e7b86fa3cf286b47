"""The layout cannot decay silently. The arrows point one way, ``paged_kernels`` <- ``lab`` <- ``simulator`` <-
``app_pages``/``app.py``; inside the packages, each room (a package answering one question) imports only the rooms the
table of docs/architecture.md allows; no module imports one that (directly or through others) imports it back. Every
import statement counts, at module level or inside a function: a deferred import is still an arrow
(``scripts/rooms.py`` reads them)."""
import importlib.util
import inspect
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("rooms", ROOT / "scripts" / "rooms.py")
rooms = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rooms)
LAYERS = {"paged_kernels": 0, "lab": 1, "simulator": 2, "app_pages": 3, "app": 3}
GRAPH = rooms.import_graph()


def test_the_graph_sees_every_kind_of_import():
    assert GRAPH.has_edge("simulator.cli.main", "simulator.cli.twin")  # inside a function
    assert GRAPH.has_edge("paged_kernels.cupy_backend", "paged_kernels.validate")  # from . import module
    assert GRAPH.has_edge("lab.engine.llm_engine", "lab.sched.scheduler")  # from package.module import name
    assert GRAPH.has_edge("app_pages.sweeps", "simulator")  # import package


def test_arrows_point_down_the_layers():
    upward = [f"{a} -> {b}" for a, b in GRAPH.edges if LAYERS[b.split(".")[0]] > LAYERS[a.split(".")[0]]]
    assert not upward, upward


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(GRAPH) if len(c) > 1]
    assert not cycles, cycles


def test_every_room_is_in_the_table_of_allowed_arrows():
    assert sorted(rooms.allowed_arrows()) == rooms.rooms()


def test_rooms_import_only_what_the_table_allows():
    allowed = rooms.allowed_arrows()
    forbidden = [via for a, b, data in rooms.room_graph(GRAPH).edges(data=True) if b not in allowed[a]
                 for via in data["via"]]
    assert not forbidden, forbidden


def test_the_table_has_no_cycle_between_rooms():
    table = nx.DiGraph((a, b) for a, targets in rooms.allowed_arrows().items() for b in targets if b != a)
    assert nx.is_directed_acyclic_graph(table), list(nx.simple_cycles(table))[:5]


def test_the_room_check_fails_on_an_arrow_the_table_does_not_allow():
    """The check can fail: an import from the block pool up into the engine is caught, and named."""
    graph = GRAPH.copy()
    graph.add_edge("lab.kv_cache.block_manager", "lab.engine.llm_engine")
    allowed = rooms.allowed_arrows()
    caught = [via for a, b, data in rooms.room_graph(graph).edges(data=True) if b not in allowed[a]
              for via in data["via"]]
    assert caught == ["lab.kv_cache.block_manager -> lab.engine.llm_engine"]


def test_the_picture_in_the_docs_is_the_one_the_imports_draw():
    assert rooms.drawn() == rooms.mermaid(GRAPH), "run: python scripts/rooms.py --write"


@pytest.mark.parametrize("package", ["paged_kernels", "lab", "simulator", "app_pages"])
def test_no_folder_holds_more_than_twelve_modules(package):
    crowded = {str(folder.relative_to(ROOT)): n for folder in [ROOT / package, *(ROOT / package).rglob("*")]
               if folder.is_dir() and folder.name != "__pycache__"
               and (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > 12}
    assert not crowded, crowded


@pytest.mark.parametrize("room", [r for r in rooms.rooms() if r.count(".") == 1])
def test_each_room_says_what_it_holds_and_may_import(room):
    doc = (ROOT / room.replace(".", "/") / "__init__.py").read_text()
    assert doc.startswith('"""') and "May import" in doc.split('"""')[1], room


def test_the_worker_does_not_know_the_block_pool():
    """The model runner reads the pool only through the ids and slots a plan names."""
    reached = {rooms.room_of(m) for m in nx.descendants(GRAPH, "lab.worker.model_runner")}
    assert not reached & {"lab.kv_cache", "lab.sched", "lab.engine"}, reached


def test_the_engine_step_reads_like_nano_vllm_s():
    """schedule -> run -> postprocess, as nano-vllm's ``LLMEngine.step``: a few statements (recovery and the step
    callback live in helpers of their own)."""
    import ast
    import textwrap

    from lab.engine import LLMEngine

    def statements(function) -> list:
        body = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0].body
        return [node for node in body if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))]

    assert len(statements(LLMEngine.step)) <= 4
    assert len(statements(LLMEngine._step)) <= 7
    assert "self.scheduler.postprocess(" in inspect.getsource(LLMEngine._postprocess)


def test_the_simulator_s_commands_and_pages_do_not_load_torch():
    """A simulation needs no model: the simulator's commands and the Memory simulator, Sweeps and Paper pages' imports
    start in well under a second without torch (the error boundary once pulled it in through ``paged_kernels``)."""
    code = ("import sys, simulator, simulator.cli.main, simulator.cli.sweep, simulator.experiments.sweep, "
            "simulator.experiments.plan, simulator.experiments.paper, simulator.views.charts, simulator.views.report, "
            "lab.errors, lab.cli.args; "
            "print(sorted(m for m in ('torch', 'paged_kernels', 'transformers') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


def test_one_error_root():
    """Every exception class of ``lab`` and ``simulator`` derives from ``lab.errors.LabError`` (``paged_kernels``,
    which imports nothing of ours, has its own ``KernelArgumentError``)."""
    from lab.errors import LabError

    outside = []
    for module in GRAPH:
        if module.split(".")[0] in ("lab", "simulator") and not module.endswith(("__main__", ".driver")):
            for name, obj in vars(importlib.import_module(module)).items():
                if (isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == module
                        and not issubclass(obj, LabError)):
                    outside.append(f"{module}.{name}")
    assert not outside, outside
