"""The sbatch script's shape and quoting (run by bash against fake scontrol/srun), the multi-node launch
command, the root cause across ranks, and GPU detection that believes NVML. No torchrun is launched."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest

from shardscope.orchestrator import devices, launcher, slurm
from shardscope.analysis import root_cause

CLI = [sys.executable, "-m", "shardscope.cli"]


def script_argv(tmp_path, script: str, job_id: str = "4242") -> list[str]:
    """Run the script with fake scontrol/srun on PATH; return the argv srun was given (after its options)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {
        "scontrol": '#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then echo nodeA; seq 1 100000 | sed s/^/node/; '
                    'else echo "NodeName=nodeA Arch=x86_64 CoresPerSocket=1"; echo "   NodeAddr=10.1.2.3 NodeHostName=a"; fi\n',
        # srun records its argv and, as node 0 would, leaves a summary of ok runs in --out
        "srun": f'#!/bin/bash\nprintf "%s\\0" "$@" > {shlex.quote(str(tmp_path / "srun.argv"))}\n'
                'out=; prev=; for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done\n'
                'mkdir -p "$out" && echo \'{"runs": [{"name": "ddp", "status": "ok"}]}\' > "$out/summary.json"\n',
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": job_id,
           "SLURM_JOB_NODELIST": "node[A-B]", "SLURM_JOB_NUM_NODES": "2"}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "srun.argv").read_text().split("\0")[:-1]
    return argv


def test_script_passes_any_set_value_and_path_verbatim_with_the_head_address_and_job_ports(tmp_path):
    """Every --set value and the working directory reach the orchestrator as single, unchanged arguments;
    the rendezvous is node 0's NodeAddr at ports derived from the job id; CPU nodes ask no GPU."""
    tricky = 'description="two words, \\"q\\" & \'s\' $HOME `x` ;"'
    shape = slurm.node_shape("auto", 2, 2, gpus_per_node=None, cpus_per_node=1, cpus_per_rank=None)
    script = slurm.sbatch_script("smoke", nodes=2, shape=shape, time_limit="00:10:00", overrides=[tricky, "steps=3"])
    assert "--gpus-per-node" not in script and "#SBATCH --cpus-per-task=1" in script
    work = tmp_path / "dir with space $x"
    work.mkdir()
    argv = script_argv(work, script)
    srun_opts, cmd = argv[:3], argv[3:]
    assert srun_opts == ["--kill-on-bad-exit=1", "--label", "--cpus-per-task=1"]
    assert cmd[cmd.index(tricky) - 1] == "--set" and "steps=3" in cmd
    port = slurm.PORT_BASE + slurm.PORTS_PER_JOB * (4242 % slurm.PORT_SLOTS)
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == f"10.1.2.3:{port + 1}"
    assert cmd[cmd.index("--rdzv-id") + 1] == "shardscope-4242"
    assert cmd[cmd.index("--out") + 1] == f"{work}/shardscope-runs/slurm-4242-smoke"
    assert cmd[cmd.index("--device") + 1] == "cpu" and "--slurm-task" in cmd


def test_gpu_variant_from_the_presets_device_asks_gpus_and_cpus_per_node(tmp_path):
    """A cuda preset without node options: its world size split over the nodes, GPUs and 4 CPUs per rank."""
    shape = slurm.node_shape("cuda", 16, 2, gpus_per_node=None, cpus_per_node=None, cpus_per_rank=None)
    assert shape == slurm.NodeShape(8, True, 4)
    script = slurm.sbatch_script("smoke", nodes=2, shape=shape, time_limit="1:00:00", overrides=[])
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --cpus-per-task=32" in script
    cmd = script_argv(tmp_path, script, job_id="7")
    assert cmd[cmd.index("--set") + 1] == "world_size=16" and "--device" not in cmd


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus_per_node=1, cpus_per_node=1, cpus_per_rank=None), "give one"),
    (dict(gpus_per_node=0, cpus_per_node=None, cpus_per_rank=None), "--gpus-per-node 0"),
    (dict(gpus_per_node=None, cpus_per_node=None, cpus_per_rank=None), "not a multiple"),
])
def test_node_shape_refuses_bad_options_with_the_option_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        slurm.node_shape("cpu", 3, 2, **kwargs)


def test_slurm_command_cpu_variant_from_the_presets_device_and_bad_input_exits_2():
    """`launch.device = "cpu"` without node options gives the CPU variant; a bad option is one line, exit 2."""
    ok = subprocess.run([*CLI, "slurm", "--preset", "smoke", "--nodes", "2", "--set", 'launch.device="cpu"'],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "--gpus-per-node" not in ok.stdout and "--cpus-per-task=1" in ok.stdout
    bad = subprocess.run([*CLI, "slurm", "--preset", "smoke", "--nodes", "2", "--cpus-per-node", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--cpus-per-node 0" in bad.stderr


def test_multinode_torchrun_uses_node_0s_static_rendezvous_and_a_port_per_run():
    one = " ".join(launcher.torchrun_argv("/s.json", nproc_per_node=2, rdzv_endpoint="h:1"))
    assert "--rdzv-backend c10d" in one and "--node-rank" not in one
    two = " ".join(launcher.torchrun_argv("/s.json", nproc_per_node=2, nnodes=2, node_rank=1, rdzv_endpoint="h:100"))
    assert "--rdzv-backend static" in two and "--node-rank 1" in two
    assert [launcher.endpoint_for_run("10.0.0.1:100", i) for i in range(3)] == ["10.0.0.1:100", "10.0.0.1:101",
                                                                                 "10.0.0.1:102"]


def test_root_cause_is_the_first_primary_error_and_the_rest_are_consequences():
    """Rank 0's broken connection, though read first and stamped a little earlier (another node's clock),
    is a consequence of rank 1's fault."""
    errors = [
        {"rank": 0, "t": 99.9, "message": "RuntimeError: Connection closed by peer [127.0.0.1]:4242", "traceback": "tb0"},
        {"rank": 1, "t": 100.0, "message": "RuntimeError: injected fault", "traceback": "tb1", "host": "n1"},
        {"rank": 2, "t": 100.5, "message": "ValueError: later, unrelated", "traceback": "tb2"},
    ]
    message, traceback = root_cause.root_cause(errors)
    assert message == "RuntimeError: injected fault"
    assert traceback.startswith("root cause on rank 1 (n1):\ntb1") and "rank 0, -0.10 s: RuntimeError: Connection" in traceback
    assert root_cause.root_cause(errors[:1])[0].startswith("RuntimeError: Connection")  # nothing else: it is the cause
    assert root_cause.root_cause([]) == ("", "")


def test_cuda_visible_devices_alone_is_not_a_gpu(monkeypatch):
    """NVML is believed: a set CUDA_VISIBLE_DEVICES without GPUs counts none; with GPUs it selects among them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert devices.visible_gpu_count([]) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0,-1,2")
    assert devices.visible_gpu_count(["A", "B", "C", "D"]) == 2
    monkeypatch.setattr(devices, "gpu_names", lambda: [])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert devices.resolve_device("auto") == "cpu"


def test_dry_run_with_cuda_visible_devices_resolves_to_cpu_without_nvml_gpus():
    if devices.gpu_names():
        pytest.skip("this machine has GPUs through NVML")
    proc = subprocess.run([*CLI, "run", "--dry-run"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split(" on ")[1].startswith("cpu;")
    assert json.loads(proc.stdout.split("\n", 1)[1].split("\n# run")[0])["launch"]["device"] == "auto"


def test_a_preset_by_path_names_the_job_by_its_name_and_node_local_files_are_warned(tmp_path):
    """`--preset runs/mine.toml` names the job shardscope-mine (not a path), and a data file under /tmp (often one
    node's own disk) gets a warning on stderr, the script on stdout untouched."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    data = Path(__file__).parent / "data" / "user"
    folder = Path("/tmp") / f"shardscope-slurm-test-{tmp_path.name}"
    folder.mkdir(exist_ok=True)
    shutil.copy(data / "train.bin", folder / "train.bin")
    preset = tmp_path / "sub" / "mine.toml"
    preset.parent.mkdir()
    preset.write_text((Path(__file__).parents[1] / "shardscope" / "presets" / "smoke.toml").read_text().replace(
        "[profile]", f'[data]\nkind = "tokens"\npath = "{folder / "train.bin"}"\n\n[profile]').replace("vocab_size = 256", "vocab_size = 512"))
    try:
        proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "slurm", "--preset", str(preset), "--nodes", "2",
                               "--cpus-per-node", "1"], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --job-name=shardscope-mine\n" in proc.stdout
    assert f"warning: data.path = {folder / 'train.bin'}: every node reads it" in proc.stderr
    assert proc.stdout.startswith("#!/bin/bash")
