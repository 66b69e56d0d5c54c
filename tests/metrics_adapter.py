"""A fake custom-metrics API (``custom.metrics.k8s.io/v1beta2``) for the real HPA controller.

It serves the one metric the operator's HPA reads, ``iterserve_num_requests_waiting`` of
pods, with the value the test sets per namespace, for every pod that matches the HPA's label
selector (listed from the API server). Registered as an aggregated API: an APIService whose
selector-less Service has an EndpointSlice at this server's address (the API server runs
with ``--enable-aggregator-routing``). In production a Prometheus adapter (or KEDA) serves
the same API from the pods' ``/metrics``.
"""

from __future__ import annotations

import datetime
import json
import ssl
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cluster_utils import LocalCluster
from kubernetes import client, config
from localcluster import pki

GROUP, VERSION = "custom.metrics.k8s.io", "v1beta2"
METRIC = "iterserve_num_requests_waiting"


class MetricsAdapter:
    """The fake adapter, its registration and the values it reports."""

    def __init__(self, cluster: LocalCluster, directory: Path) -> None:
        self.cluster = cluster
        self.values: dict[str, float] = {}  # namespace -> the metric's value of each pod
        self.requests: list[str] = []
        self.core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        issued = pki.CertificateAuthority().issue("metrics-adapter", ips=(cluster.host_ip,))
        cert = pki.write_private(directory / "adapter.crt", issued.cert)
        key = pki.write_private(directory / "adapter.key", issued.key)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        adapter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                adapter.requests.append(self.path)
                status, body = adapter.answer(self.path)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((cluster.host_ip, 0), Handler)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        url = urllib.parse.urlsplit(path)
        parts = [urllib.parse.unquote(p) for p in url.path.strip("/").split("/")]
        if parts == ["apis", GROUP, VERSION]:
            return 200, {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"{GROUP}/{VERSION}",
                "resources": [
                    {"name": f"pods/{METRIC}", "singularName": "", "namespaced": True,
                     "kind": "MetricValueList", "verbs": ["get"]},
                ],
            }  # fmt: skip
        # /apis/GROUP/VERSION/namespaces/NS/pods/*/METRIC?labelSelector=...
        if len(parts) == 8 and parts[3] == "namespaces" and parts[5:] == ["pods", "*", METRIC]:
            namespace = parts[4]
            selector = urllib.parse.parse_qs(url.query).get("labelSelector", [""])[0]
            pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
            now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            items = [
                {
                    "describedObject": {"kind": "Pod", "namespace": namespace,
                                        "name": p.metadata.name, "apiVersion": "/v1"},
                    "metric": {"name": METRIC, "selector": None},
                    "timestamp": now,
                    "windowSeconds": 15,
                    "value": f"{int(self.values.get(namespace, 0) * 1000)}m",
                }
                for p in pods
                if p.status.phase == "Running"
            ]  # fmt: skip
            return 200, {"kind": "MetricValueList", "apiVersion": f"{GROUP}/{VERSION}",
                         "metadata": {}, "items": items}  # fmt: skip
        return 404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404}

    def register(self) -> None:
        """Serve, and make the API server route ``custom.metrics.k8s.io`` here."""
        self.thread.start()
        name, namespace = "fake-custom-metrics", "kube-system"
        objects = [
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": name, "namespace": namespace},
             "spec": {"ports": [{"name": "https", "port": 443, "targetPort": self.port}]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": name, "namespace": namespace,
                          "labels": {"kubernetes.io/service-name": name}},
             "addressType": "IPv4",
             "endpoints": [{"addresses": [self.cluster.host_ip],
                            "conditions": {"ready": True}}],
             "ports": [{"name": "https", "port": self.port, "protocol": "TCP"}]},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": f"{VERSION}.{GROUP}"},
             "spec": {"group": GROUP, "version": VERSION, "insecureSkipTLSVerify": True,
                      "groupPriorityMinimum": 100, "versionPriority": 200,
                      "service": {"name": name, "namespace": namespace, "port": 443}}},
        ]  # fmt: skip
        self.cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1",
                             "kind": "List", "items": objects}))  # fmt: skip

    def close(self) -> None:
        self.cluster.kubectl("delete", "apiservice", f"{VERSION}.{GROUP}", check=False)
        self.server.shutdown()
        self.server.server_close()
