"""How a rival's child process (Ray Train's, torchft's) gets the project's task: ``workers/task.py``
loaded as a standalone module, in the benchmark-only virtualenv where the project's own packages and
dependencies are not installed.  Every contender then trains the same model on the same data.

Standard library only.  ``tests/workers/test_rival_task.py`` loads the task through this function,
with the project's packages and dependencies unimportable, as the rivals' children do.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

MODULE_NAME = "spotswarm_task"


def load_task_module(root: str | Path) -> Any:
    """``workers/task.py`` of the checkout at ``root``, as the module ``spotswarm_task``."""
    if MODULE_NAME in sys.modules:
        return sys.modules[MODULE_NAME]
    spec = importlib.util.spec_from_file_location(MODULE_NAME, Path(root) / "workers" / "task.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no task module at {Path(root) / 'workers' / 'task.py'}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[MODULE_NAME]
        raise
    return module
