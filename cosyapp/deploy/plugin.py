"""vLLM's plugin entry point for a cosyapp source tree that is not pip-installed.

vLLM finds cosyapp's LM architecture in each of its processes through the ``vllm.general_plugins``
entry point of an installed distribution (pyproject.toml declares it). A Space installs only
requirements.txt and then copies the repository, so there is no such distribution: this writes its
metadata, with the entry point from pyproject.toml, into a folder on the path that vLLM's processes
inherit.
"""

import importlib
import os
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import cosyapp

GROUP = "vllm.general_plugins"


def source_root() -> Path:
    """The folder holding the cosyapp package and its pyproject.toml."""
    return Path(cosyapp.__file__).resolve().parents[1]


def is_installed() -> bool:
    """Whether a cosyapp distribution (with its entry points) is installed."""
    try:
        distribution("cosyapp")
    except PackageNotFoundError:
        return False
    return True


def write_plugin_metadata(folder: Path, root: Path) -> Path:
    """Write ``folder``/cosyapp-VERSION.dist-info declaring the entry points of ``root``/pyproject.toml
    in GROUP; returns the dist-info folder."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    info = folder / f"cosyapp-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: cosyapp\nVersion: {project['version']}\n")
    points = "".join(f"{name} = {target}\n" for name, target in project["entry-points"][GROUP].items())
    (info / "entry_points.txt").write_text(f"[{GROUP}]\n{points}")
    return info


def provide_vllm_plugin(folder: Path) -> Path | None:
    """Make the plugin entry point visible to this process and the ones it starts, when cosyapp is
    not installed; returns the dist-info written (None when cosyapp is installed)."""
    if is_installed():
        return None
    root = source_root()
    info = write_plugin_metadata(folder, root)
    sys.path.append(str(folder))
    # vLLM's engine and workers are new interpreters: they find both folders through PYTHONPATH.
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(root), str(folder), *inherited])
    importlib.invalidate_caches()
    return info
