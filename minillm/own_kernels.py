"""minillm's Triton kernels are the top-level package `kernels`, and Hugging Face publishes a
distribution of that import name too (hub kernels; transformers 5.25 and later require it, and
import it whenever its metadata says it is installed). Python loads one package a name: a
`kernels` anywhere on sys.path (site-packages, PYTHONPATH, a `kernels/` folder in the working
directory) hides an editable install of minillm, whose finder comes last, and a regular install
lets the two overwrite each other's files. The engine would then fail later on a missing
attribute, or transformers on a missing name. Importing this module checks first, and says
what to do in one line.
"""
import importlib.metadata
import importlib.util
from pathlib import Path

OWN_KERNELS = Path(__file__).resolve().parents[1] / "kernels"


class KernelsPackageError(ImportError):
    """`import kernels` would not load minillm's kernels here."""


def kernels_conflict():
    """Why `import kernels` cannot be minillm's kernels in this environment, or None."""
    try:
        hub = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        hub = None
    if hub is not None:
        return (f"Hugging Face's `kernels` {hub.version} is installed (in {hub.locate_file('')}) and takes the "
                "import name of minillm's Triton kernels; the two cannot share an environment: "
                "`pip uninstall kernels` (transformers below 5.25 runs without it)")
    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin != OWN_KERNELS / "__init__.py":
        if spec is None:
            found = "nothing (is minillm installed? `pip install -e .` in its folder)"
        elif origin is None:  # a folder without __init__.py: a namespace package
            found = f"the namespace package {', '.join(spec.submodule_search_locations or ())}"
        else:
            found = origin.parent
        return (f"`import kernels` loads {found} instead of minillm's {OWN_KERNELS}; "
                "rename that package or take its folder off sys.path (PYTHONPATH, the working directory)")
    return None


def require_own_kernels():
    problem = kernels_conflict()
    if problem:
        raise KernelsPackageError(f"kernels: {problem}")


require_own_kernels()
