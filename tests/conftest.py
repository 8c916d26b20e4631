import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Single-machine Ray on loopback only. With clusters "enabled" (Linux's default) Ray resolves
# even _node_ip_address="127.0.0.1" to the host's routable IP, and its GCS, raylets, workers and
# agents listen there and on 0.0.0.0. Read when ray is imported, and inherited by every Ray
# process and subprocess the tests start.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from tests.model_fixtures import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from engine.models.loader import resolve_model

    return str(resolve_model("default"))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster (Serve without HTTP) for one test module, shut down after it."""
    from tests.serve_fixtures import start_ray, stop_ray

    start_ray(None)
    try:
        yield
    finally:
        stop_ray()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count (the benchmark smoke tests run with --threads 1)
    must not leave every later test, the demo adapters' training included, on one thread."""
    num_threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
