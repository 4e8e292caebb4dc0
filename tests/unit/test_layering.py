"""Dependencies point one way (DESIGN.md §2): checked on the import statements of every module."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "torchrelay"

# package prefix -> torchrelay packages it must not import
FORBIDDEN = {
    "torchrelay.spec": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train",
                        "torchrelay.scheduler"),
    "torchrelay.scheduler": ("torchrelay.server", "torchrelay.client", "torchrelay.agent", "torchrelay.train"),
    "torchrelay.train": ("torchrelay.server", "torchrelay.client", "torchrelay.scheduler"),
    "torchrelay.agent": ("torchrelay.server", "torchrelay.scheduler", "torchrelay.train"),
    "torchrelay.server": ("torchrelay.client", "torchrelay.agent", "torchrelay.train"),
    "torchrelay.client": ("torchrelay.train", "torchrelay.scheduler"),
}
# the CLI verbs that start a server or an agent process in the foreground may import them
ALLOWED = {"torchrelay.client.cli.server": ("torchrelay.server",), "torchrelay.client.cli.agent": ("torchrelay.agent",)}


def modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("name, path", list(modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_module_respects_layers(name, path):
    rules = [bad for prefix, bad in FORBIDDEN.items() if name == prefix or name.startswith(prefix + ".")]
    allowed = ALLOWED.get(name, ())
    for imported in imports_of(path):
        for bad in (b for group in rules for b in group):
            if (imported == bad or imported.startswith(bad + ".")) and bad not in allowed:
                pytest.fail(f"{name} imports {imported}, which its layer must not depend on")
