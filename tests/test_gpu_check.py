"""tools/gpu_check.sh without a GPU (as CI runs it): every check skipped cleanly; and every
command line its checks would run on a GPU (the elastic check: each group's job) is one the dry
run accepts (so a lent GPU's few minutes are not lost to a typo in a flag)."""

import importlib.util
import subprocess
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_every_check_is_skipped():
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    checks = _gpu_check().CHECKS
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == f"0 passed, 0 failed, {len(checks)} skipped"
    assert [line.split(":")[0] for line in lines[1:-1]] == [f"SKIP {c.name}" for c in checks]


def test_every_check_runs_command_lines_the_dry_run_accepts(tmp_path, monkeypatch):
    from fl_megatron.pretrain import main

    module = _gpu_check()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    seen = []

    def dry(work, name, nproc, *flags, env=None, timeout=240):
        argv = [*module.SMALL, "--run-dir", str(work / name), *flags, "--world-size", str(nproc), "--dry-run"]
        seen.append((name, main(argv)))
        return subprocess.CompletedProcess(argv, 1, "", "dry run only")  # the check stops here

    def dry_elastic(work, name, groups, *flags, timeout=300):
        """Each group's job, as tools/elastic_launch.py would start it, dry-run for its one rank."""
        for command in module.elastic_commands(work, name, groups, *flags)[1:]:
            assert command.env["FL_MEGATRON_DEVICE"] == "cuda" and command.env["CUDA_VISIBLE_DEVICES"]
            argv = command.argv[command.argv.index("fl_megatron.pretrain") + 1:]
            seen.append((command.name, main([*argv, "--world-size", "1", "--dry-run"])))
        return {}  # the check stops here

    monkeypatch.setattr(module, "pretrain", dry)
    monkeypatch.setattr(module, "elastic", dry_elastic)
    for index, check in enumerate(module.CHECKS):
        work = tmp_path / f"c{index}"
        work.mkdir()
        check.run(work, 4)
    assert len(seen) >= len(module.CHECKS) and all(code == 0 for _, code in seen), seen
