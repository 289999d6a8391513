"""deploy/kubernetes/: the manifests validate against the official ``kubernetes`` client's models,
their ``phalanx run`` lines parse as the CLI reads them, and the elastic host-discovery script
lists the ready pods of a fake API server through the real client (phalanx's discovery contract).
None of this ran on a real cluster (docs/kubernetes.md)."""

import http.server
import json
import os
import pathlib
import re
import shlex
import sys
import threading
import types

import pytest
import yaml

from phalanx.cli.main import build_parser
from phalanx.cli.torchrun_flags import torchrun_layout
from phalanx.launcher.discovery import discover_hosts
from phalanx.preemption import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.unit

kubernetes = pytest.importorskip("kubernetes", reason="pip install kubernetes (the test extra)")

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
SCRIPT = DEPLOY / "elastic" / "discover_hosts.py"
MODELS = {"Service": "V1Service", "Job": "V1Job", "PersistentVolumeClaim": "V1PersistentVolumeClaim",
          "StatefulSet": "V1StatefulSet", "ServiceAccount": "V1ServiceAccount", "Role": "V1Role",
          "RoleBinding": "V1RoleBinding"}


def _docs():
    out = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        out += [(path.relative_to(DEPLOY).as_posix(), d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _round_trip(doc: dict, model: str) -> dict:
    """Deserialize into the client's model and back: a misspelled or misplaced field is dropped, so it shows."""
    api = kubernetes.client.ApiClient()
    try:
        obj = api.deserialize(json.dumps(doc), model, "application/json")
    except (TypeError, AttributeError):  # older clients read a response object's .data, no content type
        obj = api.deserialize(types.SimpleNamespace(data=json.dumps(doc)), model)
    return api.sanitize_for_serialization(obj)


def _phalanx_lines(doc: dict):
    """(container, the argv after `exec phalanx run`) for every container that runs phalanx."""
    spec = doc.get("spec", {})
    templates = [spec["template"]] if "template" in spec else \
        [r["template"] for r in spec.get("pytorchReplicaSpecs", {}).values()]
    for template in templates:
        for c in template["spec"]["containers"]:
            text = " ".join(c.get("args", []))
            if "phalanx run" in text:
                yield c, shlex.split(text.split("exec phalanx run", 1)[1])


def _parse_run(argv, env):
    argv = [re.sub(r"\$(\w+)", lambda m: env[m.group(1)], a) for a in argv]
    args = build_parser().parse_args(["run", *argv])
    return args, torchrun_layout(args)


def test_every_manifest_validates_against_the_client_models():
    docs = _docs()
    kinds = {d["kind"] for _, d in docs}
    assert {"Job", "Service", "StatefulSet", "PyTorchJob", "Role"} <= kinds, kinds
    for name, doc in docs:
        if doc["kind"] in ("PyTorchJob", "Kustomization"):
            continue
        assert doc["kind"] in MODELS, f"{name}: no model for {doc['kind']}"
        assert _round_trip(doc, MODELS[doc["kind"]]) == doc, f"{name}: {doc['kind']} has fields the model lacks"


def test_pytorchjob_shape_and_pod_templates():
    (doc,) = [d for _, d in _docs() if d["kind"] == "PyTorchJob"]
    assert doc["apiVersion"] == "kubeflow.org/v1"
    assert set(doc["spec"]) <= {"runPolicy", "pytorchReplicaSpecs", "elasticPolicy", "nprocPerNode"}
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for kind, rs in replicas.items():
        assert set(rs) <= {"replicas", "restartPolicy", "template"}, kind
        assert rs["restartPolicy"] == "OnFailure", "ExitCode would make exit 85 (preempted) permanent"
        assert _round_trip(rs["template"], "V1PodTemplateSpec") == rs["template"], kind
        assert [c["name"] for c in rs["template"]["spec"]["containers"]] == ["pytorch"]  # the operator's name
    # the operator's variables for the Worker pod (Master: RANK 0)
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "phalanx-train-master-0", "MASTER_PORT": "23456"}
    for _, argv in _phalanx_lines(doc):
        args, layout = _parse_run(argv, env)
        assert layout["multi"] and layout["min_nodes"] == layout["max_nodes"] == 2 and not layout["is_host"]
        assert args.command[-1] == "/app/train.py"


def test_indexed_job_service_names_and_preemption_policy():
    docs = dict(((d["kind"], d["metadata"]["name"]), d) for n, d in _docs() if n == "indexed-job.yaml")
    job, svc = docs["Job", "phalanx-train"], docs["Service", "phalanx-train"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert svc["spec"]["clusterIP"] == "None" and spec["template"]["spec"]["subdomain"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    (container, argv), = _phalanx_lines(job)
    for index in ("0", "1"):
        args, layout = _parse_run(argv, {"JOB_COMPLETION_INDEX": index})
        assert layout["max_nodes"] == spec["completions"] and layout["is_host"] == (index == "0")
        assert layout["rdzv_endpoint"].startswith(f"{job['metadata']['name']}-0.{svc['metadata']['name']}:")
    rule = spec["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "Ignore" and rule["onExitCodes"]["values"] == [PREEMPTED_EXIT_CODE]
    assert rule["onExitCodes"]["containerName"] == container["name"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it


def test_elastic_variant_is_wired_together():
    docs = dict(((d["kind"], d["metadata"]["name"]), d) for n, d in _docs()
                if n.startswith("elastic/") and d["kind"] != "Kustomization")
    kustomization = yaml.safe_load((DEPLOY / "elastic" / "kustomization.yaml").read_text())
    assert all((DEPLOY / "elastic" / r).exists() for r in kustomization["resources"])
    launcher, workers = docs["Job", "phalanx-elastic-launcher"], docs["StatefulSet", "phalanx-elastic-worker"]
    pod = launcher["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == docs["ServiceAccount", "phalanx-launcher"]["metadata"]["name"]
    assert "list" in docs["Role", "phalanx-pod-reader"]["rules"][0]["verbs"]
    (container, argv), = _phalanx_lines(launcher)
    args, _ = _parse_run(argv, {})
    assert args.min_np == 1 and args.max_np == 4
    assert f"COPY deploy/kubernetes/elastic/discover_hosts.py {args.host_discovery_script}" in \
        (DEPLOY / "Dockerfile").read_text()
    selector = {e["name"]: e["value"] for e in container["env"]}["PHALANX_K8S_SELECTOR"]
    key, _, value = selector.partition("=")
    assert workers["spec"]["template"]["metadata"]["labels"][key] == value


# ----------------------------------------------------------------------------- discovery, fake API server


def _pod(name, ip, *, phase="Running", ready=True, deleting=False, slots=None):
    meta = {"name": name, "namespace": "train", "labels": {"app": "phalanx-elastic-worker"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if slots is not None:
        meta["annotations"] = {"phalanx.dev/slots": str(slots)}
    status = {"phase": phase, "podIP": ip,
              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return {"metadata": meta, "status": status}


PODS = [_pod("w-2", "10.0.0.12", slots=2), _pod("w-0", "10.0.0.10"), _pod("w-1", "10.0.0.11", ready=False),
        _pod("w-3", "10.0.0.13", deleting=True), _pod("w-4", None, phase="Pending", ready=False)]


@pytest.fixture
def fake_api(tmp_path):
    seen, status = [], {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            body = json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": PODS}
                              if status["code"] == 200 else {"kind": "Status", "code": 403, "message": "forbidden"})
            self.send_response(status["code"])
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
              "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}],
              "users": [{"name": "fake", "user": {"token": "t"}}],
              "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    wrapper = tmp_path / "discover.sh"  # the contract runs the script by path; here on this Python
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {SCRIPT}\n")
    wrapper.chmod(0o755)
    env = {"KUBECONFIG": str(tmp_path / "kubeconfig"), "PHALANX_K8S_NAMESPACE": "train",
           "PHALANX_K8S_SELECTOR": "app=phalanx-elastic-worker", "KUBERNETES_SERVICE_HOST": ""}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield str(wrapper), seen, status
    server.shutdown()
    for k, v in old.items():
        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_discovery_lists_ready_pods_through_the_client(fake_api):
    script, seen, _ = fake_api
    assert os.access(SCRIPT, os.X_OK)
    assert discover_hosts(script) == {"10.0.0.10": 1, "10.0.0.12": 2}  # not ready, terminating, pending: left out
    assert seen and seen[0].startswith("/api/v1/namespaces/train/pods?") and \
        "labelSelector=app%3Dphalanx-elastic-worker" in seen[0]


def test_discovery_failure_is_one_line_and_nonzero(fake_api):
    import subprocess

    script, _, status = fake_api
    status["code"] = 403
    with pytest.raises(subprocess.CalledProcessError) as caught:
        discover_hosts(script)
    assert caught.value.stderr.count("\n") == 1 and "cannot list pods" in caught.value.stderr
