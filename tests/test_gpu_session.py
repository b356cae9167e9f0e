"""scripts/gpu_session.sh: its stage names are checked before any work starts, and the call's
time cap (CALL_CAP_S) skips a stage that has too little time left, still packing the tarball."""
import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_session.sh"


def run(*stages, env=None):
    return subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=env)


def test_no_stage_prints_the_stages_and_fails():
    out = run()
    assert out.returncode == 2
    assert out.stderr.startswith("usage: gpu_session.sh STAGE...") and "rest-tests" in out.stderr


def test_an_unknown_stage_fails_before_any_work(tmp_path):
    out = run("bench-ttft", "bench-tfft", env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line
    assert "unknown stage 'bench-tfft'" in out.stderr
    assert not any(tmp_path.iterdir())  # nothing ran, nothing written


def test_a_stage_past_the_call_cap_is_skipped_and_the_tarball_still_written(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), CALL_CAP_S="5", MINILLM_GIT_REV="abc1234")
    out = run("bench-ttft", "kernel-tests", env=env)
    assert out.returncode == 0, out.stderr
    for stage in ("bench-ttft", "kernel-tests"):
        assert f"[stage {stage}: skipped, under 30 s left of 5 s]" in out.stdout
    with tarfile.open(tmp_path / "results.tgz") as tar:
        names = tar.getnames()
        env_txt = tar.extractfile("results/env.txt").read().decode()
    assert names == ["results", "results/env.txt"]
    assert "git abc1234" in env_txt


def test_every_listed_stage_has_commands_and_every_branch_is_listed():
    """STAGES (what the script accepts) and the case labels (what it runs) are written apart: a
    stage listed without a branch would pass the check and then do nothing, silently."""
    text = SCRIPT.read_text()
    listed = set(text.split('STAGES="', 1)[1].split('"', 1)[0].split())
    body = text.split('  case $stage in\n', 1)[1].split("\n  esac", 1)[0]
    labels = {name for line in body.splitlines()
              if re.match(r"^    [a-z|-]+\)", line)
              for name in line.strip().split(")", 1)[0].split("|")}
    assert listed == labels
