"""Typed run configuration.

A run is described by YAML. An experiment names its parts by reference (`model: smollm2-135m` loads
`configs/models/smollm2-135m.yaml`, `method: clozemath` loads `configs/methods/clozemath.yaml`) or inline;
dotted `key=value` overrides from the command line apply on top. A grid is a base experiment plus axes whose
values are such overrides. Every mistake becomes a one-line `ClozeMathError` naming the key and the file.
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from clozemath.errors import ClozeMathError
from clozemath.tasks import get_task

Dataset = Literal["gsm8k", "math"]
Decoding = Literal["greedy", "beam", "cot"]
AtLeastOne = Annotated[int, Field(ge=1)]
"""A size or a count of steps."""
AtLeastZero = Annotated[int, Field(ge=0)]
PositiveReal = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A rate or a length: finite, above 0."""
NonNegativeReal = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Strict):
    rank: AtLeastOne = 32
    alpha: AtLeastOne = 64
    dropout: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """The paper gives rank 32 only; alpha (2 x rank) and no dropout are LLaMA-Factory's defaults (and 0.0 is
    peft's). Dropout costs speed on a GPU: 7 masks a layer over the adapted projections' inputs, each kept for the
    backward (the 1B shape in rows of 8,192 tokens: a step ~7% longer, a third more memory)."""
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
    dataset: Dataset = "gsm8k"
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
    objectives: list[Literal["lm", "cloze", "random_span"]] = ["lm"]
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
    lr: PositiveReal = 5e-5
    warmup_ratio: Probability = 0.03
    weight_decay: NonNegativeReal = 0.0
    max_grad_norm: NonNegativeReal = 1.0
    """0: no clipping."""
    checkpoint_every: AtLeastOne = 50
    max_failures: AtLeastZero = 1
    seed: int = 0
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
    document masks. auto: when packing on a GPU under ZeRO-2 and the run trains enough tokens to pay back the
    compilation (`clozemath.train.loop.COMPILE_PAYS_OFF_TOKENS`); otherwise packed rows of at most
    `EAGER_PACK_TOKENS` through sdpa with dense masks, which starts at once."""
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
    per_template: AtLeastOne = 50
    """GSM-Symbolic instances drawn per template (100 templates x 50 = the paper's 5000)."""
    generate: bool = False
    """gsm_p2: instantiate the p2 templates (`per_template`, `seed`) instead of reading Apple's released instances."""
    decodings: list[Decoding] | None = None
    """This set's decodings, a subset of `eval.decodings` (default: all of them); e.g. CoT-decoding on GSM8K only."""

    @field_validator("dataset")
    @classmethod
    def _registered(cls, name: str) -> str:
        try:
            get_task(name)
        except ClozeMathError as exc:
            raise ValueError(str(exc)) from None
        return name


class EvalConfig(_Strict):
    sets: list[EvalSetConfig] = [EvalSetConfig(dataset="gsm8k")]
    decodings: list[Decoding] = ["greedy"]
    num_beams: AtLeastOne = 5
    cot_k: AtLeastOne = 9
    cot_vote: Literal["marked", "any"] = "marked"
    """CoT-decoding: which branches vote. marked: only those whose answer the format marks (`####` on GSM8K, the
    paper's rule: "answer tokens are numerical tokens after the annotation string ####"); any: also those answered by
    the last-number fallback (the rule of the replication's first, epochs-budget results)."""
    max_new_tokens: AtLeastOne = 512
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

    def decodings_of(self, set_cfg: EvalSetConfig) -> list[Decoding]:
        """The decodings one set is evaluated with, in `decodings`' order."""
        return [d for d in dict.fromkeys(self.decodings) if set_cfg.decodings is None or d in set_cfg.decodings]


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
    return name


def _folder_name(name: str) -> str:
    """A name written in a config (an experiment's, a grid's): one folder under `train.output_dir`."""
    if "/" in _run_name(name):
        raise ValueError(f"'{name}' holds a '/': a run's name is one folder under train.output_dir")
    return name


RunName = Annotated[str, AfterValidator(_run_name)]
FolderName = Annotated[str, AfterValidator(_folder_name)]


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
# YAML loading, references, overrides

_REFERENCE_FOLDERS = {"model": "models", "method": "methods", "data": "data"}


_REFERENCE_MODELS: dict[str, type[BaseModel]] = {"model": ModelConfig, "method": MethodConfig, "data": DataConfig}


def configs_root(near: Path | None = None) -> Path:
    """The `configs/` folder a reference resolves in: the one holding `near`, else `./configs`."""
    if near is not None:
        for parent in near.resolve().parents:
            if parent.name == "configs":
                return parent
    return Path.cwd() / "configs"


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read (1 MiB): the project's own are under 5 KiB, the paper's grid included."""
MAX_CONFIG_VALUES = 100_000
"""The most values (mappings, lists, scalars) a YAML document may hold once its aliases are expanded: a `&anchor`
used many times counts each time, so that a few lines of nested aliases ("billion laughs") cannot grow into
gigabytes when the config is validated, copied or logged. The paper's grid holds 256."""
MAX_CONFIG_DEPTH = 64
"""The deepest nesting of mappings and lists in a YAML document (the project's go 8 deep)."""


def _expanded_size(root: yaml.Node) -> tuple[int, int] | None:
    """How many values the document holds with every alias expanded, and how deep it nests; None when an alias holds
    itself. Walks the node graph once (each shared node sized once), without recursion."""
    sizes: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        children = [] if isinstance(node, yaml.ScalarNode) else (
            [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else node.value
        )
        if children_done:
            open_nodes.discard(id(node))
            counted = [sizes[id(child)] for child in children]
            size, depth = sum(size for size, _ in counted), max((depth for _, depth in counted), default=0)
            sizes[id(node)] = (1 + size, 1 + depth)
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            return None
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    return sizes[id(root)]


class NotYaml(ClozeMathError):
    """Text that does not parse as YAML."""


def parse_yaml(text: str, where: str) -> Any:
    """YAML `text` as plain data, within `MAX_CONFIG_VALUES` (aliases expanded) and `MAX_CONFIG_DEPTH`; a mistake
    or an excess is a one-line error naming `where`."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        expanded = _expanded_size(node)
        if expanded is None:
            raise ClozeMathError(f"{where}: an alias (*name) inside its own anchor (&name): the YAML never ends")
        size, depth = expanded
        if size > MAX_CONFIG_VALUES:
            raise ClozeMathError(
                f"{where}: the YAML holds more than {MAX_CONFIG_VALUES:,} values once its aliases (*name) are expanded"
            )
        if depth > MAX_CONFIG_DEPTH:
            raise ClozeMathError(f"{where}: the YAML nests deeper than {MAX_CONFIG_DEPTH} levels")
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise NotYaml(f"{where}{line}: not valid YAML ({getattr(exc, 'problem', None) or exc})") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise ClozeMathError(f"{where}: the YAML nests deeper than {MAX_CONFIG_DEPTH} levels") from None
    finally:
        loader.dispose()


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ClozeMathError(f"{path}: no such config file")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ClozeMathError(f"{path}: {size:,} bytes, more than a config may hold ({MAX_CONFIG_BYTES:,})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ClozeMathError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    raw = parse_yaml(text, str(path))
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClozeMathError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def _resolve_reference(kind: str, ref: str, root: Path, source: Path | str) -> dict[str, Any]:
    folder = root / _REFERENCE_FOLDERS[kind]
    candidate = Path(ref) if ref.endswith((".yaml", ".yml")) else folder / f"{ref}.yaml"
    if not candidate.is_absolute() and ref.endswith((".yaml", ".yml")):
        candidate = root / ref
    if not candidate.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise ClozeMathError(f"{source}: unknown {kind} '{ref}' (known: {', '.join(known) or 'none'})")
    raw = read_yaml(candidate)
    _validate(_REFERENCE_MODELS[kind], raw, candidate)  # a mistake inside it is reported against that file
    return raw


def load_method(name: str, root: Path) -> MethodConfig:
    """`configs/methods/<name>.yaml` under the configs folder `root`."""
    return MethodConfig.model_validate(_resolve_reference("method", name, root, f"{root / 'methods'}"))


def _resolve_references(raw: dict[str, Any], root: Path, source: Path | str) -> dict[str, Any]:
    out = dict(raw)
    for kind in _REFERENCE_FOLDERS:
        if isinstance(out.get(kind), str):
            out[kind] = _resolve_reference(kind, out[kind], root, source)
    return out


def parse_override(text: str) -> tuple[str, Any]:
    """`train.lr=1e-4` -> ("train.lr", 0.0001). Values are read as YAML scalars, numbers first."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ClozeMathError(f"override '{text}': expected key=value")
    for cast in (int, float):
        try:
            return key.strip(), cast(value)
        except ValueError:
            pass
    try:
        return key.strip(), parse_yaml(value, f"override '{key.strip()}'")
    except NotYaml:
        return key.strip(), value


def apply_override(raw: dict[str, Any], key: str, value: Any, root: Path, source: Path | str) -> None:
    """Set a dotted key, resolving a by-name reference on the way down (`model.lora.rank=8`)."""
    parts = key.split(".")
    node = raw
    for depth, part in enumerate(parts[:-1]):
        if depth == 0 and part in _REFERENCE_FOLDERS and isinstance(node.get(part), str):
            node[part] = _resolve_reference(part, node[part], root, source)
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ClozeMathError(f"{source}: override '{key}': '{part}' is not a mapping")
        node = child
    node[parts[-1]] = value


def _format_validation_error(exc: ValidationError, source: Path | str) -> str:
    errors = exc.errors()
    first = errors[0]
    key = ".".join(str(p) for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{key}'{more}"
    if first["type"] == "missing":
        return f"{source}: missing key '{key}'{more}"
    where = f"'{key}': " if key else ""
    return f"{source}: {where}{first['msg'].removeprefix('Value error, ')}{more}"


def _validate(cls: type[BaseModel], raw: dict[str, Any], source: Path | str) -> Any:
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise ClozeMathError(_format_validation_error(exc, source)) from None


def experiment_from_dict(
    raw: dict[str, Any], root: Path, source: Path | str, overrides: list[tuple[str, Any]] = ()
) -> ExperimentConfig:
    raw = copy.deepcopy(raw)  # overrides write into nested mappings: the caller's (a grid's base) stays untouched
    base_name = raw.pop("experiment", None)
    if base_name is not None:
        base = read_yaml(root / "experiments" / f"{base_name}.yaml")
        raw = _deep_merge(base, raw)
    for key, value in overrides:
        apply_override(raw, key, value, root, source)
    return _validate(ExperimentConfig, _resolve_references(raw, root, source), source)


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def is_grid(raw: dict[str, Any]) -> bool:
    return "axes" in raw or "base" in raw


_GRID_KEYS = ("name", "max_concurrent_trials")
"""Overrides of a grid that set the grid itself; `axes.<axis>=...` replaces (or, for bundles, picks) an axis's values;
`tracking.*` sets the grid's tracking (when it has its own) and the base's; any other key goes to the base."""


def _override_grid(grid: GridConfig, key: str, value: Any, root: Path, source: Path | str) -> None:
    if key in _GRID_KEYS:
        try:
            setattr(grid, key, value)
        except ValidationError as exc:
            raise ClozeMathError(_format_validation_error(exc, source)) from None
    elif key.startswith("axes."):
        grid.axes = {**grid.axes, **{key[len("axes."):]: _narrowed_axis(grid, key[len("axes."):], value, source)}}
    else:
        apply_override(grid.base, key, value, root, source)
        if key.startswith("tracking.") and grid.tracking is not None:
            raw = grid.tracking.model_dump()
            apply_override(raw, key[len("tracking."):], value, root, source)
            grid.tracking = _validate(TrackingConfig, raw, f"{source}: override '{key}'")


def _narrowed_axis(grid: GridConfig, axis: str, value: Any, source: Path | str) -> list[Any] | dict[str, Any]:
    """`axes.seed=[0]`: new values for a dotted-key axis; for a bundle axis, the labels to keep (or new bundles)."""
    values = value if isinstance(value, (list, dict)) else [value]
    current = grid.axes.get(axis)
    if current is None:
        raise ClozeMathError(f"{source}: override 'axes.{axis}': no such axis (axes: {', '.join(grid.axes) or 'none'})")
    if isinstance(current, dict) and isinstance(values, list):
        unknown = [label for label in values if label not in current]
        if unknown:
            raise ClozeMathError(
                f"{source}: override 'axes.{axis}': no bundle '{unknown[0]}' (bundles: {', '.join(current)})"
            )
        return {label: current[label] for label in values}
    return values


@dataclass(frozen=True)
class RunPlan:
    """A config file as `clozemath run` runs it, parsed and validated once: the experiment or grid it states, and
    every experiment of it (an experiment is a grid of one)."""

    config: ExperimentConfig | GridConfig
    experiments: list[ExperimentConfig]
    root: Path
    """The `configs/` folder its references resolve in."""

    @property
    def grid(self) -> GridConfig:
        return as_grid(self.config)


def load_plan(path: str | Path, overrides: list[str] = ()) -> RunPlan:
    """Load an experiment or a grid YAML with command-line overrides applied (see `_GRID_KEYS` for a grid's), and
    expand it into its experiments; a mistake anywhere is refused here, before anything starts."""
    path = Path(path)
    raw = read_yaml(path)
    root = configs_root(path)
    parsed = [parse_override(o) for o in overrides]
    if not is_grid(raw):
        experiment = experiment_from_dict(raw, root, path, parsed)
        try:
            _folder_name(experiment.name)
        except ValueError as exc:
            raise ClozeMathError(f"{path}: 'name': {exc}") from None
        return RunPlan(experiment, [experiment], root)
    grid = _validate(GridConfig, raw, path)
    check_conditions(grid, path)  # against the axes as written: `axes.*` overrides may narrow them
    grid.base = copy.deepcopy(grid.base)
    for key, value in parsed:
        _override_grid(grid, key, value, root, path)
    return RunPlan(grid, expand_grid(grid, root, path), root)


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig | GridConfig:
    """The experiment, or the grid, of a YAML file with overrides applied (validated as `load_plan` does)."""
    return load_plan(path, overrides).config


@dataclass(frozen=True)
class GridPoint:
    """One trial of a grid: the value (or bundle label) it takes on each axis, and the overrides those make."""

    labels: dict[str, Any]
    overrides: list[tuple[str, Any]]

    def label(self) -> str:
        """`model=tiny-llama,method=clozemath,seed=0`: each axis by the last part of its key (whole when ambiguous)."""
        short = [axis.split(".")[-1] for axis in self.labels]
        return ",".join(
            f"{name if short.count(name) == 1 else axis}={value}"
            for name, axis, value in zip(short, self.labels, self.labels.values())
        ) or "default"


def _axis_choices(axis: str, values: Any, source: Path | str) -> list[tuple[Any, list[tuple[str, Any]]]]:
    """(label, overrides) for every value of one axis."""
    if not isinstance(values, (list, dict)):
        raise ClozeMathError(f"{source}: axis '{axis}': expected a list of values or a mapping of labelled bundles")
    if not values:
        raise ClozeMathError(f"{source}: axis '{axis}' has no values")
    if isinstance(values, dict):
        for label, bundle in values.items():
            if not isinstance(bundle, dict):
                raise ClozeMathError(
                    f"{source}: axis '{axis}', bundle '{label}': expected a mapping of dotted keys, got {bundle!r}"
                )
        return [(label, list(bundle.items())) for label, bundle in values.items()]
    return [(value, [(axis, value)]) for value in values]


def _matches(labels: dict[str, Any], condition: dict[str, Any]) -> bool:
    return all(labels[axis] in (want if isinstance(want, list) else [want]) for axis, want in condition.items())


def _check_condition(
    grid: GridConfig, condition: dict[str, Any], where: str, source: Path | str, values: bool = True
) -> None:
    """Every axis a `when`/`exclude` entry names exists, and (`values`) every value it names is one of that axis's."""
    for axis, want in condition.items():
        if axis not in grid.axes:
            raise ClozeMathError(f"{source}: {where}: unknown axis '{axis}' (axes: {', '.join(grid.axes) or 'none'})")
        if not values:
            continue
        known = list(grid.axes[axis])
        for value in want if isinstance(want, list) else [want]:
            if value not in known:
                raise ClozeMathError(
                    f"{source}: {where}: axis '{axis}' has no value {value!r} (values: {', '.join(map(str, known))})"
                )


def check_conditions(grid: GridConfig, source: Path | str = "grid", values: bool = True) -> None:
    """`exclude` and `overrides[].when` name existing axes and (`values`) values those axes have."""
    for index, condition in enumerate(grid.exclude):
        _check_condition(grid, condition, f"exclude[{index}]", source, values)
    for index, rule in enumerate(grid.overrides):
        _check_condition(grid, rule.when, f"overrides[{index}].when", source, values)


MAX_GRID_POINTS = 10_000
"""The most points a grid's axes may make (before `exclude`): the paper's grid makes 68 (168 before its exclusions);
each point is an experiment validated up front, so that a product of long axes would otherwise run for hours."""


def grid_points(grid: GridConfig, source: Path | str = "grid") -> list[GridPoint]:
    """The product of the axes, less the excluded points, each with its conditional overrides."""
    check_conditions(grid, source, values=False)
    choices = [_axis_choices(axis, values, source) for axis, values in grid.axes.items()]
    product = math.prod(len(choice) for choice in choices)
    if product > MAX_GRID_POINTS:
        raise ClozeMathError(
            f"{source}: the axes make {product:,} points, more than a grid may hold ({MAX_GRID_POINTS:,})"
        )
    points = []
    for combination in itertools.product(*choices):
        labels = {axis: label for axis, (label, _) in zip(grid.axes, combination)}
        if any(_matches(labels, condition) for condition in grid.exclude):
            continue
        overrides = [item for _, items in combination for item in items]
        overrides += [item for rule in grid.overrides if _matches(labels, rule.when) for item in rule.set.items()]
        points.append(GridPoint(labels, overrides))
    if not points:
        raise ClozeMathError(f"{source}: `exclude` leaves no point of the grid")
    return points


def _check_method_lr(grid: GridConfig, point: GridPoint, root: Path, where: str, name: str) -> None:
    """`require_method_lr`: a point that trains sets `train.lr` itself (an axis or a rule), to a number."""
    given = [(key, value) for key, value in point.overrides if key != "train.lr"]
    method = experiment_from_dict(grid.base, root, where, [*given, ("name", name)]).method
    if method.trains and dict(point.overrides).get("train.lr") is None:
        null = " (its rule sets null)" if "train.lr" in dict(point.overrides) else ""
        raise ClozeMathError(
            f"{where}: method '{method.name}' has no learning rate of its own{null} (the grid sets "
            "require_method_lr): give it one in `overrides` (when: {method: ...}, set: {train.lr: ...})"
        )


def expand_grid(grid: GridConfig, root: Path | None = None, source: Path | str = "grid") -> list[ExperimentConfig]:
    """One validated experiment per point of the grid, named `<grid>/<point>`, all tracked alike."""
    root = root or configs_root()
    experiments = []
    for point in grid_points(grid, source):
        name = f"{grid.name}/{point.label()}" if point.labels else grid.name
        where = f"{source} (point {point.label()})"
        if grid.require_method_lr:
            _check_method_lr(grid, point, root, where, name)
        experiment = experiment_from_dict(grid.base, root, where, [*point.overrides, ("name", name)])
        if grid.tracking is not None:
            experiment.tracking = grid.tracking
        experiments.append(experiment)
    if len({experiment.tracking.model_dump_json() for experiment in experiments}) > 1:
        raise ClozeMathError(f"{source}: every point of a grid must share one `tracking` (an axis sets tracking.*)")
    return experiments


def as_grid(config: ExperimentConfig | GridConfig) -> GridConfig:
    """A single experiment is a grid of one."""
    if isinstance(config, GridConfig):
        return config
    return GridConfig(name=config.name, base=config.model_dump())


def to_wire(config: ExperimentConfig) -> dict[str, Any]:
    """The experiment as plain JSON data, for where it crosses into another process (a Tune trial, Ray Train's
    workers, the evaluation actors); `from_wire` reads it back."""
    return config.model_dump(mode="json")


def from_wire(data: dict[str, Any]) -> ExperimentConfig:
    return ExperimentConfig.model_validate(data)


def flatten(config: BaseModel | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> scalar values (lists become their string form), e.g. for MLflow params."""
    data = config.model_dump() if isinstance(config, BaseModel) else config
    flat: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    return flat


def dump_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
