"""Kernel tests run the Triton kernels under the interpreter (no GPU needed).

TRITON_INTERPRET must be set before anything imports triton, so it is set here, at conftest
import time, before pytest collects the test modules in this folder.
"""

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:  # the repo may not be pip-installed yet
    sys.path.insert(0, _REPO_ROOT)
