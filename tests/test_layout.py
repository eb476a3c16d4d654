"""The package's architecture, checked: layers without cycles, a flat errors module, no private name
crossing a module boundary, modules of a readable size, private internals behind compat."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

import weightsync_audit
from weightsync_audit import compat
from weightsync_audit.engine.config import AuditConfig

PACKAGE = Path(weightsync_audit.__file__).parent
MODULES = sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every ``from weightsync_audit... import names`` anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("weightsync_audit"):
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("weightsync_audit")]
    return out


def test_errors_and_text_import_nothing_of_the_package() -> None:
    for leaf in ("errors.py", "text.py", "compat.py"):
        assert _imports(PACKAGE / leaf) == [], leaf


def test_no_private_name_is_imported_across_modules() -> None:
    crossing = [
        f"{_module_name(p)} imports {name} from {mod}"
        for p in MODULES
        for mod, names in _imports(p)
        for name in names
        if name.startswith("_") and name != "__version__"
    ]
    assert crossing == []


def test_no_module_is_over_450_lines_and_each_opens_with_a_docstring() -> None:
    for p in MODULES:
        text = p.read_text()
        assert len(text.splitlines()) <= 450, f"{p.relative_to(PACKAGE)}: {len(text.splitlines())} lines"
        if text.strip():
            assert ast.get_docstring(ast.parse(text)), f"{p.relative_to(PACKAGE)} has no module docstring"


def test_no_function_in_the_package_is_over_80_lines() -> None:
    long = []
    for p in MODULES:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                where = (p.relative_to(PACKAGE).as_posix(), node.name)
                if lines > 80:
                    long.append(f"{where[0]}:{node.lineno} {node.name}: {lines} lines")
    assert long == []


def test_no_folder_of_the_package_holds_over_12_modules() -> None:
    folders: dict[str, int] = {}
    for p in MODULES:
        if p.name != "__init__.py":
            folder = p.parent.relative_to(PACKAGE.parent).as_posix()
            folders[folder] = folders.get(folder, 0) + 1
    assert {f: n for f, n in folders.items() if n > 12} == {}


def test_the_import_graph_has_no_cycle() -> None:
    known = {_module_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for p in MODULES:
        deps = set()
        for mod, names in _imports(p):
            for target in [f"{mod}.{n}" for n in names] + [mod]:
                if target in known:
                    deps.add(target)
                    break
        graph[_module_name(p)] = deps - {_module_name(p)}
    # A package's __init__ re-exports its children: only edges between leaf modules form real cycles.
    leaves = {m for m in graph if not (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node] & leaves):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for m in sorted(leaves):
        if m not in state:
            visit(m, [m])


def test_private_torch_internals_are_reached_only_through_compat() -> None:
    internals = {"_get_default_group", "_get_default_store", "_get_zeros_like_grad_buckets", "_get_ddp_logging_data",
                 "_remove_autograd_hooks", "_setup_model", "_pl_static_graph_delay_done", "_FabricModule",
                 "_LightningModuleWrapperBase", "_original_module", "_flat_param", "_inter_node_pg", "_shapes",
                 "single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "ds_status", "ds_persist",
                 "ds_tensor"}  # fmt: skip
    for p in MODULES:
        if p.name in ("compat.py", "compat_engines.py"):  # DeepSpeed's and FSDP1's internals: compat_engines.py
            continue
        used = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
                used.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
            elif isinstance(node, ast.Compare):
                used.update(
                    c.value for c in node.comparators if isinstance(c, ast.Constant) and isinstance(c.value, str)
                )
        assert not used & internals, f"{p.relative_to(PACKAGE)} uses {sorted(used & internals)} outside compat.py"


def test_no_raw_read_of_memory_outside_the_reader() -> None:
    """Every read of a tensor's bytes goes through engine/hashing/reader.py: no module but the reader imports
    ``ctypes``, reads memory by address (``from_address``, ``from_buffer``, ``numpy.ctypeslib``) or does
    arithmetic on a ``data_ptr()`` (an address compared for identity, as the digest plan does, is no read)."""
    raw = {"from_address", "from_buffer", "from_buffer_copy", "ctypeslib", "string_at", "memmove", "cast"}
    found = []
    for p in MODULES:
        if p.relative_to(PACKAGE).as_posix() == "engine/hashing/reader.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                found += [f"{p.name}: import {n}" for n in names if n.split(".")[0] in ("ctypes", "cffi")]
            elif isinstance(node, ast.Attribute) and node.attr in raw and getattr(node.value, "id", "") != "torch":
                if node.attr != "cast" or getattr(node.value, "id", "") == "ctypes":
                    found.append(f"{p.name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.BinOp):
                for side in (node.left, node.right):
                    if isinstance(side, ast.Call) and getattr(side.func, "attr", "") == "data_ptr":
                        found.append(f"{p.name}:{node.lineno}: arithmetic on data_ptr()")
    assert not found, found


def test_compat_self_check_passes_here_and_names_the_versions_when_an_internal_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compat.self_check()
    monkeypatch.setattr(compat, "_checked", False)
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_store")
    with pytest.raises(compat.CompatError, match=r"_get_default_store.*torch 2\."):
        compat.self_check()


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"include": ("params", "weights")}, "include"),
        ({"exclude": (3,)}, "exclude"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"method": "md5"}, "method"),
        ({"slices": 0}, "slices"),
    ],
)
def test_one_config_validates_every_setting_naming_the_argument(kwargs: dict, argument: str) -> None:
    with pytest.raises((ValueError, TypeError), match=argument):
        AuditConfig(**kwargs)


def test_the_auditor_takes_a_config_whole() -> None:
    import torch

    cfg = AuditConfig(include=("params",), slices=4)
    auditor = weightsync_audit.Auditor(torch.nn.Linear(2, 2), config=cfg)
    assert auditor.config is cfg
    result = auditor.audit(step=0)
    assert result.checked["param"] == 2 and result.checked["optimizer"] == 0
    with pytest.raises(TypeError, match="config"):
        weightsync_audit.Auditor(config={"include": ("params",)})  # type: ignore[arg-type]
