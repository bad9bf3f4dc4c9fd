"""The environment for a subprocess that must run the same ctxfold as the test process.

In CI that is the installed package (site-packages); in a development loop it is the source tree
(PYTHONPATH=python). Pointing PYTHONPATH at the tree in CI would import sources without the built
extension, so subprocesses take the directory of the ctxfold this process imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import ctxfold

PACKAGE_ROOT = str(Path(ctxfold.__file__).resolve().parent.parent)


def ctxfold_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (default: this process's environment) with PYTHONPATH set to ctxfold's root."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = PACKAGE_ROOT
    env.update(extra)
    return env


def can_mount() -> bool:
    """Whether ``unshare -m`` works here: tests then mount real file systems (read-only, full) in a
    private mount namespace."""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], check=False, capture_output=True).returncode == 0
