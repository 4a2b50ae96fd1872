"""The dependency rules of docs/architecture.md, checked on the code: every import between the project's
packages is an allowed edge, and the HTTP edge loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "router", "prefill_workers", "decode_workers", "kv_transfer")

#: cluster's shared vocabulary: plain data and helpers every layer may use.
VOCABULARY = {
    "cluster",
    "cluster.config",
    "cluster.errors",
    "cluster.dtypes",
    "cluster.kv_layout",
    "cluster.prefix_hash",
    "cluster.prompting",
    "cluster.tokenizer",
    "cluster.openai_protocol",
    "cluster.openai_responses",
    "cluster.scores",
    "cluster.grammar",
    "cluster.tool_calls",
}

#: layer -> the layers it may import (its own included). The composition root may import anything.
ALLOWED = {
    "vocabulary": {"vocabulary"},
    "engine": {"vocabulary", "engine"},
    "kv_transfer": {"vocabulary", "kv_transfer"},
    "serving": {"vocabulary", "engine", "serving", "kv_transfer"},
    "router": {"vocabulary", "serving", "router"},
    "prefill_workers": {"vocabulary", "engine", "serving", "kv_transfer", "prefill_workers"},
    "decode_workers": {"vocabulary", "engine", "serving", "kv_transfer", "decode_workers"},
    "tools": {"vocabulary", "engine", "serving", "tools", "composition root"},
    "composition root": {
        "vocabulary",
        "engine",
        "serving",
        "kv_transfer",
        "router",
        "prefill_workers",
        "decode_workers",
        "tools",
    },
}

#: What the HTTP edge may use of the serving runtime: its messages, config and metrics (no engine driver).
ROUTER_MAY_USE_FROM_SERVING = {
    "cluster.serving",
    "cluster.serving.config",
    "cluster.serving.messages",
    "cluster.serving.metrics",
    "cluster.serving.pool_board",
    "cluster.serving.tracing",
}


def layer(module: str) -> str:
    if module in VOCABULARY:
        return "vocabulary"
    if module == "cluster.app":
        return "composition root"
    for prefix, name in (("cluster.engine", "engine"), ("cluster.serving", "serving"), ("cluster.tools", "tools")):
        if module == prefix or module.startswith(prefix + "."):
            return name
    top = module.split(".")[0]
    if top in PACKAGES and top != "cluster":
        return top
    raise AssertionError(f"{module} is in no layer: add it to docs/architecture.md and to this test")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a project module, anywhere in the file, except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import sub`` may name a submodule: count the most specific project module.
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        modules = dict.fromkeys(resolve(n) for n in names if n.split(".")[0] in PACKAGES)
        found += [(node.lineno, m) for m in modules]
    return found


def resolve(name: str) -> str:
    """The project module ``name`` refers to (a name imported from a module resolves to that module)."""
    parts = name.split(".")
    while parts:
        candidate = ROOT.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    raise AssertionError(f"{name} is not a project module")


def test_every_import_is_an_allowed_edge():
    violations = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = module_name(path)
            here = layer(source)
            for line, target in imports(path):
                there = layer(target)
                bad = there not in ALLOWED[here]
                if here == "router" and there == "serving" and target not in ROUTER_MAY_USE_FROM_SERVING:
                    bad = True
                if bad:
                    violations.append(f"{path.relative_to(ROOT)}:{line}: {source} ({here}) imports {target} ({there})")
    assert not violations, "imports across layers that docs/architecture.md does not allow:\n" + "\n".join(violations)


def test_the_rules_catch_a_wrong_edge(tmp_path):
    """The walker sees imports in function bodies too (a test that could not fail would prove nothing)."""
    bad = tmp_path / "engine_module.py"
    bad.write_text("def f():\n    from router.server import OpenAIServer\n")
    assert imports(bad) == [(2, "router.server")]
    assert layer("router.server") not in ALLOWED[layer("cluster.engine.llm_engine")]


def test_importing_the_http_edge_loads_no_torch():
    code = (
        "import sys\n"
        "import router.server, router.plan, router.replica_choice, router.streaming\n"
        "heavy = [m for m in ('torch', 'numba', 'triton', 'transformers', 'cluster.engine') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
