"""The tree reads as the pipeline (DESIGN.md): data flows one way between the folders, no module reaches
into another's private names, the files stay small, and there is one cost model."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "shardwise"


def modules():
    """(dotted module name, path, parsed tree) of every module of the package."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        yield name, path, ast.parse(path.read_text())


def imports(name: str, path: pathlib.Path, tree) -> list[tuple[str, list[str]]]:
    """(absolute module imported, names imported from it) for every import of a module, lazy ones too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            names = [a.name for a in node.names]
            if not node.module and node.level:  # ``from . import x``: each x is a module
                out += [(f"{mod}.{n}", []) for n in names]
            else:
                out.append((mod, names))
    return out


def edges():
    return [(name, mod, names) for name, path, tree in modules() for mod, names in imports(name, path, tree)]


def _under(mod: str, folder: str) -> bool:
    return mod == f"shardwise.{folder}" or mod.startswith(f"shardwise.{folder}.")


@pytest.mark.parametrize("folder, forbidden", [("runtime", ("passes", "compiler", "job", "budget", "report")),
                                               ("costmodel", ("passes", "runtime", "compiler", "job", "planner")),
                                               ("sharding", ("passes", "runtime", "costmodel", "job")),
                                               ("capture", ("passes", "runtime", "costmodel", "job"))])
def test_data_flows_one_way_between_the_folders(folder, forbidden):
    bad = [(src, mod) for src, mod, _ in edges() if _under(src, folder) and any(_under(mod, f) for f in forbidden)]
    assert not bad, f"{folder}/ imports what lies downstream of it: {bad}"


def test_models_import_nothing_of_shardwise():
    bad = [(src, mod) for src, mod, _ in edges()
           if _under(src, "models") and mod.startswith("shardwise") and not _under(mod, "models")]
    assert not bad


def test_no_module_imports_another_modules_private_name():
    # a private module (models/_common.py) serves its own package alone; private names serve their module
    bad = []
    for src, mod, names in edges():
        if not mod.startswith("shardwise"):
            continue
        parts = mod.split(".")
        for i, part in enumerate(parts[1:], 1):
            if part.startswith("_") and not src.startswith(".".join(parts[:i]) + "."):
                bad.append((src, mod))
        bad += [(src, f"{mod}.{n}") for n in names if n.startswith("_")]
    assert not bad, bad


def test_the_planner_calls_the_cost_model():
    planner = {mod for src, mod, _ in edges() if _under(src, "planner")}
    assert any(_under(m, "costmodel") for m in planner)


def test_one_cost_model_one_bus_factor_one_device_table_one_flops_per_token():
    # the formulas and tables live in costmodel/ alone: a ring's bus factor, the datasheet peaks,
    # the training FLOPs per token, the collective's α-β time
    checks = {r"\(\w+ - 1\) / \w+|\(\w+ - 1\) \* \w+ // \w+": "collectives.py",
              r"989e12|312e12|790e12": "devices.py",
              r"6\.0 \* \w+ \+ 12\.0 \* ": "compute.py",
              r"def bus_factor|\* \w+ / lvl\.bw\(": "collectives.py"}
    for pattern, home in checks.items():
        found = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if re.search(pattern, p.read_text())]
        assert found == [f"costmodel/{home}"], (pattern, found)


def test_the_planner_and_the_compiler_time_a_collective_alike():
    # the same all-reduce of 64 MiB over our two H200s: the planner's cluster preset and the cost model
    # a job on that machine uses (its default NCCL link profile) give the same seconds
    import torch

    from shardwise.costmodel import CostModel
    from shardwise.passes import emit
    from shardwise.planner.clusters import cluster
    from shardwise.sharding.collective import mark

    nbytes = 64 * 2**20
    planner = cluster("h200-nv18-x2:1").collective_s("all_reduce", nbytes, 2)
    g = torch.fx.Graph()
    n = g.call_function(torch.ops._c10d_functional.all_reduce.default, ())
    mark(n, emit.collective("all_reduce", nbytes, 2, "bwd"))
    compiler = CostModel.for_job(None, "cuda", "nccl", "NVIDIA H200").comm_time(n)
    assert compiler == planner and 200e-6 < planner < 400e-6


LIMITS = {"job.py": 400}
FILE_LIMIT = 700
CORE_LIMIT = 15_000
KERNELS_LIMIT = 600
"""kernels/ is GPU code (Triton kernels and their symmetric-memory plumbing, a pure-torch reference
and the portable decomposed path beside each): a library the compiler calls, on a budget of its own."""


def test_files_stay_small():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    big = {f: n for f, n in sizes.items() if n > LIMITS.get(f, FILE_LIMIT)}
    assert not big, f"files over their line budget: {big}"
    kernels = sum(n for f, n in sizes.items() if f.startswith("kernels/"))
    assert kernels < KERNELS_LIMIT, kernels
    assert sum(sizes.values()) - kernels < CORE_LIMIT, sum(sizes.values()) - kernels
