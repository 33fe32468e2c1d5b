"""The house plan's figures (issue 28): sizes, configuration spread, optimiser loops, import direction.

    python -m bench.architecture --out bench/results

Read from the source with `ast`, nothing imported or run:
  - classes over 300 lines, functions over 60 (argparse tables aside: the lines of `add_argument`,
    `add_parser` and `add_argument_group` statements are not counted);
  - configuration classes (dataclasses and pydantic models named ...Config, ...Settings, ...Spec, ...Objective,
    ...Setup or ...Ref, and classes of those names derived from one; and each federated method's settings model in
    `protocol.methods`, whatever its name) and the field names declared in two or more of them (class variables,
    `ClassVar`, are not fields);
    a field whose type is a configuration class embeds that one home (`protocol.training_parts`: a round's,
    `ffr train`'s and `ffr pretrain`'s `optimisation`) and is listed as a part, not counted as a copy;
  - hand-written optimiser loops in the product's packages: functions that call both `.backward(` and `.step(`
    (benchmarks aside: `bench.train_throughput` keeps a bare PyTorch loop as the reference it measures against);
  - imports that run upward or sideways in protocol <- models <- coordinator / edge_client <- fleet <- ffr <- bench
    (function-local imports included: a cycle hidden in a function is still a cycle), and import cycles.
"""
from __future__ import annotations

import argparse
import ast
import re
from collections import defaultdict
from pathlib import Path

from bench.common import result_name, write_results

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"protocol": 0, "models": 1, "coordinator": 2, "edge_client": 2, "fleet": 3, "ffr": 4, "bench": 5}
MAX_CLASS, MAX_FUNCTION = 300, 60
METHODS_MODULE = "protocol.methods"
CONFIG_NAME = re.compile(r"(Config|Settings|Spec|Objective|Setup|Ref)$")  # GateSetup and PublicSetRef are too
ARGPARSE_CALLS = {"add_argument", "add_parser", "add_argument_group", "add_mutually_exclusive_group"}


def modules(root: Path = ROOT) -> dict[str, ast.Module]:
    """Every module of the product's packages, by dotted name."""
    found = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            found[name] = ast.parse(path.read_text(), str(path))
    return found


def _argparse_lines(node: ast.AST) -> set[int]:
    """Lines of statements that only declare command-line options."""
    lines = set()
    for stmt in ast.walk(node):
        value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign)) else None
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in ARGPARSE_CALLS:
            lines.update(range(stmt.lineno, stmt.end_lineno + 1))
    return lines


def sizes(tree: dict[str, ast.Module]) -> tuple[list[dict], list[dict]]:
    """(classes over MAX_CLASS lines, functions over MAX_FUNCTION lines net of argparse tables)."""
    classes, functions = [], []
    for module, node in tree.items():
        for item in ast.walk(node):
            span = (item.end_lineno - item.lineno + 1) if hasattr(item, "end_lineno") else 0
            if isinstance(item, ast.ClassDef) and span > MAX_CLASS:
                classes.append({"where": f"{module}.{item.name}", "lines": span})
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                net = span - len(_argparse_lines(item))
                if net > MAX_FUNCTION:
                    functions.append({"where": f"{module}.{item.name}", "lines": net})
    key = lambda row: -row["lines"]  # noqa: E731
    return sorted(classes, key=key), sorted(functions, key=key)


def _is_config(cls: ast.ClassDef) -> bool:
    decorated = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    model = any(ast.unparse(b) in ("BaseModel", "_Body", "_Part") or CONFIG_NAME.search(ast.unparse(b))
                for b in cls.bases)
    return bool(CONFIG_NAME.search(cls.name)) and (decorated or model)


def _config_classes(tree: dict[str, ast.Module]) -> dict[str, ast.ClassDef]:
    found = {f"{module}.{cls.name}": cls for module, node in tree.items()
             for cls in ast.walk(node) if isinstance(cls, ast.ClassDef) and _is_config(cls)}
    return {**found, **_method_settings(tree.get(METHODS_MODULE))}


def _method_settings(node: ast.Module | None) -> dict[str, ast.ClassDef]:
    """The methods' settings models: `protocol.methods`' pydantic models (`BaseModel` and the classes built on one),
    named for the method they configure rather than ...Settings."""
    models, found = {"BaseModel"}, {}
    for cls in (node.body if node else []):
        if isinstance(cls, ast.ClassDef) and any(ast.unparse(b) in models for b in cls.bases):
            models.add(cls.name)
            found[f"{METHODS_MODULE}.{cls.name}"] = cls
    return found


def _fields(cls: ast.ClassDef) -> list[str]:
    """A configuration class's own fields: its annotated names, class variables aside."""
    return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            and not ast.unparse(s.annotation).startswith("ClassVar")]


def configs(tree: dict[str, ast.Module], count_parts: bool = False
            ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """({config class: its field names}, {field name declared in 2+ config classes: those classes}); fields whose
    type is a configuration class (embedded parts, `parts`) are listed but not counted as copies unless
    `count_parts` (the rule before the parts, for comparison)."""
    classes = _config_classes(tree)
    fields = {name: _fields(cls) for name, cls in classes.items()}
    embedded = {} if count_parts else parts(tree)
    owners = defaultdict(list)
    for cls, names in fields.items():
        for name in names:
            if name not in embedded.get(cls, ()):
                owners[name].append(cls)
    return fields, {name: where for name, where in sorted(owners.items()) if len(where) > 1}


def parts(tree: dict[str, ast.Module]) -> dict[str, list[str]]:
    """{config class: its fields whose type is a configuration class}: the parts it embeds."""
    classes = _config_classes(tree)
    short = {name.rsplit(".", 1)[1] for name in classes}

    def embedded(cls: ast.ClassDef) -> list[str]:
        return [s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                and ast.unparse(s.annotation).strip("'\"") in short]
    return {name: found for name, cls in classes.items() if (found := embedded(cls))}


def optimiser_loops(tree: dict[str, ast.Module]) -> list[str]:
    """Functions of the product that both back-propagate and step an optimiser: each is a training loop of its own."""
    loops = []
    for module, node in tree.items():
        if module.startswith("bench."):
            continue
        for fn in (n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            calls = {c.func.attr for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)}
            if {"backward", "step"} <= calls:
                loops.append(f"{module}.{fn.name}")
    return loops


def imports(tree: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Each module's imports of the product's own modules (function-local ones included)."""
    graph = {}
    for module, node in tree.items():
        targets = set()
        for item in ast.walk(node):
            names = [a.name for a in item.names] if isinstance(item, ast.Import) else []
            if isinstance(item, ast.ImportFrom) and item.level == 0 and item.module:
                names = [item.module] + [f"{item.module}.{a.name}" for a in item.names]
            targets.update(n for n in names if n in tree and n != module)
        graph[module] = targets
    return graph


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer to a higher one, or between the two peers (coordinator, edge_client)."""
    found = []
    for module, targets in graph.items():
        mine = module.split(".")[0]
        for target in sorted(targets):
            theirs = target.split(".")[0]
            if LAYERS[theirs] > LAYERS[mine] or (LAYERS[theirs] == LAYERS[mine] and theirs != mine):
                found.append(f"{module} -> {target}")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan)."""
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


# what the service and the simulator may call on the engine (ARCHITECTURE.md); the rest are its collaborators
ENGINE_API = {"view", "open_round", "close_round", "round_view", "admit", "status", "pause", "resume", "running",
              "finished", "on_message", "tick"}


READERS = ("fleet", "coordinator.api", "coordinator.dashboard")  # read the engine through engine.view alone


def engine_reads(tree: dict[str, ast.Module], readers: tuple[str, ...] = READERS) -> list[str]:
    """`engine.X` in the `readers` (packages or modules) where X is not the engine's API: a reach into its
    collaborators (sorted)."""
    found = []
    for name, module in tree.items():
        if not any(name == r or name.startswith(r + ".") for r in readers):
            continue
        for node in ast.walk(module):
            inner = node.value if isinstance(node, ast.Attribute) else None
            named = inner.attr if isinstance(inner, ast.Attribute) else getattr(inner, "id", None)
            if named == "engine" and node.attr not in ENGINE_API:
                found.append(f"{name}:{node.lineno} engine.{node.attr}")
    return sorted(found)


def parameters(tree: dict[str, ast.Module], module: str = "edge_client.local_training",
               function: str = "train_round") -> int:
    """How many parameters a function takes (the local round's own: issue 51 asks for at most 6)."""
    found = next(n for n in ast.walk(tree[module]) if isinstance(n, ast.FunctionDef) and n.name == function)
    a = found.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)


def measure(root: Path = ROOT) -> dict:
    tree = modules(root)
    big_classes, long_functions = sizes(tree)
    fields, shared = configs(tree)
    graph = imports(tree)
    return {"classes_over_300": big_classes, "functions_over_60": long_functions, "config_classes": fields,
            "duplicated_config_fields": shared, "embedded_config_parts": parts(tree),
            "duplicated_config_fields_counting_parts": configs(tree, count_parts=True)[1],
            "optimiser_loops": optimiser_loops(tree),
            "wrong_way_imports": wrong_way(graph), "import_cycles": cycles(graph),
            "engine_reads_from_readers": engine_reads(tree), "train_round_parameters": parameters(tree)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", type=result_name, default="architecture")
    args = parser.parse_args()
    figures = measure()
    table = [{"figure": f"classes over {MAX_CLASS} lines", "count": len(figures["classes_over_300"]),
              "target": 0},
             {"figure": f"functions over {MAX_FUNCTION} lines (argparse tables aside)",
              "count": len(figures["functions_over_60"]), "target": 0},
             {"figure": "configuration classes", "count": len(figures["config_classes"]), "target": "halved"},
             {"figure": "field names declared in 2+ configuration classes",
              "count": len(figures["duplicated_config_fields"]), "target": "at most 10"},
             {"figure": "... counting an embedded part's name (`optimisation`, `model`, `gate`) as a copy",
              "count": len(figures["duplicated_config_fields_counting_parts"]), "target": "-"},
             {"figure": "configuration classes embedding a part instead of copying its fields",
              "count": len(figures["embedded_config_parts"]), "target": "-"},
             {"figure": "optimiser loops", "count": len(figures["optimiser_loops"]), "target": 1},
             {"figure": "imports upward or sideways", "count": len(figures["wrong_way_imports"]), "target": 0},
             {"figure": "import cycles", "count": len(figures["import_cycles"]), "target": 0},
             {"figure": "reads of the engine's collaborators from fleet/, the API and the dashboard",
              "count": len(figures["engine_reads_from_readers"]), "target": 0},
             {"figure": "parameters of the local round (`train_round`)", "count": figures["train_round_parameters"],
              "target": "at most 6"}]
    write_results(args.out, args.name, figures, table, "House plan figures (issue 28)",
                  f"python -m bench.architecture --out {args.out}")


if __name__ == "__main__":
    main()
