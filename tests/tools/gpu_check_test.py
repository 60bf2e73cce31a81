#!/usr/bin/env python3
"""scripts/gpu-check's stage choice and its reading of compute-sanitizer, with no GPU: a stand-in
nvidia-smi, and a stand-in compute-sanitizer that either runs the qflash command it is given on
the CPU or prints what the real tool prints on errors, races, a crash, a hang or a device it
cannot use.

    gpu_check_test.py BUILD_DIR    a build configured with CUDA (cmake --preset ci)
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(sys.argv.pop(1)) if len(sys.argv) > 1 else REPO / "build" / "ci"

NVIDIA_SMI = """#!/bin/sh
if [ "$1" = -L ]; then echo "GPU 0: Stand-in GPU (UUID: GPU-0)"; else echo "index, name"; echo "0, Stand-in"; fi
"""

# Modes (FAKE_MODE): cpu runs the command with --device cpu; errors and race report a finding;
# crash: the target fails with a clean summary; nodev: the device is refused; hang sleeps.
SANITIZER = r"""#!/usr/bin/env bash
[[ $1 == --version ]] && { echo "NVIDIA (R) Compute Sanitizer"; echo "Version 2099.1.0 stand-in"; exit 0; }
tool=memcheck
while [[ $1 == --* ]]; do
  case $1 in
    --tool | --error-exitcode | --print-limit | --report-api-errors) [[ $1 == --tool ]] && tool=$2; shift 2 ;;
    *) echo "stand-in compute-sanitizer: unknown option $1" >&2; exit 99 ;;
  esac
done
echo "$tool $*" >>"$FAKE_LOG"
echo "========= COMPUTE-SANITIZER"
summary() {
  if [[ $tool == racecheck ]]; then
    echo "========= RACECHECK SUMMARY: $1 hazards displayed ($1 errors, 0 warnings)"
  else
    echo "========= ERROR SUMMARY: $1 errors"
  fi
}
case $FAKE_MODE in
  nodev) echo "========= Error: Device not supported"; exit 1 ;;
  errors) echo "========= Invalid __global__ read of size 4 bytes"; echo "=========     at k+0x10"; summary 1; exit 86 ;;
  race)
    if [[ $tool == racecheck ]]; then
      echo "========= Error: Race reported between Write access at k+0x20"; summary 1; exit 86
    fi ;;
  crash) summary 0; exit 3 ;;
  hang) sleep 30 ;;
  cpu)
    args=()
    for a in "$@"; do [[ $a == cuda ]] && a=cpu; args+=("$a"); done
    "${args[@]}" >/dev/null 2>&1 || { rc=$?; summary 0; exit $rc; } ;;
esac
summary 0
"""


class GpuCheck(unittest.TestCase):
    def setUp(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_test."))
        self.bin = self.tmp / "bin"
        self.bin.mkdir()
        for name, text in (("nvidia-smi", NVIDIA_SMI), ("compute-sanitizer", SANITIZER)):
            (self.bin / name).write_text(text)
            (self.bin / name).chmod(0o755)
        self.log = self.tmp / "calls.txt"

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def check(self, mode="cpu", path=None, **env):
        out = self.tmp / "out"
        e = dict(os.environ, OUT=str(out), FAKE_MODE=mode, FAKE_LOG=str(self.log), GPU_CHECK_STAGES="sanitize",
                 PATH=path if path is not None else f"{self.bin}:{os.environ['PATH']}")
        e.update(env)
        r = subprocess.run([str(REPO / "scripts" / "gpu-check"), str(BUILD)], env=e, capture_output=True, text=True,
                           timeout=600)
        report = (out / "gpu-report.txt").read_text() if (out / "gpu-report.txt").exists() else ""
        calls = self.log.read_text().splitlines() if self.log.exists() else []
        return r.returncode, report, calls

    def test_clean_runs_pass_and_each_tool_sees_a_cuda_command(self):
        rc, report, calls = self.check("cpu")
        self.assertEqual(rc, 0, report)
        self.assertIn("stages: sanitize (GPU_CHECK_STAGES)", report)
        self.assertEqual([c.split()[0] for c in calls],
                         ["memcheck", "racecheck", "memcheck", "initcheck", "synccheck", "memcheck"])
        for c in calls:
            self.assertTrue(c.split()[1].endswith("/bin/qflash"), c)
            self.assertIn("--device cuda", c)
        self.assertTrue(any("--routing top_p" in c and "--kv int6" in c for c in calls))
        self.assertTrue(any("--synthetic qwen3_6_35b_a3b" in c for c in calls))
        self.assertEqual(report.count(": ERROR SUMMARY: 0 errors"), 5)
        self.assertIn("racecheck, default model: RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)", report)
        self.assertIn("gpu-check: PASS", report)
        self.assertEqual((self.tmp / "out" / "sanitizer.txt").read_text().count("### "), 6)

    def test_findings_fail_with_the_first_report(self):
        rc, report, _ = self.check("errors")
        self.assertEqual(rc, 1)
        self.assertIn("FAIL: compute-sanitizer memcheck, default model: ERROR SUMMARY: 1 errors", report)
        self.assertIn("   ========= Invalid __global__ read of size 4 bytes", report)
        self.assertNotIn("   =========     at k+0x10", report)
        self.assertIn("gpu-check: FAIL", report)

    def test_a_race_fails_only_racecheck(self):
        rc, report, _ = self.check("race")
        self.assertEqual(rc, 1)
        self.assertEqual(report.count("gpu-check: FAIL: "), 1, report)
        self.assertIn("FAIL: compute-sanitizer racecheck, default model: RACECHECK SUMMARY: 1 hazards", report)
        self.assertIn("Race reported between", report)

    def test_a_target_that_fails_under_a_clean_summary_fails(self):
        rc, report, _ = self.check("crash")
        self.assertEqual(rc, 1)
        self.assertIn("FAIL: qflash run under compute-sanitizer memcheck, default model: exit status 3", report)
        self.assertIn("FAIL: qflash bench under compute-sanitizer memcheck, synthetic", report)

    def test_a_device_it_cannot_use_is_named_once_and_not_failed(self):
        rc, report, calls = self.check("nodev")
        self.assertEqual(rc, 3, report)
        self.assertEqual(len(calls), 1)
        self.assertIn("compute-sanitizer cannot use this device", report)
        self.assertIn("not run or not finished: compute-sanitizer (device not supported)", report)
        self.assertIn("gpu-check: INCOMPLETE", report)

    def test_a_run_past_its_limit_is_unfinished(self):
        rc, report, _ = self.check("hang", GPU_CHECK_SANITIZE_TIMEOUT="1")
        self.assertEqual(rc, 3, report)
        self.assertIn("memcheck, default model: did not finish in 1 s", report)
        self.assertIn("compute-sanitizer memcheck, default model (unfinished)", report)

    def test_no_time_left_skips_the_stage(self):
        rc, report, calls = self.check("cpu", GPU_CHECK_DEADLINE="10")
        self.assertEqual(rc, 3, report)
        self.assertEqual(calls, [])
        self.assertIn("compute-sanitizer (deadline)", report)

    def test_an_unknown_stage_is_refused(self):
        rc, report, calls = self.check("cpu", GPU_CHECK_STAGES="tests,sanitise")
        self.assertEqual(rc, 2)
        self.assertIn("GPU_CHECK_STAGES: no stage 'sanitise'", report)
        self.assertEqual(calls, [])

    def test_no_gpu_is_a_clear_error(self):
        if shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists():
            self.skipTest("this machine has an NVIDIA GPU")
        rc, report, _ = self.check("cpu", path=os.environ["PATH"])
        self.assertEqual(rc, 2)
        self.assertIn("no NVIDIA GPU on this machine", report)


if __name__ == "__main__":
    if not (BUILD / "CMakeCache.txt").exists() or not (BUILD / "bin" / "qflash").exists():
        sys.exit(f"gpu_check_test: {BUILD} is not a built CUDA build dir (cmake --preset ci, then build)")
    unittest.main(verbosity=2)
