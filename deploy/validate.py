#!/usr/bin/env python3
"""Validate Kubernetes manifests offline and strictly (an unknown field is an error).

Built-in kinds go through kubernetes-validate (Kubernetes' OpenAPI schemas). The
custom resources lmops ships, KServe InferenceService, are checked against the
structural schemas in deploy/schemas/, and the pods they embed against Kubernetes'
PodTemplate schema; KServe's LLMInferenceService and LLMInferenceServiceConfig,
Kubeflow Trainer v2's TrainJob and ClusterTrainingRuntime (its pods too),
prometheus-operator's PodMonitor and PrometheusRule, Argo Rollouts' Rollout
(its pod too) and AnalysisTemplate, the Inference Extension's InferencePool and the
Gateway API's HTTPRoute against their CRDs' own schemas, made strict
(deploy/schemas/import_crd.py). llm-d-router's EndpointPickerConfig has no CRD: a
ConfigMap's file that is one, an LLMInferenceService's inline scheduler config, or
such a file itself, is checked against
deploy/schemas/endpointpickerconfig.json (derived from its Go types), and every
pluginRef in it must name one of its plugins. Any other kind fails.

    python deploy/validate.py FILE...      ('-' reads standard input)
"""

from __future__ import annotations

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
    ("serving.kserve.io/v1alpha2", "LLMInferenceService"): "llminferenceservice.json",
    ("serving.kserve.io/v1alpha2", "LLMInferenceServiceConfig"): "llminferenceserviceconfig.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob.json",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): "clustertrainingruntime.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("argoproj.io/v1alpha1", "Rollout"): "rollout.json",
    ("argoproj.io/v1alpha1", "AnalysisTemplate"): "analysistemplate.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute.json",
    ("llm-d.ai/v1alpha1", "EndpointPickerConfig"): "endpointpickerconfig.json",
    ("llm-d.ai/v1alpha2", "InferenceObjective"): "inferenceobjective.json",
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


def embedded_pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Where each pod of a custom resource sits -> that pod as a PodTemplateSpec."""
    if doc["kind"] == "InferenceService":
        predictor = doc["spec"]["predictor"]
        pod = {k: v for k, v in predictor.items() if k not in KSERVE_PREDICTOR_FIELDS}
        return {"spec.predictor": {"spec": pod}}
    if doc["kind"] == "Rollout" and "template" in doc["spec"]:
        return {"spec.template": doc["spec"]["template"]}
    if doc["kind"] != "ClusterTrainingRuntime":
        return {}
    return {  # a JobSet's replicated Jobs, each with its pod template
        f"spec.template.spec.replicatedJobs.{job['name']}.template.spec.template": job["template"]["spec"][
            "template"
        ]
        for job in doc["spec"]["template"]["spec"]["replicatedJobs"]
    }


def endpoint_picker_configs(doc: dict[str, Any]) -> dict[str, Any]:
    """The files of a ConfigMap that are EndpointPickerConfigs, by key."""
    found = {}
    for key, text in (doc.get("data") or {}).items():
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError:
            continue
        if isinstance(parsed, dict) and parsed.get("kind") == "EndpointPickerConfig":
            found[key] = parsed
    return found


def inline_picker_configs(doc: dict[str, Any]) -> dict[str, Any]:
    """An LLMInferenceService's (or its preset's) scheduler config: an EndpointPickerConfig inline."""
    if doc["kind"] not in ("LLMInferenceService", "LLMInferenceServiceConfig"):
        return {}
    config = ((doc["spec"].get("router") or {}).get("scheduler") or {}).get("config") or {}
    return {"spec.router.scheduler.config.inline": config["inline"]} if "inline" in config else {}


def dangling_plugin_refs(config: dict[str, Any]) -> list[str]:
    """pluginRefs that name no plugin (the picker refuses to start on them)."""
    names = {p.get("name") or p["type"] for p in config["plugins"]}
    data_layer = config.get("dataLayer") or {}
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    for source in data_layer.get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    refs += [p["pluginRef"] for p in (config.get("requestHandler") or {}).get("parsers", [])]
    return [f"pluginRef {ref!r} names no plugin" for ref in refs if ref not in names]


def problems(doc: Any) -> list[str]:
    """Everything wrong with one manifest document (empty when it is valid)."""
    if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
        return ["not a Kubernetes object (no apiVersion/kind)"]
    schema_file = CUSTOM_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    try:
        if schema_file is None:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            if doc["kind"] != "ConfigMap":
                return []
            return [
                f"data.{key}: {problem}"
                for key, config in endpoint_picker_configs(doc).items()
                for problem in problems(config)
            ]
        schema = json.loads((SCHEMAS / schema_file).read_text())
        jsonschema.validate(doc, schema)
        if doc["kind"] == "EndpointPickerConfig":
            return dangling_plugin_refs(doc)
        found = [
            f"{where}: {problem}"
            for where, config in inline_picker_configs(doc).items()
            for problem in problems(config)
        ]
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
