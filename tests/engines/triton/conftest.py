"""The tiny-model fixture of the triton engine tests: built once per pytest process per arch
(tests/helpers/once.py), shared by every module here that asks for ``tiny`` (a module's own ``tiny`` wins)."""

import pytest

from tests.helpers.triton_tiny import ARCHS, build_tiny


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    """-> (ModelSpec, {engine: {name: AdapterSpec}}, prompts) for one arch, saved under a temporary directory; built
    once per pytest process for this module and the ones that re-export this fixture (tests/helpers/once.py)."""
    from tests.helpers.once import once

    return once(("test_triton_engine.tiny", request.param), lambda: build_tiny(request.param, tmp_path_factory))
