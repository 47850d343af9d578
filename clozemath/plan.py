"""Planning a run: a config file as `clozemath run` runs it.

An experiment names its parts by reference (`model: smollm2-135m` loads `configs/models/smollm2-135m.yaml`,
`method: clozemath` loads `configs/methods/clozemath.yaml`) or inline; dotted `key=value` overrides from the command
line apply on top. A grid is a base experiment plus axes whose values are such overrides, expanded here into its
experiments. The names an experiment gives are checked against the registries that know them (evaluation sets,
training sets, decodings, objectives; models and methods are the files under `configs/`). The schema itself is
`clozemath.config`'s; every mistake becomes a one-line `ClozeMathError` naming the key and the file.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from clozemath.config import (
    DataConfig,
    ExperimentConfig,
    GridConfig,
    GridRule,
    MethodConfig,
    ModelConfig,
    TrackingConfig,
    folder_name,
)
from clozemath.data.objectives import get_objective
from clozemath.data.training_sets import training_set
from clozemath.errors import ClozeMathError
from clozemath.eval.decoding import decoding_names
from clozemath.data.sources import data_identity, fingerprint, ids_identity, listed_problems
from clozemath.records import RunInputs, grid_folder
from clozemath.safe_yaml import NotYaml, parse_yaml, read_yaml
from clozemath.tasks import get_task
from clozemath.tracking import artifact_location, resolved_uri

# --------------------------------------------------------------------------------------------------------------
# YAML references and overrides

_REFERENCE_FOLDERS = {"model": "models", "method": "methods", "data": "data"}


_REFERENCE_MODELS: dict[str, type[BaseModel]] = {"model": ModelConfig, "method": MethodConfig, "data": DataConfig}


def configs_root(near: Path | None = None) -> Path:
    """The `configs/` folder a reference resolves in: the one holding `near`, else `./configs`."""
    if near is not None:
        for parent in near.resolve().parents:
            if parent.name == "configs":
                return parent
    return Path.cwd() / "configs"


def _resolve_reference(kind: str, ref: str, root: Path, source: Path | str) -> dict[str, Any]:
    folder = root / _REFERENCE_FOLDERS[kind]
    candidate = Path(ref) if ref.endswith((".yaml", ".yml")) else folder / f"{ref}.yaml"
    if not candidate.is_absolute() and ref.endswith((".yaml", ".yml")):
        candidate = root / ref
    if not candidate.is_file():
        known = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise ClozeMathError(f"{source}: unknown {kind} '{ref}' (known: {', '.join(known) or 'none'})")
    raw = read_yaml(candidate)
    config = _validate(_REFERENCE_MODELS[kind], raw, candidate)  # a mistake inside it is reported against that file
    if isinstance(config, MethodConfig):
        _check_method(config, candidate)
    elif isinstance(config, DataConfig):
        _check_data(config, candidate)
    return raw


def load_method(name: str, root: Path) -> MethodConfig:
    """`configs/methods/<name>.yaml` under the configs folder `root`."""
    return MethodConfig.model_validate(_resolve_reference("method", name, root, f"{root / 'methods'}"))


def budget_reference(config: ExperimentConfig, root: Path) -> ExperimentConfig:
    """The experiment with `train.budget_reference`'s method (from the configs folder `root`): the training set whose
    footprint sets a matched budget (`clozemath.train.budget.matched_epochs`)."""
    return config.model_copy(update={"method": load_method(config.train.budget_reference, root)}, deep=True)


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
    experiment = _validate(ExperimentConfig, _resolve_references(raw, root, source), source)
    check_names(experiment, source)
    return experiment


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


def _keep_over_axes_and_rules(grid: GridConfig, overrides: list[tuple[str, Any]], source: Path | str) -> None:
    """A command-line override of the base that an axis or a rule would undo (one that sets the key, or a mapping
    above it: `model.lora.rank=16` under a model axis) is applied after them, as the grid's last rule; one of a key
    an axis varies is refused (it would make the axis's trials alike): narrow the axis instead; so is a rate where
    the grid requires each method's own (`require_method_lr`). An override below one made a rule (`model=NAME` then
    `model.gguf_chunks.files=...`) is made a rule after it, so the command line's order holds."""
    def covers(key: str, other: str) -> bool:  # setting `key` sets `other` too
        return other == key or other.startswith(f"{key}.")

    axis_keys = {axis: {key for _, items in _axis_choices(axis, values, source) for key, _ in items}
                 for axis, values in grid.axes.items()}
    set_keys = {key for rule in grid.overrides for key in rule.set}.union(*axis_keys.values())
    moved: list[str] = []  # what became rules: a later override below one of them follows it there, in order
    for key, value in overrides:
        if grid.require_method_lr and key in ("train", "train.lr"):
            raise ClozeMathError(
                f"{source}: override '{key}': the grid gives each method its own rate (require_method_lr): change "
                "them in its `overrides`, or narrow a rate axis")
        for axis, keys in axis_keys.items():
            if any(covers(key, set_key) for set_key in keys):
                raise ClozeMathError(
                    f"{source}: override '{key}': the grid's axis '{axis}' sets it for each trial; narrow the axis "
                    f"instead (axes.{axis}=[...])")
        if any(covers(key, set_key) or covers(set_key, key) for set_key in set_keys) or \
                any(covers(earlier, key) for earlier in moved):
            grid.overrides = [*grid.overrides, GridRule(when={}, set={key: value})]
            moved.append(key)


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

    @property
    def folder(self) -> Path:
        """The run's folder: an experiment's, or the folder of a grid's trials' folders."""
        return grid_folder(self.experiments[0].train.output_dir, self.grid.name)


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
            folder_name(experiment.name)
        except ValueError as exc:
            raise ClozeMathError(f"{path}: 'name': {exc}") from None
        return RunPlan(experiment, [experiment], root)
    grid = _validate(GridConfig, raw, path)
    check_conditions(grid, path)  # against the axes as written: `axes.*` overrides may narrow them
    grid.base = copy.deepcopy(grid.base)
    for key, value in parsed:
        _override_grid(grid, key, value, root, path)
    _keep_over_axes_and_rules(grid, [(key, value) for key, value in parsed
                                     if key not in _GRID_KEYS and not key.startswith("axes.")], path)
    return RunPlan(grid, expand_grid(grid, root, path), root)


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig | GridConfig:
    """The experiment, or the grid, of a YAML file with overrides applied (validated as `load_plan` does)."""
    return load_plan(path, overrides).config


# --------------------------------------------------------------------------------------------------------------
# What a run's results depend on besides its settings: where its paths lead, the data it reads, the code that makes
# its samples


def with_absolute_paths(config: ExperimentConfig) -> ExperimentConfig:
    """Paths resolved against this process's folder: a trial runs in a folder of Tune's, maybe on another node, and
    `./runs` and its absolute path are one folder."""
    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser().resolve())

    resolved = config.model_copy(deep=True)
    resolved.train.output_dir = absolute(resolved.train.output_dir)
    if resolved.train.storage is not None and "://" not in resolved.train.storage:
        resolved.train.storage = absolute(resolved.train.storage)
    resolved.train.compile_cache = absolute(resolved.train.compile_cache)
    resolved.data.path = absolute(resolved.data.path)
    resolved.eval.adapter = absolute(resolved.eval.adapter)
    for set_cfg in resolved.eval.sets:
        set_cfg.path = absolute(set_cfg.path)
        set_cfg.ids = absolute(set_cfg.ids)
    if resolved.tracking.artifact_location is not None:  # else beside the store, whose URI is resolved here
        resolved.tracking.artifact_location = artifact_location(resolved.tracking)
    resolved.tracking.uri = resolved_uri(resolved.tracking.uri)
    return resolved


def data_inputs(experiments: list[ExperimentConfig], training: bool = True) -> dict[str, str]:
    """Every file the experiments read problems from (`training`: their training sets too), by what it is
    (`training set gsm8k/train`), as where it is and a hash of its bytes (or the hub dataset it comes from), and the
    local files of their models and tokenizers (`local_files_identity`); a missing file is an error."""
    def at(path: str | None) -> str:
        return "" if path is None else f" at {path}"

    from clozemath.model.tokenizer import local_files_identity  # transformers: only once a run is about to start

    found = {}
    for model in {experiment.model.model_dump_json(): experiment.model for experiment in experiments}.values():
        found.update(local_files_identity(model))  # each model's files read once, however many trials share it
    for data in (e.data for e in experiments if training and e.method.trains):
        found[f"training set {data.dataset}/{data.split}{at(data.path)}"] = data_identity(
            data.dataset, data.split, data.path
        )
    for experiment in experiments:
        for set_cfg in experiment.eval.sets:
            task = get_task(set_cfg.dataset)
            found[f"evaluation set {set_cfg.dataset}/{set_cfg.split}{at(set_cfg.path)}"] = task.identity(set_cfg)
            if set_cfg.ids is not None:
                what = f"{set_cfg.dataset}/{set_cfg.split}"
                key = f"evaluation ids {set_cfg.ids} of {what}{at(set_cfg.path)}"
                if key not in found:  # each file's ids checked against the set once, before anything runs
                    listed_problems(task.problems(set_cfg), set_cfg.ids, what)
                found[key] = ids_identity(set_cfg.ids)
    return found


def run_inputs(experiments: list[ExperimentConfig]) -> RunInputs:
    """What the experiments' results depend on besides their settings: the data they read (`data_inputs`) and,
    where one trains, the code that makes its samples (`clozemath.data.prepare.sample_code`)."""
    from clozemath.data.prepare import sample_code  # transformers and torch: only once a run is about to start

    trains = any(experiment.method.trains for experiment in experiments)
    return RunInputs(data=data_inputs(experiments), code=sample_code() if trains else {})


def evaluation_inputs(config: ExperimentConfig, adapter: Path | None) -> RunInputs:
    """What `clozemath eval`'s results depend on besides its settings: the evaluation sets' data and the adapter's
    files."""
    data = data_inputs([config], training=False)
    if adapter is not None:
        data["adapter"] = f"{adapter.resolve()} {fingerprint(sorted(p for p in adapter.rglob('*') if p.is_file()))}"
    return RunInputs(data=data, code={})


# --------------------------------------------------------------------------------------------------------------
# Grid expansion


def as_grid(config: ExperimentConfig | GridConfig) -> GridConfig:
    """A single experiment is a grid of one."""
    if isinstance(config, GridConfig):
        return config
    return GridConfig(name=config.name, base=config.model_dump())


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


def trial_name(grid: GridConfig, point: GridPoint) -> str:
    """`<grid>/<point>` (`smoke-grid/model=tiny-llama,method=clozemath,...`); a grid without axes: its name."""
    return f"{grid.name}/{point.label()}" if point.labels else grid.name


def trial_labels(grid: GridConfig) -> dict[str, dict[str, Any]]:
    """Each trial of the grid by name (as `expand_grid` names it): the value or bundle label it takes on each axis."""
    return {trial_name(grid, point): point.labels for point in grid_points(grid)}


def expand_grid(grid: GridConfig, root: Path | None = None, source: Path | str = "grid") -> list[ExperimentConfig]:
    """One validated experiment per point of the grid, named `<grid>/<point>`, all tracked alike."""
    root = root or configs_root()
    experiments = []
    for point in grid_points(grid, source):
        name = trial_name(grid, point)
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


# --------------------------------------------------------------------------------------------------------------
# Names checked against the registries


def _decoding(name: str) -> None:
    known = decoding_names()
    if name not in known:
        raise ClozeMathError(f"unknown decoding '{name}' (known: {', '.join(known)})")


def _known(lookup: Callable[[str], object], name: str, key: str, source: Path | str) -> None:
    """`lookup(name)` finds it, else an error naming the key and the file."""
    try:
        lookup(name)
    except ClozeMathError as exc:
        raise ClozeMathError(f"{source}: '{key}': {exc}") from None


def _check_method(method: MethodConfig, source: Path | str, prefix: str = "") -> None:
    for index, objective in enumerate(method.objectives):
        _known(get_objective, objective, f"{prefix}objectives.{index}", source)


def _check_data(data: DataConfig, source: Path | str, prefix: str = "") -> None:
    _known(training_set, data.dataset, f"{prefix}dataset", source)


def check_names(experiment: ExperimentConfig, source: Path | str) -> None:
    """Every name the experiment gives is known: its training set, objectives, evaluation sets and decodings."""
    _check_data(experiment.data, source, "data.")
    _check_method(experiment.method, source, "method.")
    for index, set_cfg in enumerate(experiment.eval.sets):
        _known(get_task, set_cfg.dataset, f"eval.sets.{index}.dataset", source)
        for position, decoding in enumerate(set_cfg.decodings or []):
            _known(_decoding, decoding, f"eval.sets.{index}.decodings.{position}", source)
    for position, decoding in enumerate(experiment.eval.decodings):
        _known(_decoding, decoding, f"eval.decodings.{position}", source)
