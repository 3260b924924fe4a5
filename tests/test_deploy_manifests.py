"""Deployment assets: render the kustomize overlays and the Helm chart, validate them against
the Kubernetes schemas offline, lint the Dockerfile, and check the properties that matter.

The tools come from PyPI wheels (deploy/requirements-tools.txt). They are required: a missing
tool fails these tests with the install command, it never skips them.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("deploy_validate", ROOT / "deploy" / "validate.py")
assert _spec and _spec.loader
dv = importlib.util.module_from_spec(_spec)
sys.modules["deploy_validate"] = dv
_spec.loader.exec_module(dv)

MODES = dv.MODES


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    missing = dv.check_tools()
    if missing:
        pytest.fail("deploy validation tools missing:\n" + "\n".join(missing), pytrace=False)


_cache: dict[tuple[str, str], list[dict[str, Any]]] = {}


def rendered(renderer: str, mode: str) -> list[dict[str, Any]]:
    key = (renderer, mode)
    if key not in _cache:
        _cache[key] = dv.render_kustomize(mode) if renderer == "kustomize" else dv.render_helm(mode)
    return _cache[key]


RENDERS = [(r, m) for r in ("kustomize", "helm") for m in MODES]
RENDER_IDS = [f"{r}-{m}" for r, m in RENDERS]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    by_name = {c["name"]: c for c in pod["containers"]}
    assert name in by_name, f"no container {name!r} in {sorted(by_name)}"
    return by_name[name]


def gateway_env(objs: list[dict[str, Any]]) -> dict[str, Any]:
    """Effective env of the gateway container: ConfigMap envFrom, then env entries override."""
    gw = container(objs, "gateway")
    env: dict[str, Any] = {}
    cms = {o["metadata"]["name"]: o.get("data", {}) for o in objs if o["kind"] == "ConfigMap"}
    for src in gw.get("envFrom", []):
        ref = src["configMapRef"]["name"]
        assert ref in cms, f"envFrom references missing ConfigMap {ref}"
        env.update(cms[ref])
    for e in gw.get("env", []):
        env[e["name"]] = e.get("value", e.get("valueFrom"))
    return env


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_rendered_objects_match_kubernetes_schemas(renderer: str, mode: str) -> None:
    objs = rendered(renderer, mode)
    assert objs
    assert dv.validate_objects(objs) == []


def test_schema_validation_rejects_bad_objects() -> None:
    objs = [dict(o) for o in rendered("kustomize", "sidecar")]
    svc = dict(one(objs, "Service"))
    svc["spec"] = {**svc["spec"], "bogusField": 1}
    errors = dv.validate_objects([svc])
    assert errors and "bogusField" in " ".join(errors)


def test_helm_lint_strict_is_clean() -> None:
    assert dv.helm_lint() == []


@pytest.mark.parametrize("mode", MODES)
def test_helm_renders_the_same_kinds_as_kustomize(mode: str) -> None:
    assert sorted(o["kind"] for o in rendered("helm", mode)) == sorted(o["kind"] for o in rendered("kustomize", mode))


def test_helm_rejects_unknown_mode() -> None:
    with pytest.raises(Exception, match="mode must be sidecar or standalone"):
        dv.render_helm("daemonset")


# ------------------------------------------------------------------ gateway container
@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_service_targets_the_gateway_port(renderer: str, mode: str) -> None:
    objs = rendered(renderer, mode)
    svc = one(objs, "Service")
    gw = container(objs, "gateway")
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert len(svc["spec"]["ports"]) == 1
    target = svc["spec"]["ports"][0]["targetPort"]
    resolved = ports.get(target, target) if isinstance(target, str) else target
    assert resolved == dv.GATEWAY_PORT
    assert str(resolved) == str(gateway_env(objs)["GATEWAY_PORT"])
    # The selector selects the Deployment's pods.
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_gateway_probes(renderer: str, mode: str) -> None:
    gw = container(rendered(renderer, mode), "gateway")
    assert gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe"):
        port = gw[probe]["httpGet"]["port"]
        assert port in ("http", dv.GATEWAY_PORT)


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_grace_period_exceeds_drain(renderer: str, mode: str) -> None:
    objs = rendered(renderer, mode)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    drain = int(gateway_env(objs)["GATEWAY_DRAIN_TIMEOUT"])
    pre_stop = container(objs, "gateway").get("lifecycle", {}).get("preStop", {})
    sleep = int(pre_stop["exec"]["command"][-1]) if "exec" in pre_stop else 0
    assert pod["terminationGracePeriodSeconds"] > drain + sleep


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_gateway_security_context(renderer: str, mode: str) -> None:
    objs = rendered(renderer, mode)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    sc = container(objs, "gateway")["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert (sc.get("seccompProfile") or pod["securityContext"]["seccompProfile"])["type"] == "RuntimeDefault"
    # /tmp is the only writable path and must be an emptyDir.
    mounts = {m["mountPath"]: m["name"] for m in container(objs, "gateway")["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert pod["automountServiceAccountToken"] is False


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_resources_pdb_and_metrics(renderer: str, mode: str) -> None:
    objs = rendered(renderer, mode)
    gw = container(objs, "gateway")
    assert {"cpu", "memory"} <= gw["resources"]["requests"].keys()
    assert "memory" in gw["resources"]["limits"]
    pdb = one(objs, "PodDisruptionBudget")
    labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ann = one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert ann["prometheus.io/path"] == "/metrics"
    assert ann["prometheus.io/port"] == str(dv.GATEWAY_PORT)


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_gateway_env_contract(renderer: str, mode: str) -> None:
    env = gateway_env(rendered(renderer, mode))
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert env["GATEWAY_UPSTREAM_API"] in ("responses", "chat")
    assert env["GATEWAY_TOOL_CHOICE_ENFORCEMENT"] in ("off", "validate", "constrain")
    for secret_var in ("GATEWAY_UPSTREAM_API_KEY", "GATEWAY_API_KEYS"):
        ref = env[secret_var]["secretKeyRef"]
        assert ref["optional"] is True
    for name in (
        "GATEWAY_MAX_BODY_BYTES",
        "GATEWAY_STREAM_IDLE_TIMEOUT",
        "GATEWAY_MAX_CONCURRENCY",
        "GATEWAY_STORE_TTL",
        "GATEWAY_LOG_LEVEL",
        "GATEWAY_STORE",
        "GATEWAY_UPSTREAM_URL",
    ):
        assert name in env, name


# ------------------------------------------------------------------ sidecar
@pytest.mark.parametrize("renderer", ["kustomize", "helm"])
def test_sidecar_vllm_container(renderer: str) -> None:
    objs = rendered(renderer, "sidecar")
    vllm = container(objs, "vllm")
    args = vllm["args"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert not vllm["image"].endswith(":latest")
    assert "--enable-auto-tool-choice" in args
    parser_args = [a for a in args if a.startswith("--tool-call-parser")]
    assert parser_args, args
    if parser_args[0] == "--tool-call-parser":
        assert args[args.index("--tool-call-parser") + 1] == "hermes"
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert vllm["securityContext"]["allowPrivilegeEscalation"] is False
    env = gateway_env(objs)
    assert env["GATEWAY_UPSTREAM_URL"] == "http://127.0.0.1:8000"
    assert env["GATEWAY_STORE"] == "sqlite:////tmp/responses-gateway.db"
    assert one(objs, "Deployment")["spec"]["replicas"] == 1
    assert one(objs, "Deployment")["spec"]["strategy"]["type"] == "Recreate"
    # vLLM is not exposed by the Service.
    assert all(p["targetPort"] != 8000 and p["targetPort"] != "vllm" for p in one(objs, "Service")["spec"]["ports"])


def test_sidecar_parser_comment_names_the_choices() -> None:
    text = (ROOT / "deploy/k8s/overlays/sidecar/deployment-vllm.yaml").read_text()
    for parser in ("hermes", "qwen3_coder", "qwen3_xml", "llama3_json", "mistral", "openai"):
        assert parser in text
    assert "structured-outputs" in text


def test_helm_sidecar_parser_is_configurable() -> None:
    objs = dv.render_helm(
        "sidecar", {"sidecar": {"vllm": {"toolCallParser": "llama3_json", "structuredOutputsBackend": "xgrammar"}}}
    )
    args = container(objs, "vllm")["args"]
    assert args[args.index("--tool-call-parser") + 1] == "llama3_json"
    assert "--structured-outputs-config.backend=xgrammar" in args


# ------------------------------------------------------------------ standalone
@pytest.mark.parametrize("renderer", ["kustomize", "helm"])
def test_standalone_scales_and_shares_the_store(renderer: str) -> None:
    objs = rendered(renderer, "standalone")
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] >= 2
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": dep["metadata"]["name"],
    }
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["gateway"]
    env = gateway_env(objs)
    assert env["GATEWAY_UPSTREAM_URL"] == "http://vllm:8000"
    store = env["GATEWAY_STORE"]
    assert isinstance(store, dict) and "secretKeyRef" in store and not store["secretKeyRef"].get("optional")


# ------------------------------------------------------------------ Dockerfile
def test_dockerfile_hadolint() -> None:
    assert dv.run_hadolint() == []


def test_dockerfile_policy() -> None:
    assert dv.dockerfile_policy() == []


def test_dockerfile_policy_catches_bad_dockerfiles(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text('FROM python:latest\nCOPY . /app\nENTRYPOINT ["python"]\n')
    problems = " | ".join(dv.dockerfile_policy(bad))
    for expected in ("latest", "USER", "HEALTHCHECK", "EXPOSE", "ENTRYPOINT", "PYTHONDONTWRITEBYTECODE"):
        assert expected in problems, (expected, problems)
    bad.write_text("FROM python\nUSER root\n")
    problems = " | ".join(dv.dockerfile_policy(bad))
    assert "no pinned tag" in problems and "non-root" in problems


# ------------------------------------------------------------------ env contract
CONTRACT_ENV = {
    "GATEWAY_UPSTREAM_URL",
    "GATEWAY_HOST",
    "GATEWAY_PORT",
    "GATEWAY_UPSTREAM_API_KEY",
    "GATEWAY_API_KEYS",
    "GATEWAY_MAX_BODY_BYTES",
    "GATEWAY_STREAM_IDLE_TIMEOUT",
    "GATEWAY_MAX_CONCURRENCY",
    "GATEWAY_DRAIN_TIMEOUT",
    "GATEWAY_STORE",
    "GATEWAY_STORE_TTL",
    "GATEWAY_LOG_LEVEL",
    "GATEWAY_UPSTREAM_API",
    "GATEWAY_TOOL_CHOICE_ENFORCEMENT",
}


@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_manifests_use_only_contract_env_names(renderer: str, mode: str) -> None:
    names = {k for k in gateway_env(rendered(renderer, mode)) if k.startswith("GATEWAY_")}
    assert names <= CONTRACT_ENV, names - CONTRACT_ENV


def test_contract_env_names_exist_in_gateway_settings() -> None:
    try:
        from gateway.config import OPTIONS
    except ImportError as exc:  # the settings table lands separately from the deploy assets
        pytest.skip(f"gateway.config.OPTIONS not importable yet: {exc}")
    known = {opt.env for opt in OPTIONS}
    assert known >= CONTRACT_ENV, CONTRACT_ENV - known


# ------------------------------------------------------------------ Host/Origin rules vs probes and scrapers
@pytest.mark.parametrize(("renderer", "mode"), RENDERS, ids=RENDER_IDS)
def test_probes_and_scrapes_pass_the_host_and_origin_rules(renderer: str, mode: str) -> None:
    """The manifests bind to every address, so the Host rule defaults to '*' (the API-key secrets are optional:
    this is the keyless case), and the probe and scrape paths are exempt from any --allowed-hosts list anyway
    (kubelet and Prometheus name the pod IP); probes send no Origin."""
    from starlette.testclient import TestClient

    from gateway.config import load_settings
    from gateway.server import create_app
    from gateway.server.guard import EXEMPT_PATHS

    objs = rendered(renderer, mode)
    env = {k: v for k, v in gateway_env(objs).items() if isinstance(v, str)}
    settings = load_settings(None, env=env, store="none", upstream_url="http://127.0.0.1:9")
    assert not settings.is_loopback_bind() and settings.effective_allowed_hosts() == ("*",)
    gw = container(objs, "gateway")
    probes = [gw[p]["httpGet"] for p in ("livenessProbe", "readinessProbe")]
    ann = one(objs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    paths = {p["path"] for p in probes} | {ann["prometheus.io/path"]}
    assert paths <= EXEMPT_PATHS
    assert not any(h["name"].lower() in ("origin", "host") for p in probes for h in p.get("httpHeaders", []))
    pod_ip = "http://10.1.2.3:8080"
    for listed in (None, ("gateway.example",)):  # the default, and an operator's list that omits the pod IP
        app = create_app(settings.with_overrides(allowed_hosts=listed) if listed else settings)
        with TestClient(app, base_url=pod_ip) as client:
            answers = {path: client.get(path).status_code for path in sorted(paths)}
            api = client.get("/v1/models").status_code
        assert all(status != 403 for status in answers.values()), answers
        assert answers["/healthz"] == 200 and answers["/metrics"] == 200
        assert (api == 403) == (listed is not None)
