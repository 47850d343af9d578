"""Base model (hub id, local folder, GGUF file or its chunks, or random init; its tokenizer from
`clozemath.model.tokenizer`), the method's special tokens, LoRA.

The special tokens' rows of the input embedding (and of the output matrix when it is untied) train along with LoRA
through peft's `trainable_token_indices`: peft keeps a small trainable copy of those rows and writes them over the
frozen matrix in every forward pass, so every other row stays bit-for-bit the base model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from clozemath.config import LoraConfig, ModelConfig
from clozemath.data.tokenize import SpecialTokens, install_special_tokens, special_names
from clozemath.errors import ClozeMathError
from clozemath.files import write_text_atomic
from clozemath.model.gguf_cache import load_gguf_model
from clozemath.model.speed import PLAIN, SpeedLevers, apply_levers
from clozemath.model.tokenizer import from_pretrained, load_tokenizer, looks_local, weights_location

SPECIALS_FILE = "special_tokens.json"
SEED = 0
"""Seed of random weights (a `random_init` model unless its settings carry `seed`, rows added to a vocabulary):
training and reloading must build the same base."""
VOCAB_MULTIPLE = 64
"""The embedding and output matrices grow to a multiple of this many rows when tokens are added: a row count off
a multiple of 8 puts the output layer's matrix products (a training step's largest) on cuBLAS's slow unaligned
kernels. Decoding never picks the rows past the tokenizer (`generation_config.suppress_tokens`)."""


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
        return from_pretrained(
            AutoModelForCausalLM, folder, gguf_file=gguf, dtype=dtype, attn_implementation=attn_implementation
        )

    if gguf_file is not None and looks_local(location):
        return load_gguf_model(Path(location).expanduser() / gguf_file, dtype, read)  # dequantized once, then kept
    return read(location, gguf_file)


def warm_caches(cfg: ModelConfig, device: torch.device | str) -> str:
    """Reads `cfg`'s tokenizer and, from a local GGUF file, its weights in `device`'s dtype into this machine's caches
    (chunks joined, the dequantized model kept: `clozemath.model.gguf_cache`), so that later loads here skip the parse;
    says what it read. A run's first load of a GGUF model on a fresh machine otherwise parses it in a training worker
    after the data is prepared, the card idle (Qwen2.5-Coder-1.5B on one H200, 2026-12-03: 100 s from the workers'
    start to their first step, the parse among it)."""
    load_tokenizer(cfg)
    if cfg.random_init is not None:
        return "the tokenizer (the weights are built from a config)"
    location, gguf_file = weights_location(cfg)
    if gguf_file is None or not looks_local(location):
        return "the tokenizer (the weights are not a local GGUF file: nothing of them to keep)"
    dtype = compute_dtype(cfg, device)
    _pretrained_model(cfg, dtype, attention_implementation(cfg, device, training=True))
    return f"the tokenizer and the weights ({str(dtype).removeprefix('torch.')})"


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
