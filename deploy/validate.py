#!/usr/bin/env python3
"""Validate Kubernetes manifests offline and strictly (an unknown field is an error).

Built-in kinds go through kubernetes-validate (Kubernetes' OpenAPI schemas). The
custom resources lmops ships are checked against the schemas in deploy/schemas/:
KServe InferenceService and Kubeflow PyTorchJob against structural schemas written
for the fields lmops uses; Argo Rollouts' Rollout and AnalysisTemplate against the
openAPIV3Schema of their CRDs (deploy/schemas/import_crd.py), made strict. The pods
they embed go through Kubernetes' PodTemplate schema too. Any other kind fails.

    python deploy/validate.py FILE...      ('-' reads standard input)
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

KUBERNETES_VERSION = "1.37.0"
SCHEMAS = Path(__file__).with_name("schemas")
CUSTOM_SCHEMAS = {
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.json",
}
# Imported from the CRDs of Argo Rollouts (the release and commit are in each file).
CRD_SCHEMAS = {
    ("argoproj.io/v1alpha1", "Rollout"): "rollout.json",
    ("argoproj.io/v1alpha1", "AnalysisTemplate"): "analysistemplate.json",
}
# A KServe predictor is a PodSpec plus these fields (checked by inferenceservice.json).
KSERVE_PREDICTOR_FIELDS = {
    "minReplicas",
    "maxReplicas",
    "scaleMetric",
    "scaleTarget",
    "containerConcurrency",
    "timeout",
    "canaryTrafficPercent",
}


def strict(schema: Any) -> Any:
    """A CRD's structural schema that rejects the unknown fields the API server would
    silently prune: no additional properties wherever the CRD lists them, except
    where it says to preserve unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":  # a mapping of field names, each to a schema
            out[key] = {name: strict(sub) for name, sub in value.items()}
        else:
            out[key] = strict(value)
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def schema_for(api_version: str, kind: str) -> dict[str, Any] | None:
    """The JSON schema of a custom resource lmops ships, or None for built-in kinds."""
    name = CUSTOM_SCHEMAS.get((api_version, kind))
    if name is not None:
        return json.loads((SCHEMAS / name).read_text())
    name = CRD_SCHEMAS.get((api_version, kind))
    if name is None:
        return None
    stored = json.loads((SCHEMAS / name).read_text())
    schema = strict(stored["openAPIV3Schema"])
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    schema["properties"]["apiVersion"] = {"const": api_version}
    schema["properties"]["kind"] = {"const": kind}
    return schema


def embedded_pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Where each pod of a custom resource sits -> that pod as a PodTemplateSpec."""
    spec = doc["spec"]
    if doc["kind"] == "InferenceService":
        pod = {k: v for k, v in spec["predictor"].items() if k not in KSERVE_PREDICTOR_FIELDS}
        return {"spec.predictor": {"spec": pod}}
    if doc["kind"] == "PyTorchJob":
        return {
            f"spec.pytorchReplicaSpecs.{role}.template": replica["template"]
            for role, replica in spec["pytorchReplicaSpecs"].items()
        }
    if doc["kind"] == "Rollout" and "template" in spec:
        return {"spec.template": spec["template"]}
    return {}


def problems(doc: Any) -> list[str]:
    """Everything wrong with one manifest document (empty when it is valid)."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    schema = schema_for(doc["apiVersion"], doc["kind"])
    try:
        if schema is None:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            return []
        jsonschema.validate(doc, schema)
        found = []
        for where, template in embedded_pod_templates(doc).items():
            wrapped = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "embedded"},
                "template": template,
            }
            try:
                kubernetes_validate.validate(wrapped, KUBERNETES_VERSION, strict=True)
            except jsonschema.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                found.append(f"{where} ({path}): {exc.message}")
        return found
    except SchemaNotFoundError as exc:
        return [exc.message]
    except jsonschema.ValidationError as exc:
        return [f"{'.'.join(str(p) for p in exc.path) or '(top)'}: {exc.message}"]


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    failed = 0
    for name in argv:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            print(f"FAIL {name}: not YAML: {exc}")
            failed += 1
            continue
        for doc in docs:
            if doc is None:
                continue
            what = f"{name}: {doc.get('kind', '?')}/{doc.get('metadata', {}).get('name', '?')}"
            errors = problems(doc)
            for error in errors:
                print(f"FAIL {what}: {error}")
            if not errors:
                print(f"ok   {what}")
            failed += bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
