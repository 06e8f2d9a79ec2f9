"""What the installs and images promise, checked without Docker or a network (`make docker-smoke`
builds and runs the images where a Docker engine exists).

- versions: the Makefile's torch release, both images' and pyproject's floor agree, and the floor
  is the one transformers itself declares
- `make install` takes torch from its CPU index on the CPU and not on CUDA; `make serve` binds
  loopback; CI runs exactly `make test`
- images: every project package the CLI imports is copied in (and not excluded from the build
  context), a non-root user, a HEALTHCHECK on /ready at the served port, the model baked in at
  S5_CACHE_DIR, which no compose volume hides
- compose: the CPU service by default, the CUDA one alone under --profile gpu (never two on one
  host port), the published port is the image's
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import shlex
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile", "cuda": ROOT / "docker" / "Dockerfile.cuda"}
PROJECT_PACKAGES = ("engine", "service", "bench")


# ---- small readers ------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") and not pending:
            continue
        pending += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            if pending.strip():
                word, _, rest = pending.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def args_of(path: Path) -> dict[str, str]:
    return dict(a.split("=", 1) for k, a in instructions(path) if k == "ARG" and "=" in a)


def env_of(path: Path) -> dict[str, str]:
    env = {}
    for k, a in instructions(path):
        if k == "ENV":
            for item in shlex.split(a):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    return next(r for r in reqs if r.name == name)


def makefile_var(name: str) -> str:
    m = re.search(rf"^{name}\s*\?=\s*(\S+)\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert m, name
    return m.group(1)


def make_dry_run(*args: str) -> str:
    """The commands `make -n` would run (nothing is run, nothing installed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}  # under `make test`
    return subprocess.run(["make", "-n", "-B", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True).stdout


def imported_project_packages(module: Path, seen: set[Path] | None = None) -> set[str]:
    """Top-level project packages that `module` imports, following project modules transitively."""
    seen = set() if seen is None else seen
    if module in seen or not module.exists():
        return set()
    seen.add(module)
    found: set[str] = set()
    for node in ast.walk(ast.parse(module.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
        for name in names:
            top = name.split(".")[0]
            if top in PROJECT_PACKAGES:
                found.add(top)
                parts = name.split(".")
                target = ROOT.joinpath(*parts)
                for candidate in (target.with_suffix(".py"), target / "__init__.py"):
                    found |= imported_project_packages(candidate, seen)
                if (ROOT / parts[0] / "__init__.py").exists():
                    found |= imported_project_packages(ROOT / parts[0] / "__init__.py", seen)
    return found


def dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = PurePosixPath(rel).parts
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(fnmatch.fnmatch(prefix, pat.strip("/")) or fnmatch.fnmatch(prefix, pat.removeprefix("**/"))
               for pat in patterns for prefix in prefixes)


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def active_services(profiles: set[str]) -> set[str]:
    return {name for name, svc in compose()["services"].items()
            if not svc.get("profiles") or set(svc["profiles"]) & profiles}


def default_profiles() -> set[str]:
    """COMPOSE_PROFILES as docker compose reads it from the project's .env."""
    env = dict(line.split("=", 1) for line in (ROOT / ".env").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
    return {p.strip() for p in env.get("COMPOSE_PROFILES", "").split(",") if p.strip()}


def published(service: dict) -> list[tuple[str, str]]:
    """(host address:port, container port) of each published port, defaults of ${VAR:-x} taken."""
    out = []
    for spec in service.get("ports", []):
        spec = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(spec))
        host, _, container = spec.rpartition(":")
        out.append((host, container))
    return out


# ---- versions -----------------------------------------------------------------------------------
def test_torch_floor_is_what_transformers_declares_and_the_pinned_release_meets_it():
    from transformers.dependency_versions_table import deps

    theirs = Requirement(deps["torch"]).specifier
    ours = requirement("torch").specifier
    floor = lambda spec: min(Version(s.version) for s in spec if s.operator in (">=", ">", "=="))  # noqa: E731
    assert floor(ours) == floor(theirs), f"pyproject torch {ours} vs transformers' {theirs}"
    pinned = makefile_var("TORCH_VERSION")
    assert ours.contains(pinned)
    for kind, path in DOCKERFILES.items():
        assert args_of(path)["TORCH_VERSION"] == pinned, kind
    import transformers

    assert requirement("transformers").specifier.contains(transformers.__version__)


def test_images_python_meets_requires_python():
    requires = pyproject()["project"]["requires-python"]
    for kind, path in DOCKERFILES.items():
        base = next(a for k, a in instructions(path) if k == "FROM")
        m = re.match(r"python:(\d+\.\d+)", base)
        assert m, f"{kind}: base {base} (a python:X.Y image keeps the Python version checkable)"
        assert Requirement(f"python{requires}").specifier.contains(m.group(1) + ".0"), kind


# ---- make ---------------------------------------------------------------------------------------
def test_cpu_install_takes_torch_from_the_cpu_index_and_cuda_does_not():
    cpu = make_dry_run("install", "VENV=/nonexistent/venv")
    index = makefile_var("TORCH_CPU_INDEX")
    assert index.endswith("/whl/cpu")
    assert f'--index-url "{index}"' in cpu and f'"torch=={makefile_var("TORCH_VERSION")}"' in cpu
    # the index is reached before pip runs; without it, the pinned release (never a bare `torch`)
    assert "torch/" in cpu and not re.search(r"pip install[^\n]*\btorch\b(?!==)", cpu)
    assert '".[test]"' in cpu
    cuda = make_dry_run("install", "DEVICE=cuda")
    assert ".venv-cuda" in cuda and "/whl/cpu" not in cuda and '".[test,cuda]"' in cuda


def test_serve_binds_loopback_and_ci_runs_make_test():
    assert "--host 127.0.0.1" in make_dry_run("serve")
    assert "0.0.0.0" not in make_dry_run("serve")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == "make test"


# ---- images -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", DOCKERFILES)
def test_image_copies_every_package_the_cli_imports(kind):
    scripts = {target.split(".")[0] for target in pyproject()["project"]["scripts"].values()}
    needed = scripts | imported_project_packages(ROOT / "service" / "cli.py")
    assert {"engine", "service", "bench"} <= needed  # s5serve imports engine; s5serve-bench is bench
    copies = {src for k, a in instructions(DOCKERFILES[kind]) if k == "COPY" for src in a.split()[:-1]}
    for package in needed | {"pyproject.toml", "README.md"}:
        assert package in copies, f"{kind} image does not copy {package}"
    includes = pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    for package in needed:
        assert f"{package}*" in includes
    for rel in ["pyproject.toml", "README.md", "engine/kernels/q8_matmul.c", "bench/corpus/devils_dictionary.txt",
                *(str(p.relative_to(ROOT)) for pkg in needed for p in (ROOT / pkg).rglob("*.py"))]:
        assert not dockerignored(rel), f"{rel} is excluded from the build context"


def test_build_context_leaves_out_what_images_do_not_need():
    for rel in [".venv/lib/x.py", ".venv-cuda/bin/python", ".git/HEAD", "bench/results/a.json",
                "wheels/x.whl", "engine/__pycache__/a.pyc", ".pytest_cache/v", "s5serve.egg-info/PKG-INFO", ".env"]:
        assert dockerignored(rel), rel


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_image_runs_as_a_user_with_a_healthcheck_on_ready(kind):
    steps = instructions(DOCKERFILES[kind])
    kinds = [k for k, _ in steps]
    users = [a for k, a in steps if k == "USER"]
    assert users and users[-1] not in ("root", "0") and kinds.index("USER") < kinds.index("CMD")
    user = users[-1]
    assert any(k == "RUN" and "useradd" in a and user in a for k, a in steps)
    env = env_of(DOCKERFILES[kind])
    port = env["S5_PORT"]
    assert env["S5_HOST"] == "0.0.0.0"  # inside the container; compose decides what is published
    assert f"EXPOSE {port}" in [f"{k} {a}" for k, a in steps]
    health = [a for k, a in steps if k == "HEALTHCHECK"]
    assert len(health) == 1 and "/ready" in health[0] and "S5_PORT" in health[0] and "CMD" in health[0]
    cmd = next(a for k, a in steps if k == "CMD")
    assert cmd.startswith('["s5serve", "serve"') and pyproject()["project"]["scripts"]["s5serve"] == "service.cli:main"


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_model_is_baked_in_by_the_image_user_where_no_volume_hides_it(kind):
    steps = instructions(DOCKERFILES[kind])
    env = env_of(DOCKERFILES[kind])
    cache = PurePosixPath(env["S5_CACHE_DIR"])
    bake = [i for i, (k, a) in enumerate(steps) if k == "RUN" and "embedded_dir(" in a]
    user_at = max(i for i, (k, _) in enumerate(steps) if k == "USER")
    assert bake and bake[0] > user_at  # converted as the user who serves (files it owns)
    assert any(k == "RUN" and "chown" in a and str(cache) in a for k, a in steps)
    for name, svc in compose()["services"].items():
        for vol in svc.get("volumes", []):
            target = PurePosixPath(str(vol).split(":")[1])
            assert target != cache and target not in cache.parents, f"{name}: volume {vol} hides the model"
    owned = " ".join(a for k, a in steps if k == "RUN" and "chown" in a)
    for svc in compose()["services"].values():  # a fresh volume takes the owner of the image's directory
        for vol in svc.get("volumes", []):
            target = PurePosixPath(str(vol).split(":")[1])
            assert any(str(p) in owned.split() for p in (target, *target.parents) if str(p) != "/"), \
                f"{kind}: {target} is not made the user's in the image"
    data = PurePosixPath(env["S5_SESSION_DB"]).parent
    assert all(any(PurePosixPath(str(v).split(":")[1]) == data for v in svc.get("volumes", []))
               for svc in compose()["services"].values()), "session transcripts must be on a volume"


def test_cuda_image_installs_the_cuda_extra_and_cpu_image_the_cpu_torch():
    cuda_steps = " ".join(a for k, a in instructions(DOCKERFILES["cuda"]) if k == "RUN")
    assert '".[cuda]"' in cuda_steps and "/whl/cpu" not in cuda_steps
    assert env_of(DOCKERFILES["cuda"])["S5_DEVICE"] == "cuda"
    cpu_args = args_of(DOCKERFILES["cpu"])
    assert cpu_args["TORCH_INDEX"] == makefile_var("TORCH_CPU_INDEX")
    assert "S5_DEVICE" not in env_of(DOCKERFILES["cpu"])


# ---- compose ------------------------------------------------------------------------------------
def test_compose_runs_one_server_per_profile_on_the_image_port():
    services = compose()["services"]
    by_file = {Path(svc["build"]["dockerfile"]).name: name for name, svc in services.items()}
    cpu, cuda = by_file["Dockerfile"], by_file["Dockerfile.cuda"]
    assert active_services(default_profiles()) == {cpu}  # docker compose up
    assert active_services({"gpu"}) == {cuda}  # docker compose --profile gpu up
    assert active_services({"cpu"}) == {cpu}
    for profiles in ({"cpu"}, {"gpu"}, default_profiles()):
        hosts = [h for name in active_services(profiles) for h, _ in published(services[name])]
        assert len(hosts) == len(set(hosts)), profiles
    for name, svc in services.items():
        dockerfile = ROOT / svc["build"]["dockerfile"]
        port = env_of(dockerfile)["S5_PORT"]
        assert [c for _, c in published(svc)] == [port], name
        assert all(h.startswith("127.0.0.1:") for h, _ in published(svc)), "published on loopback by default"
        assert "S5_API_KEYS" in svc.get("environment", {}), name
        grace = int(str(svc["stop_grace_period"]).rstrip("s"))
        assert grace > 30, "stop_grace_period must outlast the drain grace (30 s)"
    assert services[cuda]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


@pytest.mark.parametrize("kind", DOCKERFILES)
def test_image_build_steps_import_names_that_exist(kind):
    """The `python -c` steps that bake the model and the CPU kernel into an image name project
    modules; each `from X import Y` there must still resolve, or the image fails to build."""
    import importlib

    found = 0
    for k, a in instructions(DOCKERFILES[kind]):
        if k not in ("RUN", "HEALTHCHECK"):
            continue
        for module, names in re.findall(r"from ((?:engine|service|bench)[\w.]*) import ([\w, ]+)", a):
            mod = importlib.import_module(module)
            for name in names.split(","):
                assert hasattr(mod, name.strip()), f"{kind} image: {module} has no {name.strip()}"
            found += 1
    assert found >= 1
