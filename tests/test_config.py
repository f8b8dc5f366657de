"""Preset validation: every bad input gives one line naming file, key, value and what is allowed."""

from __future__ import annotations

import subprocess
import sys

import os

import pytest

from shardscope import config
from shardscope.config import ConfigError, HostInfo

HOST = HostInfo("cpu", 4, "2 CPU cores", True)


def test_builtin_smoke_loads_with_defaults():
    c = config.load_preset("smoke", host=HOST)
    assert c.name == "smoke" and c.baseline == "ddp"
    assert [r.strategy for r in c.runs] == ["ddp", "fsdp2"]
    assert config.resolved_world_size(c, c.runs[0]) == 2


def test_overrides_are_typed():
    c = config.load_preset("smoke", ["steps=7", "lr=0.01", "model.n_layers=1",
                                     "runs.fsdp2.options.reshard_after_forward=false", "precision=bf16-autocast"], host=HOST)
    assert c.steps == 7 and c.lr == 0.01 and c.model.n_layers == 1 and c.precision == "bf16-autocast"
    assert c.run("fsdp2").options == {"reshard_after_forward": False}


def test_user_file_by_path(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('description = "mine"\nsteps = 3\n[[runs]]\nname = "a"\nstrategy = "ddp"\n')
    c = config.load_preset(str(p), host=HOST)
    assert c.name == "mine" and c.steps == 3 and c.source == str(p)


@pytest.mark.parametrize("override, needle", [
    ("bogus=1", "unknown key 'bogus'; allowed:"),
    ("steps='x'", "--set steps='x': expected an integer"),
    ("steps=true", "expected an integer"),
    ("world_size=0", "--set world_size=0: must be > 0"),
    ("world_size=64", "hosts at most 4 (2 CPU cores)"),
    ("runs.ddp.strategy='nope'", "--set runs.ddp.strategy='nope': allowed: "),
    ("precision='fp8'", "--set precision='fp8': allowed: fp32"),
    ("model.n_heads=3", "--set model.n_heads=3: must divide model.d_model = 64"),
    ("global_batch=3", "--set global_batch=3: must be divisible by dp (2)"),
    ("runs.fsdp2.options.nope=1", "--set runs.fsdp2.options.nope=1: unknown option of fsdp2; allowed:"),
    ("runs.fsdp2.options.reshard_after_forward=3", "allowed: true or false"),
    ("runs.ddp.fault='rank=1,step=2,kind=explode'", "kind must be one of raise, exit, hang"),
    ("baseline='zzz'", "--set baseline='zzz': not a run; runs: ddp, fsdp2"),
    ("runs.zzz.steps=1", "no run named 'zzz'"),
    ("model.kind='cnn'", "--set model.kind='cnn': allowed: transformer, hf, vit, module"),
    ("data.kind='text'", "data.path = '': no such text file"),
    ("launch.device='tpu'", "--set launch.device='tpu': allowed: auto, cpu, cuda"),
    ("lr=nan", "--set lr=nan: must be a finite number"),
    ("lr=inf", "--set lr=inf: must be a finite number"),
    ("grad_clip=-inf", "--set grad_clip=-inf: must be a finite number"),
    ("runs.ddp.name='" + "a" * 65 + "'", "(65 characters): at most 64"),
])
def test_bad_inputs_name_key_value_and_allowed(override, needle):
    with pytest.raises(ConfigError) as info:
        config.load_preset("smoke", [override], host=HOST)
    message = str(info.value)
    assert needle in message
    assert "\n" not in message
    assert "smoke" in message or "--set" in message


def test_fp16_on_cpu_torch_strategies_yes_deepspeed_only_with_the_isa(tmp_path):
    """torch's CPU autocast runs fp16 anywhere; DeepSpeed's CPU accelerator needs AVX512-FP16/AMX-FP16."""
    c = config.load_preset("smoke", ["precision=fp16"], host=HOST)
    assert c.precision == "fp16"
    with pytest.raises(ConfigError) as info:
        config.load_preset("zero-stages", ["precision=fp16"], host=HOST)
    assert "precision = 'fp16'" in str(info.value) and "AVX512-FP16" in str(info.value)
    with_isa = HostInfo("cpu", 4, "2 CPU cores", True, cpu_fp16=True)
    assert config.load_preset("zero-stages", ["precision=fp16"], host=with_isa).precision == "fp16"
    flags = tmp_path / "cpuinfo"
    flags.write_text("processor : 0\nflags\t\t: fpu sse2 avx512f avx512_fp16\n")
    assert config.cpu_has_fp16_isa(str(flags))
    flags.write_text("processor : 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    assert not config.cpu_has_fp16_isa(str(flags))
    assert not config.cpu_has_fp16_isa(str(tmp_path / "absent"))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="no such preset file"):
        config.load_preset(str(tmp_path / "absent.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load_preset(str(bad))
    norun = tmp_path / "norun.toml"
    norun.write_text("steps = 3\n")
    with pytest.raises(ConfigError, match="at least one"):
        config.load_preset(str(norun))
    with pytest.raises(ConfigError, match="built-in presets: "):
        config.load_preset("no-such-preset")


def test_parse_fault():
    assert config.parse_fault("rank=1,step=3,kind=hang") == {"rank": 1, "step": 3, "kind": "hang"}
    with pytest.raises(ValueError):
        config.parse_fault("rank=x")
    assert config.parse_fault("rank=1,step=2,kind=slow,ms=40") == {"rank": 1, "step": 2, "kind": "slow", "ms": 40}


def test_spec_payload_resolves_defaults(tmp_path):
    c = config.load_preset("smoke", host=HOST)
    payload = config.run_spec_payload(c, c.run("fsdp2"), out_dir=str(tmp_path), device="cpu")
    assert payload["run"]["world_size"] == 2 and payload["run"]["dp"] == 2 and payload["run"]["tp"] == 1
    assert payload["run"]["options"]["reshard_after_forward"] is True
    assert payload["init_path"].endswith("init.safetensors")
    assert config.Comparison.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("args", [
    ["run", "--preset", "nope", "--headless"],
    ["run", "--preset", "smoke", "--headless", "--set", "world_size=0"],
    ["run", "--preset", "smoke", "--headless", "--set", "steps"],
    ["estimate", "--preset", "smoke", "--world-size", "0"],
])
def test_cli_bad_input_exits_2_with_one_line(args):
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("shardscope: error:"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_dry_run_prints_torchrun_commands_and_launches_nothing(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--dry-run",
                           "--set", "launch.device='cpu'", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("torch.distributed.run") == 3  # ddp, fsdp2 and the A/A control (ddp again)
    assert "ddp.again/spec.json" in proc.stdout
    assert "--nproc-per-node 2" in proc.stdout and "--start-method fork --run-path" in proc.stdout  # CPU: forked ranks
    assert "shardscope/engines/rank.py" in proc.stdout
    assert not out.exists()


def test_cpu_overrides_apply_only_on_cpu_and_user_set_wins(tmp_path):
    p = tmp_path / "sized.toml"
    p.write_text('steps = 100\n[model]\nd_model = 768\nn_heads = 12\n[cpu_overrides]\nsteps = 5\n"model.d_model" = 64\n'
                 '"model.n_heads" = 4\n[[runs]]\nname = "a"\nstrategy = "ddp"\n')
    cpu = config.load_preset(str(p), host=HOST)
    assert (cpu.steps, cpu.model.d_model, cpu.size_profile) == (5, 64, "cpu")
    assert config.load_preset(str(p), ["steps=7"], host=HOST).steps == 7
    gpu = config.load_preset(str(p), host=HostInfo("cuda", 8, "8 GPUs", True))
    assert (gpu.steps, gpu.model.d_model, gpu.size_profile) == (100, 768, "full")


def test_validate_is_pure_and_returns_the_validated_comparison():
    """validate() leaves its argument as it was and returns a new value with the baseline filled in."""
    runs = [config.RunSpec("a", "ddp"), config.RunSpec("b", "fsdp2", options={"reshard_after_forward": False})]
    c = config.Comparison(name="pure", runs=runs, world_size=2, global_batch=4)
    before = c.to_dict()
    v = config.validate(c, host=HOST)
    assert c.to_dict() == before and c.baseline == ""
    assert v is not c and v.baseline == "a" and v.run("b").options == {"reshard_after_forward": False}
    with pytest.raises(ConfigError, match="baseline = 'zzz'"):
        config.validate(config.Comparison(name="pure", runs=runs, baseline="zzz"))


def test_check_parity_without_headless_is_refused_in_one_line(tmp_path):
    """The app path has no exit code to gate on: --check-parity there is refused (exit 2), not silently ignored."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "shardscope.cli", "run", "--preset", "smoke", "--check-parity",
                           "--out", str(out)], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("shardscope: error:")]
    assert errors == [errors[0]] and "--check-parity needs --headless" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_preset_nested_too_deep_is_one_line(tmp_path):
    """A hostile preset (5,000 nested arrays, or tables 9 deep) is refused in one line, not a RecursionError."""
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested deeper than 8 tables or arrays"):
        config.load_preset(str(deep), host=HOST)
    tables = tmp_path / "tables.toml"
    tables.write_text("[" + ".".join("t" * (i + 1) for i in range(9)) + "]\nx = 1\n")
    with pytest.raises(ConfigError, match="t.tt.ttt.tttt.ttttt.tttttt.ttttttt.tttttttt.ttttttttt: nested deeper"):
        config.load_preset(str(tables), host=HOST)


def test_too_many_ranks_for_the_gpus_names_the_cpu_way_out():
    """A 2-rank preset on a one-GPU machine says how to run it on CPU cores; on CPU there is no such hint."""
    hint = r"hosts at most 1 \(1 GPU\); launch.device = .cpu. \(`run --device cpu`\) runs it on CPU"
    with pytest.raises(ConfigError, match=hint):
        config.load_preset("smoke", host=HostInfo("cuda", 1, "1 GPU", True))
    with pytest.raises(ConfigError) as err:
        config.load_preset("smoke", ["world_size=64"], host=HOST)
    assert "launch.device" not in str(err.value)


def test_the_preset_files_own_launch_device_is_the_one_the_command_line_uses(tmp_path, monkeypatch):
    """A preset's ``launch.device`` decides the device (and so the host checks) unless ``--set`` names one."""
    from shardscope.cli import common
    from shardscope.orchestrator import devices

    monkeypatch.setattr(devices, "gpu_names", lambda: ["NVIDIA H200"])  # a one-GPU node, as NVML would say
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    p = tmp_path / "two.toml"
    body = ('description = "x"\nsteps = 3\nworld_size = 2\n[launch]\ndevice = "{}"\n'
            '[[runs]]\nname = "a"\nstrategy = "ddp"\n')
    p.write_text(body.format("cpu"))
    assert common.resolve(str(p), [])[1] == "cpu"  # two ranks fit on CPU cores, not on the one GPU
    p.write_text(body.format("auto"))
    with pytest.raises(SystemExit) as exited:
        common.resolve(str(p), [])
    assert exited.value.code == 2
    assert common.resolve(str(p), ["launch.device='cpu'"])[1] == "cpu"


@pytest.mark.parametrize("override, message", [
    ("seed=1000000000000000000000000000000", "--set seed=1000000000000000000000000000000: at most 9,223,372,036,854,775,807"),
    ("model.n_layers=1000000000000000000000000000000", "--set model.n_layers=1000000000000000000000000000000: at most 16,384"),
    ("stall_timeout_s=1e308", "--set stall_timeout_s=1e308: at most 10,000,000"),
    ("global_batch=100000000000", "--set global_batch=100000000000: at most 16,777,216"),
    ("launch.rdzv_endpoint=nonsense", "--set launch.rdzv_endpoint=nonsense: 'nonsense': expected host:port"),
    ("runs.ddp.fault='rank=1,step=3,kind=exit,code=1000'", "code = 1000: at most 255"),
])
def test_numbers_no_rank_can_honour_are_refused_before_the_start(override, message):
    """A value that would only fail inside every rank (a seed torch refuses, a timeout datetime cannot hold, a
    model no memory holds, an exit code past a byte) is one line before anything starts."""
    with pytest.raises(ConfigError) as err:
        config.load_preset("smoke", [override])
    assert message in str(err.value), str(err.value)


def test_a_preset_must_be_a_small_regular_file(tmp_path):
    """A FIFO would block the reader forever and /dev/zero would never end: only regular files under 1 MiB."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        config.load_preset(str(fifo))
    with pytest.raises(ConfigError, match="not a regular file"):
        config.load_preset("/dev/zero")
    big = tmp_path / "big.toml"
    big.write_text("#" * (2 << 20))
    with pytest.raises(ConfigError, match="larger than 1024 KiB"):
        config.load_preset(str(big))
    with pytest.raises(ConfigError, match="--preset '': empty"):
        config.load_preset("")


def test_presets_show_and_copy(tmp_path):
    """A preset can be read and copied: `show` prints its TOML (and the [cpu_overrides] that apply here), `copy`
    writes it to a new file and never overwrites one."""
    import subprocess
    import sys

    show = subprocess.run([sys.executable, "-m", "shardscope.cli", "presets", "show", "ddp-vs-fsdp"],
                          capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and 'name = "fsdp2"' in show.stdout and show.stdout.startswith("# ")
    target = tmp_path / "mine.toml"
    copy = subprocess.run([sys.executable, "-m", "shardscope.cli", "presets", "copy", "smoke", str(target)],
                          capture_output=True, text=True, timeout=60)
    assert copy.returncode == 0 and target.read_text() == (config.PRESET_DIR / "smoke.toml").read_text()
    assert config.load_preset(str(target)).name == "mine"
    again = subprocess.run([sys.executable, "-m", "shardscope.cli", "presets", "copy", "smoke", str(target)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr
