import pytest

from colossal_lite.core import global_context as gpc


@pytest.fixture
def launched():
    """Launch colossal_lite as a single process with a config dict; destroyed afterwards."""
    import colossal_lite

    def _launch(config=None, seed=1024):
        gpc.destroy()
        colossal_lite.launch_from_torch(config=config or {}, seed=seed, verbose=False)
        return gpc

    yield _launch
    gpc.destroy()
