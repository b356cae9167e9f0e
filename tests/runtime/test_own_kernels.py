"""minillm.own_kernels: a `kernels` package other than minillm's (Hugging Face's distribution, a
foreign package ahead on sys.path) is refused in one line before the engine loads. Subprocesses,
since a process imports one `kernels`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(args, pythonpath, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def hub_kernels_metadata(site, version="0.19.1"):
    """What `pip install kernels` leaves for importlib.metadata to find (the package itself is
    not needed: the distribution alone is refused)."""
    info = site / f"kernels-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n")
    return site


def test_this_environment_loads_minillms_kernels():
    """The test environment itself is clean, and transformers does not take minillm's kernels for
    its hub kernels package (it would import names from it that do not exist)."""
    from minillm.own_kernels import kernels_conflict

    assert kernels_conflict() is None
    import_utils = pytest.importorskip("transformers.utils.import_utils")
    if hasattr(import_utils, "is_kernels_available"):
        assert not import_utils.is_kernels_available()


def test_hub_kernels_distribution_is_refused(tmp_path):
    site = hub_kernels_metadata(tmp_path / "site")
    p = run(["-c", "import minillm.model"], [ROOT, site], cwd=tmp_path)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("minillm.own_kernels.KernelsPackageError: kernels: Hugging Face's `kernels` 0.19.1")
    assert "pip uninstall kernels" in last


@pytest.mark.parametrize("module", ["minillm.model", "minillm.generate", "minillm.decode_state", "minillm.torch_peer"])
def test_foreign_kernels_ahead_on_sys_path_is_refused(tmp_path, module):
    foreign = tmp_path / "elsewhere" / "kernels"
    foreign.mkdir(parents=True)
    (foreign / "__init__.py").write_text("raise SystemExit(3)  # imported: the check came too late\n")
    p = run(["-c", f"import {module}"], [foreign.parent, ROOT], cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert f"`import kernels` loads {foreign} instead of minillm's {ROOT / 'kernels'}" in p.stderr


def test_kernels_folder_in_working_directory_is_refused(tmp_path):
    """A `kernels/` folder without __init__.py in the working directory is a namespace package,
    which Python's path search returns before an editable install's finder is asked."""
    where = run(["-c", "import minillm; print(minillm.__file__)"], [], cwd=tmp_path)
    if where.returncode or Path(where.stdout.strip()).parent != ROOT / "minillm":
        pytest.skip("minillm is not installed from this folder (`pip install -e .`); only an install meets this case")
    (tmp_path / "kernels").mkdir()
    p = run(["-c", "import minillm.model"], [], cwd=tmp_path)
    assert p.returncode == 1, p.stderr
    assert f"`import kernels` loads the namespace package {tmp_path / 'kernels'} instead of minillm's" in p.stderr


def test_cli_says_it_in_one_line(tmp_path):
    site = hub_kernels_metadata(tmp_path / "site", version="0.18.2")
    p = run(["-m", "minillm", "generate", "--model", str(tmp_path / "no-model"), "Hello"], [ROOT, site], cwd=tmp_path)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"minillm: error: kernels: Hugging Face's `kernels` 0.18.2 is installed (in {site}) and takes the import "
        "name of minillm's Triton kernels; the two cannot share an environment: `pip uninstall kernels` "
        "(transformers below 5.25 runs without it)"]
