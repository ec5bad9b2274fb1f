"""The device plan: which GPUs each process of a run gets and how shared GPUs split their memory
(grpo_stream/plan/device_plan.py), for 1, 2, 4 and 8 GPUs, 1-3 samplers and both engines."""

import json
import os
import stat

import pytest

from grpo_stream.common.config.loading import load_config
from grpo_stream.plan.device_plan import (DeviceLayoutError, detect_gpus, load_figures, own_process_env,
                                                    plan_devices)

GIB = 1 << 30
H100 = 80 * GIB


def config(*overrides):
    return load_config(None, list(overrides))


def visible(p) -> list[str]:
    return p.env["CUDA_VISIBLE_DEVICES"].split(",")


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
@pytest.mark.parametrize("samplers", [1, 2, 3])
@pytest.mark.parametrize("engine", ["jax", "vllm"])
def test_every_layout_gives_each_process_its_gpus_and_shares_that_fit(gpus, samplers, engine):
    cfg = config(f"sampler.replicas={samplers}", f"sampler.engine={engine}")
    plan = plan_devices(cfg, [str(g) for g in range(gpus)], H100)
    trainer, procs = plan.process("trainer"), [plan.process(f"sampler-{i}") for i in range(samplers)]
    assert visible(trainer) == ["0"]  # the first GPU, always
    for p in procs:
        assert len(visible(p)) == 1 and int(visible(p)[0]) < gpus
        assert (p.env.get("JAX_PLATFORMS") == "cpu") == (engine == "vllm")  # vLLM's own JAX never takes a GPU
    if gpus > samplers:  # enough GPUs: one each, nobody shares, every runtime keeps its defaults
        assert sorted(int(visible(p)[0]) for p in procs) == list(range(1, samplers + 1))
        assert not plan.sharing()
        assert all("XLA_PYTHON_CLIENT_MEM_FRACTION" not in p.env and not p.overrides for p in plan.processes)
    for g, names in plan.sharing().items():  # shared: capped shares that add up to at most 1 - margin
        users = [plan.process(n) for n in names]
        assert sum(p.share for p in users) <= 0.9 + 1e-6
        for p in users:
            if p.engine == "jax":
                assert p.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
                assert float(p.env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == p.share
            else:
                assert p.overrides == (f"sampler.vllm.gpu_memory_utilization={p.share}",)


def test_one_gpu_is_shared_by_all_with_the_trainer_taking_twice_a_sampler():
    plan = plan_devices(config("sampler.replicas=2"), ["0"], H100)
    assert plan.sharing() == {0: ["trainer", "sampler-0", "sampler-1"]}
    assert [plan.process(n).share for n in ("trainer", "sampler-0", "sampler-1")] == [0.45, 0.225, 0.225]


def test_two_gpus_give_the_trainer_its_own_and_the_samplers_share_the_other():
    plan = plan_devices(config("sampler.replicas=2"), ["0", "1"], H100)
    assert plan.process("trainer").env == {"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert [visible(plan.process(f"sampler-{i}")) for i in range(2)] == [["1"], ["1"]]
    assert plan.process("sampler-0").share == plan.process("sampler-1").share == 0.45


def test_meshes_over_several_gpus_and_a_multi_process_trainer():
    cfg = config("trainer.mesh.fsdp=4", "trainer.processes=2", "sampler.mesh.tp=2", "sampler.replicas=3")
    plan = plan_devices(cfg, [str(g) for g in range(8)], H100)
    assert visible(plan.process("trainer")) == ["0", "1"] and visible(plan.process("trainer-1")) == ["2", "3"]
    assert [visible(plan.process(f"sampler-{i}")) for i in range(3)] == [["4", "5"], ["6", "7"], ["4", "5"]]
    assert plan.sharing() == {4: ["sampler-0", "sampler-2"], 5: ["sampler-0", "sampler-2"]}


def test_host_ids_follow_cuda_visible_devices_and_explicit_lists_are_used():
    cfg = config("sampler.replicas=2", "hardware.trainer_devices=[1]", "hardware.sampler_devices=[[0], [0]]")
    plan = plan_devices(cfg, ["GPU-a", "GPU-b"], H100)  # up was started with CUDA_VISIBLE_DEVICES=GPU-a,GPU-b
    assert visible(plan.process("trainer")) == ["GPU-b"]
    assert visible(plan.process("sampler-1")) == ["GPU-a"] and plan.process("sampler-1").share == 0.45


def test_colocated_takes_the_gpus_its_meshes_need_in_one_process():
    plan = plan_devices(config("weights.transport=local"), ["0", "1"], H100)
    assert [(p.name, visible(p)) for p in plan.processes] == [("colocated", ["0"])]
    assert plan.process("colocated").share is None


@pytest.mark.parametrize("overrides, gpus, match", [
    (["trainer.mesh.fsdp=4"], 2, r"trainer\.mesh .*need 4 GPUs but this host shows 2"),
    (["sampler.mesh.tp=2"], 1, r"sampler\.mesh\.tp=2: a sampler needs 2 GPUs"),
    (["sampler.engine=vllm", "sampler.vllm.tensor_parallel_size=4", "sampler.vllm.weight_install=files"], 2,
     r"sampler\.vllm\.tensor_parallel_size=4"),
    (["hardware.sampler_devices=[[5], [1]]"], 2, r"hardware\.sampler_devices\[0\]: GPU \[5\] beyond the 2"),
    (["hardware.sampler_devices=[[1]]"], 2, r"hardware\.sampler_devices has 1 lists for sampler\.replicas=2"),
    (["hardware.trainer_devices=[0, 1]"], 2, r"hardware\.trainer_devices=\[0, 1\]: trainer\.mesh .* needs 1"),
    (["sampler.engine=vllm", "sampler.replicas=1", "sampler.vllm.gpu_memory_utilization=0.88"], 1,
     r"GPU 0: trainer would get nothing: the others take 88%.*hardware\.sampler_devices"),
])
def test_a_layout_that_cannot_work_is_refused_naming_the_fix(overrides, gpus, match):
    with pytest.raises(DeviceLayoutError, match=match):
        plan_devices(config(*overrides), [str(g) for g in range(gpus)], H100)


def plan_report(trainer_gib: float, sampler_gib: float) -> dict:
    return {"architecture": {"num_layers": 16, "num_kv_heads": 8, "head_dim": 64},
            "trainer": {"parameters": 1_240_000_000, "per_device_bytes": {"total": int(trainer_gib * GIB)}},
            "sampler": {"per_device_bytes": {"total": int(sampler_gib * GIB)}}}


def test_plan_figures_size_the_shares_and_a_vllm_cache(tmp_path):
    cfg = config("sampler.replicas=1")
    plan = plan_devices(cfg, ["0"], H100, plan_report(20, 10))
    assert plan.process("trainer").share == 0.6 and plan.process("sampler-0").share == 0.3  # 2:1, filling 90%
    assert plan.process("trainer").need_bytes == 20 * GIB
    vllm = config("sampler.replicas=1", "sampler.engine=vllm", "sampler.rows_in_flight=64",
                  "generation.num_generations=8", "generation.max_prompt_tokens=256", "generation.max_new_tokens=768",
                  "sampler.dtype=bfloat16")
    s = plan_devices(vllm, ["0"], H100, plan_report(20, 10)).process("sampler-0")
    kv = 64 * 1024 * 2 * 16 * 8 * 64 * 2  # sequences x tokens x (K and V) x layers x KV heads x head_dim x bf16
    assert f"sampler.vllm.kv_cache_gib={kv / GIB:.3f}" in s.overrides
    assert s.need_bytes == int(1.25 * (1_240_000_000 * 2 + kv))
    with pytest.raises(DeviceLayoutError, match=r"GPU 0: trainer 75%, sampler-0 38% .* more than the 90% usable"):
        plan_devices(cfg, ["0"], H100, plan_report(60, 30))
    (tmp_path / "plan.json").write_text(json.dumps(plan_report(20, 10)))
    assert load_figures(config(f"hardware.plan_json={tmp_path / 'plan.json'}"))["trainer"]["parameters"] > 0
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DeviceLayoutError, match=r"hardware\.plan_json=.*bad\.json: not a readable"):
        load_figures(config(f"hardware.plan_json={tmp_path / 'bad.json'}"))


@pytest.fixture
def nvidia_smi(tmp_path, monkeypatch):
    """A stand-in `nvidia-smi` on PATH that lists four 80 GiB GPUs as the real one's CSV query prints them."""
    exe = tmp_path / "nvidia-smi"
    rows = "\\n".join(f"{i}, GPU-{i}aaa, 81920" for i in range(4))
    exe.write_text(f"#!/bin/sh\nprintf '{rows}\\n'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_gpus_are_found_with_nvidia_smi_and_filtered_by_cuda_visible_devices(nvidia_smi):
    cfg = config()
    assert detect_gpus(cfg, {}) == (["0", "1", "2", "3"], H100)
    assert detect_gpus(cfg, {"CUDA_VISIBLE_DEVICES": "2,GPU-0aaa"}) == (["2", "GPU-0aaa"], H100)
    assert detect_gpus(cfg, {"CUDA_VISIBLE_DEVICES": ""}) == ([], H100)
    assert detect_gpus(cfg, {"JAX_PLATFORMS": "cpu"})[0] == []  # the user chose the CPU
    assert detect_gpus(config("hardware.gpus=0"), {})[0] == []
    assert detect_gpus(config("hardware.gpus=2", "hardware.trainer_chip=h200"), {"CUDA_VISIBLE_DEVICES": "3,1,0"}) \
        == (["3", "1"], 143_771 << 20)
    with pytest.raises(DeviceLayoutError, match=r"hardware\.gpus=2, but CUDA_VISIBLE_DEVICES=3 shows 1"):
        detect_gpus(config("hardware.gpus=2"), {"CUDA_VISIBLE_DEVICES": "3"})


def test_no_nvidia_smi_means_a_cpu_run(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_gpus(config(), {"CUDA_VISIBLE_DEVICES": "0"}) == ([], None)


def test_a_vllm_sampler_started_alone_keeps_its_jax_on_the_cpu():
    vllm = config("sampler.engine=vllm")
    assert own_process_env(vllm, "sampler", {}) == {"JAX_PLATFORMS": "cpu"}
    assert own_process_env(vllm, "sampler", {"JAX_PLATFORMS": "cuda"}) == {}  # the user's choice stands
    assert own_process_env(vllm, "trainer", {}) == {} and own_process_env(config(), "sampler", {}) == {}


def test_up_gives_each_process_its_plan_under_the_users_own_settings():
    from grpo_stream.up.run import process_envs

    cfg = config("sampler.replicas=2", "hardware.sampler_env={XLA_PYTHON_CLIENT_MEM_FRACTION: '0.2'}")
    plan = plan_devices(cfg, ["0"], H100)
    base = {"CUDA_VISIBLE_DEVICES": "0,1", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    trainers, samplers = process_envs(cfg, plan, base, dict(base))
    assert trainers[0]["CUDA_VISIBLE_DEVICES"] == "0"  # the plan's GPUs replace what up was given
    assert trainers[0]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"  # the environment's own setting stands
    assert trainers[0]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.450"
    assert [e["XLA_PYTHON_CLIENT_MEM_FRACTION"] for e in samplers] == ["0.2", "0.2"]  # hardware.sampler_env wins


def test_a_vllm_cache_holds_one_sequence_of_the_endpoints_longer_context():
    """vLLM's max_model_len is the OpenAI endpoint's context when that is longer than a rollout, and vLLM refuses to
    start with a KV cache that cannot hold one sequence of it: the cache `up` gives it (kv_cache_gib) must."""
    overrides = ["sampler.replicas=1", "sampler.engine=vllm", "sampler.rows_in_flight=16",
                 "generation.num_generations=8", "generation.max_prompt_tokens=256", "generation.max_new_tokens=768",
                 "sampler.dtype=bfloat16"]
    per_token = 2 * 16 * 8 * 64 * 2  # K and V x layers x KV heads x head_dim x bf16 (plan_report's architecture)
    served = config(*overrides, "sampler.openai.port=8000", "sampler.openai.max_context_tokens=65536")
    s = plan_devices(served, ["0"], H100, plan_report(20, 10)).process("sampler-0")
    kv = (15 * 1024 + 65536) * per_token  # 15 rollouts beside one sequence of the whole context
    assert f"sampler.vllm.kv_cache_gib={kv / GIB:.3f}" in s.overrides and kv > 65536 * per_token
    plain = plan_devices(config(*overrides), ["0"], H100, plan_report(20, 10)).process("sampler-0")
    assert f"sampler.vllm.kv_cache_gib={16 * 1024 * per_token / GIB:.3f}" in plain.overrides  # no endpoint: as before


def test_a_vllm_cache_over_more_gpus_than_kv_heads_keeps_a_whole_head_on_each():
    """vLLM replicates KV heads when tensor_parallel_size exceeds them (Qwen2.5-1.5B: 2 KV heads, tp 4): each GPU
    holds one head of every token, half the cache, not a quarter; a quarter would leave vLLM half the sequences."""
    qwen = {"architecture": {"num_layers": 28, "num_kv_heads": 2, "head_dim": 128},
            "trainer": {"parameters": 1_543_714_304, "per_device_bytes": {"total": 10 * GIB}}}
    cfg = config("sampler.replicas=1", "sampler.engine=vllm", "sampler.vllm.tensor_parallel_size=4",
                 "sampler.vllm.weight_install=files", "sampler.rows_in_flight=64", "generation.num_generations=8",
                 "generation.max_prompt_tokens=256", "generation.max_new_tokens=768", "sampler.dtype=bfloat16")
    s = plan_devices(cfg, ["0", "1", "2", "3"], H100, qwen).process("sampler-0")
    assert s.gpus == (0, 1, 2, 3)  # beside the trainer on GPU 0: its cache is sized for it
    kv = 64 * 1024 * 2 * 28 * 1 * 128 * 2  # sequences x tokens x (K and V) x layers x one KV head x head_dim x bf16
    assert f"sampler.vllm.kv_cache_gib={kv / GIB:.3f}" in s.overrides
    assert s.need_bytes == int(1.25 * (1_543_714_304 * 2 / 4 + kv))


def test_compose_settings_for_the_local_transport_are_refused_naming_it(tmp_path, capsys):
    """weights.transport=local is one `colocated` process, which compose has no service for: `devices --compose`
    stopped on an IndexError (the process "colocated" has no sampler number) instead of saying so."""
    from grpo_stream.plan.devices import run_devices

    assert run_devices(config("weights.transport=local"), 2, None, True, None) == 2
    out = capsys.readouterr().out
    assert "weights.transport=local" in out and "compose" in out
    assert run_devices(config(), 2, None, True, None) == 0  # the grpc default still gets compose's settings


def test_devices_json_goes_into_a_folder_it_makes(tmp_path):
    """`devices --json runs/x/devices.json` printed the plan, then failed on the missing folder (FileNotFoundError,
    exit 1), where `plan --json` makes it."""
    from grpo_stream.plan.devices import run_devices

    path = tmp_path / "new" / "devices.json"
    assert run_devices(config(), 2, None, False, path) == 0
    assert json.loads(path.read_text())["gpu_ids"] == ["0", "1"]
