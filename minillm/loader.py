"""Find a model folder (local path, weights/NAME, or a Hugging Face hub id) and load its
safetensors weights straight to the device, checking every tensor's name and shape."""
import json
import os
import re
from pathlib import Path

import torch

from .config import ConfigError, GPTConfig
from .sampling import generation_defaults, unapplied_settings

WEIGHTS_DIR = Path(os.environ.get("MINILLM_WEIGHTS_DIR", Path(__file__).resolve().parents[1] / "weights"))
CONFIG_FILES = ["config.json", "generation_config.json"]
HUB_PATTERNS = [*CONFIG_FILES, "model.safetensors", "model*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json"]
IGNORED = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in old GPT-2 checkpoints
CROSS_ATTENTION = re.compile(r"h\.\d+\.(crossattention|ln_cross_attn)\.")  # (config.add_cross_attention)
HUB_TIMEOUT = 10.0  # seconds for the hub's answer on a repo's files


class ModelLoadError(RuntimeError):
    """The model could not be found or its files are unusable; the message says which and why."""


def _offline():
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def download(repo_id, local_dir=None):
    """Fetch a hub repo's config, safetensors weights and tokenizer files (with progress bars)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        files = _repo_files(repo_id)
        if files is not None and not any(f.endswith(".safetensors") for f in files):
            if any(f.endswith(".bin") for f in files):
                raise ModelLoadError(f"{repo_id}: the repo has only PyTorch .bin weights; minillm loads "
                                     "safetensors only (convert with transformers' save_pretrained)")
            raise ModelLoadError(f"{repo_id}: the repo has no safetensors weights")
        # its config first: a model this engine cannot run fails before its weights download
        config_dir = snapshot_download(repo_id, allow_patterns=CONFIG_FILES, local_dir=local_dir)
        try:
            read_model_settings(config_dir)
        except ModelLoadError as e:
            raise ModelLoadError(str(e).replace(str(Path(config_dir)), repo_id)) from None
        path = snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_dir=local_dir)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if _offline() else "the Hugging Face hub could not be reached"
        if local_dir is not None:  # `minillm download`: no local folder was looked for
            raise ModelLoadError(f"{repo_id}: cannot download into {local_dir}: {why}") from None
        raise ModelLoadError(f"{repo_id}: not a local folder and not in the Hugging Face cache, and {why}") from None
    except GatedRepoError:
        raise ModelLoadError(f"{repo_id}: a gated model; accept its terms on the Hugging Face hub, then log in "
                             "(hf auth login)") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(f"{repo_id}: no such model on the Hugging Face hub (or it is private)") from None
    return Path(path)


def _repo_files(repo_id):
    """The repo's file names, or None where the hub does not answer (snapshot_download then looks
    in the cache). One request with no retries: huggingface_hub's file listing retries an
    unreachable hub for about 24 s, printing a warning each time."""
    if _offline():
        return None
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    try:
        info = HfApi().model_info(repo_id, timeout=HUB_TIMEOUT)
    except RepositoryNotFoundError:  # (and GatedRepoError, its subclass)
        raise
    except Exception:  # unreachable hub, timeout, server error
        return None
    return None if info.siblings is None else [s.rfilename for s in info.siblings]


def resolve(name_or_path):
    """A local folder, a folder under weights/, or a hub id (downloaded into the HF cache)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        return p
    for root in (Path.cwd() / "weights", WEIGHTS_DIR):
        if (root / str(name_or_path)).is_dir():
            return root / str(name_or_path)
    if p.exists():
        raise ModelLoadError(f"{name_or_path}: expected a model folder, got a file")
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise ModelLoadError(f"{name_or_path}: no such folder")
    return download(str(name_or_path))


def read_json(path):
    """A model folder's JSON file (config, shard index, tokenizer config), parsed."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError, and UnicodeDecodeError for non-text bytes
        raise ModelLoadError(f"{path}: not a readable JSON file ({e})") from None


def _read_settings(path):
    settings = read_json(path)
    if not isinstance(settings, dict):
        raise ModelLoadError(f"{path}: expected a JSON object of settings, got a {type(settings).__name__}")
    return settings


def read_model_settings(model_dir):
    """(config, sampling defaults, unapplied settings) of a model folder, each file parsed once:
    the GPTConfig of its config.json, with the end-of-sequence ids transformers' generate stops at
    (generation_config.json's where that file is); the SamplingParams fields generation_config.json
    sets (sampling.generation_defaults); and its settings transformers' generate would apply and
    minillm does not (sampling.unapplied_settings). Without that file: ({}, {}) for the two."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model folder)")
    hf = _read_settings(path)
    gen_path = path.with_name("generation_config.json")
    generation = _read_settings(gen_path) if gen_path.is_file() else None
    try:
        cfg = GPTConfig.from_hf(hf, source=str(path), generation=generation, generation_source=str(gen_path))
    except ConfigError as e:
        raise ModelLoadError(str(e)) from None
    if generation is None:
        return cfg, {}, {}
    try:
        return cfg, generation_defaults(generation), unapplied_settings(generation)
    except ValueError as e:
        raise ModelLoadError(f"{gen_path}: {e}") from None


def read_config(model_dir):
    """The folder's GPTConfig (read_model_settings)."""
    return read_model_settings(model_dir)[0]


def expected_shapes(cfg: GPTConfig):
    C, V, F = cfg.n_embd, cfg.vocab_size, cfg.mlp_width
    shapes = {"wte.weight": (V, C), "wpe.weight": (cfg.n_positions, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "attn.c_attn.weight": (C, 3 * C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "mlp.c_fc.weight": (C, F), p + "mlp.c_fc.bias": (F,),
            p + "mlp.c_proj.weight": (F, C), p + "mlp.c_proj.bias": (C,),
        })
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def _weight_files(model_dir):
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        parsed = read_json(index)
        weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(f, str) and f for f in weight_map.values()):
            raise ModelLoadError(f"{index}: expected a \"weight_map\" object from tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (d / f).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard {missing[0]} is missing")
        return [d / f for f in files]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    if list(d.glob("*.bin")):
        raise ModelLoadError(f"{d}: only PyTorch .bin weights found; minillm loads safetensors only")
    raise ModelLoadError(f"{d}: no model.safetensors or model.safetensors.index.json")


def load_weights(model_dir, cfg: GPTConfig, device, dtype):
    """Every tensor the model needs, on `device` in `dtype`, read one tensor at a time (no second
    full copy in host memory). Raises ModelLoadError naming the tensor and file on any problem;
    nothing is returned half-loaded."""
    from safetensors import SafetensorError, safe_open

    shapes = expected_shapes(cfg)
    weights, origin = {}, {}
    load_device = str(device) if torch.device(device).type == "cuda" else "cpu"
    for path in _weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device=load_device) as f:
                for key in f.keys():
                    name = key[len("transformer."):] if key.startswith("transformer.") else key
                    if name.endswith(IGNORED) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                        continue
                    if cfg.add_cross_attention and CROSS_ATTENTION.match(name):
                        continue  # blocks generation never runs (no encoder states): not read at all
                    if name not in shapes:
                        raise ModelLoadError(f"{path}: unexpected tensor {key} for a {cfg.n_layer}-layer GPT-2")
                    got = tuple(f.get_slice(key).get_shape())
                    if got != shapes[name]:
                        raise ModelLoadError(f"{path}: tensor {key} has shape {got}, expected {shapes[name]}")
                    t = f.get_tensor(key)
                    if not t.is_floating_point():  # as floats it would load as a wrong model, silently
                        raise ModelLoadError(f"{path}: tensor {key} is stored as {str(t.dtype).removeprefix('torch.')}"
                                             ", expected floating point (quantized checkpoints are not supported)")
                    t = t.to(device=device, dtype=dtype)
                    if not torch.isfinite(t).all():  # NaN logits later, or garbage tokens: say it here
                        bad = int((~torch.isfinite(t)).sum())
                        raise ModelLoadError(f"{path}: tensor {key} holds {bad} NaN or inf value(s) in "
                                             f"{str(dtype).removeprefix('torch.')} (NaN in the file, or values "
                                             "too large for the dtype)")
                    weights[name] = t
                    origin[name] = path
        except SafetensorError as e:
            raise ModelLoadError(f"{path}: corrupt or truncated safetensors file ({e})") from None
        except (OSError, RuntimeError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{path}: could not read weights ({e})") from None
    missing = [n for n in shapes if n not in weights]
    if missing:
        files = ", ".join(p.name for p in _weight_files(model_dir))
        raise ModelLoadError(f"{model_dir}: tensor {missing[0]} is missing from {files}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return weights

