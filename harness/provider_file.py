"""Bring your own kernel: providers defined in a Python file (`runner.py --provider-file FILE`).

The file defines `PROVIDERS = {name: forward}` with
`forward(q, k, v, causal, softmax_scale) -> out` in flash-attn's layout (batch, seqlen, heads,
headdim), differentiable through autograd for the backward modes. A value may also be a
`baselines.providers.Provider` (to give a label, a `supports` check or a `config`). The
providers are measured next to the registry's with the same accuracy gate, rows and plots;
their names must not shadow a registry name or another provider file's, and a PROVIDERS dict
literal must not repeat a key (Python would keep the last one silently).

    # my_kernels.py
    import torch.nn.functional as F

    def sdpa_math(q, k, v, causal, softmax_scale):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal, scale=softmax_scale)
        return out.transpose(1, 2)

    PROVIDERS = {"my-sdpa-math": sdpa_math}
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from pathlib import Path

from baselines.providers import Provider


class ProviderFileError(ValueError):
    """A provider file that cannot be used; the message names the file and what is wrong."""


def _everywhere() -> str | None:
    return None


def _duplicate_keys(path: Path, where: str) -> None:
    """Refuse a key written twice in a `PROVIDERS = {...}` literal of the file."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        raise ProviderFileError(f"{where}, line {exc.lineno}: not valid Python ({exc.msg})") from None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if not (any(isinstance(t, ast.Name) and t.id == "PROVIDERS" for t in targets)
                and isinstance(node.value, ast.Dict)):
            continue
        seen = {}
        for key in node.value.keys:  # None for a ** unpacking
            if isinstance(key, ast.Constant):
                if key.value in seen:
                    raise ProviderFileError(f"{where}, line {key.lineno}: PROVIDERS has the key {key.value!r} twice "
                                            f"(lines {seen[key.value]} and {key.lineno}); a dict keeps only the last: "
                                            "rename one")
                seen[key.value] = key.lineno


def load_provider_file(path: Path, known_names: dict[str, str]) -> list[Provider]:
    """The providers of `path` (see the module docstring), in the file's order. `known_names`:
    the names already taken, each with where it comes from ('the registry', another file)."""
    path = Path(path)
    where = f"--provider-file {path}"
    if not path.is_file():
        raise ProviderFileError(f"{where}: no such file (expected a Python file defining PROVIDERS)")
    _duplicate_keys(path, where)
    name = f"provider_file_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ProviderFileError(f"{where}: not importable as a Python module (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # a script's sys.exit() at import: not a provider file
        raise ProviderFileError(f"{where}: importing it called sys.exit({exc.code!r}); a provider file must "
                                "define PROVIDERS and not exit (guard script code with "
                                "`if __name__ == \"__main__\":`)") from None
    except Exception as exc:
        raise ProviderFileError(f"{where}: importing it raised {type(exc).__name__}: {exc}") from exc
    table = getattr(module, "PROVIDERS", None)
    if not isinstance(table, dict) or not table:
        raise ProviderFileError(f"{where}: must define PROVIDERS = {{name: forward}}, a non-empty dict "
                                f"(found {type(table).__name__})")
    providers = []
    for key, value in table.items():
        if not isinstance(key, str) or not key or any(c in key for c in ", \n\t"):
            raise ProviderFileError(f"{where}: provider name {key!r} must be a non-empty string without "
                                    "commas or spaces")
        if key in known_names:
            raise ProviderFileError(f"{where}: provider name {key!r} is already defined by {known_names[key]}: "
                                    "rename it")
        if isinstance(value, Provider):
            if value.name != key:
                raise ProviderFileError(f"{where}: PROVIDERS[{key!r}] is a Provider named {value.name!r}: "
                                        "the key and the name must agree")
            providers.append(value)
        elif callable(value):
            providers.append(Provider(name=key, label=f"{key} ({path.name})", forward=value,
                                      availability=_everywhere, has_backward=True))
        else:
            raise ProviderFileError(f"{where}: PROVIDERS[{key!r}] must be a forward(q, k, v, causal, "
                                    f"softmax_scale) callable or a Provider, got {type(value).__name__}")
    return providers


def file_digest(path: Path) -> str:
    """sha256 of the file, recorded with the run so that results name the code they measured."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
