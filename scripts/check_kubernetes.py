#!/usr/bin/env python3
"""Renders every kustomize overlay under deploy/kubernetes/overlays and validates the result.

  scripts/check_kubernetes.py [--repo DIR] [--kubernetes-version 1.37]

- Rendering: `kubectl kustomize` (or `kustomize build`), the real tool.
- Built-in kinds: kubernetes-validate (PyPI), strict (unknown fields refused).
- LeaderWorkerSet: deploy/kubernetes/schemas/leaderworkerset-v1.json (jsonschema), and its leader
  and worker pod templates against Kubernetes' own PodTemplate schema (strict).
- PodMonitor: deploy/kubernetes/schemas/podmonitor-v1.json.
- moeserve's own rules on every pod template: gRPC startup/readiness/liveness probes, /dev/shm as
  a memory emptyDir, CPU and memory requests, explicit --listen 0.0.0.0:50051 and
  --metrics_address 0.0.0.0:9464 with a `metrics` port; ep16-lws: 2 pods x 8 GPUs x --ranks 8,
  startupPolicy LeaderCreated, the Service selecting the leader only and the PodMonitor both.
- The Grafana dashboard: valid JSON whose queries name only metrics server/metrics.cc exports,
  with panels for latency, throughput, stage times, batch sizes and per-rank tokens.

Exit 0 when everything holds, 1 on any failure (each named), 77 when a tool is missing (CTest
reports the test as skipped; scripts/setup.sh installs them).
"""

import argparse
import glob
import json
import os
import re
import shutil
import subprocess
import sys

SKIP = 77


def skip(msg):
    print(f"check_kubernetes: SKIP: {msg}", flush=True)
    sys.exit(SKIP)


try:
    import jsonschema
    import kubernetes_validate
    import yaml
except ImportError as e:  # pragma: no cover
    skip(f"{e.name} is not installed (scripts/setup.sh installs kubernetes-validate, "
         "jsonschema, PyYAML)")


class Checker:
    def __init__(self, label="FAIL"):
        self.failures = []
        self.passed = 0
        self.label = label

    def check(self, cond, what):
        if cond:
            self.passed += 1
        else:
            self.failures.append(what)
            print(f"check_kubernetes: {self.label}: {what}", flush=True)
        return cond


def renderer():
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    skip("neither kubectl nor kustomize is on PATH")


def render(cmd, overlay):
    r = subprocess.run(cmd + [overlay], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} {overlay} failed:\n{r.stderr}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def exported_metrics(repo):
    text = open(os.path.join(repo, "server", "metrics.cc")).read()
    names = set(re.findall(r'\.Name\("(moeserve_[a-z_]+)"\)', text))
    out = set(names)
    for n in names:  # histograms' series
        out |= {n + "_bucket", n + "_sum", n + "_count"}
    return out


def pod_templates(doc):
    """(where, PodTemplateSpec) of a workload."""
    kind = doc["kind"]
    name = doc["metadata"]["name"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield f"{kind}/{name}", doc["spec"]["template"]
    elif kind == "LeaderWorkerSet":
        lwt = doc["spec"]["leaderWorkerTemplate"]
        if "leaderTemplate" in lwt:
            yield f"{kind}/{name} leaderTemplate", lwt["leaderTemplate"]
        yield f"{kind}/{name} workerTemplate", lwt["workerTemplate"]


def check_pod_template(c, where, tmpl):
    spec = tmpl["spec"]
    c.check(spec.get("securityContext", {}).get("runAsNonRoot") is True,
            f"{where}: securityContext.runAsNonRoot true")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for ct in spec["containers"]:
        w = f"{where} container {ct['name']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = ct.get(probe, {})
            c.check(p.get("grpc", {}).get("port") == 50051, f"{w}: {probe} is a gRPC probe on 50051")
        startup = ct.get("startupProbe", {})
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        c.check(budget >= 300, f"{w}: startup probe allows >= 5 minutes of loading (has {budget} s)")
        req = ct.get("resources", {}).get("requests", {})
        c.check("cpu" in req and "memory" in req, f"{w}: requests cpu and memory")
        args = ct.get("args", [])
        c.check("--listen=0.0.0.0:50051" in args, f"{w}: args --listen=0.0.0.0:50051")
        c.check("--metrics_address=0.0.0.0:9464" in args,
                f"{w}: args --metrics_address=0.0.0.0:9464")
        ports = {p.get("name"): p.get("containerPort") for p in ct.get("ports", [])}
        c.check(ports.get("metrics") == 9464 and ports.get("grpc") == 50051,
                f"{w}: ports grpc 50051 and metrics 9464")
        shm = [m for m in ct.get("volumeMounts", []) if m.get("mountPath") == "/dev/shm"]
        ok = bool(shm) and volumes.get(shm[0]["name"], {}).get("emptyDir", {}).get("medium") == \
            "Memory"
        c.check(ok, f"{w}: /dev/shm is a memory emptyDir")


def validate_builtin(c, doc, version):
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
        c.check(True, where)
    except kubernetes_validate.ValidationError as e:
        c.check(False, f"{where}: {e.message} at {'.'.join(map(str, e.path))}")
    except kubernetes_validate.SchemaNotFoundError as e:
        c.check(False, f"{where}: {e.message}")


def validate_podtemplate(c, where, tmpl, version):
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate",
               "metadata": {"name": "check"}, "template": tmpl}
    try:
        kubernetes_validate.validate(wrapped, version, strict=True)
        c.check(True, where)
    except kubernetes_validate.ValidationError as e:
        c.check(False, f"{where}: {e.message} at {'.'.join(map(str, e.path))}")


def validate_custom(c, doc, schema):
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc), key=str)
    for e in errors:
        c.check(False, f"{where}: {e.message} at {'.'.join(map(str, e.path))}")
    if not errors:
        c.check(True, where)


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_overlay(c, name, docs, schemas, version):
    kinds = [d["kind"] for d in docs]
    print(f"check_kubernetes: {name}: {len(docs)} objects: {', '.join(sorted(kinds))}")
    templates = []
    for doc in docs:
        if doc["kind"] == "LeaderWorkerSet":
            validate_custom(c, doc, schemas["LeaderWorkerSet"])
            for where, tmpl in pod_templates(doc):
                validate_podtemplate(c, f"{name}: {where}", tmpl, version)
        elif doc["kind"] == "PodMonitor":
            validate_custom(c, doc, schemas["PodMonitor"])
        else:
            validate_builtin(c, doc, version)
        for where, tmpl in pod_templates(doc):
            templates.append((where, tmpl))
            check_pod_template(c, f"{name}: {where}", tmpl)
    c.check(templates, f"{name}: has a workload")
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    c.check(len(services) == 1 and len(monitors) == 1, f"{name}: one Service and one PodMonitor")
    c.check(any(d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"].get(
        "labels", {}) for d in docs), f"{name}: the Grafana dashboard ConfigMap")
    for where, tmpl in templates:
        labels = tmpl.get("metadata", {}).get("labels", {})
        serves = labels.get("moeserve.io/serves-api") == "true"
        for svc in services:
            c.check(labels_match(svc["spec"]["selector"], labels) == serves,
                    f"{name}: Service selects {where} iff it serves the API")
        for mon in monitors:
            c.check(labels_match(mon["spec"]["selector"]["matchLabels"], labels),
                    f"{name}: PodMonitor scrapes {where}")
    if name == "ep16-lws":
        lws = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
        if c.check(len(lws) == 1, f"{name}: one LeaderWorkerSet"):
            spec = lws[0]["spec"]
            size = spec["leaderWorkerTemplate"].get("size", 1)
            c.check(size == 2, f"{name}: 2 pods per group (size {size})")
            c.check(spec.get("startupPolicy") == "LeaderCreated",
                    f"{name}: startupPolicy LeaderCreated (the leader is ready only after the "
                    "workers joined)")
            for where, tmpl in pod_templates(lws[0]):
                ct = tmpl["spec"]["containers"][0]
                gpus = ct["resources"]["limits"].get("nvidia.com/gpu")
                c.check("--ranks=8" in ct["args"] and gpus == 8,
                        f"{name}: {where}: 8 GPUs and --ranks=8 (2 x 8 = EP16)")
                env = {e["configMapRef"]["name"] for e in ct.get("envFrom", [])}
                c.check("moeserve-nccl" in env, f"{name}: {where}: NCCL environment")
    if name == "cpu":
        c.check("Deployment" in kinds, f"{name}: a Deployment")


def check_dashboard(c, path, metrics):
    try:
        dash = json.load(open(path))
    except (OSError, ValueError) as e:
        c.check(False, f"dashboard {path}: {e}")
        return
    panels = [p for p in dash.get("panels", []) if p.get("type") != "row"]
    c.check(len(panels) >= 6, f"dashboard: {len(panels)} panels")
    titles = " ".join(p.get("title", "").lower() for p in panels)
    for topic in ("latency", "throughput", "stage", "batch", "rank"):
        c.check(topic in titles, f"dashboard: a panel about {topic}")
    for p in panels:
        for t in p.get("targets", []):
            for m in re.findall(r"\b(moeserve_[a-z_]+)", t.get("expr", "")):
                c.check(m in metrics, f"dashboard panel '{p.get('title')}': metric {m} is "
                                      "exported by server/metrics.cc")


def self_test(c, docs_by_overlay, schemas, version):
    """The validators must reject broken objects: a typo'd container field, an LWS field out of
    its enum, a PodMonitor endpoint field that does not exist."""
    import copy
    probe = Checker("self-test, refused as expected")
    for docs in docs_by_overlay.values():
        for doc in docs:
            bad = copy.deepcopy(doc)
            if doc["kind"] == "Deployment":
                bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
                validate_builtin(probe, bad, version)
            elif doc["kind"] == "LeaderWorkerSet":
                bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
                validate_custom(probe, bad, schemas["LeaderWorkerSet"])
                bad = copy.deepcopy(doc)
                bad["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
                    "resources"]["limts"] = {}
                for where, tmpl in pod_templates(bad):
                    validate_podtemplate(probe, where, tmpl, version)
            elif doc["kind"] == "PodMonitor":
                bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
                validate_custom(probe, bad, schemas["PodMonitor"])
    c.check(len(probe.failures) >= 5,
            f"self-test: broken objects are refused ({len(probe.failures)} refusals)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--kubernetes-version", default="1.32")
    args = ap.parse_args()
    repo = os.path.abspath(args.repo)
    cmd = renderer()
    root = os.path.join(repo, "deploy", "kubernetes")
    schemas = {
        "LeaderWorkerSet": json.load(open(os.path.join(root, "schemas",
                                                       "leaderworkerset-v1.json"))),
        "PodMonitor": json.load(open(os.path.join(root, "schemas", "podmonitor-v1.json"))),
    }
    for s in schemas.values():
        jsonschema.Draft202012Validator.check_schema(s)
    c = Checker()
    docs_by_overlay = {}
    overlays = sorted(glob.glob(os.path.join(root, "overlays", "*")))
    c.check({os.path.basename(o) for o in overlays} >= {"cpu", "ep16-lws"},
            "overlays cpu and ep16-lws exist")
    for overlay in overlays:
        name = os.path.basename(overlay)
        try:
            docs = render(cmd, overlay)
        except RuntimeError as e:
            c.check(False, str(e))
            continue
        docs_by_overlay[name] = docs
        check_overlay(c, name, docs, schemas, args.kubernetes_version)
    self_test(c, docs_by_overlay, schemas, args.kubernetes_version)
    check_dashboard(c, os.path.join(root, "base", "grafana", "moeserve-dashboard.json"),
                    exported_metrics(repo))
    print(f"check_kubernetes: rendered with {' '.join(cmd)}, validated against Kubernetes "
          f"{args.kubernetes_version} (kubernetes-validate {kubernetes_validate.__version__})")
    print(f"{c.passed} passed, {len(c.failures)} failed")
    return 1 if c.failures else 0


if __name__ == "__main__":
    sys.exit(main())
