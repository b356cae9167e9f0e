"""Downloads from the Hugging Face hub (minillm/loader.py's download): offline, unreachable,
gated, unknown and weightless repos fail fast with one line; only safetensors and tokenizer files
are fetched. The hub is faked: no test reaches the network."""
import json
import re
import time
from types import SimpleNamespace

import pytest

from minillm import LLM, ModelLoadError
from minillm.config import GPTConfig


def test_unknown_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        LLM("no-such-org/no-such-model-xyz", device="cpu")


def _fake_model_info(*files):
    """HfApi.model_info as the hub answers for a repo holding `files`."""
    def model_info(self, repo_id, timeout=None):
        return SimpleNamespace(siblings=[SimpleNamespace(rfilename=f) for f in files])
    return model_info


def test_download_unreachable_hub_fails_fast(monkeypatch, caplog):
    """Not offline, but no hub answers (here: nothing listens at its address): one clean error
    within seconds, not huggingface_hub's file listing's retries (about 24 s, a warning each)."""
    from huggingface_hub import constants

    from minillm import loader

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache, and the Hugging Face hub could not be "
                                             "reached"):
        loader.download("no-such-org/no-such-model-xyz")
    assert time.monotonic() - t0 < 8
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_download_gated_and_missing_repos(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from minillm import loader

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _fake_model_info("config.json", "model.safetensors"))
    for error, message in ((GatedRepoError, "a gated model; accept its terms"),
                           (RepositoryNotFoundError, "no such model on the Hugging Face hub")):
        def refuse(*a, error=error, **k):  # (built bare: its HTTP response type depends on the hub's version)
            raise error.__new__(error)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
        with pytest.raises(ModelLoadError, match=message):
            loader.download("someone/model")


def test_download_refuses_repos_without_safetensors(monkeypatch, tmp_path):
    """Online, a hub repo with only .bin weights, with no weights, or that the hub does not know
    is refused before anything downloads."""
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    from minillm import loader

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("must not download"))
    for files, message in ((("config.json", "pytorch_model.bin"), "the repo has only PyTorch .bin weights; "),
                           (("config.json", "README.md"), "the repo has no safetensors weights$")):
        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _fake_model_info(*files))
        with pytest.raises(ModelLoadError, match=f"^someone/repo: {message}"):
            loader.download("someone/repo")

    def unknown(*a, **k):
        raise RepositoryNotFoundError.__new__(RepositoryNotFoundError)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unknown)
    with pytest.raises(ModelLoadError, match=r"^someone/repo: no such model on the Hugging Face hub \(or it is "
                                             r"private\)$"):
        loader.download("someone/repo")


def test_download_fetches_safetensors_and_tokenizer_only(monkeypatch, tmp_path):
    import huggingface_hub

    from minillm import loader

    seen = {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        _fake_model_info("config.json", "model.safetensors", "pytorch_model.bin"))

    def fake_snapshot(repo_id, allow_patterns, local_dir=None):
        seen.update(repo_id=repo_id, patterns=allow_patterns, local_dir=local_dir)
        (tmp_path / "config.json").write_text(json.dumps(GPTConfig().to_hf()))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert loader.download("gpt2", local_dir=str(tmp_path / "gpt2")) == tmp_path
    assert seen["local_dir"] == str(tmp_path / "gpt2")
    assert "model.safetensors" in seen["patterns"] and not any(p.endswith(".bin") for p in seen["patterns"])


@pytest.mark.parametrize("config,message", [
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
     "unsupported architecture LlamaForCausalLM; minillm supports model_type 'gpt2'"),
    ("[1]", "expected a JSON object of settings, got a list"),
])
def test_download_reads_the_config_before_the_weights(monkeypatch, tmp_path, config, message):
    """A repo of another architecture (or a broken config.json) fails on its config alone: the
    weights (gigabytes for a large model) are never asked for, and the error names the repo."""
    import huggingface_hub

    from minillm import loader

    asked = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", _fake_model_info("config.json", "model.safetensors"))

    def fake_snapshot(repo_id, allow_patterns, local_dir=None):
        asked.append(allow_patterns)
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    with pytest.raises(ModelLoadError, match=f"^someone/llama/config.json: {re.escape(message)}"):
        loader.download("someone/llama")
    assert asked == [loader.CONFIG_FILES]
