"""Which chain of this repository's code first imports a module: the opening of a probe that
a fresh interpreter runs with `python -c PROBE REPO_ROOT ...` (the repository root first on
sys.path, as the servers run). The probe's own code follows it, and may report `first_import`:
the repository's frames (file:line) on the stack when `module` was first imported, or []."""


def witness_source(module: str) -> str:
    return f"""
import importlib.abc, json, sys, traceback
sys.path.insert(0, sys.argv[1])
first_import = []


class Witness(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {module!r} and not first_import:
            first_import.extend(f"{{f.filename}}:{{f.lineno}}" for f in traceback.extract_stack()
                                if sys.argv[1] in f.filename)
        return None


sys.meta_path.insert(0, Witness())
"""
