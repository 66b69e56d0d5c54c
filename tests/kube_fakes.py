"""An in-memory Kubernetes API for the operator's unit tests (``reconcile`` without KMock)."""

from __future__ import annotations

import copy
import json
from typing import Any

from kubernetes.aio.client.exceptions import ApiException

from iterserve.operator.kube import Kube


class MemoryKube(Kube):
    """Objects by (kind, name); ``refuse`` kinds answer 422 on create, as the API server
    answers an invalid object."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.refuse = refuse

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> Any | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    async def create(self, body: dict[str, Any]) -> Any:
        if body["kind"] in self.refuse:
            status = {"kind": "Status", "message": f"{body['kind']} is invalid: bad field"}
            raise ApiException(status=422, reason=json.dumps(status))
        self.objects[body["kind"], body["metadata"]["name"]] = json.loads(json.dumps(body))
        return body

    async def patch(self, body: dict[str, Any]) -> Any:
        live = self.objects[body["kind"], body["metadata"]["name"]]
        for key, value in body.items():
            live[key] = {**live.get(key, {}), **value} if isinstance(value, dict) else value
        return live

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, name), None)

    async def list(self, kind: str, namespace: str, labels: dict[str, str]) -> list[Any]:
        return []
