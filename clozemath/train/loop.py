"""One training worker's loop on a DeepSpeed engine: ZeRO-2/3 LoRA fine-tuning, checkpoints, exact resume.

Ray-free: the caller hands in the worker's tokenized rows and a `report` callback that receives the metrics of
every optimizer step and, every `checkpoint_every` steps and at the last one, a folder holding a checkpoint; what
it does with them (print, `ray.train.report`, copy) is its business. Every rank calls `report` the same number
of times. The last checkpoint also holds the trained adapter in `adapter/` (written by rank 0), so that a run's
final checkpoint is its result.

Resuming is exact. The data order is a pure function of (seed, epoch, rank, the rows): a seeded permutation per
epoch (laid into packed rows, `clozemath.train.packing`, or cut into padded micro-batches), read as an endless stream
of micro-batches; everything random within a step (dropout, MFT noise) is drawn
after seeding with (seed, step, rank). A checkpoint holds the engine state (trainable weights, optimizer
partitions, schedule), the step and the data position (the next micro-batch); a resumed run redoes no step and
ends at the planned number of optimizer steps whatever happened on the way.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import torch
import torch.distributed as dist

from clozemath import console
from clozemath.config import ExperimentConfig, TrainConfig
from clozemath.data.objectives import apply_mft_noise, mft_rate
from clozemath.data.tokenize import IGNORE_INDEX, MASK, SpecialTokens, collate, collate_packs
from clozemath.errors import ClozeMathError
from clozemath.model.attention import attention_inputs, flex_kernel_options, head_dim
from clozemath.model.load import save_adapter
from clozemath.model.memory import usable_bytes
from clozemath.records import ADAPTER_DIR, train_metric
from clozemath.train.packing import auto_pack_tokens, epoch_packs, packs_needed, whole_blocks
from clozemath.train.zero import deepspeed_config, with_zero_stage

CHECKPOINT_TAG = "state"
"""DeepSpeed's tag (sub-folder) for the engine state inside a checkpoint folder."""
LENGTH_WINDOW = 32
"""Micro-batches whose rows are sorted by length together (`train.group_by_length`)."""


class InjectedFailure(RuntimeError):
    """Raised by the `train.fail_at_step` test hook."""


@dataclass(frozen=True)
class StepMetrics:
    """One optimizer step, averaged over its micro-batches and over all ranks."""

    step: int
    total_steps: int
    epoch: float
    loss: float
    lr: float
    tokens: int
    """Real (non-padding) tokens of all ranks in this step."""
    tokens_per_s: float
    """Real (non-padding) tokens of all ranks per second of this step."""
    pad_share: float
    """Share of the batch positions that are padding."""
    seconds: float
    """Wall time of this step on rank 0 (the first: compiling included, on a cold cache minutes)."""
    peak_memory_gib: float
    """The most GPU memory any rank's tensors held so far (torch's allocator; 0 on CPU)."""

    def as_dict(self) -> dict[str, float | int]:
        values = asdict(self)
        return {
            "step": values.pop("step"),
            "total_steps": values.pop("total_steps"),
            **{train_metric(name): value for name, value in values.items()},
        }


Report = Callable[[StepMetrics, Path | None], None]
"""Called after every optimizer step; the folder (or None) holds a checkpoint valid for the call's duration."""


@dataclass(frozen=True)
class Plan:
    """How many micro-batches an epoch has on this worker, and how many optimizer steps the run makes."""

    micro_batches_per_epoch: int
    total_steps: int
    warmup_steps: int


def plan_steps(per_epoch: int, train: TrainConfig) -> Plan:
    """Steps of the whole run from one worker's micro-batches per epoch (every rank must get the same count)."""
    if per_epoch < train.grad_accum:
        raise ClozeMathError(
            f"too few training samples: {per_epoch} micro-batches per worker cannot fill one step of "
            f"train.grad_accum={train.grad_accum} (train.micro_batch_size={train.micro_batch_size}, "
            f"train.pack_tokens={train.pack_tokens})"
        )
    total = train.max_steps or max(1, int(train.epochs * per_epoch) // train.grad_accum)
    return Plan(per_epoch, total, warmup_steps=math.ceil(train.warmup_ratio * total))


def pack_budget(train: TrainConfig, model: torch.nn.Module, lengths: Sequence[int]) -> int | None:
    """Tokens of a packed row, or None for padded micro-batches (`train.pack_tokens`; auto packs on a GPU only).

    auto sizes the row to the card's memory (this process's share of it) less what the model holds, not to the memory free right now, and takes
    the smallest over the ranks: a restarted run (or another rank) then plans the same rows and steps."""
    if train.pack_tokens != "auto":
        return train.pack_tokens
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    tokens = auto_pack_tokens(model.config, usable_bytes(device), max(lengths, default=1))
    return all_ranks_reduce(tokens, dist.ReduceOp.MIN, device)


def micro_batches_per_epoch(lengths: Sequence[int], train: TrainConfig, budget: int | None, device: torch.device) -> int:
    """The same on every rank: padded micro-batches of the smallest shard (the others drop their extra rows), or
    the packed rows of the largest (the others spread their samples over as many rows)."""
    if budget is None:
        return all_ranks_reduce(len(lengths) // train.micro_batch_size, dist.ReduceOp.MIN, device)
    return all_ranks_reduce(packs_needed(lengths, budget), dist.ReduceOp.MAX, device)


def ensure_distributed_env() -> None:
    """Single-process defaults for the variables DeepSpeed reads, when no launcher (or Ray Train) set them."""
    if "RANK" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def init_distributed(device: torch.device) -> None:
    """Join torch.distributed through DeepSpeed; an existing process group (Ray Train's) is reused."""
    import deepspeed

    ensure_distributed_env()
    if device.type == "cpu":
        # DeepSpeed would compile its shared-memory all-reduce (a minute and more on a fresh machine, and a C++
        # compiler) for inference; training's collectives are torch.distributed's.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


LIGER_CHUNK_MEM = 64
"""liger-kernel's `chunk_mem_const`: its chunks of target tokens may hold this many times their hidden states in
logits. At its default (1) a chunk of the 1B shape is ~64 tokens, so the output matrix's gradient (the whole
vocabulary: the trainable special-token rows make it need one) is read and written once per 64 tokens; at 64 the loss
and its backward took 8.2 ms instead of 35 (3,000 targets, H200), and the 1B step 110 ms instead of 134 with its peak
memory at 13.9 GiB instead of 13.1 (`bench/results/train_throughput_loss_chunks_h200.md`)."""


class TargetLoss(torch.nn.Module):
    """The causal-LM loss with the output layer applied to target positions only.

    A causal LM's forward projects every position onto the vocabulary and the loss then ignores the prefix's.
    PrefixLM samples are mostly prefix (ClozeMath's GSM8K samples: 66% of their tokens), and with a 128k vocabulary
    that projection, its float32 upcast and its backward are a large share of a step's work and memory. Here the
    decoder's hidden states are gathered at the positions whose next token is a target first. The loss is the same
    mean cross-entropy over target tokens that `model(..., labels=...)` returns.
    """

    def __init__(self, model: torch.nn.Module, fused: bool = False):
        super().__init__()
        self.model = model
        self.fused = fused
        """liger-kernel's fused linear + cross-entropy (Triton, GPU only): the logits are made and dropped chunk by
        chunk, never all at once in float32."""

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None, **masks: Any
    ) -> torch.Tensor:
        """`positions`: `target_positions(labels)`, computed by the caller on the host (else here, on the device,
        where finding them waits for the GPU to finish the forward)."""
        causal_lm = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = causal_lm.get_decoder()(input_ids=input_ids, use_cache=False, **masks).last_hidden_state
        positions = target_positions(labels) if positions is None else positions
        predicted = hidden.flatten(0, 1).index_select(0, positions)
        wanted = labels.flatten().index_select(0, positions + 1)
        output = causal_lm.get_output_embeddings()
        if self.fused:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

            return liger_fused_linear_cross_entropy(predicted, output_matrix(output), wanted,
                                                    bias=getattr(output, "bias", None),
                                                    chunk_mem_const=LIGER_CHUNK_MEM)
        return torch.nn.functional.cross_entropy(output(predicted).float(), wanted)


def target_positions(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices (into [batch * seq]) of the positions whose next token is a target, in row order."""
    predicts = torch.zeros_like(labels, dtype=torch.bool)
    predicts[:, :-1] = labels[:, 1:] != IGNORE_INDEX
    return predicts.flatten().nonzero().squeeze(1)


def output_matrix(output: torch.nn.Module) -> torch.Tensor:
    """The output layer's matrix as the layer applies it: peft's trainable special-token rows (an output layer tied to
    the embedding) written over the frozen ones."""
    tokens = getattr(output, "token_adapter", None)
    if tokens is None or tokens.merged or tokens.disable_adapters or not tokens.active_adapters:
        return output.weight
    return tokens.get_merged_weights(tokens.active_adapters)


def use_fused_loss(train: TrainConfig, device: torch.device) -> bool:
    """`train.fused_loss`; auto: on a GPU when liger-kernel is installed."""
    if train.fused_loss is False:
        return False
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        if train.fused_loss is True:
            raise ClozeMathError("train.fused_loss=true needs liger-kernel: pip install 'clozemath[gpu]'") from None
        return False
    if train.fused_loss is True and device.type != "cuda":
        raise ClozeMathError("train.fused_loss=true needs a GPU (liger-kernel's kernels are Triton's)")
    return device.type == "cuda"


def build_engine(model: torch.nn.Module, train: TrainConfig, total_steps: int, warmup_steps: int) -> Any:
    """AdamW (only the trainable parameters) and a cosine schedule with linear warmup, on a DeepSpeed engine whose
    module is the model's `TargetLoss` (so `engine.module.model` is the model)."""
    import deepspeed
    from transformers import get_cosine_schedule_with_warmup

    trainable = [p for p in model.parameters() if p.requires_grad]
    device = trainable[0].device
    # fused AdamW: one kernel for the whole update instead of one per tensor
    optimizer = torch.optim.AdamW(
        trainable, lr=train.lr, weight_decay=train.weight_decay, fused=device.type == "cuda"
    )
    engine, _, _, _ = deepspeed.initialize(
        model=TargetLoss(model, fused=use_fused_loss(train, device)),
        optimizer=optimizer,
        lr_scheduler=lambda opt: get_cosine_schedule_with_warmup(opt, warmup_steps, total_steps),
        config=deepspeed_config(train, bf16=next(model.parameters()).dtype == torch.bfloat16,
                                layer=decoder_layers(model)[0], trained=trainable),
    )
    _leave_tied_frozen_weights_out(engine)
    if train.zero_stage == 3:
        _register_weights_read_outside_their_modules(engine)
    return engine


def _register_weights_read_outside_their_modules(engine: Any) -> None:
    """ZeRO-3 gathers a module's parameters as its forward starts. peft's trainable-token layers read their base
    layer's weight and their own token rows without calling the modules that hold them; inside the engine's forward
    DeepSpeed finds such reads itself, outside it (decoding during training) it does not, and the layer would read an
    empty shard. Registered as the layer's external parameters, they are gathered with it wherever it runs."""
    import deepspeed
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    for module in engine.module.modules():
        if isinstance(module, TrainableTokensLayer):
            for parameter in (module.base_layer.weight, *module.trainable_tokens_delta.parameters()):
                deepspeed.zero.register_external_parameter(module, parameter)


def _leave_tied_frozen_weights_out(engine: Any) -> None:
    """Make `exclude_frozen_parameters` leave out every frozen weight.

    DeepSpeed finds the frozen weights through `named_parameters()`, which names a tied weight once: the output
    matrix tied to the embedding (SmolLM2, Llama 3.2 1B/3B) stays in every checkpoint, a whole vocabulary's worth.
    """
    frozen = {name for name, p in engine.module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    module_state_dict = engine.module_state_dict

    def state_dict(*args: Any, exclude_frozen_parameters: bool = False, **kwargs: Any) -> dict[str, Any]:
        state = module_state_dict(*args, exclude_frozen_parameters=exclude_frozen_parameters, **kwargs)
        if exclude_frozen_parameters:
            for name in frozen & state.keys():
                del state[name]
        return state

    engine.module_state_dict = state_dict


def epoch_micro_batches(
    lengths: Sequence[int], micro_batches: int, micro_batch_size: int, seed: int, epoch: int, group_by_length: bool
) -> list[list[int]]:
    """One epoch's micro-batches (row indices): a seeded permutation, the last partial micro-batch dropped.

    `group_by_length`: within windows of `LENGTH_WINDOW` micro-batches the rows are sorted by length before they are
    cut, and the micro-batches then shuffled, so that a batch pads little and the order stays random.
    """
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()[: micro_batches * micro_batch_size]
    if group_by_length:
        window = micro_batch_size * LENGTH_WINDOW
        windows = [order[start : start + window] for start in range(0, len(order), window)]
        order = [i for rows in windows for i in sorted(rows, key=lengths.__getitem__)]
    batches = [order[k * micro_batch_size : (k + 1) * micro_batch_size] for k in range(micro_batches)]
    if group_by_length:
        batches = [batches[k] for k in torch.randperm(micro_batches, generator=generator).tolist()]
    return batches


def micro_batch_rows(
    lengths: Sequence[int], plan: Plan, train: TrainConfig, budget: int | None, seed: int, start: int
) -> Iterator[list[int]]:
    """Row indices of micro-batch `start`, `start + 1`, ... of the endless stream of epochs (with packing, a
    micro-batch is one packed row)."""
    index = start
    while True:
        epoch, offset = divmod(index, plan.micro_batches_per_epoch)
        if budget is None:
            batches = epoch_micro_batches(
                lengths, plan.micro_batches_per_epoch, train.micro_batch_size, seed, epoch, train.group_by_length
            )
        else:
            batches = epoch_packs(lengths, budget, plan.micro_batches_per_epoch, seed, epoch)
        yield from batches[offset:]
        index = (epoch + 1) * plan.micro_batches_per_epoch


def micro_batch(rows: Sequence[Mapping[str, Any]], indices: list[int], budget: int | None, pad_id: int) -> dict[str, torch.Tensor]:
    """The tensors of one micro-batch: one packed row of `budget` tokens, or one sample a row padded to the longest."""
    samples = [rows[i] for i in indices]
    return collate(samples, pad_id) if budget is None else collate_packs([samples], pad_id, width=budget)


def model_inputs(
    batch: Mapping[str, torch.Tensor], config: ExperimentConfig, model: torch.nn.Module, packed: bool
) -> dict[str, torch.Tensor | Any]:
    """Forward arguments: the batch with the method's attention mask (PrefixLM, or causal) in the form the model's
    attention implementation takes. A causal one-sample-a-row batch passes its padding mask alone (the model's own
    causal mask is the fastest); packed rows always need the document mask."""
    prefix_mask: torch.Tensor | None = batch["prefix_mask"]
    if config.method.attention != "prefix_lm":
        prefix_mask = torch.zeros_like(prefix_mask) if packed else None
    implementation = model.config._attn_implementation
    dtype = next(model.parameters()).dtype
    options = flex_kernel_options(head_dim(model.config), dtype, batch["attention_mask"].device)
    masks = attention_inputs(implementation, batch["attention_mask"], prefix_mask, dtype, options)
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], **masks}


COMPILE_PAYS_OFF_TOKENS = 2_000_000
"""`train.compile: auto` compiles a worker's run of at least this many tokens. Compiling the decoder layers and
FlexAttention's kernels costs 10 s to 4 minutes (bench/results/train_throughput_profile_h100_h200.md); below
this a run is over sooner uncompiled, in rows of `EAGER_PACK_TOKENS` through sdpa. Measured break-even: ~1.3M
tokens for SmolLM2-135M (H200: 65.7k tokens/s compiled after a 56 s first step, 18.5k uncompiled), 2.5M-6M for the
Llama-3.2-1B shape (H100: 26k compiled, 12.8k uncompiled, 40-230 s of compiling)."""
EAGER_PACK_TOKENS = 4096
"""`train.pack_tokens: auto` caps an uncompiled row here: sdpa's dense mask spans all L x L pairs of a row, so a longer
row spends more on attention across samples it then masks out."""


@dataclass(frozen=True)
class Layout:
    """How one worker's steps are shaped: packed rows of `budget` tokens (None: padded micro-batches), and whether the
    decoder layers are compiled (FlexAttention's block-sparse document masks) or run eagerly (dense masks, sdpa)."""

    budget: int | None
    compiled: bool
    plan: Plan


def training_layout(
    config: ExperimentConfig, model: torch.nn.Module, lengths: Sequence[int], device: torch.device
) -> Layout:
    """Row size, compilation and the steps they give; the same on every rank and on every restart (a function of the
    rows' lengths, the config and the GPU's memory). An uncompiled packed run on FlexAttention (chosen when the model
    was loaded for training) moves to sdpa: FlexAttention run eagerly compiles its own kernels all the same."""
    train = config.train
    layout = choose_layout(train, pack_budget(train, model, lengths), max(lengths, default=1), device,
                           lambda budget: micro_batches_per_epoch(lengths, train, budget, device))
    if layout.budget is not None and not layout.compiled and config.model.attn_implementation == "auto" \
            and model.config._attn_implementation == "flex_attention":
        model.set_attn_implementation("sdpa")
    return layout


def choose_layout(
    train: TrainConfig, budget: int | None, longest: int, device: torch.device, per_epoch: Callable[[int | None], int]
) -> Layout:
    """`training_layout`'s choice from the row `budget` it sizes (None: padded micro-batches) and `per_epoch`, the
    micro-batches an epoch takes in rows of a budget: compiled when `should_compile`, else an auto row capped at
    `EAGER_PACK_TOKENS`. `clozemath.cost` makes the same choice for a run not started."""
    plan = plan_steps(per_epoch(budget), train)
    compiled = should_compile(train, budget, plan, device)
    if budget is None or compiled:
        return Layout(budget, compiled, plan)
    if train.pack_tokens == "auto" and budget > EAGER_PACK_TOKENS:
        budget = max(EAGER_PACK_TOKENS, whole_blocks(longest))
        plan = plan_steps(per_epoch(budget), train)
    return Layout(budget, compiled, plan)


def should_compile(train: TrainConfig, budget: int | None, plan: Plan, device: torch.device) -> bool:
    """`train.compile`; auto: packed rows (one shape) on a GPU under ZeRO-2 (ZeRO-3 gathers each layer's weights
    in module hooks, which a compiled layer would trace), for a run long enough to pay the compilation back."""
    if train.compile != "auto":
        return train.compile
    if device.type != "cuda" or budget is None or train.zero_stage != 2:
        return False
    return planned_tokens(plan, train, budget) >= COMPILE_PAYS_OFF_TOKENS


def planned_tokens(plan: Plan, train: TrainConfig, budget: int) -> int:
    """Token positions of a worker's whole run in packed rows of `budget` tokens (padding included: rows are ~full)."""
    return plan.total_steps * train.grad_accum * budget


def plan_line(layout: Layout, train: TrainConfig) -> str:
    """What the steps will be, said before the first: a compiled first step is silent for minutes on a cold cache."""
    plan, budget = layout.plan, layout.budget
    rows = f"packed rows of {budget:,} tokens" if budget is not None else f"micro-batches of {train.micro_batch_size}"
    text = f"{plan.total_steps:,} steps of {train.grad_accum} {rows}"
    if layout.compiled:
        return text + "; the first step compiles the decoder layers (minutes on a cold cache)"
    if budget is not None and train.compile == "auto" and train.zero_stage == 2:
        tokens = planned_tokens(plan, train, budget)
        return text + (f", not compiled ({tokens / 1e6:.1f}M tokens; compiling pays back past "
                       f"{COMPILE_PAYS_OFF_TOKENS / 1e6:.0f}M: train.compile=true forces it)")
    return text


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    return causal_lm.get_decoder().layers


COMPILE_CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
"""Where compiled code is kept (torch 2.11-2.13, read from the environment when a compilation looks it up): every
modular cache of torch.compile (Inductor's FX graphs and the Triton kernels it generates, AOTAutograd's joint graphs,
autotuning results; on by default) under `TORCHINDUCTOR_CACHE_DIR` (PyTorch's "Compile Time Caching" recipe), and the
binaries of Triton kernels that Triton compiles itself (liger-kernel's fused loss) under `TRITON_CACHE_DIR`. Both write
by atomic rename, so concurrent trials can share a folder; their keys hold the torch and Triton versions and the card,
so another machine misses rather than loads a wrong kernel. (`torch.compiler.save_cache_artifacts` packs the same
caches into bytes, for a store that is not a shared folder.)"""


def use_compile_cache(folder: Path) -> None:
    """Keep this process's compilations in `folder` (created), to be found by every later process pointed there:
    the trials after the first of a grid, on any node that sees the folder, compile from the cache."""
    folder.mkdir(parents=True, exist_ok=True)
    for variable, sub in COMPILE_CACHE_ENV.items():
        os.environ[variable] = str(folder / sub)


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """Regional compilation: each decoder layer (with its LoRA adapters) compiled in place, fixed shapes. The layers
    share one compiled graph (their weights are its inputs), so compiling costs about one layer's time; the
    embedding and the loss stay eager (the loss's shape follows the number of target tokens)."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=False)


@contextmanager
def eager_inference(model: torch.nn.Module) -> Iterator[None]:
    """Decoding with a training model: compiled layers run eagerly (decoding's shapes change every call) and attention
    is sdpa (decoding's dense PrefixLM prompt masks); both restored afterwards."""
    implementation = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        model.set_attn_implementation(implementation)


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of everything random in one step on one rank (dropout, MFT noise): resuming redraws the same."""
    return (seed * 1_000_003 + step) * 1009 + rank


def noised(
    batch: dict[str, torch.Tensor],
    config: ExperimentConfig,
    step: int,
    total_steps: int,
    mask_id: int,
    noise_ids: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """MFT: the batch with target tokens replaced at the step's rate (labels unchanged); others untouched.
    Drawn from the global RNG, which `train` seeds per step."""
    mft = config.method.mft
    if mft is None:
        return batch
    rate = mft_rate(step, total_steps, mft.r_max)
    input_ids = apply_mft_noise(batch["input_ids"], batch["labels"], rate, mft.noise, mask_id, noise_ids)
    return {**batch, "input_ids": input_ids}


def all_ranks_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums over the ranks (on `device`: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_ranks_reduce(value: int, op: dist.ReduceOp, device: torch.device) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def save_checkpoint(engine: Any, folder: Path, step: int, plan: Plan, next_micro_batch: int) -> None:
    """Engine state (trainable weights, optimizer partitions, schedule), the step and the data position (the next
    micro-batch of the stream); every rank writes its part, frozen base weights are left out."""
    state = {"step": step, "total_steps": plan.total_steps, "next_micro_batch": next_micro_batch}
    engine.save_checkpoint(str(folder), tag=CHECKPOINT_TAG, client_state=state, exclude_frozen_parameters=True)


def load_checkpoint(engine: Any, folder: Path, plan: Plan) -> tuple[int, int]:
    """Restore the engine from `folder`; returns the step it was taken at and the next micro-batch to read."""
    path, client_state = engine.load_checkpoint(str(folder), tag=CHECKPOINT_TAG, load_module_strict=False)
    if path is None:
        raise ClozeMathError(f"{folder}: no DeepSpeed checkpoint '{CHECKPOINT_TAG}' in it")
    if client_state["total_steps"] != plan.total_steps:
        raise ClozeMathError(
            f"{folder}: checkpoint planned {client_state['total_steps']} steps, this run plans {plan.total_steps}"
            " (data or train.* changed?)"
        )
    return int(client_state["step"]), int(client_state["next_micro_batch"])


@dataclass
class _StepTally:
    """One step's sums; the loss stays on the device (reading it would wait for the GPU every micro-batch)."""

    loss: torch.Tensor | float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    positions: int = 0

    def add(self, loss: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self.loss = self.loss + loss.detach().float()
        self.micro_batches += 1
        self.tokens += int((attention_mask > 0).sum())
        self.positions += attention_mask.numel()


def train(
    model: torch.nn.Module,
    rows: Sequence[Mapping[str, Any]],
    config: ExperimentConfig,
    *,
    specials: SpecialTokens,
    pad_id: int,
    report: Report,
    resume_from: Path | None = None,
    scratch_dir: Path | None = None,
) -> Any:
    """Fine-tune `model` (peft, trainable parameters already chosen) on this worker's `rows` (input_ids, labels,
    prefix_len); return the DeepSpeed engine. `resume_from`: a checkpoint folder `report` was given earlier.
    Checkpoints are written under `scratch_dir` (default: the system's temp folder) and removed after `report`.
    `train.zero_stage: auto` is resolved here (`clozemath.train.zero.with_zero_stage`)."""
    noise_ids = torch.tensor(specials.ordinary_ids)
    mask_id = specials.ids[MASK]
    device = next(model.parameters()).device
    if device.type == "cpu" and model.config._attn_implementation == "flex_attention":
        raise ClozeMathError("model.attn_implementation=flex_attention cannot train on CPU (no backward there): use sdpa")
    init_distributed(device)
    config = with_zero_stage(config, model, device)
    train_cfg = config.train
    rank = dist.get_rank()
    lengths = [len(row["input_ids"]) for row in rows]
    layout = training_layout(config, model, lengths, device)
    plan, budget = layout.plan, layout.budget
    if layout.compiled:
        compile_decoder_layers(model)
    if rank == 0:
        console.phase(f"[{config.name}] training: {plan_line(layout, train_cfg)}")
    engine = build_engine(model, train_cfg, plan.total_steps, plan.warmup_steps)
    step, next_micro_batch = load_checkpoint(engine, resume_from, plan) if resume_from is not None else (0, 0)
    batches = micro_batch_rows(lengths, plan, train_cfg, budget, seed=train_cfg.seed * 1009 + rank, start=next_micro_batch)
    engine.train()
    while step < plan.total_steps:
        if train_cfg.fail_at_step == step + 1 and resume_from is None and rank == 0:
            raise InjectedFailure(f"train.fail_at_step={train_cfg.fail_at_step}: failing on purpose")
        started, tally, lr = time.perf_counter(), _StepTally(), engine.get_lr()[0]  # this step's (the schedule moves on)
        torch.manual_seed(step_seed(train_cfg.seed, step, rank))  # dropout: a function of the step, as the data
        for _ in range(train_cfg.grad_accum):
            batch = micro_batch(rows, next(batches), budget, pad_id)
            batch = noised(batch, config, step, plan.total_steps, mask_id, noise_ids)
            inputs = model_inputs({k: v.to(device, non_blocking=True) for k, v in batch.items()}, config, model,
                                  packed=budget is not None)
            targets_at = target_positions(batch["labels"]).to(device, non_blocking=True)
            loss = engine(**inputs, positions=targets_at)
            engine.backward(loss)
            engine.step()
            tally.add(loss, batch["attention_mask"])
        step += 1
        loss_sum, micro_batches, tokens, positions = all_ranks_sum(
            [float(tally.loss), tally.micro_batches, tally.tokens, tally.positions], device
        )
        seconds = time.perf_counter() - started
        peak = all_ranks_reduce(torch.cuda.max_memory_allocated(device), dist.ReduceOp.MAX, device) \
            if device.type == "cuda" else 0
        metrics = StepMetrics(
            step=step,
            total_steps=plan.total_steps,
            epoch=step * train_cfg.grad_accum / plan.micro_batches_per_epoch,
            loss=loss_sum / micro_batches,
            lr=lr,
            tokens=int(tokens),
            tokens_per_s=tokens / seconds,
            pad_share=1.0 - tokens / positions,
            seconds=seconds,
            peak_memory_gib=peak / 2**30,
        )
        if step % train_cfg.checkpoint_every == 0 or step == plan.total_steps:
            with _checkpoint_folder(scratch_dir) as folder:
                save_checkpoint(engine, folder, step, plan, next_micro_batch=step * train_cfg.grad_accum)
                if step == plan.total_steps:
                    export_adapter(engine, folder / ADAPTER_DIR, specials)
                report(metrics, folder)
        else:
            report(metrics, None)
    return engine


@contextmanager
def _checkpoint_folder(scratch_dir: Path | None) -> Iterator[Path]:
    with TemporaryDirectory(prefix="clozemath-ckpt-", dir=scratch_dir) as folder:
        yield Path(folder)


@contextmanager
def full_trainable_parameters(engine: Any) -> Iterator[None]:
    """Under ZeRO-3, gather the trainable parameters (LoRA, special-token rows) on every rank for the duration."""
    if engine.zero_optimization_stage() != 3:
        yield
        return
    import deepspeed

    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None):
        yield


def export_adapter(engine: Any, folder: Path, specials: SpecialTokens) -> None:
    """Rank 0 writes the adapter (LoRA + special-token rows, safetensors) and the special-token map; under ZeRO-3
    every rank takes part in gathering the trainable parameters first."""
    with full_trainable_parameters(engine):
        if dist.get_rank() == 0:
            save_adapter(engine.module.model, folder, specials)
    if dist.get_world_size() > 1:
        dist.barrier()
