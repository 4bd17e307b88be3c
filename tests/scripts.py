"""Load a repository script (benchmarks/, scripts/) as a module, for the tests that run it or use its functions."""
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative_path: str):
    """The module of ``ROOT / relative_path``, executed once per session (registered in ``sys.modules`` while it
    runs, so the dataclasses it defines can resolve their module)."""
    path = ROOT / relative_path
    name = path.stem
    if name not in sys.modules or getattr(sys.modules[name], "__file__", None) != str(path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]
