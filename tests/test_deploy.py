"""The container image and the Kubernetes manifests (`deploy/`): each kustomize overlay renders with
`kubectl kustomize` and validates against Kubernetes' own schemas, and what the manifests hand the
gateway (its servegate.yaml, route, commands, probes, metric, user) is what the gateway accepts."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import typer
import yaml

from gateway.api import health, metrics
from gateway.cli import app as cli
from gateway.config import load_backends
from gateway.operations.telemetry import GatewayMetrics
from gateway.rollout.route_versions import RouteSpec
from gateway.settings import Settings

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "kubernetes" / "overlays").iterdir())
# The release of Debian's kubectl here, and the newest the schemas know.
KUBERNETES = ("1.32.0", kubernetes_validate.latest_version())
CONFIG_MOUNT = "/etc/servegate"


def kustomize(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is not installed: .ci/run installs it with apt")
        pytest.skip("kubectl is not installed (apt package kubectl); the manifests are checked in CI")
    rendered = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay)],
                              capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    return [o for o in yaml.safe_load_all(rendered.stdout) if o]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def servegate_containers(objects: list[dict]):
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            if container["image"].split(":")[0] == "servegate":
                yield o, spec, container


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("version", KUBERNETES)
def test_each_overlay_validates_against_the_kubernetes_schemas(overlay, version):
    objects = kustomize(overlay)
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ConfigMap"} <= \
        {o["kind"] for o in objects}
    for o in objects:
        kubernetes_validate.validate(o, version, strict=True)  # raises, naming the field


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_the_manifests_hand_the_gateway_is_what_it_accepts(overlay, tmp_path):
    objects = kustomize(overlay)
    (config_map,) = [c for c in of_kind(objects, "ConfigMap") if c["metadata"]["name"].startswith("servegate-config")]
    for name, text in config_map["data"].items():
        (tmp_path / name).write_text(text)
    served = load_backends(tmp_path / "servegate.yaml")  # raises, naming the field
    names = {backend.name for backend in served.values()}
    if (tmp_path / "route.yaml").exists():
        spec = RouteSpec.model_validate(yaml.safe_load((tmp_path / "route.yaml").read_text()))
        assert set(spec.backends()) <= names

    # Every servegate command parses with the CLI, its config files where the ConfigMap mounts them.
    group = typer.main.get_command(cli)
    commands = []
    for _, _, container in servegate_containers(objects):
        args = [a.replace(CONFIG_MOUNT, str(tmp_path)) for a in container["args"]]
        with group.make_context("servegate", list(args), resilient_parsing=False) as context:
            command_name, command, rest = group.resolve_command(context, args)
            while hasattr(command, "resolve_command"):  # a group: `routes deploy`, `db upgrade`
                context = command.make_context(command_name, rest, parent=context)
                command_name, command, rest = command.resolve_command(context, rest)
            command.make_context(command_name, rest, parent=context)  # raises on an unknown or missing option
            commands.append(command_name)
        assert {m["mountPath"] for m in container.get("volumeMounts", [])} >= \
            ({CONFIG_MOUNT} if any(CONFIG_MOUNT in a for a in container["args"]) else set())
    assert "serve" in commands and "upgrade" in commands

    # Probes ask paths the gateway serves, on the port it listens on.
    (deployment,) = [d for d in of_kind(objects, "Deployment") if d["metadata"]["name"] == "servegate"]
    (gateway,) = deployment["spec"]["template"]["spec"]["containers"]
    paths = {route.path for module in (health, metrics) for route in module.router.routes}
    port = int(gateway["args"][gateway["args"].index("--port") + 1])
    assert gateway["ports"][0]["containerPort"] == port
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert gateway[probe]["httpGet"]["path"] in paths
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"] in paths

    # Streams drain on SIGTERM: the grace period outlasts the gateway's request timeout.
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > Settings().request_timeout_s

    # The autoscaler's metric is one the gateway exports; the budget keeps a replica up.
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    metric = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric in {m.name for m in GatewayMetrics().registry.collect()}
    assert hpa["spec"]["minReplicas"] >= 2
    (pdb,) = of_kind(objects, "PodDisruptionBudget")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_the_image_runs_as_the_user_the_pods_require_and_copies_every_package():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = int(re.findall(r"^USER (\d+)$", dockerfile, re.M)[-1])
    assert user != 0
    for overlay in OVERLAYS:
        for _, spec, _ in servegate_containers(kustomize(overlay)):
            assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == user
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in packages["include"]:
        assert re.search(rf"^COPY {package.rstrip('*')} ", dockerfile, re.M), f"the image lacks {package}"
    assert len(re.findall(r"^FROM ", dockerfile, re.M)) >= 2  # multi-stage: no compilers' leftovers


def test_a_non_editable_install_carries_every_file_the_packages_need(tmp_path):
    """The image installs the project from its wheel: native kernel sources, policies and the
    migrations' template must be in it, not only the Python modules."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp_path.glob("servegate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    tracked = subprocess.run(["git", "ls-files", *(p.rstrip("*") for p in packages["include"])], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    missing = [path for path in tracked if path not in names]
    assert not missing, f"not in the wheel: {missing}"
