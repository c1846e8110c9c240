import json
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
REFERENCE_DIR = Path(os.environ.get("COSYAPP_REFERENCE_DIR", REPO.parent / "shared" / "reference"))


def _load_manifest(name: str) -> dict[str, list[int]]:
    path = REFERENCE_DIR / f"{name}.json"
    if not path.is_file():
        if os.environ.get("CI") == "true":
            pytest.fail(f"checkpoint manifest {path} is missing (required under CI=true)")
        pytest.skip(f"checkpoint manifest {path} not present")
    data = json.loads(path.read_text())
    return {k: v for k, v in data.items() if not k.startswith("total_params") and not k.startswith("_")}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One intra-op thread: the engines run torch in worker threads beside the test's own, and on the
    2 shared cores of the test machines more threads stall each other (seconds per tiny flow call)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def manifest():
    """manifest("llm.pt") -> {tensor name: shape} from ../shared/reference."""
    return _load_manifest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight model folder in the official layout, written once per test session."""
    from cosyapp.modelgen.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    """The tiny model loaded on CPU through the user-facing loader."""
    from cosyapp.models.checkpoint import load_model

    return load_model(tiny_model_dir, device="cpu")
