"""The CUDA image (``make image-cuda``: the runtime image on torch's CUDA build from PyPI, whose
CUDA libraries come as wheels; a GPU node's driver comes from the node): its torch is built with
CUDA, and a services-mode release whose containers all run it serves Generate, health, the
OpenAI API and /metrics, as ``test_image.py`` checks for the CPU image. This machine has no GPU,
so the verifier runs on the CPU here; the chart gives the CUDA image to containers with GPUs.

``make image-cuda-test`` builds the images and runs this (not CI: the image is about 4x the CPU
one); its latest output is committed in deploy/container/image-cuda-test.txt."""

from __future__ import annotations

import json

import pytest

from tests.image.test_image import VALUES, VERSION, generate_health_http_and_metrics, podman, services_release

pytestmark = pytest.mark.image_cuda

CUDA_IMAGE = f"specmesh/specmesh:{VERSION}-cuda"


def test_the_cuda_image_carries_torch_built_with_cuda():
    probe = "import json, torch; print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda}))"
    info = json.loads(podman("run", "--rm", "--entrypoint", "python", CUDA_IMAGE, "-c", probe).splitlines()[-1])
    print(f"{CUDA_IMAGE}: torch {info['version']}, CUDA {info['cuda']}")
    assert info["cuda"], "torch in the CUDA image has no CUDA"
    assert "+cpu" not in info["version"]


def test_a_release_on_the_cuda_image_serves(tmp_path):
    values = {**VALUES, "image": {"tag": f"{VERSION}-cuda", "pullPolicy": "Never"}}
    with services_release(values, tmp_path, "specmesh-smoke-cuda") as (ip, docs):
        routers = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")]
        assert routers[0]["spec"]["template"]["spec"]["containers"][0]["image"] == CUDA_IMAGE
        generate_health_http_and_metrics(ip)
