#!/usr/bin/env python3
"""Host discovery for ``phalanx run --host-discovery-script`` on Kubernetes: the job's ready pods.

Prints one ``ADDRESS:SLOTS`` line per pod matching ``$PHALANX_K8S_SELECTOR`` (a label selector,
default ``app=phalanx-elastic-worker``) in ``$PHALANX_K8S_NAMESPACE`` (default: this pod's own
namespace) that is Running, Ready and not being deleted, in pod-name order (a StatefulSet's
ordinals). ADDRESS is the pod IP; SLOTS the pod's ``phalanx.dev/slots`` annotation, else
``$PHALANX_K8S_SLOTS`` (default 1). phalanx polls it every ``--discovery-interval`` seconds
and grows or shrinks the job at the next commit (phalanx/launcher/discovery.py).

It reads the API with the official ``kubernetes`` client: in a pod, with the pod's service
account (it needs ``list`` on pods: elastic/rbac.yaml); elsewhere, with ``$KUBECONFIG``.
A failed call prints one line on stderr and exits 1; phalanx then keeps the hosts it has.

    $ PHALANX_K8S_SELECTOR=app=phalanx-elastic-worker ./discover_hosts.py
    10.42.0.17:1
    10.42.1.9:1
"""

import os
import sys

SLOTS_ANNOTATION = "phalanx.dev/slots"
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _ready(pod) -> bool:
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def ready_hosts(pods, default_slots: int = 1) -> list[tuple[str, int]]:
    """``(pod IP, slots)`` of the ready pods among ``pods`` (V1Pod objects), by pod name."""
    out = []
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        if not _ready(pod) or not pod.status.pod_ip:
            continue
        slots = (pod.metadata.annotations or {}).get(SLOTS_ANNOTATION, default_slots)
        out.append((pod.status.pod_ip, int(slots)))
    return out


def _namespace() -> str:
    if os.environ.get("PHALANX_K8S_NAMESPACE"):
        return os.environ["PHALANX_K8S_NAMESPACE"]
    if os.path.exists(_NAMESPACE_FILE):
        with open(_NAMESPACE_FILE) as f:
            return f.read().strip()
    return "default"


def main() -> int:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    selector = os.environ.get("PHALANX_K8S_SELECTOR", "app=phalanx-elastic-worker")
    try:
        pods = client.CoreV1Api().list_namespaced_pod(_namespace(), label_selector=selector, timeout_seconds=10)
    except Exception as err:  # ApiException, connection errors: one line, phalanx keeps its hosts
        print(f"discover_hosts: cannot list pods ({selector}): {err}".splitlines()[0], file=sys.stderr)
        return 1
    for host, slots in ready_hosts(pods.items, int(os.environ.get("PHALANX_K8S_SLOTS", "1"))):
        print(f"{host}:{slots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
