"""A wheel in a clean virtual environment, as a user installs it: built from a copy of the
tree, installed into a venv without system site-packages, run from an unrelated directory.
Nothing of the checkout or of the developer's environment may serve a module: no
``__editable__`` finder on ``sys.meta_path``, and every ``pcpflow`` module the runs import
lives in the venv's site-packages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

SMALL = ["workload.num_requests=2", "workload.output_len=[2,3]", "output.progress=false", "output.plots=false"]

# What the probe runs inside the venv, in process: a run and a simulated run through the
# driver, then where every pcpflow module it imported came from.
PROBE = """
import json, sys, sysconfig
from pathlib import Path
site = Path(sysconfig.get_paths()["purelib"]).resolve()
editable = [type(f).__name__ for f in sys.meta_path if "editable" in type(f).__name__.lower()]
from pcpflow.driver.cli import main
codes = [main(["pcp=1", "hydra.run.dir=probe-run", *sys.argv[1:]]),
         main(["mode=simulate", "model=llama3_8b", "hardware=h200_sxm", "workload=explicit",
               "workload.prompt_lens=[4096]", "workload.output_lens=[4]", "hydra.run.dir=probe-sim"])]
outside = sorted(name for name, m in sys.modules.items() if name.split(".")[0] == "pcpflow"
                 and getattr(m, "__file__", None) and site not in Path(m.__file__).resolve().parents)
print(json.dumps({"codes": codes, "editable": editable, "outside": outside, "site": str(site),
                  "modules": sum(n.split(".")[0] == "pcpflow" for n in sys.modules)}))
"""


def _clean_env(venv: Path) -> dict[str, str]:
    """This machine's environment, less whatever would point Python at the checkout or at
    another environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (argv, r.stdout[-2000:], r.stderr[-4000:])
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A venv holding the wheel built from a copy of the tracked files (and new files git
    does not ignore), with torch's CPU wheel and the wheel's own dependencies."""
    root = tmp_path_factory.mktemp("install")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    src = root / "src"
    for name in listed:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    venv = root / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], root, dict(os.environ))
    env = _clean_env(venv)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "-w", str(root / "wheel"), str(src)], root, env)
    (wheel,) = (root / "wheel").glob("pcpflow-*.whl")
    _run([*pip, "install", "torch==2.13.0"], root, env)  # the CPU wheel first, as the README says
    _run([*pip, "install", str(wheel)], root, env)
    return venv


def test_the_wheel_holds_every_package_and_no_top_level_folder(venv):
    site = next((venv / "lib").glob("python3*/site-packages"))
    on_disk = {p.parent.relative_to(REPO).as_posix().replace("/", ".") for p in (REPO / "pcpflow").rglob("__init__.py")}
    installed = {p.parent.relative_to(site).as_posix().replace("/", ".") for p in (site / "pcpflow").rglob("__init__.py")}
    assert on_disk <= installed, f"packages missing from the wheel: {sorted(on_disk - installed)}"
    assert (site / "pcpflow" / "stages" / "mtp.py").is_file() and (site / "pcpflow" / "conf" / "config.yaml").is_file()
    assert not (site / "stages").exists() and not (site / "conf").exists()


def test_runs_from_an_unrelated_directory_import_only_the_installed_package(venv, tmp_path):
    env = _clean_env(venv)
    python = str(venv / "bin" / "python")
    probe = _run([python, "-c", PROBE, *SMALL], tmp_path, env)
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["codes"] == [0, 0], probe.stderr[-3000:]
    assert found["editable"] == [] and found["outside"] == [], found
    assert found["modules"] > 30  # the driver, the engine, the simulator: all from site-packages
    for name in ("probe-run", "probe-sim"):
        assert json.loads((tmp_path / name / "result.json").read_text())["status"] == "ok"


def test_the_default_run_a_drafter_and_the_console_script(venv, tmp_path):
    env = _clean_env(venv)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pcpflow", "hydra.run.dir=default"], tmp_path, env)  # the embedded default, as is
    _run([python, "-m", "pcpflow", "draft=mtp", "hydra.run.dir=mtp", *SMALL], tmp_path, env)
    _run([str(venv / "bin" / "pcpflow"), "pcp=1", "hydra.run.dir=script", *SMALL], tmp_path, env)
    for name in ("default", "mtp", "script"):
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert result["status"] == "ok" and result["verify"]["passed"], (name, result.get("error"))
    mtp = json.loads((tmp_path / "mtp" / "result.json").read_text())
    assert "acceptance_rate" in mtp["metrics"]
    helped = _run([str(venv / "bin" / "pcpflow"), "--help"], tmp_path, env)
    assert helped.stdout.startswith("pcpflow: ")
