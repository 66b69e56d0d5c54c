"""The pod runner: the local cluster's kubelet and container runtime, for iterserve's pods.

For each pod kube-scheduler bound to one of the fake nodes it hands out an IP of the pod
range, lays out the pod's volumes in a directory (ConfigMaps and Secrets written from the
API as the kubelet's AtomicWriter does, each key a symlink through ``..data``, and refreshed
every :data:`VOLUME_REFRESH_S` while the pod runs by swapping ``..data``; emptyDirs empty;
the ServiceAccount token a kubeconfig), resolves its environment
(values, Secret and ConfigMap keys, the downward API, ``$(VAR)`` in args), and runs the
container's command inside the pod network namespace, bound to the pod IP:

- ``iterserve serve ...`` (server pods) runs as ``iterserve serve --simulate PROFILE``
  (the real scheduler, block manager and HTTP server over a latency profile): the profile
  is ``a100x4-llama3-70b`` for a tensor-parallel degree of 4 and ``cpu-smollm2`` otherwise
  (its degree replaces the pod's); ``--model`` is dropped (no weights are mounted).
- ``iterserve operator|router ...`` (the control image) runs as it is, with a kubeconfig for
  the pod's ServiceAccount, so RBAC authorizes its every call for real; a router's
  ``--tokenizer`` naming a directory without a tokenizer (the model's volume: no weights here)
  becomes ``char``, the simulated replicas' tokenizer.
- ``--host`` becomes the pod IP (pods share one network namespace here, so ``0.0.0.0`` would
  collide); paths under a volume's mount path become the pod directory's.

The runner's own ``PYTHONPATH``, if set, is passed to every pod: a checkout's code runs in the
pods (the tests run their worktree's). Each mapping is logged. Status follows the process and
the readiness probe (HTTP GET of the container's readinessProbe on the pod IP): Running, Ready
when the probe answers 2xx or 3xx. A process that exits is restarted (restartPolicy Always,
backoff 1-10 s, restartCount). A deleted pod's process gets SIGTERM, SIGKILL after the grace
period, then the pod is removed.
Not done: startup and liveness probes, preStop hooks, init containers (logged), resource
limits, other containers than the first, NetworkPolicies (no network plugin enforces them).
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from localcluster import pki
from localcluster.control_plane import NODE_NAMES
from localcluster.network import NetworkError, PodNetwork
from localcluster.processes import Process, stop_all

logger = logging.getLogger("localcluster.pods")

ITERSERVE = str(Path(sys.executable).with_name("iterserve"))
PROFILE_BY_TP = {4: "a100x4-llama3-70b", 1: "cpu-smollm2"}
TOKEN_EXPIRATION_S = 24 * 3600
PROBE_PERIOD_S = 1.0
# How often a running pod's ConfigMap and Secret volumes are read again (a kubelet: its sync
# period, about a minute; shorter here so that a test of a rotation waits seconds).
VOLUME_REFRESH_S = 2.0
MAX_BACKOFF_S = 10.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Unsupported(Exception):
    """A pod this runner cannot run (not an iterserve command)."""


class ContainerConfigError(Exception):
    """What a pod needs is not there (yet): a Secret, a ConfigMap, one of their keys, a free
    pod IP. The pod waits, as a kubelet's CreateContainerConfigError, and is tried again."""


@dataclass
class RunningPod:
    """A pod the runner started, and what it last reported."""

    uid: str
    namespace: str
    name: str
    ip: str
    directory: Path
    pod: dict[str, Any]  # as first seen (a pod's spec does not change)
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    process: Process | None = None
    restart_count: int = 0
    restart_at: float = 0.0
    started_at: str = field(default_factory=_now)
    ready: bool | None = None
    last_exit: int | None = None
    stopping: bool = False

    @property
    def container(self) -> dict[str, Any]:
        return dict(self.pod["spec"]["containers"][0])


class PodRunner:
    """Watches pods on the fake nodes and runs them (see the module docstring)."""

    def __init__(
        self, kubeconfig: Path, server: str, ca_cert: Path, network: PodNetwork, workdir: Path
    ) -> None:
        # Any: plain dicts go in where the client's stubs want its models.
        self.api: Any = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
        self.server = server
        self.ca_cert = ca_cert.read_bytes()
        self.network = network
        self.workdir = workdir
        self.pods: dict[str, RunningPod] = {}
        # Pods that could not start for a Secret or ConfigMap the API did not give (as a
        # kubelet's CreateContainerConfigError): tried again every probe period.
        self.waiting: dict[str, dict[str, Any]] = {}
        self.unsupported: set[str] = set()  # pods this runner cannot run (warned once)
        self.said: set[tuple[str, Any]] = set()  # (pod, volume) mappings logged once
        self.lock = threading.RLock()
        self.stopped = threading.Event()
        self.threads = [
            threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True),
            threading.Thread(target=self._probe_loop, name="pod-probe", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        """Stop every pod's process (the pods stay in the API: the cluster is going away)."""
        self.stopped.set()
        t0 = time.monotonic()
        with self.lock:
            for pod in self.pods.values():
                pod.stopping = True
            stop_all([p.process for p in self.pods.values() if p.process is not None], 5.0)
            self.pods.clear()
        logger.info("pods stopped in %.1f s", time.monotonic() - t0)

    # ---------------------------------------------------------------- watching

    def _watch_loop(self) -> None:
        while not self.stopped.is_set():
            try:
                listed = self.api.list_pod_for_all_namespaces()
                seen = set()
                for pod in listed.items:
                    seen.add(pod.metadata.uid)
                    self._on_pod(self.api.api_client.sanitize_for_serialization(pod))
                with self.lock:
                    for uid in [u for u in (*self.pods, *self.waiting) if u not in seen]:
                        self._forget(uid)
                stream = watch.Watch().stream(
                    self.api.list_pod_for_all_namespaces,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                    _preload_content=False,
                )
                for event in stream:
                    if self.stopped.is_set():
                        return
                    obj = event["raw_object"]
                    if event["type"] == "DELETED":
                        with self.lock:
                            self._forget(obj["metadata"]["uid"])
                    elif event["type"] in ("ADDED", "MODIFIED"):
                        self._on_pod(obj)
            except Exception as e:  # the API server restarting, a watch expiring (410)
                if not self.stopped.is_set():
                    logger.info("pod watch ended (%s); listing again", e)
                    self.stopped.wait(1.0)

    def _on_pod(self, pod: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod.get("spec") or {}
        if spec.get("nodeName") not in NODE_NAMES:
            return
        uid = meta["uid"]
        with self.lock:
            running = self.pods.get(uid)
            if meta.get("deletionTimestamp"):
                if running is not None and not running.stopping:
                    running.stopping = True
                    grace = meta.get("deletionGracePeriodSeconds") or 30
                    threading.Thread(
                        target=self._terminate, args=(running, float(grace)), daemon=True
                    ).start()
                elif running is None:
                    self._forget(uid)
                    self._delete_now(meta["namespace"], meta["name"], uid)
                return
            if running is not None or (pod.get("status") or {}).get("phase") in (
                "Failed",
                "Succeeded",
            ):
                return
            try:
                self.pods[uid] = self._prepare(pod)
            except Unsupported as e:
                if uid in self.unsupported:
                    return  # said once per pod
                self.unsupported.add(uid)
                logger.warning("pod %s/%s not run: %s", meta["namespace"], meta["name"], e)
                self._patch_status(
                    meta["namespace"],
                    meta["name"],
                    {
                        "phase": "Pending",
                        "conditions": [{"type": "PodScheduled", "status": "True"}],
                        "containerStatuses": [
                            self._container_status(
                                spec["containers"][0],
                                {
                                    "waiting": {
                                        "reason": "UnsupportedByLocalRunner",
                                        "message": str(e),
                                    }
                                },
                                False,
                                0,
                            )
                        ],
                    },
                )
                return
            except (ApiException, ContainerConfigError, NetworkError) as e:  # retried
                self.network.remove_pod_ip(uid)
                reason = f"{e.status} {e.reason}" if isinstance(e, ApiException) else str(e)
                if uid not in self.waiting:
                    logger.warning("pod %s/%s waits: %s", meta["namespace"], meta["name"], reason)
                    waiting = {"reason": "CreateContainerConfigError", "message": reason}
                    self._patch_status(meta["namespace"], meta["name"], {
                        "phase": "Pending",
                        "containerStatuses": [self._container_status(
                            spec["containers"][0], {"waiting": waiting}, False, 0)],
                    })  # fmt: skip
                self.waiting[uid] = pod
                return
            self.waiting.pop(uid, None)
            self._launch(self.pods[uid])

    def _forget(self, uid: str) -> None:
        self.waiting.pop(uid, None)
        self.unsupported.discard(uid)
        pod = self.pods.pop(uid, None)
        if pod is not None:
            pod.stopping = True
            if pod.process is not None:
                pod.process.stop(grace_s=2.0)
        self.network.remove_pod_ip(uid)

    def _terminate(self, pod: RunningPod, grace_s: float) -> None:
        if pod.process is not None:
            code = pod.process.stop(grace_s=grace_s)
            logger.info("pod %s/%s stopped (exit %s)", pod.namespace, pod.name, code)
        with self.lock:
            self.pods.pop(pod.uid, None)
            self.network.remove_pod_ip(pod.uid)
        self._delete_now(pod.namespace, pod.name, pod.uid)

    def _delete_now(self, namespace: str, name: str, uid: str) -> None:
        try:
            self.api.delete_namespaced_pod(
                name,
                namespace,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
                ),
            )
        except ApiException as e:
            if e.status not in (404, 409):
                logger.warning("deleting pod %s/%s: %s", namespace, name, e.reason)

    # ---------------------------------------------------------------- preparing

    def _prepare(self, pod: dict[str, Any]) -> RunningPod:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        if not command or Path(command[0]).name != "iterserve" or len(command) < 2:
            raise Unsupported(f"command {command!r}: only `iterserve ...` containers run here")
        if command[1] not in ("serve", "operator", "router"):
            raise Unsupported(f"`iterserve {command[1]}`: only serve, operator and router run here")
        where = f"{meta['namespace']}/{meta['name']}"
        if len(spec["containers"]) > 1 or spec.get("initContainers"):
            logger.info(
                "pod %s: only container %s runs here (no init or other containers)",
                where,
                container["name"],
            )
        directory = self.workdir / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        if directory.exists():
            shutil.rmtree(directory)
        ip = self.network.add_pod_ip(meta["uid"])
        running = RunningPod(meta["uid"], meta["namespace"], meta["name"], ip, directory, pod)
        self._configure(running)
        return running

    def _configure(self, running: RunningPod, refresh: bool = False) -> None:
        """The container's argv and env for its next start: volumes laid out (with
        ``refresh``, ConfigMaps and Secrets read again, as a kubelet does for a restarted
        container), the environment resolved, the arguments mapped (module docstring).

        Raises:
            ApiException: a Secret or ConfigMap could not be read.
        """
        pod, ip, directory = running.pod, running.ip, running.directory
        container = running.container
        where = f"{running.namespace}/{running.name}"
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        mounts = self._volumes(pod, container, directory / "volumes", refresh)
        env = self._env(pod, container, ip)
        env = {k: _under_mounts(v, mounts) for k, v in env.items()}
        if command[1] in ("operator", "router"):
            env["KUBECONFIG"] = str(self._service_account_kubeconfig(pod, directory))
        argv = [_expand(a, env) for a in command[1:]]
        argv = [_under_mounts(a, mounts) for a in argv]
        argv = _host_is_pod_ip(argv, ip, where)
        if command[1] == "serve":
            argv = _simulated(argv, where)
        elif command[1] == "router":
            argv = _simulated_tokenizer(argv, where)
        running.argv, running.env = [ITERSERVE, *argv], env

    def _volumes(
        self, pod: dict[str, Any], container: dict[str, Any], root: Path, refresh: bool = False
    ) -> dict[str, Path]:
        """Each volume mount of ``container``: its mount path -> a directory (or file, with
        subPath) under ``root``, filled as the kubelet would."""
        namespace, where = pod["metadata"]["namespace"], pod["metadata"]["name"]
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        mounts: dict[str, Path] = {}
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount["name"], {})
            directory = root / mount["name"]
            if refresh and directory.exists() and ("configMap" in volume or "secret" in volume):
                self._fill(volume, directory, pod, namespace, where)  # ..data swapped
            if not directory.exists():
                directory.mkdir(parents=True)
                self._fill(volume, directory, pod, namespace, where)
            target = directory / mount["subPath"] if mount.get("subPath") else directory
            mounts[mount["mountPath"]] = target
        return mounts

    def _fill(
        self,
        volume: dict[str, Any],
        directory: Path,
        pod: dict[str, Any],
        namespace: str,
        where: str,
    ) -> None:
        if "configMap" in volume:
            data = self.api.read_namespaced_config_map(volume["configMap"]["name"], namespace).data
            _atomic_write(directory, _items(data or {}, volume["configMap"].get("items")))
        elif "secret" in volume:
            secret = self.api.read_namespaced_secret(volume["secret"]["secretName"], namespace)
            decoded = {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            _atomic_write(directory, _items(decoded, volume["secret"].get("items")))
        elif "projected" in volume:  # the ServiceAccount's kube-api-access-* volume
            for source in volume["projected"].get("sources") or []:
                if "serviceAccountToken" in source:
                    token = self._token(pod)
                    (directory / source["serviceAccountToken"]["path"]).write_text(token)
                elif "configMap" in source and source["configMap"]["name"] == "kube-root-ca.crt":
                    (directory / "ca.crt").write_bytes(self.ca_cert)
                elif "downwardAPI" in source:
                    (directory / "namespace").write_text(namespace)
        elif "emptyDir" not in volume and (where, volume.get("name")) not in self.said:
            self.said.add((where, volume.get("name")))
            logger.info(
                "pod %s/%s: volume %s (%s) is an empty directory here",
                namespace,
                where,
                volume.get("name"),
                ", ".join(sorted(set(volume) - {"name"})),
            )

    def _token(self, pod: dict[str, Any]) -> str:
        meta = pod["metadata"]
        account = pod["spec"].get("serviceAccountName") or "default"
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[],
                expiration_seconds=TOKEN_EXPIRATION_S,
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=meta["name"], uid=meta["uid"]
                ),
            )
        )
        answer = self.api.create_namespaced_service_account_token(
            account, meta["namespace"], request
        )
        return str(answer.status.token)

    def _service_account_kubeconfig(self, pod: dict[str, Any], directory: Path) -> Path:
        account = pod["spec"].get("serviceAccountName") or "default"
        user = f"system:serviceaccount:{pod['metadata']['namespace']}:{account}"
        kubeconfig = pki.kubeconfig(self.server, self.ca_cert, user, token=self._token(pod))
        return pki.write_kubeconfig(directory / "kubeconfig", kubeconfig)

    def _env(self, pod: dict[str, Any], container: dict[str, Any], ip: str) -> dict[str, str]:
        meta, namespace = pod["metadata"], pod["metadata"]["namespace"]
        fields = {
            "metadata.name": meta["name"],
            "metadata.namespace": namespace,
            "metadata.uid": meta["uid"],
            "spec.nodeName": pod["spec"].get("nodeName", ""),
            "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
            "status.podIP": ip,
            "status.hostIP": self.network.node_ip,
        }
        env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
        }
        if os.environ.get("PYTHONPATH"):  # a checkout's code in the pods (module docstring)
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        for item in container.get("env") or []:
            source = item.get("valueFrom")
            if source is None:
                env[item["name"]] = _expand(item.get("value", ""), env)
            elif "secretKeyRef" in source or "configMapKeyRef" in source:
                value = self._key_ref(source, namespace)
                if value is not None:
                    env[item["name"]] = value
            elif "fieldRef" in source:
                env[item["name"]] = fields.get(source["fieldRef"]["fieldPath"], "")
        return env

    def _key_ref(self, source: dict[str, Any], namespace: str) -> str | None:
        """The value of an env entry's ``secretKeyRef`` or ``configMapKeyRef``; None when it is
        ``optional`` and missing (the variable is left out, as a kubelet does).

        Raises:
            ContainerConfigError: the object or its key is missing and not optional.
        """
        secret = "secretKeyRef" in source
        ref = source["secretKeyRef" if secret else "configMapKeyRef"]
        kind = "secret" if secret else "configmap"
        try:
            read = (
                self.api.read_namespaced_secret if secret else self.api.read_namespaced_config_map
            )
            data = read(ref["name"], namespace).data or {}
        except ApiException as e:
            if e.status != 404:
                raise
            data = None
        if data is not None and ref["key"] in data:
            value = data[ref["key"]]
            return base64.b64decode(value).decode() if secret else str(value)
        if ref.get("optional"):
            return None
        missing = f'{kind} "{ref["name"]}" not found' if data is None else (
            f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}"
        )  # fmt: skip
        raise ContainerConfigError(missing)

    # ---------------------------------------------------------------- running

    def _launch(self, pod: RunningPod) -> None:
        pod.directory.mkdir(parents=True, exist_ok=True)
        pod.process = Process(
            f"{pod.namespace}/{pod.name}",
            [*self.network.netns_command(), *pod.argv],
            pod.directory / "container.log",
            env=pod.env,
            cwd=pod.directory,
        )
        pod.started_at = _now()
        pod.ready = None  # reported at the next probe
        logger.info(
            "pod %s/%s started at %s: %s", pod.namespace, pod.name, pod.ip, " ".join(pod.argv[1:])
        )
        self._report(pod, ready=False)

    def _probe_loop(self) -> None:
        refreshed_at = time.monotonic()
        while not self.stopped.wait(PROBE_PERIOD_S):
            with self.lock:
                pods = [p for p in self.pods.values() if not p.stopping]
                waiting = list(self.waiting.values())
            if time.monotonic() - refreshed_at >= VOLUME_REFRESH_S:
                refreshed_at = time.monotonic()
                for pod in pods:
                    self._refresh_volumes(pod)
            for pod_dict in waiting:
                try:
                    self._on_pod(pod_dict)
                except Exception as e:  # the API server restarting: next period
                    logger.debug("pod %s: %s", pod_dict["metadata"]["name"], e)
            for pod in pods:
                try:
                    self._check(pod)
                except Exception as e:  # the API server restarting: next period
                    logger.debug("pod %s/%s: %s", pod.namespace, pod.name, e)

    def _refresh_volumes(self, pod: RunningPod) -> None:
        """A running pod's ConfigMap and Secret volumes read again, as a kubelet's sync does
        (a changed one swaps its ``..data``); not those mounted with a subPath (a kubelet does
        not update those either). An object that cannot be read keeps its files."""
        volumes = {v["name"]: v for v in pod.pod["spec"].get("volumes") or []}
        mounts = pod.container.get("volumeMounts") or []
        pinned = {m["name"] for m in mounts if m.get("subPath")}
        for name in {m["name"] for m in mounts} - pinned:
            volume, directory = volumes.get(name, {}), pod.directory / "volumes" / name
            if ("configMap" in volume or "secret" in volume) and directory.exists():
                try:
                    self._fill(volume, directory, pod.pod, pod.namespace, pod.name)
                except Exception as e:  # the API server restarting, the object deleted
                    logger.debug("pod %s/%s: volume %s: %s", pod.namespace, pod.name, name, e)

    def _check(self, pod: RunningPod) -> None:
        assert pod.process is not None
        code = pod.process.exit_code()
        if code is not None:
            if pod.restart_at == 0.0:
                pod.process.stop(grace_s=1.0)
                pod.last_exit = code
                backoff = min(MAX_BACKOFF_S, 2.0**pod.restart_count)
                pod.restart_at = time.monotonic() + backoff
                logger.warning(
                    "pod %s/%s exited with %s; restart in %.0f s:\n%s",
                    pod.namespace,
                    pod.name,
                    code,
                    backoff,
                    pod.process.tail(15),
                )
                self._report(pod, ready=False, terminated=code)
            elif time.monotonic() >= pod.restart_at:
                self._configure(pod, refresh=True)  # raises: tried again next period
                pod.restart_at = 0.0
                pod.restart_count += 1
                with self.lock:
                    if not pod.stopping:
                        self._launch(pod)
            return
        ready = self._probe(pod)
        if ready != pod.ready:
            self._report(pod, ready=ready)

    def _probe(self, pod: RunningPod) -> bool:
        probe = (pod.container.get("readinessProbe") or {}).get("httpGet")
        if probe is None:
            return True
        port = probe["port"]
        if isinstance(port, str):
            port = next(
                p["containerPort"]
                for p in pod.container.get("ports") or []
                if p.get("name") == port
            )
        url = f"http://{pod.ip}:{port}{probe.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return bool(200 <= response.status < 400)
        except (urllib.error.URLError, OSError):
            return False

    def _report(self, pod: RunningPod, ready: bool, terminated: int | None = None) -> None:
        if terminated is not None:
            state = {
                "terminated": {
                    "exitCode": terminated,
                    "reason": "Error" if terminated else "Completed",
                    "finishedAt": _now(),
                }
            }
        else:
            state = {"running": {"startedAt": pod.started_at}}
        status = "True" if ready else "False"
        body = {
            "phase": "Running",
            "hostIP": self.network.node_ip,
            "hostIPs": [{"ip": self.network.node_ip}],
            "podIP": pod.ip,
            "podIPs": [{"ip": pod.ip}],
            "startTime": pod.started_at,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": status, "lastTransitionTime": _now()},
                {"type": "Ready", "status": status, "lastTransitionTime": _now()},
            ],
            "containerStatuses": [
                self._container_status(pod.container, state, ready, pod.restart_count)
            ],
        }
        if self._patch_status(pod.namespace, pod.name, body):
            pod.ready = ready

    @staticmethod
    def _container_status(
        container: dict[str, Any], state: dict[str, Any], ready: bool, restart_count: int
    ) -> dict[str, Any]:
        return {
            "name": container["name"],
            "image": container.get("image", ""),
            "imageID": "",
            "ready": ready,
            "started": "running" in state,
            "restartCount": restart_count,
            "state": state,
        }

    def _patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> bool:
        try:
            self.api.patch_namespaced_pod_status(name, namespace, {"status": status})
            return True
        except ApiException as e:
            if e.status != 404:
                logger.info("pod %s/%s status: %s %s", namespace, name, e.status, e.reason)
            return False


# -------------------------------------------------------------------- argument mapping


def _items(data: dict[str, str], items: list[dict[str, Any]] | None) -> dict[str, str]:
    """Path -> content of a ConfigMap's or Secret's volume (``items`` picks and renames)."""
    chosen = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
    return {path: data[key] for key, path in chosen.items() if key in data}


def _atomic_write(directory: Path, files: dict[str, str]) -> bool:
    """``files`` (path -> content) into ``directory`` as the kubelet's AtomicWriter lays them
    out: a hidden timestamped directory holds them, ``..data`` links to it, and each top-level
    name links through ``..data``; an update writes a new directory and renames a new
    ``..data`` link over the old one, so a reader sees the old files or the new, never a mix.
    Whether anything changed."""
    data = directory / "..data"
    if data.is_symlink():
        current = data.resolve()
        old = {
            str(f.relative_to(current)): f.read_text() for f in current.rglob("*") if f.is_file()
        }
        if old == files:
            return False
    stamp = datetime.datetime.now(datetime.UTC).strftime("..%Y_%m_%d_%H_%M_%S.")
    new = Path(tempfile.mkdtemp(prefix=stamp, dir=directory))
    for path, text in files.items():
        (new / path).parent.mkdir(parents=True, exist_ok=True)
        (new / path).write_text(text)
    previous = data.resolve() if data.is_symlink() else None
    (directory / "..data_tmp").unlink(missing_ok=True)
    (directory / "..data_tmp").symlink_to(new.name)
    os.replace(directory / "..data_tmp", data)
    names = {Path(path).parts[0] for path in files}
    for entry in directory.iterdir():
        if not entry.name.startswith("..") and entry.is_symlink() and entry.name not in names:
            entry.unlink()  # a key removed from the object
    for name in names:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(f"..data/{name}")
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return True


_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (an unknown variable stays as written)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def _under_mounts(value: str, mounts: dict[str, Path]) -> str:
    """A path under a mount path, as the pod directory's (the longest mount path wins)."""
    for mount_path in sorted(mounts, key=len, reverse=True):
        if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
            return str(mounts[mount_path]) + value[len(mount_path.rstrip("/")) :]
    return value


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _without(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _host_is_pod_ip(argv: list[str], ip: str, where: str) -> list[str]:
    host = _flag_value(argv, "--host")
    if host is None or host == ip:
        return argv
    logger.info("pod %s: --host %s -> %s (pods share one network namespace here)", where, host, ip)
    return [*_without(argv, "--host"), "--host", ip]


def _simulated_tokenizer(argv: list[str], where: str) -> list[str]:
    """A router's ``--tokenizer DIR`` without a tokenizer there (no weights are mounted here)
    as ``char``: the simulated replicas' tokenizer (~4 characters per token over the
    ``cpu-smollm2`` profile's 49152 ids; replicas on the 70B profile use 128256 and would not
    match), so that its KV-event match sees the token ids the replicas publish."""
    tokenizer = _flag_value(argv, "--tokenizer")
    if (
        tokenizer is None
        or tokenizer.startswith("char")
        or ((Path(tokenizer) / "tokenizer.json").is_file() or Path(tokenizer).is_file())
    ):
        return argv
    logger.info("pod %s: --tokenizer %s -> char (no tokenizer there)", where, tokenizer)
    return [*_without(argv, "--tokenizer"), "--tokenizer", "char"]


def _simulated(argv: list[str], where: str) -> list[str]:
    """``iterserve serve`` args as a simulated replica's."""
    tp = int(_flag_value(argv, "--tensor-parallel-size") or 1)
    profile = PROFILE_BY_TP.get(tp, PROFILE_BY_TP[1])
    mapped = _without(_without(argv, "--model"), "--tensor-parallel-size")
    profile_tp = next(k for k, v in PROFILE_BY_TP.items() if v == profile)
    logger.info(
        "pod %s: serve --simulate %s (--model dropped%s)",
        where,
        profile,
        "" if tp == profile_tp else f", --tensor-parallel-size {tp} -> {profile_tp}",
    )
    return [*mapped, "--simulate", profile, "--tensor-parallel-size", str(profile_tp)]
