"""--generation-config auto|vllm|PATH: which generation_config.json supplies the request defaults."""

from __future__ import annotations

import json

import pytest

from ops.sampling.params import SamplingParams
from torch_runner.serve.generation_defaults import load_sampling_defaults
from torch_runner.serve.state import ServingState

QWEN3_LIKE = {  # Qwen3's generation_config.json, plus the ids every file carries
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _folder(tmp_path, config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_auto_reads_the_sampling_keys_only(tmp_path):
    defaults = load_sampling_defaults("auto", _folder(tmp_path, QWEN3_LIKE), SamplingParams)
    assert defaults.values == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert "temperature=0.6" in defaults.describe()


def test_auto_without_a_file_and_vllm_are_neutral(tmp_path):
    assert load_sampling_defaults("auto", tmp_path, SamplingParams).values == {}
    folder = _folder(tmp_path, QWEN3_LIKE)
    neutral = load_sampling_defaults("vllm", folder, SamplingParams)
    assert neutral.values == {} and "vllm" in neutral.describe()


def test_a_path_names_a_folder_or_the_file(tmp_path):
    (tmp_path / "other").mkdir()
    other = _folder(tmp_path / "other", {"repetition_penalty": 1.1, "min_p": 0.05})
    for mode in (str(other), str(other / "generation_config.json")):
        values = load_sampling_defaults(mode, None, SamplingParams).values
        assert values == {"repetition_penalty": 1.1, "min_p": 0.05}


@pytest.mark.parametrize(
    ("config", "field"), [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k")]
)
def test_bad_values_are_one_line_naming_the_field(tmp_path, config, field):
    with pytest.raises(ValueError) as info:
        load_sampling_defaults("auto", _folder(tmp_path, config), SamplingParams)
    assert field in str(info.value) and "\n" not in str(info.value)


def test_not_json_and_missing_path(tmp_path):
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_sampling_defaults("auto", tmp_path, SamplingParams)
    with pytest.raises(ValueError, match="--generation-config .*nowhere"):
        load_sampling_defaults(str(tmp_path / "nowhere"), None, SamplingParams)


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [1]

    def convert_ids_to_tokens(self, ids):
        return ["a"]


def test_request_values_win_over_the_defaults(tmp_path):
    defaults = load_sampling_defaults("auto", _folder(tmp_path, QWEN3_LIKE), SamplingParams)
    state = ServingState(
        engine=None,
        tokenizer=_Tokenizer(),
        model_name="m",
        max_model_len=64,
        vocab_size=8,
        params_cls=SamplingParams,
        sampling_defaults=defaults,
    )
    unset = state.build_choices("r", [[1]], {"max_tokens": 4}, 1, None, {}, 0.0)[0].params
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.95, 20)
    given = {"max_tokens": 4, "temperature": 0.0, "top_k": -1}
    params = state.build_choices("r", [[1]], given, 1, None, {}, 0.0)[0].params
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, -1)
