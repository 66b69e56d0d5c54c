"""Where the operator's Kubernetes API is: a kubeconfig file (``--kubeconfig``, else
``$KUBECONFIG`` or ``~/.kube/config``) or, inside a pod, its ServiceAccount. Both kopf's own
connection and the operator's client (``kubernetes.aio``) come from the same configuration."""

from __future__ import annotations

import os
from pathlib import Path

import kopf
from kubernetes.aio import client, config

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


async def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """The API's address and credentials.

    Raises:
        kubernetes ConfigException: no kubeconfig and not in a pod.
    """
    configuration = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if kubeconfig is None and not Path(path).exists() and IN_CLUSTER_TOKEN.exists():
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(config_file=path, client_configuration=configuration)
    return configuration


async def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    return client.ApiClient(await load_configuration(kubeconfig))


async def connection_info(kubeconfig: str | None = None) -> kopf.ConnectionInfo:
    """kopf's connection from the same configuration (as kopf's own ``login_via_client``)."""
    c = await load_configuration(kubeconfig)
    bearer = await c.get_api_key_with_prefix("BearerToken")
    header = bearer or await c.get_api_key_with_prefix("authorization") or ""
    scheme, _, token = header.partition(" ")
    if not token:
        scheme, token = "Bearer", scheme
    return kopf.ConnectionInfo(
        server=c.host,
        ca_path=c.ssl_ca_cert,
        insecure=not c.verify_ssl,
        scheme=scheme if token else None,
        token=token or None,
        certificate_path=c.cert_file,
        private_key_path=c.key_file,
    )
