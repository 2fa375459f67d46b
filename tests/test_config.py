import pytest
import yaml

from k3rl.config import ConfigError, JobConfig, apply_override


def test_defaults_resolve_and_round_trip_through_yaml(tmp_path):
    cfg = JobConfig.load()
    path = cfg.save(tmp_path / "resolved.yaml")
    again = JobConfig.load(path)
    assert again == cfg
    assert again.tracking.uri.startswith("sqlite:///")


def test_yaml_and_set_overrides_with_types(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({"learner": {"lr": 0.01}, "envs": {"train": [{"id": "k3rl/PythonTool-v0"}]}}))
    cfg = JobConfig.load(f, ["learner.lr=2e-4", "rollout.sampling.temperature=0.7", "learner.bf16=true",
                             "envs.train.0.kwargs.n_keys=3", "envs.train.1.id=k3rl/KeyLookup-v0"])
    assert cfg.learner.lr == 2e-4 and cfg.learner.bf16 is True
    assert cfg.rollout.sampling.temperature == 0.7
    assert [e.id for e in cfg.envs.train] == ["k3rl/PythonTool-v0", "k3rl/KeyLookup-v0"]
    assert cfg.envs.train[0].kwargs == {"n_keys": 3}


def test_unknown_key_is_rejected_with_its_dotted_path():
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, ["rollout.sampling.temprature=0.5"])
    assert "rollout.sampling.temprature: unknown key" in str(e.value)


def test_bad_value_names_field_and_expectation():
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, ["learner.lr=-1", "rollout.engine=tgi"])
    msg = str(e.value)
    assert "learner.lr: Input should be greater than 0 (got -1)" in msg
    assert "rollout.engine: Input should be 'embedded' or 'vllm' (got 'tgi')" in msg


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="ratio_mask_low"):
        JobConfig.load(None, ["learner.ratio_mask_low=5", "learner.ratio_mask_high=2"])
    with pytest.raises(ConfigError, match=r"learner: .*world_size=2 needs data_parallel='fsdp'"):
        JobConfig.load(None, ["learner.world_size=2"])  # ranks of a learner must share one sharded model


def test_learner_ranks_need_whole_gpus():
    with pytest.raises(ConfigError, match=r"learner: .*0.5 GPU per rank; .*whole GPUs"):
        JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2", "learner.gpus=1"])
    JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2", "learner.gpus=2"])
    JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2"])  # CPU ranks (gloo)


def test_weight_transport_must_fit_the_devices():
    # a broadcast group is NCCL between GPUs or gloo between CPUs, never a mix
    with pytest.raises(ConfigError, match=r"<root>: .*weight_transport='nccl' needs the learner and the engines on the same kind"):
        JobConfig.load(None, ["rollout.weight_transport=nccl", "learner.gpus=1"])
    # NCCL cannot connect two processes on one GPU: colocated engines use CUDA IPC
    with pytest.raises(ConfigError, match=r"one whole GPU per process .* use 'cuda_ipc'"):
        JobConfig.load(None, ["rollout.weight_transport=nccl", "learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5"])
    with pytest.raises(ConfigError, match=r"'cuda_ipc' needs the learner and the engines on GPUs"):
        JobConfig.load(None, ["rollout.weight_transport=cuda_ipc"])
    for ok in (["rollout.weight_transport=nccl"],  # gloo on CPUs
               ["rollout.weight_transport=nccl", "learner.gpus=1", "rollout.gpus_per_inference_worker=1"],
               ["rollout.weight_transport=cuda_ipc", "learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5"]):
        JobConfig.load(None, ok)


def test_bad_override_syntax_and_files(tmp_path):
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_override({}, "learner.lr")
    with pytest.raises(ConfigError, match="does not exist"):
        JobConfig.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        JobConfig.load(bad)


def test_flat_params_use_dotted_keys():
    flat = JobConfig().flat()
    assert flat["learner.lr"] == JobConfig().learner.lr
    assert flat["envs.train.0.id"] == "k3rl/KeyLookup-v0"


def test_examples_are_valid():
    from pathlib import Path

    for f in sorted(Path(__file__).resolve().parents[1].joinpath("examples").glob("*.yaml")):
        JobConfig.load(f)
