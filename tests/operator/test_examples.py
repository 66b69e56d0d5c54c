"""The examples a user applies as they are (``examples/``): every file renders with
``iterserve operator render``, its spec passes ``parse_spec``, and what it renders passes
``kubernetes-validate``; the CPU demo runs this version's CPU image, the 70B example 4 GPUs
with CPU and memory requested."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from iterserve.cli import main as cli_main
from iterserve.operator.spec import parse_spec

EXAMPLES = Path(__file__).parents[2] / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def test_the_examples_are_there() -> None:
    assert [f.name for f in FILES] == ["cpu-demo.yaml", "llama-3-70b-4xa100.yaml"]


def _render(path: Path, capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    assert cli_main(["operator", "render", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return list(yaml.safe_load_all(out))


@pytest.mark.parametrize("path", FILES, ids=[f.name for f in FILES])
def test_every_example_renders_and_validates(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (document,) = yaml.safe_load_all(path.read_text())  # one plain resource, no template
    assert (document["apiVersion"], document["kind"]) == ("iterserve.io/v1alpha1", "LLMDeployment")
    # No namespace: `kubectl apply -n NS -f FILE` puts it where the user says.
    assert set(document["metadata"]) == {"name"}
    parse_spec(document["spec"])
    objects = _render(path, capsys)
    assert [o["kind"] for o in objects][:5] == [
        "ConfigMap", "Service", "Service", "Deployment", "Deployment"
    ]  # fmt: skip
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def _server_pod(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name
    ]
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def _server_container(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    container: dict[str, Any] = _server_pod(objects, name)["containers"][0]
    return container


def test_the_cpu_demo_runs_this_versions_cpu_image(capsys: pytest.CaptureFixture[str]) -> None:
    document = yaml.safe_load((EXAMPLES / "cpu-demo.yaml").read_text())
    assert document["spec"]["image"] == f"ghcr.io/iterserve/iterserve:{version('iterserve')}-cpu"
    container = _server_container(_render(EXAMPLES / "cpu-demo.yaml", capsys), "smollm2-demo")
    assert container["resources"] == {
        "limits": {"cpu": "2", "memory": "3Gi"},
        "requests": {"cpu": "2", "memory": "3Gi"},
    }
    assert "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf" in container["args"]


def test_the_70b_example_asks_for_4_gpus_cpu_and_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = EXAMPLES / "llama-3-70b-4xa100.yaml"
    document = yaml.safe_load(path.read_text())
    assert document["spec"]["image"] == f"ghcr.io/iterserve/iterserve:{version('iterserve')}"
    spec = parse_spec(document["spec"])
    assert (spec.resources.gpus, spec.tensor_parallel_size) == (4, 4)
    objects = _render(path, capsys)
    container = _server_container(objects, "llama-3-70b")
    amounts = {"nvidia.com/gpu": "4", "cpu": "16", "memory": "128Gi"}
    assert container["resources"] == {"limits": amounts, "requests": amounts}
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/Meta-Llama-3-70B-Instruct"
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    pod = _server_pod(objects, "llama-3-70b")
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models"}} in pod["volumes"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
