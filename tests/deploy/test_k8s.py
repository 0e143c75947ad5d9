"""deploy/k8s: every manifest valid against the Kubernetes API schemas, and wired together as docs/deploy.md says."""

from __future__ import annotations

import copy
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from servers import ROOT

from inference_api.config import ServerConfig
from lifecycle.drain import EXIT_MARGIN
from proxy.config import ProxyConfig

K8S = ROOT / "deploy" / "k8s"
VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]  # preStop sleep is there from 1.30
GiB = 1 << 30


def manifests() -> list:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def quantity(text: str) -> float:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "m": 1e-3}
    for unit, factor in units.items():
        if str(text).endswith(unit):
            return float(str(text)[: -len(unit)]) * factor
    return float(text)


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def port_number(c: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name_or_number)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_is_valid(path, version):
    for document in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_rejects_a_wrong_field():
    broken = copy.deepcopy(load("server-deployment.yaml"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_but_the_secret():
    kustomization = load("kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization["resources"]) == {p.name for p in manifests()} - {"secret.yaml"}
    secret = load("secret.yaml")
    assert secret["kind"] == "Secret" and secret["stringData"]["JWT_SECRET"] == ""  # empty: the proxy refuses
    images = {i["name"] for i in kustomization["images"]}
    for name in ("server-deployment.yaml", "proxy-deployment.yaml"):
        assert container(load(name))["image"] in images


def test_server_probes_grace_period_resources_and_scrape_annotations():
    deployment = load("server-deployment.yaml")
    pod = deployment["spec"]["template"]
    c = container(deployment)
    port = port_number(c, "http")
    assert c["command"][:3] == ["python", "-m", "inference_api"] and c["command"][
        c["command"].index("--port") + 1
    ] == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health" and port_number(c, get["port"]) == port, probe
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    # the server's drain on SIGTERM, then gunicorn's margin for cutting late streams and exiting
    assert pod["spec"]["terminationGracePeriodSeconds"] > ServerConfig().drain_timeout + pre_stop + EXIT_MARGIN
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics" and int(annotations["prometheus.io/port"]) == port
    # the pre-flight figures: engine (weights + KV cache) at most 1.5 GiB, the app worker 0.25 GiB
    resources = c["resources"]
    assert quantity(resources["requests"]["memory"]) >= 1.75 * GiB
    assert quantity(resources["limits"]["memory"]) >= quantity(resources["requests"]["memory"])
    assert "cpu" not in resources.get("limits", {})
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_services_select_their_pods():
    for service_name, deployment_name in (
        ("server-service.yaml", "server-deployment.yaml"),
        ("proxy-service.yaml", "proxy-deployment.yaml"),
    ):
        service, deployment = load(service_name), load(deployment_name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items(), service_name
        for port in service["spec"]["ports"]:
            port_number(container(deployment), port["targetPort"])
    assert load("server-service.yaml")["spec"]["clusterIP"] == "None"  # one DNS address per ready server pod


def test_the_proxy_balances_over_the_server_service_with_the_secret():
    c = container(load("proxy-deployment.yaml"))
    env = {e["name"]: e for e in c["env"]}
    upstream = urlsplit(env["UPSTREAM_URL"]["value"])
    service = load("server-service.yaml")
    assert upstream.hostname == service["metadata"]["name"]
    assert upstream.port == service["spec"]["ports"][0]["port"]
    ref = env["JWT_SECRET"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (load("secret.yaml")["metadata"]["name"], "JWT_SECRET")
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "tcpSocket" in c["livenessProbe"]  # not restarted because the servers are away


def test_the_proxy_pod_outlasts_its_drain():
    deployment = load("proxy-deployment.yaml")
    pre_stop = container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > ProxyConfig().drain_timeout + pre_stop + EXIT_MARGIN


def test_disruption_budgets_and_autoscaler_target_the_deployments():
    server, proxy = load("server-deployment.yaml"), load("proxy-deployment.yaml")
    for pdb_name, deployment in (("server-pdb.yaml", server), ("proxy-pdb.yaml", proxy)):
        pdb = load(pdb_name)
        assert (
            pdb["spec"]["selector"]["matchLabels"].items()
            <= deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        assert pdb["spec"]["minAvailable"] < deployment["spec"]["replicas"]  # a node drain can go on
    hpa = load("server-hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": server["metadata"]["name"],
    }
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert container(server)["resources"]["requests"]["cpu"]  # CPU utilisation needs a request


def test_only_the_proxy_pods_reach_the_servers_and_both_share_the_internal_secret():
    policy = load("server-networkpolicy.yaml")
    server, proxy = load("server-deployment.yaml"), load("proxy-deployment.yaml")
    pod_labels = lambda d: d["spec"]["template"]["metadata"]["labels"]  # noqa: E731
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(server).items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (source,) = rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= pod_labels(proxy).items()
    assert [p["port"] for p in rule["ports"]] == [port_number(container(server), "http")]
    secret = load("secret.yaml")
    assert "INTERNAL_SECRET" in secret["stringData"]
    for deployment in (server, proxy):
        ref = {e["name"]: e for e in container(deployment)["env"]}["INTERNAL_SECRET"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "INTERNAL_SECRET")


def test_the_team_limits_are_shared_through_the_clusters_redis():
    deployment, service, policy = yaml.safe_load_all((K8S / "redis-deployment.yaml").read_text())
    assert "redis-deployment.yaml" in (K8S / "kustomization.yaml").read_text()
    env = {
        name: {e["name"]: e.get("value") for e in container(load(name))["env"]}
        for name in ("proxy-deployment.yaml", "server-deployment.yaml")
    }
    for values in env.values():
        url = urlsplit(values["REDIS_URL"])
        assert url.hostname == service["metadata"]["name"] and url.port == service["spec"]["ports"][0]["port"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert int(env["proxy-deployment.yaml"]["MAX_CONCURRENT_PER_TEAM"]) == ProxyConfig().max_concurrent_per_team
    assert int(env["server-deployment.yaml"]["TOKENS_PER_MINUTE_PER_TEAM"]) == ServerConfig().tokens_per_minute_per_team
    allowed = {
        peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for peer in policy["spec"]["ingress"][0]["from"]
    }
    assert allowed == {"llm-proxy", "llm-server"}
    assert "--save" in container(deployment)["args"]  # counters only: nothing written to disk
