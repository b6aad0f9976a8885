"""lpdiff: a logprob-diff regression harness for LoRA adapters on Mixture-of-Experts LLMs.

The repository keeps its folders at the top level (``harness/``, ``engines/``, ``kernels/``); they are installed as
``lpdiff.harness``, ``lpdiff.engines`` and ``lpdiff.kernels`` so that nothing claims a top-level name such as
Hugging Face's ``kernels`` package. In a checkout, ``lpdiff/harness`` (and engines, kernels, baselines) are relative
symlinks to those folders, so Python, mypy and IDEs resolve ``lpdiff.harness.x`` from the checkout as they would
from an install (an engine's own virtualenv imports lpdiff through PYTHONPATH). A copy that drops symlinks (a zip
download, a filesystem without them) still works: then the subpackages are found beside this folder.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.2.0"

_here = Path(__file__).resolve().parent
if not (_here / "harness").is_dir() and (_here.parent / "harness").is_dir():
    __path__.append(str(_here.parent))  # a copy without the symlinks: lpdiff.harness is ../harness
