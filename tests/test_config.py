from pathlib import Path

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
    with pytest.raises(ConfigError, match=r"learner.ratio_mask_low: 5.0 must be below ratio_mask_high \(2.0\)"):
        JobConfig.load(None, ["learner.ratio_mask_low=5", "learner.ratio_mask_high=2"])
    with pytest.raises(ConfigError, match=r"learner.world_size: world_size=2 needs data_parallel='fsdp'.*"
                                          r"set learner.data_parallel: fsdp"):
        JobConfig.load(None, ["learner.world_size=2"])  # ranks of a learner must share one sharded model


def test_learner_ranks_need_whole_gpus():
    with pytest.raises(ConfigError, match=r"learner.gpus: gpus=1.0 over world_size=2 ranks is 0.5 GPU per rank; .*whole GPUs"):
        JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2", "learner.gpus=1"])
    JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2", "learner.gpus=2"])
    JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2"])  # CPU ranks (gloo)


def test_weight_transport_must_fit_the_devices():
    # a broadcast group is NCCL between GPUs or gloo between CPUs, never a mix
    with pytest.raises(ConfigError, match=r"rollout.weight_transport: 'nccl' needs the learner and the engines on the same kind"):
        JobConfig.load(None, ["rollout.weight_transport=nccl", "learner.gpus=1"])
    # NCCL cannot connect two processes on one GPU: colocated engines use CUDA IPC
    with pytest.raises(ConfigError, match=r"rollout.weight_transport: 'nccl' needs one whole GPU per process .* use 'cuda_ipc'"):
        JobConfig.load(None, ["rollout.weight_transport=nccl", "learner.gpus=0.5", "rollout.gpus_per_inference_worker=0.5"])
    with pytest.raises(ConfigError, match=r"rollout.weight_transport: 'cuda_ipc' needs the learner and the engines on GPUs"):
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
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nmodel:\n  preset: [k3\n")
    with pytest.raises(ConfigError) as e:  # YAML's own error, naming the file where it was (not "<unicode string>")
        JobConfig.load(broken)
    assert f"{broken} is not valid YAML" in str(e.value) and f'in "{broken}", line 3, column 11' in str(e.value)


def test_flat_params_use_dotted_keys():
    flat = JobConfig().flat()
    assert flat["learner.lr"] == JobConfig().learner.lr
    assert flat["envs.train.0.id"] == "k3rl/KeyLookup-v0"


def test_examples_are_valid():
    from pathlib import Path

    for f in sorted(Path(__file__).resolve().parents[1].joinpath("examples").glob("*.yaml")):
        JobConfig.load(f)


def refusal(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, list(overrides))
    return str(e.value)


def test_vllm_needs_a_checkpoint_and_no_routing_replay():
    msg = refusal("rollout.engine=vllm")  # the adapter cannot return routed experts, and serves a checkpoint
    assert "learner.routing_replay: rollout.engine 'vllm' does not return the routed experts" in msg
    assert "set learner.routing_replay: false" in msg
    assert "model.checkpoint: rollout.engine 'vllm' serves an HF-layout checkpoint directory" in msg
    assert "rollout.compile_decode" not in msg
    assert "rollout.compile_decode: compiles the embedded engine's decode step" in refusal(
        "rollout.engine=vllm", "rollout.compile_decode=true")
    assert "rollout.prefill_graphs: graphs the embedded engine's prefill" in refusal(
        "rollout.engine=vllm", "rollout.prefill_graphs=true")
    assert "rollout.prefill_wait_steps: schedules the embedded engine's prefills" in refusal(
        "rollout.engine=vllm", "rollout.prefill_wait_steps=8")
    cfg = JobConfig.load(None, ["rollout.engine=vllm", "learner.routing_replay=false", "model.checkpoint=/ckpt"])
    assert cfg.rollout.engine == "vllm"


def test_sft_warm_start_needs_demonstrations():
    msg = refusal("learner.sft_steps=10", "learner.sft_episodes=0")
    assert "learner.sft_episodes: is 0, but sft_steps=10 needs oracle demonstrations" in msg
    JobConfig.load(None, ["learner.sft_steps=0", "learner.sft_episodes=0"])


def test_sft_phases_start_in_order_inside_the_warm_start():
    phase = "{from_step: %d, env_kwargs: {oracle_wrong_key: 0.5}}"
    cfg = JobConfig.load(None, ["learner.sft_steps=130", f"learner.sft_phases=[{phase % 100}]"])
    assert cfg.learner.sft_phases[0].env_kwargs == {"oracle_wrong_key": 0.5}
    msg = refusal("learner.sft_steps=50", f"learner.sft_phases=[{phase % 100}]")
    assert "learner.sft_phases.0.from_step: 100 must be below sft_steps=50" in msg
    msg = refusal("learner.sft_steps=50", f"learner.sft_phases=[{phase % 20}, {phase % 10}]")
    assert "learner.sft_phases.1.from_step: 10 must be below sft_steps=50 and above the phase before it" in msg
    assert "learner.sft_phases.0: changes nothing: set env_kwargs, env_kwargs_by_env, envs or lr" in refusal(
        "learner.sft_steps=5", "learner.sft_phases=[{from_step: 2}]")
    # a curriculum: a first phase at step 0 on some of envs.train, then all of them at a restarted rate
    two = "envs.train=[{id: k3rl/KeyLookup-v0}, {id: k3rl/ScreenRead-v0}]"
    cfg = JobConfig.load(None, [two, "learner.sft_steps=50",
                                "learner.sft_phases=[{from_step: 0, envs: [k3rl/ScreenRead-v0]}, {from_step: 30, lr: 0.001}]"])
    assert cfg.learner.sft_phases[0].envs == ["k3rl/ScreenRead-v0"] and cfg.learner.sft_phases[1].lr == 1e-3
    msg = refusal(two, "learner.sft_steps=50", "learner.sft_phases=[{from_step: 0, envs: [k3rl/ScreenReed-v0]}]")
    assert ("learner.sft_phases.0.envs: 'k3rl/ScreenReed-v0' is not in envs.train (k3rl/KeyLookup-v0, "
            "k3rl/ScreenRead-v0)") in msg
    msg = refusal("learner.sft_steps=50", "learner.sft_phases=[{from_step: 10, lr: 0.001}, {from_step: 0, lr: 0.002}]")
    assert "learner.sft_phases.1.from_step: 0 must be below sft_steps=50 and above the phase before it" in msg


def test_an_sft_phase_sets_kwargs_per_env():
    """env_kwargs for every env, env_kwargs_by_env after it for one; phase_config gives each env its own."""
    from k3rl.rollout.job_start import phase_config

    two = "envs.train=[{id: k3rl/KeyLookup-v0, kwargs: {a: 1}}, {id: k3rl/ScreenRead-v0}]"
    phase = "{from_step: 10, env_kwargs: {oracle_mistakes: 0.5}, env_kwargs_by_env: {k3rl/ScreenRead-v0: %s}}"
    cfg = JobConfig.load(None, [two, "learner.sft_steps=50", f"learner.sft_phases=[{phase % '{oracle_mistakes: 0.8}'}]"])
    kwargs = {e.id: e.kwargs for e in phase_config(cfg, cfg.learner.sft_phases[0]).envs.train}
    assert kwargs == {"k3rl/KeyLookup-v0": {"a": 1, "oracle_mistakes": 0.5}, "k3rl/ScreenRead-v0": {"oracle_mistakes": 0.8}}
    assert {e.id: e.kwargs for e in cfg.envs.train}["k3rl/KeyLookup-v0"] == {"a": 1}  # the job's own envs unchanged
    msg = refusal(two, "learner.sft_steps=50", "learner.sft_phases=[{from_step: 1, env_kwargs_by_env: {k3rl/Nope-v0: {}}}]")
    assert ("learner.sft_phases.0.env_kwargs_by_env: 'k3rl/Nope-v0' is not in envs.train (k3rl/KeyLookup-v0, "
            "k3rl/ScreenRead-v0)") in msg


def test_fsdp_with_a_kl_reference_after_an_sft_warm_start_is_accepted():
    # Trainer.reset_reference gathers the sharded weights (tests/learner/test_learner_reference.py)
    cfg = JobConfig.load(None, ["learner.data_parallel=fsdp", "learner.world_size=2", "learner.kl_coef=0.1",
                                "learner.sft_steps=5"])
    assert cfg.learner.kl_coef == 0.1


def test_model_overrides_are_checked_with_their_paths():
    assert "model.overrides.num_experts: Input should be a valid integer" in refusal("model.overrides.num_experts=x")
    assert "model.overrides.no_such_field: not a K3Config field" in refusal("model.overrides.no_such_field=1")
    # the byte tokenizer's ids must fit the embedding
    msg = refusal("model.overrides.vocab_size=300")
    assert "model.overrides.vocab_size: 300 is smaller than the byte tokenizer's 320 ids" in msg


def test_sandbox_settings_that_cannot_work():
    msg = refusal("sandbox.backend=bwrap", "sandbox.image=myorg/sandbox:1")
    assert "sandbox.image: 'myorg/sandbox:1' is a Docker image, but sandbox.backend is 'bwrap'" in msg
    assert "sandbox.memory_mb: Input should be greater than or equal to 32" in refusal("sandbox.memory_mb=16")
    assert JobConfig.load(None, ["sandbox.image=myorg/sandbox:1"]).sandbox.image == "myorg/sandbox:1"


def test_envs_and_ray_settings_that_cannot_work():
    assert "envs.train: List should have at least 1 item" in refusal("envs.train=[]")
    msg = refusal("envs.imports=[mypkg.envs, envs/my_env.py]")
    assert "envs.imports.1: 'envs/my_env.py' is not a module name" in msg and "imports.0" not in msg
    assert "ray.runtime_env.env_vars: must map variable names to values" in refusal("ray.runtime_env.env_vars=[A]")
    cfg = JobConfig.load(None, ["envs.imports=[mypkg.envs]", "ray.runtime_env.working_dir=/src"])
    assert cfg.envs.imports == ["mypkg.envs"] and cfg.ray.runtime_env == {"working_dir": "/src"}


def test_every_problem_is_reported_at_once():
    msg = refusal("rollout.engine=vllm", "sandbox.backend=bwrap", "sandbox.image=x")
    for path in ("sandbox.image:", "learner.routing_replay:", "model.checkpoint:"):
        assert f"\n  {path}" in msg, msg


def test_notes_name_settings_that_work_but_may_surprise():
    assert JobConfig().notes() == []
    notes = JobConfig.load(None, ["learner.steps=5", "tracking.sample_episodes=100", "sandbox.pool_size=20"]).notes()
    assert notes[0] == "learner.checkpoint_every=10 is more than learner.steps=5: only the final checkpoint is written"
    assert notes[1].startswith("tracking.sample_episodes=100 is more than the 32 episodes of a step")
    assert notes[2].startswith("sandbox.pool_size=20 is more than sandbox.max_concurrency=16")
    assert JobConfig.load(None, ["learner.steps=0"]).notes()[-1] == (
        "learner.steps and learner.sft_steps are 0: the job trains nothing")



def test_learning_rates_default_to_the_presets_post_training_scale():
    from k3rl.config import POST_TRAINING_LR

    for preset, (lr, sft_lr) in POST_TRAINING_LR.items():
        cfg = JobConfig.from_dict({"model": {"preset": preset}})  # validated on the meta device
        assert (cfg.learner.lr, cfg.learner.sft_lr) == (lr, sft_lr)
    assert POST_TRAINING_LR["k3"][0] < POST_TRAINING_LR["k3-small"][0] < POST_TRAINING_LR["k3-tiny"][0]
    cfg = JobConfig.load(None, ["model.preset=k3-small", "learner.lr=3e-4"])  # a rate given is kept
    assert (cfg.learner.lr, cfg.learner.sft_lr) == (3e-4, POST_TRAINING_LR["k3-small"][1])


def test_eval_specs_resolve_and_bad_ones_are_refused_by_field_path():
    cfg = JobConfig.load(None, ["envs.eval_pass_k=2", "envs.eval.0.id=k3rl/KeyLookup-v0",
                                "envs.eval.1.id=k3rl/KeyLookup-v0", "envs.eval.1.name=kl4",
                                "envs.eval.1.kwargs.num_keys=4", "envs.eval.1.pass_k=4", "envs.eval.1.samples=8",
                                "tracking.eval_every=5"])
    first, second = cfg.envs.eval
    assert (first.metric_name, cfg.envs.eval_sizes(first), first.num_tasks) == ("KeyLookup-v0", (2, 2), 16)
    assert (second.metric_name, cfg.envs.eval_sizes(second)) == ("kl4", (4, 8))
    assert cfg.tracking.eval_every == 5 and JobConfig.load().envs.eval == []
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, ["envs.eval.0.id=k3rl/KeyLookup-v0", "envs.eval.0.pass_k=4", "envs.eval.0.samples=2",
                              "envs.eval.1.id=other/KeyLookup-v0", "envs.eval.2.id=k3rl/KeyLookup-v0",
                              "envs.eval.2.name=key lookup"])
    msg = str(e.value)
    assert "envs.eval.0.samples: 2 sampled episodes per task cannot estimate pass@4; set samples >= pass_k (4)" in msg
    assert "envs.eval.1.name: 'KeyLookup-v0' is also the metrics' name of envs.eval.0; give one of them a name" in msg
    assert "envs.eval.2.name: 'key lookup' cannot name metrics" in msg
    with pytest.raises(ConfigError) as e:
        JobConfig.load(None, ["envs.eval.0.num_tasks=0", "tracking.eval_every=-1"])
    msg = str(e.value)
    assert "envs.eval.0.id: Field required" in msg and "envs.eval.0.num_tasks: Input should be greater than" in msg
    assert "tracking.eval_every: Input should be greater than or equal to 0" in msg


def test_dynamic_sampling_settings():
    cfg = JobConfig.load(None, ["rollout.dynamic_sampling=true"])
    assert cfg.rollout.dynamic_sampling and cfg.rollout.dynamic_sampling_max_refills == 2
    assert not JobConfig.load().rollout.dynamic_sampling  # off by default
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling_max_refills: Input should be greater than or equal to 0"):
        JobConfig.load(None, ["rollout.dynamic_sampling_max_refills=-1"])


def test_a_relative_checkpoint_in_a_config_file_is_read_beside_the_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "ckpt").mkdir()
    (tmp_path / "conf" / "job.yaml").write_text("model: {checkpoint: ckpt, tokenizer: byte}\n")
    monkeypatch.chdir(tmp_path)  # a working directory without ckpt/
    cfg = JobConfig.load(tmp_path / "conf" / "job.yaml")
    assert cfg.model.checkpoint == str((tmp_path / "conf" / "ckpt").resolve())
    assert cfg.model.tokenizer == "byte"  # not a path beside the file: unchanged
    # a path that does not exist beside the file stays as written (the preflight names it), and a --set
    # value is the caller's, relative to the working directory
    (tmp_path / "conf" / "job.yaml").write_text("model: {checkpoint: elsewhere/ckpt}\n")
    assert JobConfig.load(tmp_path / "conf" / "job.yaml").model.checkpoint == "elsewhere/ckpt"
    (tmp_path / "conf" / "job.yaml").write_text("model: {checkpoint: ckpt}\n")
    assert JobConfig.load(tmp_path / "conf" / "job.yaml", ["model.checkpoint=ckpt"]).model.checkpoint == "ckpt"
    # the demo's stored warm start, from any working directory
    demo = JobConfig.load(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml")
    assert Path(demo.model.checkpoint, "config.json").is_file() and demo.learner.sft_steps == 0


def test_envs_cycle_takes_each_env_as_often_as_its_weight():
    three = ("envs.train=[{id: k3rl/ScreenRead-v0, weight: 2}, {id: k3rl/PythonTool-v0}, {id: k3rl/LongHorizon-v0}]")
    cfg = JobConfig.load(None, [three, "envs.mix=cycle"])
    ids = [cfg.envs.env_of_group(i, None).id.split("/")[1][:6] for i in range(8)]
    assert ids == ["Screen", "Python", "LongHo", "Screen"] * 2
    msg = refusal("envs.train=[{id: k3rl/ScreenRead-v0, weight: 1.5}, {id: k3rl/PythonTool-v0}]", "envs.mix=cycle")
    assert "envs.train.0.weight: 1.5 with envs.mix: cycle, which takes each env as many times a round as its weight" in msg
