"""``python -m localcluster [--workdir DIR]`` (``make cluster``): a local control plane in the
foreground. Once the API server answers it writes the admin kubeconfig to DIR/kubeconfig
(default ``.cluster/kubeconfig``) and prints its path; SIGINT or SIGTERM stops everything it
started. Exit 2 when it cannot run here (no root, no free slot), 1 when a component fails."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from pathlib import Path

from localcluster import Cluster, ClusterError, NetworkError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__)
    parser.add_argument("--workdir", type=Path, default=Path(".cluster"))
    parser.add_argument(
        "--ready-file",
        type=Path,
        default=None,
        help="write a JSON line (kubeconfig, API server, slot) here once ready",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # While starting, SIGINT and SIGTERM interrupt at once (Cluster.start stops what it had
    # started); once running, they end the wait below.
    # (SIGINT too: a shell starts background jobs with it ignored.)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = Cluster(args.workdir.resolve())
    try:
        cluster.start()
    except KeyboardInterrupt:
        return 130
    except NetworkError as e:
        print(f"make cluster: {e}", file=sys.stderr)
        return 2
    except ClusterError as e:
        print(f"make cluster: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        assert cluster.control_plane is not None and cluster.network is not None
        info = {
            "kubeconfig": str(cluster.kubeconfig),
            "server": cluster.control_plane.server,
            "slot": cluster.network.slot,
            "namespace": cluster.network.namespace,
            "pod_cidr": cluster.network.pod_cidr,
            "host_ip": cluster.network.host_ip,
            # KEDA's ScaledObject CRD, from KEDA's Go module (scripts/k8s-build).
            "crds_dir": str(cluster.control_plane.bin_dir.parent / "crds"),
        }
        if args.ready_file is not None:
            args.ready_file.write_text(json.dumps(info) + "\n")
        print(f"local cluster ready: export KUBECONFIG={cluster.kubeconfig}", flush=True)
        print(
            f"  API server {info['server']}, pods in {info['pod_cidr']} "
            f"(network namespace {info['namespace']}); Ctrl-C stops it",
            flush=True,
        )
        while not stop.wait(0.5):
            cluster.control_plane.supervise()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
