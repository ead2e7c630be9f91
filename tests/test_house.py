"""The house rules a reader relies on, checked on the tree (CPU, no kernels run): kernel files a
reader can hold, no experiment scripts in the product, no module-level switch of a kernel module
set from outside it (what varies by shape or GPU is a config field, passed as an argument), and a
README of a few screens."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_KERNEL_LINES = 800
MAX_README_LINES = 300
SKIPPED_DIRS = {"tests", ".git", ".venv", "venv", "build", "dist", "__pycache__", "node_modules"}


def _product_files() -> list[Path]:
    """Every Python file of the product: all but the tests (and build or environment folders)."""
    return sorted(path for path in ROOT.rglob("*.py")
                  if not SKIPPED_DIRS & set(path.relative_to(ROOT).parts[:-1])
                  and not any(part.startswith(".") for part in path.relative_to(ROOT).parts[:-1]))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_kernels_module(name: str) -> bool:
    """Whether `name` (dotted) is kernels or a module or package in it."""
    parts = name.split(".")
    if parts[0] != "kernels":
        return False
    path = ROOT.joinpath(*parts)
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> dict[str, str]:
    """Local name -> the kernels module it is bound to, from every import in the file (function
    bodies' too); relative imports resolved against `module`."""
    names = {}
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_kernels_module(alias.name):
                    names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "kernels"
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, [*anchor, base]))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if _is_kernels_module(full):
                    names[alias.asname or alias.name] = full
    return names


def _resolve(node: ast.AST, names: dict[str, str]) -> str | None:
    """The kernels module an expression (a name or a chain of attributes) denotes, or None."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, names)
        if base is not None and _is_kernels_module(f"{base}.{node.attr}"):
            return f"{base}.{node.attr}"
    return None


def kernel_global_assignments(source: str, module: str, is_package: bool = False) -> list[str]:
    """Where the source of `module` sets a module-level name of a kernels module other than its
    own: `module.NAME = ...` (or +=, or annotated), `setattr(module, ...)` and
    `monkeypatch.setattr(module, ...)`, a patch or setattr given a "kernels.<module>.NAME" string,
    `vars(module)[...] = ...` and `module.__dict__[...] = ...`."""
    tree = ast.parse(source)
    names = _imported_modules(tree, module, is_package)
    found = []

    def foreign(target_module: str | None) -> bool:
        return target_module is not None and target_module != module

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and foreign(_resolve(part.value, names)):
                    found.append(f"{module}:{part.lineno}: {ast.unparse(part)} = ...")
                elif isinstance(part, ast.Subscript):
                    holder = part.value
                    if isinstance(holder, ast.Attribute) and holder.attr == "__dict__" and foreign(
                            _resolve(holder.value, names)):
                        found.append(f"{module}:{part.lineno}: {ast.unparse(part)} = ...")
                    if (isinstance(holder, ast.Call) and isinstance(holder.func, ast.Name) and holder.func.id == "vars"
                            and holder.args and foreign(_resolve(holder.args[0], names))):
                        found.append(f"{module}:{part.lineno}: {ast.unparse(part)} = ...")
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            first = node.args[0]
            if called == "setattr" and foreign(_resolve(first, names)):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            if (called in ("setattr", "patch", "setitem") and isinstance(first, ast.Constant)
                    and isinstance(first.value, str) and first.value.startswith("kernels.")):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_kernel_module_passes_800_lines():
    """A kernel file is one role a reader can hold (kernels/hopper/ splits the Gluon kernels so)."""
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "kernels").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_KERNEL_LINES}
    assert not long, f"kernel modules over {MAX_KERNEL_LINES} lines: {long}"


def test_no_experiment_scripts_in_the_tree():
    """A decision is timed by tools/compare_configs.py (two configs of one call) and kept as rows;
    the scripts that made past ones live in git history."""
    assert not (ROOT / "tools" / "experiments").exists(), "tools/experiments/ is back"


def test_no_product_code_sets_a_kernel_modules_globals():
    """One path per decision: what varies by shape, head dim or GPU is a config field passed to the
    kernels, so no product code (all but tests/) sets a kernel module's names from outside it."""
    found = [line for path in _product_files()
             for line in kernel_global_assignments(path.read_text(), _module_name(path), path.name == "__init__.py")]
    assert not found, "module-level names of kernels/ set from outside their module:\n" + "\n".join(found)


def test_the_scan_sees_each_way_of_setting_a_kernel_modules_globals():
    """The scan above can fail: each form it looks for, in a product module, is found; a kernel
    module setting its own globals, or reading another's, is not."""
    sources = {
        "from kernels import decode\ndecode.GPU_CONFIG = (32, 4, 2)\n": "decode.GPU_CONFIG",
        "import kernels.flash_attn_hopper as h\nh.STAGES += 1\n": "h.STAGES",
        "from kernels import dispatch\ndispatch.flash_attn_hopper.HEAD_DIMS = ()\n": "dispatch.flash_attn_hopper",
        "import kernels\nkernels.launch.MAX_KEYS = 1\n": "kernels.launch.MAX_KEYS",
        "from kernels import launch\nsetattr(launch, 'MAX_KEYS', 1)\n": "setattr(launch",
        "def f(monkeypatch):\n    from kernels import decode\n    monkeypatch.setattr(decode, 'X', 1)\n": "(decode",
        "def f(mp):\n    mp.setattr('kernels.decode.GPU_CONFIG', 1)\n": "kernels.decode.GPU_CONFIG",
        "from kernels.hopper import shared\nvars(shared)['STAGES'] = 2\n": "vars(shared)",
    }
    for source, expected in sources.items():
        found = kernel_global_assignments(source, "harness.probe")
        assert found and expected in found[0], (source, found)
    # inside kernels/: a relative import is resolved, and a module's own globals are its own
    assert kernel_global_assignments("from . import launch\nlaunch.MAX_KEYS = 1\n", "kernels.probe")
    own = "from . import launch\nX = launch.MAX_KEYS\n\ndef f():\n    global X\n    X = 2\n"
    assert kernel_global_assignments(own, "kernels.probe") == []


def test_the_readme_is_a_few_screens():
    """What the suite answers, the quick start and one headline table; the full generated tables
    live in the results page per GPU (reports/<gpu>/README.md)."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines, at most {MAX_README_LINES}"


def test_the_measuring_layer_does_not_import_the_rendering_layer():
    """harness/ measures and writes rows; reports/ renders them: no module of harness/ imports
    reports/ (at its top or inside a function)."""
    offenders = []
    for path in sorted((ROOT / "harness").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names
                          if name == "reports" or name.startswith("reports.")]
    assert not offenders, offenders
