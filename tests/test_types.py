import io

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from k3rl import SamplingParams, ToolCall, Trajectory, Turn, WeightUpdate
from k3rl.images import to_png


def _png(color):
    return to_png(Image.new("RGB", (5, 3), color))


def _trajectory():
    t = Trajectory(env_id="k3rl/KeyLookup-v0", seed=7, prompt_ids=[1, 2, 3], group_id="g", metadata={"step": 3})
    s, e = t.append([4, 5], generated=True, logprobs=[-0.1234567890123456789, -1e-30], version=2,)
    t.turns.append(Turn(role="assistant", text="hi", start=s, end=e,
                        tool_calls=[ToolCall(name="f", arguments={"a": [1, {"b": None}], "c": 1.5})]))
    s, e = t.append([6, 7, 8], generated=False)
    t.turns.append(Turn(role="tool", text="r", tool_name="f", tool_index=1, start=s, end=e, images=[_png("red"), _png("blue")]))
    t.reward = 0.75
    t.timings["episode_s"] = 1.25
    return t


def test_trajectory_json_round_trip_is_lossless():
    t = _trajectory()
    back = Trajectory.from_json(t.to_json())
    assert back == t
    assert back.logprobs[0] == -0.1234567890123456789 and back.logprobs[1] == -1e-30
    assert back.turns[1].images[0] == t.turns[1].images[0]


def test_trajectory_arrow_and_parquet_round_trip_is_lossless(tmp_path):
    ts = [_trajectory(), _trajectory()]
    table = Trajectory.to_arrow(ts)
    assert table.schema == Trajectory.arrow_schema()
    pq.write_table(table, tmp_path / "t.parquet")
    back = Trajectory.from_arrow(pq.read_table(tmp_path / "t.parquet"))
    assert back == ts
    assert Image.open(io.BytesIO(back[0].turns[1].images[1])).getpixel((0, 0)) == (0, 0, 255)


def test_trajectory_validation_errors():
    with pytest.raises(ValueError, match="logprobs has 1 entries but completion_ids has 2"):
        Trajectory(env_id="x", prompt_ids=[1], completion_ids=[1, 2], logprobs=[0.0], loss_mask=[1, 1], versions=[0, 0])
    with pytest.raises(ValueError, match="PNG"):
        Turn(role="tool", images=[b"GIF89a"])
    t = Trajectory(env_id="x", prompt_ids=[1])
    with pytest.raises(ValueError, match="one behaviour log-prob each"):
        t.append([1, 2], generated=True, logprobs=[0.0])
    with pytest.raises(ValueError, match="ends at token 9"):
        Trajectory(env_id="x", prompt_ids=[1], turns=[Turn(role="user", start=0, end=9)])


def test_append_tracks_masks_and_versions():
    t = _trajectory()
    assert t.loss_mask == [1, 1, 0, 0, 0]
    assert t.versions == [2, 2, -1, -1, -1]
    assert t.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert t.num_generated == 2 and t.num_turns == 1 and len(t.images) == 2


def test_sampling_params_validate():
    assert SamplingParams(temperature=0).greedy
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert SamplingParams.from_json(SamplingParams(seed=3, stop_strings=["</a>"]).to_json()).seed == 3


def test_weight_update_buckets_and_json_round_trip():
    state = {"a.weight": torch.randn(4, 4), "b.bias": torch.randn(300).to(torch.bfloat16), "c": torch.arange(5)}
    wu = WeightUpdate.from_state_dict(3, state, bucket_bytes=64)
    assert len(wu.buckets) == 3 and wu.names == list(state)
    back = WeightUpdate.from_json(wu.to_json())
    assert back.version == 3
    for k, v in state.items():
        got = back.state_dict()[k]
        assert got.dtype == v.dtype and torch.equal(got, v)
    assert wu.nbytes == 16 * 4 + 300 * 2 + 5 * 8


def test_weight_update_rejects_duplicates_and_non_tensors():
    from k3rl.types import WeightBucket

    with pytest.raises(ValueError, match="expected torch.Tensor"):
        WeightBucket(tensors={"a": [1, 2]})
    wu = WeightUpdate(version=1, buckets=[WeightBucket(tensors={"a": torch.zeros(1)}), WeightBucket(tensors={"a": torch.ones(1)})])
    with pytest.raises(ValueError, match="appears in two buckets"):
        wu.state_dict()
