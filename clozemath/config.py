"""The typed run configuration (the schema of an experiment and of a grid) and its one wire format.

A config is read, its references resolved, its overrides applied, a grid expanded and its names checked against the
registries (evaluation sets, training sets, decodings, objectives) by `clozemath.plan`; this module knows no registry,
so that the schema loads without them. Names are plain strings here: `clozemath.plan.check_names` refuses an unknown
one before anything runs.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

AtLeastOne = Annotated[int, Field(ge=1)]
"""A size or a count of steps."""
AtLeastZero = Annotated[int, Field(ge=0)]
PositiveReal = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A rate or a length: finite, above 0."""
NonNegativeReal = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


def _zero_or_above_one(value: float) -> float:
    if value != 0 and value <= 1:
        raise ValueError(f"must be 0 (not watched) or above 1, not {value}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    rank: AtLeastOne = 32
    alpha: AtLeastOne = 64
    dropout: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """The paper gives rank 32 only; alpha (2 x rank) and no dropout are LLaMA-Factory's defaults (and 0.0 is
    peft's). Dropout costs speed on a GPU: 7 masks a layer over the adapted projections' inputs, each kept for the
    backward (what it costs: `bench/results/`)."""
    target_modules: str | list[str] = "all-linear"
    train_special_tokens: bool = True


class GgufChunksConfig(_Strict):
    """A GGUF file shipped in chunks (PyPI caps a file's size), joined in order into a cache folder once
    (`clozemath.model.chunks`). The chunks come from installed packages or from plain files: set one of the two."""

    packages: list[str] | None = None
    """Installed distributions holding one chunk each, in the file's order: `name` or `name==version` (the installed
    version must then be that one). Each chunk is checked against the size and hash its package's RECORD gives."""
    file: str | None = None
    """With `packages`: which of a package's files is its chunk, a glob matched against the end of its recorded paths
    (`data/part*.bin`); exactly one must match."""
    files: str | list[str] | None = None
    """Chunk files in order: a list of paths, or one glob whose matches, in natural order of their names (part2 before
    part10), are the order (`chunks/part*.bin`). Relative paths are taken from the folder the command runs in."""
    size: AtLeastOne | None = None
    """Bytes of the whole file: a missing, short or surplus chunk is caught before anything is written."""
    chunk_bytes: AtLeastOne | None = None
    """Bytes of every chunk but the last (at most this many): names the chunk that is short or too long where no
    package records its size (plain `files`)."""
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    """Hex SHA-256 of the whole file, checked as it is written."""
    cache_dir: str | None = None
    """Where the joined file is kept; default `$CLOZEMATH_CACHE_DIR`, else `$XDG_CACHE_HOME/clozemath` (or
    `~/.cache/clozemath`), under `gguf/`."""

    @model_validator(mode="after")
    def _one_source(self) -> GgufChunksConfig:
        if (self.packages is None) == (self.files is None):
            raise ValueError("set one of `packages` and `files` (the other null)")
        if self.packages == [] or self.files == [] or self.files == "":
            raise ValueError("no chunks: `packages` or `files` is empty")
        if self.packages is not None and self.file is None:
            raise ValueError("`packages` needs `file`, the glob that finds each package's chunk (`data/part*.bin`)")
        return self

    @field_validator("files", "cache_dir")
    @classmethod
    def _absolute(cls, value: str | list[str] | None) -> str | list[str] | None:
        """Relative paths against this process's folder: a Tune trial runs in a folder of its own."""
        if isinstance(value, list):
            return [os.path.abspath(os.path.expanduser(path)) for path in value]
        return None if value is None else os.path.abspath(os.path.expanduser(value))


class ModelConfig(_Strict):
    name: str
    path: str | None = None
    """Hub id, local directory, `package:<module>[/sub/dir]` (a folder inside an installed package), or None."""
    gguf_file: str | None = None
    """File name of a GGUF checkpoint inside `path` (transformers dequantizes it); with `gguf_chunks`, the name the
    joined file is given."""
    gguf_chunks: GgufChunksConfig | None = None
    """The GGUF file is joined from these chunks (in place of `path`)."""
    tokenizer: str | None = None
    """Where the tokenizer lives when not beside the weights (same forms as `path`)."""
    random_init: dict[str, Any] | None = None
    """`LlamaConfig` keyword arguments (and `seed`, default 0): a randomly initialised model, for tests and benchmarks."""
    eos_token: str | None = None
    """Override the tokenizer's end-of-sequence token (SmolLM2's GGUF names `<|im_start|>`; its turns end `<|im_end|>`)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """auto: bfloat16 on GPU, float32 on CPU."""
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "eager"] = "auto"
    """auto: flex_attention to train on a GPU (block-sparse masks for packed rows), sdpa otherwise."""
    lora: LoraConfig = LoraConfig()

    @model_validator(mode="after")
    def _has_weights(self) -> ModelConfig:
        if self.gguf_chunks is not None:
            if self.path is not None or self.random_init is not None:
                raise ValueError("`gguf_chunks` makes the weights: drop `path` and `random_init`")
            if self.gguf_file is None:
                raise ValueError("`gguf_chunks` needs `gguf_file`, the name of the joined file")
            return self
        if self.path is None and self.random_init is None:
            raise ValueError("set `path` (hub id, folder or package), `gguf_chunks` or `random_init`")
        if self.random_init is not None and self.tokenizer is None and self.path is None:
            raise ValueError("a `random_init` model needs a `tokenizer`")
        return self


class DataConfig(_Strict):
    dataset: str = "gsm8k"
    """A training set (`clozemath.data.training_sets`)."""
    split: str = "train"
    path: str | None = None
    """A JSONL file or a folder holding `<split>.jsonl`; default `$CLOZEMATH_DATA_DIR/<dataset>/`, then the hub."""
    limit: AtLeastOne | None = None
    seed: int | None = None
    """Seeds which group members are masked, where random spans fall, which LM samples get an extra copy.
    Default: `train.seed`, so that a run's seeds vary its masks as they vary its initialisation and order."""
    prompt_template: str = "Question: {question}\nAnswer:"
    max_length: AtLeastOne = 1024


class SpanShape(_Strict):
    coverage: float
    """Share of the solution's tokens that the spans of one sample cover."""
    mean_span_tokens: float
    """Mean length of a span, in tokens."""

    @model_validator(mode="after")
    def _in_range(self) -> SpanShape:
        if not 0.0 < self.coverage < 1.0:
            raise ValueError("`coverage` must lie strictly between 0 and 1")
        if self.mean_span_tokens < 1:
            raise ValueError("`mean_span_tokens` must be at least 1")
        return self


class RandomSpanConfig(_Strict):
    shapes: list[SpanShape] = [
        SpanShape(coverage=0.15, mean_span_tokens=3), SpanShape(coverage=0.5, mean_span_tokens=12)
    ]
    """The shapes a problem's random-span samples take in turn, from a random first one: the paper's short spans
    (15% of the tokens) and long spans (50%)."""

    @model_validator(mode="after")
    def _has_shapes(self) -> RandomSpanConfig:
        if not self.shapes:
            raise ValueError("`shapes` needs at least one span shape")
        return self


class MftConfig(_Strict):
    r_max: Probability = 0.4
    noise: Literal["random", "mask"] = "random"


class MethodConfig(_Strict):
    name: str
    trains: bool = True
    """False for `base`: the model is evaluated few-shot, untouched."""
    objectives: list[str] = ["lm"]
    """Training objectives, by name (`clozemath.data.objectives`; `clozemath.plan` checks them)."""
    attention: Literal["causal", "prefix_lm"] = "causal"
    lm_share: float = 0.5
    """Share of LM samples after balancing (LM samples are repeated to reach it)."""
    random_span: RandomSpanConfig | None = None
    mft: MftConfig | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MethodConfig:
        if ("random_span" in self.objectives) != (self.random_span is not None):
            raise ValueError("the `random_span` objective and the `random_span` settings go together")
        if not 0.0 < self.lm_share < 1.0:
            raise ValueError("`lm_share` must lie strictly between 0 and 1")
        return self


class TrainConfig(_Strict):
    num_workers: AtLeastOne = 1
    use_gpu: bool | Literal["auto"] = "auto"
    gpu_share: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    """The share of one GPU each training worker and each evaluation actor takes (Ray's fractional GPUs; PyTorch's
    memory is capped at it too): 0.25 runs four trials of a small model on one GPU at once, where one alone would
    leave it mostly idle. The memory-sized defaults (`pack_tokens`, `eval.batch_size` auto) size to the share."""
    zero_stage: Literal[2, 3, "auto"] = "auto"
    """DeepSpeed's ZeRO stage. 2: the frozen model whole on every card, gradients and optimizer state partitioned;
    3: the frozen weights partitioned too, each decoder layer gathered as it runs (a model too large for one card).
    auto: 2 where the frozen model, the optimizer state and a packed row fit one card, else 3 (with several workers);
    2 on CPU (`clozemath.train.zero`)."""
    micro_batch_size: AtLeastOne = 4
    grad_accum: AtLeastOne = 1
    group_by_length: bool = True
    """Batch rows of similar length together (in shuffled windows): less padding, same randomness of order."""
    epochs: PositiveReal = 1.0
    max_steps: AtLeastOne | None = None
    budget: Literal["epochs", "steps", "tokens"] = "epochs"
    """What is equal across the methods of a comparison: `epochs` (each method trains `epochs` over its own samples:
    infilling methods, with several samples per problem, take several times the steps of IT or MFT), or the optimizer
    `steps` or training `tokens` that `budget_reference` makes in `epochs` (the driver scales `epochs` to match)."""
    budget_reference: str = "clozemath"
    """The method (a name under configs/methods/) whose `epochs` set a matched budget."""
    budget_configured: Literal["steps", "tokens"] | None = None
    """Written by the driver, not by a config: where it turned a matched `budget` (`steps` or `tokens`) into `epochs`
    (and `budget` into `epochs`), the budget the config asked for, so that the run's params say what its `epochs`
    were matched to: `budget_reference`'s steps or tokens in `epochs_configured` epochs."""
    epochs_configured: PositiveReal | None = None
    """Written by the driver with `budget_configured`: the configured `epochs`, the reference's."""
    lr: PositiveReal = 5e-5
    warmup_ratio: Probability = 0.03
    """Warmup steps: `ceil(warmup_ratio * steps)`, the first at learning rate 0, as transformers' `Trainer` and its
    schedules count them (a run of 8 steps warms up over 1 of them)."""
    weight_decay: NonNegativeReal = 0.0
    max_grad_norm: NonNegativeReal = 1.0
    """0: no clipping."""
    divergence_factor: Annotated[float, Field(allow_inf_nan=False), AfterValidator(_zero_or_above_one)] = 3.0
    """The loop warns, and the report marks the run, when the smoothed training loss climbs to this many times the
    lowest it reached (`clozemath.train.divergence`), and tells a run that came back from one that did not. 0: not
    watched. On Qwen2.5-Coder-1.5B most runs that trained well stayed within 2.2x (MFT's, its masking growing; the
    others within 1.43x), one surged to 3.6x and came back, the one that collapsed went 7.1x and ended at 4.3x."""
    checkpoint_every: AtLeastOne = 50
    max_failures: AtLeastZero = 1
    seed: int = 0
    paired_seeds: bool = False
    """Seed s of this trial shares, by design, what pairing cancels with seed s of the other methods it is compared
    with (LoRA's initialisation and the data order: methods with the same samples, such as IT and W/o Text
    infilling). The report then pairs their seeds; by default methods' seeds are independent and compared unpaired."""
    rerun: AtLeastZero = 0
    """Which repetition of the same training run this is: it changes nothing in training, only the run's identity,
    so that a grid axis `train.rerun: [0, 1]` trains each seed twice and the report shows the run-to-run noise floor
    (same config, same seed) beside the differences between methods. The report's other tables use rerun 0."""
    deterministic: bool = False
    """The same adapter for the same config, data, software and card: torch's deterministic algorithms, cuBLAS's
    fixed workspace, cuDNN without benchmarking; on a GPU `compile: auto` compiles a packed run, and one uncompiled
    all the same attends with transformers' eager attention instead of sdpa
    (`clozemath.train.layout.uncompiled_attention`, which says what that costs in memory). Bitwise on a CPU. On a GPU
    a compiled run (FlexAttention) repeats bit for bit with or without the switch; an uncompiled one on sdpa does
    not, switch or not, and one on eager attention does (`bench/results/reproducibility_h100_2026-12-05/`). Either
    way the seed decides LoRA's initialisation, the data order, dropout and MFT's noise
    (`clozemath.train.determinism`)."""
    output_dir: str = "runs"
    storage: str | None = None
    """Where Ray Train keeps the checkpoints a restarted worker resumes from: on a cluster, a folder every node sees
    or a URI pyarrow opens (`s3://bucket/path`, `gs://...`). Default: `ray/` in the run's folder under `output_dir`."""
    fail_at_step: AtLeastOne | None = None
    """Test hook: rank 0 raises once when it reaches this step (exercises restart and resume)."""
    pack_tokens: AtLeastOne | Literal["auto"] | None = "auto"
    """Pack the samples into rows of this many tokens, one row a micro-batch (`micro_batch_size` then does not
    apply). auto: on a GPU, sized to its memory beside the model (`clozemath.train.packing`); on CPU, no packing.
    None: one sample a row, `micro_batch_size` rows padded to the longest."""
    compile: bool | Literal["auto"] = "auto"
    """Compile each decoder layer (torch.compile, fixed shapes), attention through FlexAttention's block-sparse
    document masks. auto: when packing on a GPU and the run trains enough tokens to pay back the
    compilation (`clozemath.train.layout.COMPILE_PAYS_OFF_TOKENS`; far fewer, `COMPILE_PAYS_OFF_WARM_TOKENS`, where
    `compile_cache` holds a compiled step of the same shape and `pack_tokens` is fixed); otherwise packed rows of at
    most `EAGER_PACK_TOKENS` through sdpa with dense masks, which starts at once."""
    compile_cache: str | None = None
    """Where the workers keep torch.compile's artifacts (Inductor's compiled graphs and kernels, Triton's binaries):
    the first trial of a grid compiles, every later one with the same model, row size and card loads what it made.
    On a cluster, a folder every node sees. Default: `compile_cache/` under `train.output_dir`."""
    fused_loss: bool | Literal["auto"] = "auto"
    """The output layer and cross-entropy fused and chunked (liger-kernel's Triton kernel: no float32 logits over the
    vocabulary in memory). auto: on a GPU when liger-kernel is installed (`pip install 'clozemath[gpu]'`)."""
    report_every: AtLeastOne = 10
    """Steps between the workers' reports to Ray Train (a checkpoint or an evaluation reports at once); every step's
    metrics still reach MLflow."""
    stream_above_mb: NonNegativeReal = 64.0
    """A training set whose token ids (their Parquet files) pass this size reaches the workers through Ray Data's
    streaming split; a smaller one goes to them as one object in Ray's object store, each worker taking its share,
    which spares every start of the workers Ray Data's read and split (a few processes; 10-15 s on a 2-core machine).
    0: always Ray Data."""

    @model_validator(mode="after")
    def _one_step_count(self) -> TrainConfig:
        if self.budget != "epochs" and self.max_steps is not None:
            raise ValueError(f"`max_steps` and `budget: {self.budget}` both set the steps: drop one")
        if (self.budget_configured is None) != (self.epochs_configured is None) or (
                self.budget_configured is not None and self.budget != "epochs"):
            raise ValueError("`budget_configured` and `epochs_configured` record a matched budget turned into `epochs` "
                             "(the driver writes them): set `budget` and `epochs` instead")
        return self


class EvalSetConfig(_Strict):
    dataset: str
    """An evaluation set of the registry (`clozemath.tasks`): gsm8k, math, gsm_symbolic, gsm_p1, gsm_p2, ..."""
    split: str = "test"
    path: str | None = None
    """gsm8k, math, released gsm_p2: a JSONL file or a folder holding `<split>.jsonl`; generated GSM-Symbolic sets: the
    templates folder (holding `symbolic/`, `p1/`, `p2/`). Default: under `$CLOZEMATH_DATA_DIR`."""
    limit: AtLeastOne | None = None
    """Evaluate a seeded random subset of this many problems (file order kept)."""
    seed: int = 0
    ids: str | None = None
    """A file of problem ids (as predictions name them: `math-test-17`), one a line (`#` starts a comment): evaluate
    those problems only, in the set's order (with `limit`, a seeded subset of them); e.g. MATH-500,
    `configs/ids/math500.txt`. Its content is part of the run's inputs; an id the set does not hold is an error."""
    per_template: AtLeastOne = 50
    """GSM-Symbolic instances drawn per template (100 templates x 50 = the paper's 5000)."""
    generate: bool = False
    """gsm_p2: instantiate the p2 templates (`per_template`, `seed`) instead of reading Apple's released instances."""
    decodings: list[str] | None = None
    """This set's decodings, a subset of `eval.decodings` (default: all of them); e.g. CoT-decoding on GSM8K only."""


TRAINED_MAX_NEW_TOKENS = 512
"""A fine-tuned model's evaluation: new tokens at most a generation, unless `eval.max_new_tokens` says otherwise."""
HARNESS_MAX_NEW_TOKENS = 256
"""lm-evaluation-harness's `max_gen_toks` for Hugging Face models: a few-shot (base) evaluation's default."""


class EvalConfig(_Strict):
    sets: list[EvalSetConfig] = [EvalSetConfig(dataset="gsm8k")]
    decodings: list[str] = ["greedy"]
    """Decodings by name (`clozemath.eval.decoding`'s registry)."""
    num_beams: AtLeastOne = 5
    cot_k: AtLeastOne = 9
    cot_vote: Literal["marked", "any"] = "marked"
    """CoT-decoding: which branches vote. marked: only those whose answer the format marks (`####` on GSM8K, the
    paper's rule: "answer tokens are numerical tokens after the annotation string ####"); any: also those answered by
    the last-number fallback (the rule of the replication's first, epochs-budget results)."""
    max_new_tokens: AtLeastOne | None = None
    """New tokens at most a generation. None: `TRAINED_MAX_NEW_TOKENS` for a fine-tuned model; a few-shot evaluation
    (a base model) takes lm-evaluation-harness's `max_gen_toks`, `HARNESS_MAX_NEW_TOKENS`, as the harness decodes it."""
    prompt_attention: Literal["auto", "bidirectional", "causal"] = "auto"
    """auto: bidirectional for prefix_lm-trained models, causal otherwise."""
    batch_size: AtLeastOne | Literal["auto"] = "auto"
    """Prompts per decoding batch; auto: as many as fit the GPU's free memory (16 on CPU)."""
    few_shot: bool | Literal["auto"] = "auto"
    """auto: few-shot prompts for `base`, the fine-tuned format for trained methods."""
    adapter: str | None = None
    """Evaluate this saved adapter folder instead of the one the run trains."""
    every_steps: AtLeastOne | None = None
    """Also evaluate at these training-step intervals, on `during_training_limit` problems of the first set."""
    every_share: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    """Or at these shares of the run's planned steps (0.1: at 10%, 20%, ..., 100%): runs of different lengths are
    evaluated at the same points of their budgets, and at a matched budget (`train.budget: steps`) at nearly the
    same steps, so that methods' curves (the paper's Figure 3) share their points."""
    during_training_limit: AtLeastOne = 100
    in_worker: Literal["auto", False] = "auto"
    """auto: a trial trained by one worker (ZeRO-2 or less) is evaluated in that worker as training ends, on the model
    it trained with its adapter merged as an evaluation actor merges it (the same tokens come out), without a new
    process or a second model load; false: always by Ray Data's evaluation actors (as the base model, a trial of
    several workers and `clozemath eval` always are)."""

    def new_tokens(self, few_shot: bool) -> int:
        """`max_new_tokens` as set, else the default of a few-shot (base) or a fine-tuned model's evaluation."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return HARNESS_MAX_NEW_TOKENS if few_shot else TRAINED_MAX_NEW_TOKENS

    @model_validator(mode="after")
    def _sets_apart(self) -> EvalConfig:
        """Each set once: its predictions file and metrics are named by its dataset (checked here, before training,
        rather than when the evaluation after it writes them)."""
        seen: dict[str, EvalSetConfig] = {}
        for set_cfg in self.sets:
            earlier = seen.setdefault(set_cfg.dataset, set_cfg)
            if earlier is set_cfg:
                continue
            if earlier == set_cfg:
                raise ValueError(f"the set '{set_cfg.dataset}' (split {set_cfg.split}) appears twice in eval.sets")
            raise ValueError(
                f"two sets of '{set_cfg.dataset}' in eval.sets (splits {earlier.split} and {set_cfg.split}): its "
                "predictions and metrics are named by the dataset, so evaluate one set of it per run"
            )
        return self

    @model_validator(mode="after")
    def _set_decodings_are_known(self) -> EvalConfig:
        if self.every_steps is not None and self.every_share is not None:
            raise ValueError("`every_steps` and `every_share` both say when to evaluate during training: drop one")
        for set_cfg in self.sets:
            unknown = [decoding for decoding in set_cfg.decodings or [] if decoding not in self.decodings]
            if unknown:
                raise ValueError(f"set '{set_cfg.dataset}' asks for decoding '{unknown[0]}', not in eval.decodings")
        return self

    def decodings_of(self, set_cfg: EvalSetConfig) -> list[str]:
        """The decodings one set is evaluated with, in `decodings`' order."""
        return [d for d in dict.fromkeys(self.decodings) if set_cfg.decodings is None or d in set_cfg.decodings]

    def first_evaluation(self) -> tuple[EvalSetConfig, str] | None:
        """The first set with its first decoding (None without sets): the accuracy shown first, and the evaluation
        run during training."""
        if not self.sets:
            return None
        first = self.sets[0]
        return first, self.decodings_of(first)[0]

    def during_training(self) -> tuple[EvalSetConfig, str] | None:
        """The evaluation during training: the first set cut to `during_training_limit` problems (its own limit where
        smaller), with its first decoding; None when neither `every_steps` nor `every_share` is set, or without sets."""
        first = self.first_evaluation()
        if (self.every_steps is None and self.every_share is None) or first is None:
            return None
        set_cfg, decoding = first
        limit = min(set_cfg.limit or self.during_training_limit, self.during_training_limit)
        return set_cfg.model_copy(update={"limit": limit}), decoding

    def during_training_steps(self, total_steps: int) -> list[int]:
        """The steps of a run of `total_steps` that evaluate during training, in order: every `every_steps` steps, or
        `every_share`, 2 x `every_share`, ... of the steps (each rounded to the nearest step, halves up; at least
        step 1); and the last; none without an evaluation during training. The one rule for the workers' evaluator
        (`clozemath.eval.during_training`) and the dry-run's estimate (`clozemath.cost.trials`)."""
        if not self.sets or total_steps < 1:
            return []
        if self.every_share is not None:
            count = math.floor(1 / self.every_share + 1e-9)
            steps = {max(1, math.floor(k * self.every_share * total_steps + 0.5)) for k in range(1, count + 1)}
        elif self.every_steps is not None:
            steps = set(range(self.every_steps, total_steps + 1, self.every_steps))
        else:
            return []
        return sorted(steps | {total_steps})


TRACKING_SCHEMES = ("sqlite", "file", "http", "https", "postgresql", "mysql", "mssql", "databricks")
"""The tracking stores MLflow knows (a database's may name its driver: `postgresql+psycopg2://`)."""


class TrackingConfig(_Strict):
    uri: str = "sqlite:///mlruns.db"
    """`sqlite:///<file>`, a tracking server `http(s)://host:port`, a database URI, or a local folder (MLflow 3 takes
    one only with MLFLOW_ALLOW_FILE_STORE=true)."""
    experiment: str = "clozemath"
    artifact_location: str | None = None
    """Default: `./mlartifacts` beside a local store."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, uri: str) -> str:
        scheme, separator, _ = uri.partition("://")
        if separator and scheme.split("+")[0] not in TRACKING_SCHEMES:
            raise ValueError(f"unknown scheme '{scheme}' in '{uri}' (known: {', '.join(TRACKING_SCHEMES)})")
        return uri


def _run_name(name: str) -> str:
    """A name that stays a folder under `train.output_dir`: no empty, `.` or `..` part, not absolute, no backslash
    or control character. A grid's trials are `<grid>/<point>`: the one place a name holds a `/`."""
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts) or any(c == "\\" or not c.isprintable() for c in name):
        raise ValueError(
            f"'{name}' would leave train.output_dir or name an odd folder: use letters, digits, '-', '_', '.', '='"
        )
    longest = max(len(part.encode()) for part in parts)
    if longest > MAX_NAME_BYTES:
        raise ValueError(f"'{name[:40]}...' is {longest} bytes long: a folder's name holds at most {MAX_NAME_BYTES}")
    if "'" in name and '"' in name:
        raise ValueError(f"'{name}' holds both quotes (' and \"): MLflow's search cannot find such a name")
    return name


MAX_NAME_BYTES = 200
"""A name's part is a folder's name: file systems hold 255 bytes, and folders beside it add a key or a prefix."""


def folder_name(name: str) -> str:
    """A name written in a config (an experiment's, a grid's): one folder under `train.output_dir`."""
    if "/" in _run_name(name):
        raise ValueError(f"'{name}' holds a '/': a run's name is one folder under train.output_dir")
    return name


RunName = Annotated[str, AfterValidator(_run_name)]
FolderName = Annotated[str, AfterValidator(folder_name)]


class ExperimentConfig(_Strict):
    name: RunName
    model: ModelConfig
    method: MethodConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    eval: EvalConfig = EvalConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _data_seed_follows_train_seed(self) -> ExperimentConfig:
        if self.data.seed is None:
            self.data = self.data.model_copy(update={"seed": self.train.seed})  # never the shared default's
        return self


class GridRule(_Strict):
    when: dict[str, Any]
    """Axis -> value (or list of values): the points this rule applies to."""
    set: dict[str, Any]
    """Dotted key -> value, applied after the point's own axis values."""


class GridConfig(_Strict):
    name: FolderName
    base: dict[str, Any]
    """An experiment (inline, or `experiment: <name>` to start from `configs/experiments/<name>.yaml`)."""
    axes: dict[str, Any] = {}
    """The grid is the product of its axes. An axis is either a dotted key -> its values (`train.seed: [0, 1]`), or a
    name -> labelled bundles of dotted keys set together (`dataset: {gsm8k: {data: gsm8k, eval.sets: [...]}}`)."""
    exclude: list[dict[str, Any]] = []
    """Points left out: each entry maps axes to a value (or a list of values); a point matching all of them goes."""
    overrides: list[GridRule] = []
    """Conditional overrides: `set` applies to the points matching `when` (e.g. MFT's noise per training set)."""
    max_concurrent_trials: AtLeastOne | None = None
    """Default: as many trials as the cluster's GPUs hold (one at a time on CPU)."""
    tracking: TrackingConfig | None = None
    """Default: the base experiment's."""
    require_method_lr: bool = False
    """Every point that trains must get `train.lr` from its own axes or `overrides`, never from the base or the
    default: a method added to the grid (`axes.method=[...]` on the command line) without a rate chosen for it is
    refused at expansion instead of training at whatever rate the base holds."""


# --------------------------------------------------------------------------------------------------------------
# The wire format


def to_wire(config: ExperimentConfig) -> dict[str, Any]:
    """The experiment as plain JSON data, for where it crosses into another process (a Tune trial, Ray Train's
    workers, the evaluation actors); `from_wire` reads it back."""
    return config.model_dump(mode="json")


def from_wire(data: dict[str, Any]) -> ExperimentConfig:
    return ExperimentConfig.model_validate(data)
