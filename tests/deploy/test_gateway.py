"""The Inference Gateway overlays (deploy/<cloud>/gateway, the deploy/gateway component):
rendered by kubectl kustomize, validated strictly (InferencePool and HTTPRoute against
their pinned CRD schemas, the picker's EndpointPickerConfig against the schema derived
from its Go types), and wired as the picker needs: pool -> pods and picker, route ->
pool, picker -> the pods' metrics. The metric names themselves are checked against a
live /metrics in tests/service/test_endpoint_picker.py."""

from __future__ import annotations

import re

import pytest
import yaml

from lmops.runtime.engine.config import EngineConfig
from lmops.runtime.engine.kv_events import binds
from production_service.app import OBJECTIVE_PRIORITY_HEADER
from tests.deploy.conftest import CLUSTER_SCOPED, REPO
from tests.deploy.test_canary import render as render_text
from tests.deploy.test_kubernetes import validate

GATEWAY_OVERLAYS = ["aks/gateway", "eks/gateway"]
OBJECTIVE_HEADER = "x-llm-d-inference-objective"  # llm-d-router's (pkg/epp/metadata/consts.go)
# llm-d-router v0.10.0 exits when any of these is set (pkg/epp/server/options.go).
DEPRECATED_METRIC_FLAGS = (
    "--total-queued-requests-metric",
    "--total-running-requests-metric",
    "--kv-cache-usage-percentage-metric",
    "--lora-info-metric",
    "--cache-info-metric",
)


def render(kubectl: str, overlay: str) -> list[dict]:
    return list(yaml.safe_load_all(render_text(kubectl, overlay)))


def named(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.fixture(scope="module")
def rendered(kubectl) -> dict[str, list[dict]]:
    return {overlay: render(kubectl, overlay) for overlay in GATEWAY_OVERLAYS}


@pytest.mark.parametrize("overlay", GATEWAY_OVERLAYS)
def test_gateway_overlay_is_valid_and_the_plain_one_plus_the_gateway(rendered, kubectl, overlay, tmp_path):
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump_all(rendered[overlay]))
    proc = validate(tmp_path / "rendered.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gateway, plain = named(rendered[overlay]), named(render(kubectl, overlay.split("/")[0]))
    added = {key for key in gateway if key not in plain}
    assert {kind for kind, _ in added} == {
        "InferencePool",
        "HTTPRoute",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "Deployment",
        "Service",
        "NetworkPolicy",
        "InferenceObjective",
    }
    assert set(plain) <= set(gateway)
    assert all(
        d["metadata"]["namespace"] == "lmops" for key, d in gateway.items() if key[0] not in CLUSTER_SCOPED
    )
    for key in set(plain) - {("Deployment", "lmops"), ("Service", "lmops")}:
        assert gateway[key] == plain[key]
    # Behind the gateway the Service is internal; the pods only gain the engine label and
    # priority scheduling.
    assert gateway["Service", "lmops"]["spec"]["type"] == "ClusterIP"
    pods = gateway["Deployment", "lmops"]["spec"]["template"]
    plain_pods = plain["Deployment", "lmops"]["spec"]["template"]
    (server,), (plain_server,) = pods["spec"]["containers"], plain_pods["spec"]["containers"]
    policy = {"name": "LMOPS_SCHEDULING_POLICY", "value": "priority"}
    assert server["env"] == [policy, *plain_server["env"]]
    assert {**server, "env": plain_server["env"]} == plain_server
    assert {**pods["spec"], "containers": plain_pods["spec"]["containers"]} == plain_pods["spec"]
    assert pods["metadata"]["labels"] == {**plain_pods["metadata"]["labels"], "llm-d.ai/engine-type": "lmops"}


def test_pool_route_and_picker_are_wired_together(rendered):
    docs = named(rendered["aks/gateway"])
    pool, route = docs["InferencePool", "lmops"]["spec"], docs["HTTPRoute", "lmops"]["spec"]
    lmops = docs["Deployment", "lmops"]["spec"]["template"]
    (server,) = lmops["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    env = {e["name"]: e.get("value") for e in server["env"]}
    # The pool selects the lmops pods (and nothing of the picker's) on the API port.
    assert pool["selector"]["matchLabels"].items() <= lmops["metadata"]["labels"].items()
    epp_pods = docs["Deployment", "lmops-epp"]["spec"]["template"]
    assert not pool["selector"]["matchLabels"].items() <= epp_pods["metadata"]["labels"].items()
    assert pool["targetPorts"] == [{"number": ports["http"]}]
    # The pool's picker is the EPP Service's ext-proc port, which reaches the EPP container.
    ref = pool["endpointPickerRef"]
    epp_service = docs["Service", ref["name"]]["spec"]
    (ext_proc,) = [p for p in epp_service["ports"] if p["port"] == ref["port"]["number"]]
    (epp,) = epp_pods["spec"]["containers"]
    assert {p["name"]: p["containerPort"] for p in epp["ports"]}[ext_proc["targetPort"]] == 9002
    assert epp_service["selector"].items() <= epp_pods["metadata"]["labels"].items()
    # The picker's release, pinned by digest: a moved tag cannot change what runs.
    assert re.fullmatch(
        r"ghcr\.io/llm-d/llm-d-router-endpoint-picker:v0\.10\.0@sha256:[0-9a-f]{64}", epp["image"]
    )
    # Completions and chat go through the pool (a rule per objective, and one without);
    # the rest straight to the Service.
    *pooled, rest = route["rules"]
    for rule in pooled:
        assert {m["path"]["value"] for m in rule["matches"]} == {"/v1/completions", "/v1/chat/completions"}
        assert rule["backendRefs"] == [
            {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "lmops"}
        ]
    assert rest["backendRefs"] == [{"name": "lmops", "port": 5001}]
    # The picker watches this pool, reads the mounted config, and no deprecated flag.
    args = dict(a.removeprefix("--").split("=", 1) for a in epp["args"])
    assert args["pool-name"] == "lmops" and args["pool-namespace"] == "lmops"
    assert args["pool-group"] == "inference.networking.k8s.io"
    assert not [a for a in epp["args"] if a.startswith(DEPRECATED_METRIC_FLAGS)]
    (mount,) = [m for m in epp["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in epp_pods["spec"]["volumes"] if v["name"] == "config"]
    config_map = docs["ConfigMap", volume["configMap"]["name"]]
    directory, key = args["config-file"].rsplit("/", 1)
    assert directory == mount["mountPath"] and key in config_map["data"]
    config = yaml.safe_load(config_map["data"][key])
    # It reads lmops' metrics as engine `lmops`, on the probe port, where /metrics is.
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    extractor = plugins["core-metrics-extractor"]
    assert extractor["defaultEngine"] == lmops["metadata"]["labels"]["llm-d.ai/engine-type"]
    assert [e["name"] for e in extractor["engineConfigs"]] == ["lmops"]
    assert plugins["metrics-data-source"]["port"] == ports["probes"] == int(env["LMOPS_PROBE_PORT"])
    assert plugins["metrics-data-source"]["path"] == "/metrics"
    # Prefix-cache-aware scoring: the prefix scorer weighs most, beside queue and KV cache.
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights == {
        "prefix-cache-scorer": 3,
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "max-score-picker": None,
    }
    assert plugins["approx-prefix-cache-producer"] == {"autoTune": True}  # sized by cache_config_info


def test_each_objective_hands_its_priority_to_the_replicas(rendered):
    """objectives.yaml is the one definition: for each InferenceObjective of the pool, a
    route rule on its x-llm-d-inference-objective sets its priority in the header the
    service reads (the picker strips the objective's own); the rule without an objective
    removes the header, so a client cannot claim a priority it was not given."""
    docs = named(rendered["aks/gateway"])
    objectives = {
        name: d["spec"]["priority"]
        for (kind, name), d in docs.items()
        if kind == "InferenceObjective" and d["spec"]["poolRef"]["name"] == "lmops"
    }
    assert objectives and any(p < 0 for p in objectives.values())  # one sheddable
    *pooled, _ = docs["HTTPRoute", "lmops"]["spec"]["rules"]
    handed, default = {}, None
    for rule in pooled:
        names = {
            h["value"] for m in rule["matches"] for h in m.get("headers", ()) if h["name"] == OBJECTIVE_HEADER
        }
        assert all(len(m.get("headers", ())) == len(names) for m in rule["matches"])  # every path, or none
        (modifier,) = [
            f["requestHeaderModifier"] for f in rule["filters"] if f["type"] == "RequestHeaderModifier"
        ]
        if not names:
            assert default is None and modifier == {"remove": [OBJECTIVE_PRIORITY_HEADER]}
            default = rule
            continue
        (name,) = names
        (header,) = modifier["set"]
        assert header["name"] == OBJECTIVE_PRIORITY_HEADER and name not in handed
        handed[name] = int(header["value"])
    assert handed == objectives and default is pooled[-1]  # more specific rules first, as read


def test_network_policies_let_the_picker_scrape_and_the_gateway_reach_it(rendered):
    docs = named(rendered["aks/gateway"])
    scrape = docs["NetworkPolicy", "lmops-from-endpoint-picker"]["spec"]
    epp_labels = docs["Deployment", "lmops-epp"]["spec"]["template"]["metadata"]["labels"]
    lmops_labels = docs["Deployment", "lmops"]["spec"]["template"]["metadata"]["labels"]
    assert scrape["podSelector"]["matchLabels"].items() <= lmops_labels.items()
    (rule,) = scrape["ingress"]
    (peer,) = rule["from"]
    assert rule["ports"] == [{"port": "probes", "protocol": "TCP"}]
    assert peer["podSelector"]["matchLabels"].items() <= epp_labels.items()
    epp = docs["NetworkPolicy", "lmops-epp"]["spec"]
    rules = {rule["ports"][0]["port"]: rule.get("from") for rule in epp["ingress"]}
    assert rules == {
        "grpc": None,  # the gateway, wherever its implementation runs it
        "metrics": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }


def test_gateway_validation_is_strict(rendered, tmp_path):
    """One fault in each kind the gateway adds, and in the picker's config: each fails."""
    docs = named(yaml.safe_load_all(yaml.safe_dump_all(rendered["aks/gateway"])))  # a deep copy
    docs["InferencePool", "lmops"]["spec"]["targetPort"] = 5001
    docs["HTTPRoute", "lmops"]["spec"]["rules"][0]["backendRefs"][0]["kindd"] = "InferencePool"
    (config_map,) = [d for (kind, _), d in docs.items() if kind == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["epp-config.yaml"])
    faults = []
    for fault in (
        lambda c: c["plugins"][0]["parameters"].update(prot=5002),  # unknown parameter
        lambda c: c.update(schedulingProfile=[]),  # unknown top-level field
        lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "queue-scorr"}),
        lambda c: c["plugins"].append({"type": "queue-scorr"}),  # no such plugin type
        lambda c: c["plugins"][1]["parameters"]["engineConfigs"][0].update(kvUsageSpec="lmops kv"),
    ):
        broken = yaml.safe_load(yaml.safe_dump(config))
        fault(broken)
        faults.append({**config_map, "data": {"epp-config.yaml": yaml.safe_dump(broken)}})
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump_all([docs["InferencePool", "lmops"], docs["HTTPRoute", "lmops"], *faults])
    )
    proc = validate(tmp_path / "bad.yaml")
    assert proc.returncode != 0 and proc.stdout.count("FAIL") == 7, proc.stdout
    assert "queue-scorr' names no plugin" in proc.stdout


def test_the_picker_config_file_validates_on_its_own():
    proc = validate(REPO / "deploy/gateway/epp-config.yaml")
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


PRECISE_OVERLAYS = ["aks/gateway-precise", "eks/gateway-precise"]


@pytest.mark.parametrize("overlay", PRECISE_OVERLAYS)
def test_the_precise_overlay_is_valid_and_the_gateway_one_plus_kv_events(kubectl, overlay, tmp_path):
    docs = render(kubectl, overlay)
    (tmp_path / "rendered.yaml").write_text(yaml.safe_dump_all(docs))
    proc = validate(tmp_path / "rendered.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # The config map's name carries its content's hash: compared by kind alone.
    precise, gateway = named(docs), named(render(kubectl, overlay.replace("-precise", "")))
    assert {k for k in precise if k[0] != "ConfigMap"} - set(gateway) == {
        ("NetworkPolicy", "lmops-kv-events-to-endpoint-picker"),
        ("Service", "lmops-render"),
    }
    changed = {key for key in gateway if key[0] != "ConfigMap" and precise[key] != gateway[key]}
    assert changed == {("Deployment", "lmops"), ("Deployment", "lmops-epp")}  # the pods, the picker's config
    epp, old = precise["Deployment", "lmops-epp"], gateway["Deployment", "lmops-epp"]
    epp_volumes = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] != "config"]
    assert epp_volumes == [v for v in old["spec"]["template"]["spec"]["volumes"] if v["name"] != "config"]


def test_every_replica_publishes_where_the_precise_picker_subscribes(kubectl):
    """Ports, topic and block size as the picker expects them, the events config as the
    engine parses it, and the policies that let the picker reach the sockets and render."""
    docs = named(render(kubectl, "aks/gateway-precise"))
    lmops = docs["Deployment", "lmops"]["spec"]["template"]
    (server,) = lmops["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    env = [e["name"] for e in server["env"]]
    values = {e["name"]: e.get("value") for e in server["env"]}
    # The topic names the pod: POD_NAME comes first, so Kubernetes expands $(POD_NAME).
    assert env.index("POD_NAME") < env.index("LMOPS_KV_EVENTS_CONFIG")
    events = EngineConfig(kv_events_config=values["LMOPS_KV_EVENTS_CONFIG"]).kv_events_config
    assert events.publishes and binds(events.endpoint) and events.replay_endpoint is not None
    assert events.endpoint == f"tcp://*:{ports['kv-events']}"
    assert events.replay_endpoint == f"tcp://*:{ports['kv-replay']}"
    (volume,) = [
        v
        for v in docs["Deployment", "lmops-epp"]["spec"]["template"]["spec"]["volumes"]
        if v["name"] == "config"
    ]
    config = yaml.safe_load(docs["ConfigMap", volume["configMap"]["name"]]["data"]["epp-config.yaml"])
    assert config == yaml.safe_load((REPO / "deploy/gateway/precise/epp-config.yaml").read_text())
    plugins = {p["type"]: p.get("parameters", {}) for p in config["plugins"]}
    # It reads lmops' metrics as the approximate config does (whose names a live server's
    # /metrics is checked for: tests/service/test_endpoint_picker.py).
    approx = yaml.safe_load((REPO / "deploy/gateway/epp-config.yaml").read_text())
    approx_plugins = {p["type"]: p.get("parameters", {}) for p in approx["plugins"]}
    for shared in ("metrics-data-source", "core-metrics-extractor"):
        assert plugins[shared] == approx_plugins[shared]
    assert config["schedulingProfiles"] == approx["schedulingProfiles"]
    producer = plugins["precise-prefix-cache-producer"]
    discovery = producer["kvEventsConfig"]["podDiscoveryConfig"]
    assert producer["kvEventsConfig"]["discoverPods"] is True
    assert (discovery["socketPort"], discovery["replaySocketPort"]) == (
        ports["kv-events"],
        ports["kv-replay"],
    )
    assert events.topic == "kv@$(POD_NAME)@lmops" and events.topic.startswith(
        producer["kvEventsConfig"]["topicFilter"]
    )
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == EngineConfig().block_size
    assert "LMOPS_BLOCK_SIZE" not in values
    assert plugins["prefix-cache-scorer"] == {"prefixMatchInfoProducerName": "precise-prefix-cache-producer"}
    sources = {
        s["pluginRef"]: [e["pluginRef"] for e in s["extractors"]] for s in config["dataLayer"]["sources"]
    }
    assert sources["endpoint-notification-source"] == ["precise-prefix-cache-producer"]
    # The token producer renders through the lmops-render Service, on the probe port.
    url = plugins["token-producer"]["vllm"]["url"]
    host, port = url.removeprefix("http://").split(":")
    render_service = docs["Service", host]["spec"]
    (service_port,) = render_service["ports"]
    assert service_port["port"] == int(port) and service_port["targetPort"] == "probes"
    assert render_service["selector"].items() <= lmops["metadata"]["labels"].items()
    # The picker may reach the event sockets (and, by deploy/gateway's policy, the probe port).
    epp_labels = docs["Deployment", "lmops-epp"]["spec"]["template"]["metadata"]["labels"]
    policy = docs["NetworkPolicy", "lmops-kv-events-to-endpoint-picker"]["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= lmops["metadata"]["labels"].items()
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"].items() <= epp_labels.items()
    assert {p["port"] for p in rule["ports"]} == {"kv-events", "kv-replay"}
    probes = docs["NetworkPolicy", "lmops-from-endpoint-picker"]["spec"]["ingress"][0]["ports"]
    assert probes == [{"port": "probes", "protocol": "TCP"}]


def test_the_precise_picker_config_validates_strictly(tmp_path):
    config = yaml.safe_load((REPO / "deploy/gateway/precise/epp-config.yaml").read_text())
    assert validate(REPO / "deploy/gateway/precise/epp-config.yaml").returncode == 0
    broken = []
    for fault in (
        lambda c: c["plugins"][3]["parameters"].update(vllm={"url": "http://lmops-render:5002/"}),
        lambda c: c["plugins"][3]["parameters"].pop("modelName"),
        lambda c: c["plugins"][4]["parameters"]["kvEventsConfig"].update(socketPort=5557),  # misplaced
        lambda c: c["plugins"][4]["parameters"]["kvEventsConfig"]["podDiscoveryConfig"].update(socketPort=0),
        lambda c: c["plugins"][2].update(parameters={"kind": "Pod"}),
    ):
        copy = yaml.safe_load(yaml.safe_dump(config))
        fault(copy)
        broken.append(copy)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(broken))
    proc = validate(tmp_path / "bad.yaml")
    assert proc.returncode != 0 and proc.stdout.count("FAIL") == 5, proc.stdout
