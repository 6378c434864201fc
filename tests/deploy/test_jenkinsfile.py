"""The Jenkinsfile: every shell step runs a make target or a deploy/ script that
exists (and that test_scripts.py runs in dry-run mode), credentials come only from
Jenkins' credential bindings, and the stages and parameters are the promised ones."""

from __future__ import annotations

import re
import shlex
import subprocess

from tests.deploy.conftest import REPO
from tests.deploy.test_scripts import DRY_RUNS

JENKINSFILE = (REPO / "Jenkinsfile").read_text()
CODE = re.sub(r"^\s*//.*$", "", JENKINSFILE, flags=re.M)  # comments dropped


def sh_commands() -> list[str]:
    return re.findall(r"\bsh\s+'([^']*)'", CODE)


def test_every_sh_step_is_single_quoted_and_calls_make_or_a_deploy_script():
    assert len(re.findall(r"(?<![\w./])sh\s*[('\"]", CODE)) == len(sh_commands()), (
        "an sh step is not single-quoted"
    )
    assert "${" not in "".join(sh_commands()), "Groovy interpolation in a shell step"
    for command in sh_commands():
        program = shlex.split(command)[0]
        assert program == "make" or program.startswith("deploy/"), command


def test_every_make_target_in_the_jenkinsfile_exists():
    for command in sh_commands():
        words = shlex.split(command)
        if words[0] != "make":
            continue
        targets = [w for w in words[1:] if "=" not in w and not w.startswith("-")]
        proc = subprocess.run(
            ["make", "--dry-run", *targets], cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert "No rule to make target" not in proc.stderr, f"{command}: {proc.stderr}"


def test_every_deploy_script_in_the_jenkinsfile_exists_and_is_dry_run_tested():
    tested = {(case[0], *case[1]) for case in DRY_RUNS}
    for command in sh_commands():
        words = shlex.split(command)
        if words[0] == "make":
            continue
        script = REPO / words[0]
        assert script.is_file() and script.stat().st_mode & 0o111, f"{words[0]} is missing or not executable"
        assert (script.name, *words[1:]) in tested, f"`{command}` is not run in dry-run mode by the tests"


def test_credentials_only_through_bindings():
    bindings = re.findall(r"\b(?:string|file|usernamePassword)\(credentialsId: '([\w-]+)'", CODE)
    assert bindings, "no credential bindings"
    assert "withCredentials" in CODE
    for ident in set(bindings):
        assert f"//   {ident}" in JENKINSFILE, f"credential {ident} is not listed in the header"
    assert not re.search(r"(?i)(password|secret|token|api_?key)\s*[=:]\s*['\"][^'\"]+['\"]", CODE)
    assert not re.search(r"AKIA[0-9A-Z]{16}", JENKINSFILE), "an AWS access key id"


def test_parameters_and_stages():
    for name in (
        "CLOUD",
        "IMAGE_TAG",
        "RUN_PIPELINE",
        "DEPLOY",
        "CANARY",
        "GATEWAY",
        "RETRAIN",
        "RETRAIN_CRON",
    ):
        assert re.search(rf"name: '{name}'", CODE), name
    assert "choices: ['aks', 'eks', 'kubeflow']" in CODE
    stages = re.findall(r"stage\('([^']+)'\)", CODE)
    assert stages == [
        "Checkout",
        "Set up",
        "Lint and test",
        "DVC pull, repro, push",
        "Fetch model",
        "Build image",
        "Push image",
        "Deploy",
        "Start Kubeflow pipeline",
        "Smoke test",
    ]
    assert re.search(r"junit testResults: 'reports/junit.xml'", CODE)
    assert "make test PYTEST_ADDOPTS=--junitxml=reports/junit.xml" in sh_commands()


def stage(name: str) -> str:
    """The text of one stage, up to the next."""
    return CODE.split(f"stage('{name}')")[1].split("stage('")[0]


def test_continuous_training_retrains_on_the_timer_or_on_request_and_releases_only_a_new_champion():
    assert re.search(
        r"triggers \{\s*cron\(params\.RETRAIN_CRON == null \? 'H 2 \* \* \*' : params\.RETRAIN_CRON\)", CODE
    )
    assert "name: 'RETRAIN_CRON', defaultValue: 'H 2 * * *'" in CODE
    assert (
        "params.RETRAIN || !currentBuild.getBuildCauses('hudson.triggers.TimerTrigger$TimerTriggerCause')"
        in CODE
    )
    dvc = stage("DVC pull, repro, push")
    assert "retraining()" in dvc.split("steps")[0]
    assert re.search(r"if \(retraining\(\)\) \{\s*sh 'deploy/dvc.sh pull refresh repro push'", dvc)
    assert "fileExists('reports/new-champion')" in CODE  # what deploy/dvc.sh writes
    for name in ("Fetch model", "Build image", "Push image", "Deploy", "Smoke test"):
        assert "releasing()" in stage(name).split("steps")[0], name
    assert 'withEnv(["CANARY=${canary}"])' in stage("Deploy")
    assert "def canary = params.CANARY || (retraining() && !params.GATEWAY)" in stage("Deploy")


def test_a_failing_stage_ends_the_build_before_anything_is_deployed():
    """A champion whose image does not build never reaches the cluster: no step may
    swallow a failure, and the image is built and pushed before the deploy."""
    for forgiving in ("catchError", "returnStatus", "propagate: false", "unstable(", "try {"):
        assert forgiving not in CODE, forgiving
    stages = re.findall(r"stage\('([^']+)'\)", CODE)
    assert stages.index("Build image") < stages.index("Push image") < stages.index("Deploy")
