"""Base model + tokenizer (hub id, local folder, GGUF file or its chunks, or random init), the method's special tokens, LoRA.

The special tokens' rows of the input embedding (and of the output matrix when it is untied) train along with LoRA
through peft's `trainable_token_indices`: peft keeps a small trainable copy of those rows and writes them over the
frozen matrix in every forward pass, so every other row stays bit-for-bit the base model's.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import struct
import threading
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import HFValidationError
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from clozemath.config import LoraConfig, ModelConfig
from clozemath.data.tokenize import SpecialTokens, install_special_tokens, special_names
from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.model.chunks import joined_gguf
from clozemath.model.gguf_cache import load_gguf_model, load_gguf_tokenizer
from clozemath.model.speed import PLAIN, SpeedLevers, apply_levers

PACKAGE_PREFIX = "package:"
SPECIALS_FILE = "special_tokens.json"
SEED = 0
"""Seed of random weights (a `random_init` model unless its settings carry `seed`, rows added to a vocabulary):
training and reloading must build the same base."""
VOCAB_MULTIPLE = 64
"""The embedding and output matrices grow to a multiple of this many rows when tokens are added: a row count off
a multiple of 8 puts the output layer's matrix products (a training step's largest) on cuBLAS's slow unaligned
kernels. Decoding never picks the rows past the tokenizer (`generation_config.suppress_tokens`)."""


def resolve_location(spec: str) -> str:
    """`package:<module>[/sub/dir]` -> that folder inside the installed package; any other spec unchanged."""
    if not spec.startswith(PACKAGE_PREFIX):
        return spec
    module, _, sub = spec[len(PACKAGE_PREFIX) :].partition("/")
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise ClozeMathError(f"{spec}: package '{module}' is not installed")
    roots = list(found.submodule_search_locations or [Path(found.origin).parent])
    folder = Path(roots[0]) / sub
    if not folder.exists():
        raise ClozeMathError(f"{spec}: no such folder {folder}")
    return str(folder)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer: `cfg.tokenizer` if set, else the one beside the weights (inside the GGUF file if any).

    Read once a process and copied for each caller (a copy ~0.15 s): a GGUF file's tokenizer takes ~7 s to read, and
    a grid's driver prepared its training sets in threads that each read it, under the GIL 55 s before any data was
    touched (SmolLM2, 4 threads, 2 cores). A copy each, because loading a model adds special tokens to it."""
    if cfg.tokenizer is not None:
        location, gguf_file = _checked_location(cfg.tokenizer, None, "tokenizer path")
    else:
        location, gguf_file = weights_location(cfg)
    key = (location, gguf_file, _modified(location, gguf_file))
    with _TOKENIZERS_LOCK:  # the other threads wait for the first reader instead of reading it too
        if key not in _TOKENIZERS:
            _TOKENIZERS[key] = _read_tokenizer(location, gguf_file)
    return copy.deepcopy(_TOKENIZERS[key])


def _read_tokenizer(location: str, gguf_file: str | None) -> PreTrainedTokenizerBase:
    def read(folder: str, gguf: str | None) -> PreTrainedTokenizerBase:
        return _from_pretrained(AutoTokenizer, folder, gguf_file=gguf)

    if gguf_file is not None and _looks_local(location):
        return load_gguf_tokenizer(Path(location).expanduser() / gguf_file, read)  # parsed once a file, then kept
    return read(location, gguf_file)


_TOKENIZERS: dict[tuple[str, str | None, int | None], PreTrainedTokenizerBase] = {}
_TOKENIZERS_LOCK = threading.Lock()


def _modified(location: str, gguf_file: str | None) -> int | None:
    """When the local file a tokenizer is read from last changed (None: a hub id): a rewritten one is read again."""
    folder = Path(location).expanduser()
    candidates = [folder / gguf_file] if gguf_file else [folder / name for name in _FOLDER_MARKERS["tokenizer path"]]
    stamps = [path.stat().st_mtime_ns for path in candidates if path.is_file()]
    return max(stamps) if stamps else None


def weights_location(cfg: ModelConfig) -> tuple[str, str | None]:
    """The folder (or hub id) of the weights and the GGUF file in it, if any; chunks are joined into the cache."""
    if cfg.gguf_chunks is not None:
        assert cfg.gguf_file is not None, "ModelConfig guarantees a name for the joined file"
        return str(joined_gguf(cfg.gguf_chunks, cfg.gguf_file).parent), cfg.gguf_file
    return _checked_location(cfg.path, cfg.gguf_file)


# --------------------------------------------------------------------------------------------------------------
# Locations and errors


_FOLDER_MARKERS = {"model path": ("config.json",), "tokenizer path": ("tokenizer.json", "tokenizer_config.json")}
"""A local folder without any of these files is not what it is meant to be (a GGUF file stands in for them)."""


def _looks_local(location: str) -> bool:
    """A folder rather than a hub id (`org/name` or `name`)."""
    return Path(location).exists() or location.startswith(("/", ".", "~")) or location.count("/") > 1


def _checked_location(spec: str | None, gguf_file: str | None, what: str = "model path") -> tuple[str, str | None]:
    """Resolve `spec`; a local folder (and the GGUF file in it) must exist."""
    assert spec is not None, "ModelConfig guarantees a path or a tokenizer"
    location = resolve_location(spec)
    if _looks_local(location):
        folder = Path(location).expanduser()
        if not folder.is_dir():
            raise ClozeMathError(f"{what} '{spec}': no such folder")
        if gguf_file is not None and not (folder / gguf_file).is_file():
            raise ClozeMathError(f"GGUF file '{gguf_file}' not found in {folder}")
        markers = _FOLDER_MARKERS[what]
        if gguf_file is None and not any((folder / marker).is_file() for marker in markers):
            raise ClozeMathError(f"{what} '{spec}': no {' or '.join(markers)} in {folder}")
        return str(folder), gguf_file
    return location, gguf_file


def _from_pretrained(factory: Any, location: str, **kwargs: Any) -> Any:
    """`factory.from_pretrained` with a missing or unreachable model turned into a one-line error."""
    kwargs = {key: value for key, value in kwargs.items() if value is not None}
    try:
        return factory.from_pretrained(location, **kwargs)
    except (OSError, HFValidationError) as exc:
        raise ClozeMathError(f"model '{location}': cannot be loaded ({_first_line(exc)})") from None
    except _UNREADABLE_GGUF as exc:  # transformers' GGUF reader on a file that is not one, or not one it reads
        if "gguf_file" not in kwargs:
            raise
        raise ClozeMathError(
            f"GGUF file '{Path(location) / kwargs['gguf_file']}': cannot be read ({_first_line(exc)})"
        ) from None


_UNREADABLE_GGUF = (ValueError, struct.error, EOFError, IndexError, KeyError, OverflowError, MemoryError)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


# --------------------------------------------------------------------------------------------------------------
# The base model


def compute_dtype(cfg: ModelConfig, device: torch.device | str) -> torch.dtype:
    """`auto`: bfloat16 on GPU, float32 on CPU."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def attention_implementation(cfg: ModelConfig, device: torch.device | str, training: bool) -> str:
    """`auto`: flex_attention to train on a GPU (packed rows need its block-sparse document masks; it has no backward
    on CPU), sdpa otherwise (decoding's dense PrefixLM prompt masks)."""
    if cfg.attn_implementation != "auto":
        return cfg.attn_implementation
    return "flex_attention" if training and torch.device(device).type == "cuda" else "sdpa"


def _random_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, attn_implementation: str, dtype: torch.dtype,
    device: torch.device | str,
) -> PreTrainedModel:
    """A Llama from `cfg.random_init`, vocabulary sized to the tokenizer, seeded.

    Built in float32 on the CPU and cast, except on a GPU: there it is built in `dtype` on the card itself, which takes
    a second where the CPU spent ~2 minutes on the 8B shape (141 core-seconds per billion weights) before every GPU
    trial. So one seed gives the same weights on every worker of one kind of device, not across kinds: a shape
    trained on a GPU is also evaluated there.
    """
    settings = dict(cfg.random_init or {})
    seed = int(settings.pop("seed", SEED))
    config = LlamaConfig(
        vocab_size=aligned_vocabulary(len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation=attn_implementation,
        **settings,
    )
    device = torch.device(device)
    if device.type != "cuda":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return LlamaForCausalLM(config).to(dtype=dtype)
    with torch.random.fork_rng(devices=[device]), device:
        torch.manual_seed(seed)
        return LlamaForCausalLM._from_config(config, dtype=dtype)


def _pretrained_model(cfg: ModelConfig, dtype: torch.dtype, attn_implementation: str) -> PreTrainedModel:
    location, gguf_file = weights_location(cfg)

    def read(folder: str, gguf: str | None) -> PreTrainedModel:
        return _from_pretrained(
            AutoModelForCausalLM, folder, gguf_file=gguf, dtype=dtype, attn_implementation=attn_implementation
        )

    if gguf_file is not None and _looks_local(location):
        return load_gguf_model(Path(location).expanduser() / gguf_file, dtype, read)  # dequantized once, then kept
    return read(location, gguf_file)


def _fit_vocabulary(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Grow the embedding (and untied output) matrix to the tokenizer when tokens were added.

    New rows are drawn around the mean of the existing rows (transformers' `mean_resizing`), seeded so that a reload
    rebuilds the same rows.
    """
    if len(tokenizer) <= model.get_input_embeddings().num_embeddings:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model.resize_token_embeddings(aligned_vocabulary(len(tokenizer)), mean_resizing=True)


def aligned_vocabulary(tokens: int) -> int:
    """Rows of the embedding and output matrices for a tokenizer of `tokens` ids (`VOCAB_MULTIPLE`)."""
    return -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _use_tokenizer_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Generation stops at the tokenizer's end-of-sequence token (which `eos_token` may have changed), pads with its
    pad and never picks an id the tokenizer lacks (the rows that align the matrices)."""
    for config in (model.config, model.generation_config):
        config.eos_token_id = tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    padding = range(len(tokenizer), model.get_output_embeddings().weight.shape[0])
    model.generation_config.suppress_tokens = list(padding) or None


def embeddings_are_tied(model: PreTrainedModel) -> bool:
    """Whether the output layer shares the input embedding's weight (of a model not yet wrapped by peft)."""
    output = model.get_output_embeddings()
    return output is None or output.weight is model.get_input_embeddings().weight


# --------------------------------------------------------------------------------------------------------------
# LoRA and trainable special-token rows


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def trainable_token_indices(model: PreTrainedModel, token_ids: list[int]) -> list[int] | dict[str, list[int]]:
    """peft's `trainable_token_indices` for these rows.

    Tied: a list; peft wraps the input embedding and ties the output layer to the same trainable rows.
    Untied: the input embedding and the output layer by name, each with trainable rows of its own.
    """
    if embeddings_are_tied(model):
        return list(token_ids)
    names = (_module_name(model, model.get_input_embeddings()), _module_name(model, model.get_output_embeddings()))
    return {name: list(token_ids) for name in names}


def apply_lora(model: PreTrainedModel, lora: LoraConfig, specials: SpecialTokens, seed: int = 0) -> PeftModel:
    """LoRA on `lora.target_modules` ("all-linear": every linear projection but the output layer), its initialisation
    drawn from `seed` alone (the training seed), whatever drew from torch's generators before."""
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        trainable_token_indices=(
            trainable_token_indices(model, specials.trainable_ids) if lora.train_special_tokens else None
        ),
        task_type="CAUSAL_LM",
    )
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    _merge_token_rows_with_device_indices(peft_model)
    return peft_model


def _merge_token_rows_with_device_indices(model: PeftModel) -> None:
    """peft 0.21's `TrainableTokensLayer.get_merged_weights` makes its row indices a tensor from a Python list and
    copies it to the GPU on every call: a blocking copy (`.to(device)`), after which the host waits for all the work
    queued on the GPU. Training calls it twice a micro-batch (the embedding; the output matrix of the fused loss, after
    the whole forward is queued). Here each layer merges with indices copied to the device once."""
    for module in model.modules():
        if isinstance(module, TrainableTokensLayer):
            module.get_merged_weights = partial(merged_token_rows, module)


def merged_token_rows(layer: TrainableTokensLayer, active_adapters: list[str]) -> torch.Tensor:
    """The layer's matrix with its trainable rows written over the frozen ones (peft's `get_merged_weights`)."""
    weight = layer.base_layer.weight
    for name in active_adapters:
        rows = _device_indices(tuple(layer.token_indices[name]), weight.device)
        weight = weight.index_copy(dim=0, index=rows, source=layer.trainable_tokens_delta[name].to(weight))
    return weight


@lru_cache(maxsize=16)
def _device_indices(indices: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Made outside inference mode even when first asked inside it (a model in training decoding), so that the
    training forwards after can still use it: autograd refuses an inference tensor."""
    with torch.inference_mode(False):
        return torch.tensor(indices, dtype=torch.long, device=device)


# --------------------------------------------------------------------------------------------------------------
# The entry points


@dataclass
class Loaded:
    model: PreTrainedModel | PeftModel
    """peft-wrapped (LoRA + trainable special-token rows) when loaded for training; a plain model otherwise."""
    tokenizer: PreTrainedTokenizerBase
    specials: SpecialTokens


def load_model(
    cfg: ModelConfig, num_sentinels: int, device: torch.device | str = "cpu", training: bool = True, seed: int = 0,
    levers: SpeedLevers | None = None,
) -> Loaded:
    """Tokenizer with the special tokens installed, base model fitted to it, LoRA on top when `training` (initialised
    from `seed`: the training seed); not training, `levers` applied (`clozemath.model.speed`; None: inference's
    where they can run)."""
    tokenizer = load_tokenizer(cfg)
    specials = install_special_tokens(tokenizer, num_sentinels, cfg.eos_token)
    dtype = compute_dtype(cfg, device)
    implementation = attention_implementation(cfg, device, training)
    if cfg.random_init is not None:
        model = _random_model(cfg, tokenizer, implementation, dtype, device)
    else:
        model = _pretrained_model(cfg, dtype, implementation)
    _fit_vocabulary(model, tokenizer)
    _use_tokenizer_ids(model, tokenizer)
    model.to(device)
    if not training:
        return Loaded(model=apply_levers(model.eval(), levers), tokenizer=tokenizer, specials=specials)
    peft_model = apply_lora(model, cfg.lora, specials, seed)
    return Loaded(model=peft_model.train(), tokenizer=tokenizer, specials=specials)


def save_adapter(
    model: PeftModel, folder: str | Path, specials: SpecialTokens, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write the LoRA weights and the trained special-token rows (`adapter_model.safetensors`, via peft) and the
    special-token map (`special_tokens.json`) into `folder`.

    `state_dict`: the model's full state dict when it was gathered elsewhere (DeepSpeed ZeRO-3); peft picks the
    adapter's entries out of it. The frozen embedding matrix is never written, resized or not: the rows that were
    added are all special tokens, and those are in the file.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=state_dict, save_embedding_layers=False)
    write_text_atomic(folder / SPECIALS_FILE, json.dumps({"tokens": specials.tokens, "ids": specials.ids}, indent=1))
    return folder


def _saved_specials(folder: Path) -> dict[str, Any]:
    if not (folder / "adapter_config.json").is_file():
        raise ClozeMathError(f"adapter folder '{folder}': no adapter_config.json (not an adapter saved by clozemath)")
    try:
        return json.loads((folder / SPECIALS_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ClozeMathError(f"{folder / SPECIALS_FILE}: cannot be read ({exc})") from None


def load_for_inference(
    cfg: ModelConfig, adapter_folder: str | Path, device: torch.device | str = "cpu",
    levers: SpeedLevers | None = None,
) -> Loaded:
    """Base model + a saved adapter, LoRA and special-token rows merged into the weights, in eval mode, `levers`
    applied after the merge."""
    folder = Path(adapter_folder)
    saved = _saved_specials(folder)
    num_sentinels = len(saved["tokens"]) - len(special_names(0))
    return _merged(cfg, load_model(cfg, num_sentinels, device, training=False, levers=PLAIN), folder, levers)


def trained_for_inference(
    cfg: ModelConfig, trained: Loaded, adapter_folder: str | Path, levers: SpeedLevers | None = None
) -> Loaded:
    """The model a worker trained (`load_model(training=True)`) made what `load_for_inference` loads from the adapter
    it saved, without loading the base model again: LoRA and the trainable token rows taken off (the base weights
    were frozen: they are the loaded ones), inference's attention, the saved adapter merged in as there (so the same
    weights, to the bit, whatever precision training kept its adapter in). `trained` is spent."""
    base = trained.model.unload()
    device = next(base.parameters()).device
    base.set_attn_implementation(attention_implementation(cfg, device, training=False))
    return _merged(cfg, Loaded(model=base.eval(), tokenizer=trained.tokenizer, specials=trained.specials),
                   Path(adapter_folder), levers)


def _merged(cfg: ModelConfig, loaded: Loaded, folder: Path, levers: SpeedLevers | None) -> Loaded:
    """A base model loaded for inference, the adapter saved in `folder` merged into its weights, in eval mode, then
    `levers` applied (the merge needs transformers' modules as they are: LoRA's targets by name)."""
    saved = _saved_specials(folder)
    if loaded.specials.ids != saved["ids"]:
        raise ClozeMathError(
            f"{folder / SPECIALS_FILE}: special-token ids {saved['ids']} differ from model '{cfg.name}''s {loaded.specials.ids}"
        )
    merged = PeftModel.from_pretrained(loaded.model, folder).merge_and_unload()
    return Loaded(model=apply_levers(merged.eval(), levers), tokenizer=loaded.tokenizer, specials=loaded.specials)


def export_merged(cfg: ModelConfig, adapter_folder: str | Path, out: str | Path) -> Path:
    """The base model with the adapter merged into its weights, as a Hugging Face folder `from_pretrained` loads
    (safetensors, config, tokenizer with the special tokens, `special_tokens.json` naming them); written beside
    `out` and renamed into place, so a failed export leaves nothing half-written. `out` must not exist yet."""
    from clozemath.files import atomic_folder

    target = Path(out)
    if target.exists():
        raise ClozeMathError(f"{target}: already exists; export into a new folder")
    loaded = load_for_inference(cfg, adapter_folder, "cpu", levers=PLAIN)  # transformers' modules, as it reads them
    with atomic_folder(target) as folder:
        loaded.model.save_pretrained(folder, safe_serialization=True)
        loaded.tokenizer.save_pretrained(folder)
        (folder / SPECIALS_FILE).write_text((Path(adapter_folder) / SPECIALS_FILE).read_text())
    return target
