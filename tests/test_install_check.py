"""A torchvision that does not match torch (its import raises a RuntimeError) skips the tests that need it, with the
reason, instead of stopping the whole suite at collection; and the README's one-line check of the install runs."""
import subprocess
import sys

from dist_helpers import REPO, _env

NEEDS_TORCHVISION = ["tests/testing/test_legacy_gradient_accumulation.py", "tests/examples/test_resnet_example.py",
                     "tests/registry/test_registry.py::test_torchvision_is_imported_only_when_a_lookup_needs_it"]


def test_a_torchvision_built_for_another_torch_skips_its_tests_with_the_reason(tmp_path):
    fake = tmp_path / "torchvision"
    fake.mkdir()
    # what a CUDA torchvision beside a CPU torch raises on import
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    env = _env({"PYTHONPATH": f"{tmp_path}:{_env()['PYTHONPATH']}"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *NEEDS_TORCHVISION],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 skipped" in proc.stdout, proc.stdout
    assert "this port uses torchvision's FakeData and resnet18, but torchvision cannot be imported with torch " \
        in proc.stdout, proc.stdout
    assert "(RuntimeError: operator torchvision::nms does not exist); install the torchvision built for this " \
           "torch" in proc.stdout, proc.stdout


def test_the_readme_one_line_check_runs():
    readme = (REPO / "README.md").read_text()
    (line,) = [x for x in readme.splitlines() if x.startswith('python -c "import torch, torchvision')]
    proc = subprocess.run(line, shell=True, capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("torch ") and " torchvision " in proc.stdout and " CUDA " in proc.stdout
