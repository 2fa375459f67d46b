"""The vLLM adapter: the parts that run without vLLM here, the engine itself where vLLM and a GPU are."""

from __future__ import annotations

import pytest
import torch

from k3rl.model import K3Config, K3ForCausalLM
from k3rl.model.state_dict_adapter import to_hf
from k3rl.rollout.vllm_adapter import K3ForVLLM, sampling_kwargs, vllm_available
from k3rl.types import SamplingParams

torch.set_num_threads(1)


def test_sampling_params_map_to_vllm_keywords():
    kw = sampling_kwargs(SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=33, stop_token_ids=[5],
                                        seed=4))
    assert kw["top_k"] == -1 and kw["temperature"] == 0.7 and kw["top_p"] == 0.9 and kw["max_tokens"] == 33
    assert kw["stop_token_ids"] == [5] and kw["seed"] == 4 and kw["logprobs"] == 0 and kw["stop"] is None
    assert kw["include_stop_str_in_output"] and kw["ignore_eos"] and not kw["detokenize"]
    kw = sampling_kwargs(SamplingParams(top_k=8, stop_strings=["</x>"], logprobs=False))
    assert kw["top_k"] == 8 and kw["stop"] == ["</x>"] and kw["detokenize"] and kw["logprobs"] is None
    with pytest.raises(ValueError, match="routed experts"):
        sampling_kwargs(SamplingParams(return_routed_experts=True))


def test_fallback_vllm_model_class_follows_vllm_calls():
    """K3ForVLLM as vLLM drives it: chunked prefill then one token per step, positions given."""
    config = K3Config.preset("k3-tiny")
    torch.manual_seed(0)
    ref = K3ForCausalLM(config).eval()
    m = K3ForVLLM(config=config).eval()
    loaded = m.load_weights(to_hf(ref.state_dict()).items())  # official names, as vLLM's loader yields them
    assert len(loaded) == len(ref.state_dict())
    ids = torch.tensor([(3 * i + 1) % 250 for i in range(21)])
    with torch.no_grad():
        full = ref(ids[None])[0]
        pieces = [m(ids[0:8], torch.arange(0, 8)), m(ids[8:20], torch.arange(8, 20)), m(ids[20:21], torch.tensor([20]))]
        again = m(ids[0:5], torch.arange(0, 5))  # position 0: a new sequence
    got = torch.cat([m.compute_logits(p) for p in pieces])
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, full[:5], rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="prefix caching"):
        m(ids[10:12], torch.arange(10, 12))


needs_vllm = pytest.mark.skipif(not vllm_available() or not torch.cuda.is_available(),
                                reason="vLLM is not installed (pip install 'k3rl[vllm]') or no CUDA GPU is present")


@needs_vllm
def test_vllm_engine_matches_the_embedded_engine_and_switches_weights(tmp_path):
    from k3rl.model import save_hf
    from k3rl.rollout.engine import EmbeddedEngine
    from k3rl.rollout.vllm_adapter import VLLMEngine
    from k3rl.types import WeightUpdate

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
    save_hf(model, tmp_path / "ckpt")
    prompt = [(5 * i + 2) % 250 + 1 for i in range(19)]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    eng = VLLMEngine(tmp_path / "ckpt", dtype="float32", gpu_memory_utilization=0.3)
    try:
        r = eng.generate(prompt, greedy)
        ref = EmbeddedEngine(model.cuda(), background=False).generate(prompt, greedy)
        assert r.token_ids == ref.token_ids and r.versions == [0] * 8
        assert r.logprobs == pytest.approx(ref.logprobs, abs=1e-3)
        torch.manual_seed(1)
        new = K3ForCausalLM(K3Config.preset("k3-tiny")).eval()
        assert eng.update_weights(WeightUpdate.from_state_dict(1, to_hf(new.state_dict()))) == 1
        r2 = eng.generate(prompt, greedy)
        assert r2.versions == [1] * 8
        assert r2.token_ids == EmbeddedEngine(new.cuda(), background=False).generate(prompt, greedy).token_ids
    finally:
        eng.close()
