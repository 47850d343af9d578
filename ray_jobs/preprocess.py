"""Ray Data preprocessing: problems -> samples (flat_map) -> balanced -> token ids (map_batches, actor pool), each
step one of `clozemath.data.prepare`'s (which `clozemath prepare` runs in its own process).

The token ids are written as Parquet under `<cache root>/<key>/`, where the key hashes everything they depend on
and nothing else: the problems themselves, what of the method and the seed reaches a sample (`sample_inputs`: IT,
MFT and it_prefixlm share one set at every seed), the data settings that shape a sample, the tokenizer's settings
and the source of the code that builds and encodes samples. The rows are in an order their contents alone decide,
so that a set prepared afresh is the same files whatever order Ray Data's tasks finished in. A second run with the
same key reads the Parquet files and skips the pipeline; one that comes while the first builds waits for it (a lock
file per key), so identical sets prepared at once are built once. The folder appears atomically (written beside, then
renamed), so a crash leaves no half cache.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import ray
import ray.data
from filelock import FileLock

from clozemath.config import ExperimentConfig, MethodConfig
from clozemath.data.objectives import TokenOffsets, lm_repeats, needs_offsets
from clozemath.data.prepare import (
    SENTINELS,
    SampleEncoder,
    balanced_copies,
    preprocessing_key,
    problem_samples,
    sample_code,
    source_hashes,
)
from clozemath.data.samples import Sample
from clozemath.data.sources import Problem, load_problems
from clozemath.data.tokenize import token_offsets
from clozemath.errors import ClozeMathError
from clozemath.files import remove_abandoned_staging, staging_folder
from ray_jobs.cluster import init_ray

ROWS_DIR = "rows"
ENCODED_DIR = "encoded"
"""Where Ray Data writes the token ids, before they are put in their canonical order into `ROWS_DIR`."""
ROWS_PER_FILE = 16_384
"""Rows of each Parquet file of the cache (Ray Data's streaming split deals the workers whole files, or parts)."""
TOKENIZER_DIR = "tokenizer"
META_FILE = "meta.json"
TOKEN_COLUMNS = ["input_ids", "labels", "prefix_len"]
PROBLEMS_PER_BLOCK = 1000
"""Few blocks for a small set: each block is a task, and on a small machine every extra worker process costs more
(importing torch and transformers) than its share of the work."""
ENCODE_BATCH = 256
MAX_ENCODERS = 4


@dataclass(frozen=True)
class TokenizedSet:
    """A run's tokenized training set and what the model needs to know about it."""

    folder: Path
    num_rows: int
    num_sentinels: int
    kinds: dict[str, int]
    """Rows per sample kind (after balancing and the length cut)."""
    dropped_for_length: int
    num_tokens: int
    """Tokens of all rows (padding aside): one epoch's training tokens."""
    from_cache: bool

    def dataset(self) -> ray.data.Dataset:
        """The token ids, in a fixed order (Parquet files are read in name order)."""
        return ray.data.read_parquet(str(self.folder / ROWS_DIR), columns=TOKEN_COLUMNS)

    def files(self) -> list[Path]:
        """The token ids' Parquet files, in name order (the order `dataset` reads them in)."""
        return sorted((self.folder / ROWS_DIR).glob("*.parquet"))

    def table(self) -> pa.Table:
        """The token ids in one table, in `dataset`'s order, read here (for a small set)."""
        return pa.concat_tables([pq.read_table(file, columns=TOKEN_COLUMNS) for file in self.files()])


def cache_key(config: ExperimentConfig, problems: list[Problem]) -> str:
    """`preprocessing_key` over the code that makes a sample and this module's, which runs its steps."""
    return preprocessing_key(config, problems, sample_code() | source_hashes([sys.modules[__name__]]))


# --------------------------------------------------------------------------------------------------------------
# The pipeline's steps (run on Ray workers)


@functools.cache
def _offsets_of_tokenizer(tokenizer_dir: str) -> TokenOffsets:
    """The tokenizer's character offsets, loaded once per worker process (random spans are drawn over tokens)."""
    from transformers import AutoTokenizer

    return token_offsets(AutoTokenizer.from_pretrained(tokenizer_dir))


def samples_of_problem(
    row: dict[str, Any], method: MethodConfig, prompt_template: str, seed: int, tokenizer_dir: str, max_length: int
) -> list[dict[str, Any]]:
    offsets = _offsets_of_tokenizer(tokenizer_dir) if needs_offsets(method) else None
    return problem_samples(row, method, prompt_template, seed, max_length, offsets)


class EncodeSamples:
    """`SampleEncoder` on a Ray Data batch; each actor loads the tokenizer once (from the copy the driver saved)."""

    def __init__(self, tokenizer_dir: str, eos_token: str | None, num_sentinels: int, max_length: int) -> None:
        from transformers import AutoTokenizer

        self.encoder = SampleEncoder(AutoTokenizer.from_pretrained(tokenizer_dir), eos_token, num_sentinels, max_length)

    def __call__(self, batch: dict[str, Any]) -> pa.Table:
        samples = [
            Sample(str(p), str(k), str(x), str(y))
            for p, k, x, y in zip(batch["problem_id"], batch["kind"], batch["prefix"], batch["target"])
        ]
        kept = [(s, e) for s, e in zip(samples, self.encoder.encode(samples)) if e is not None]
        return pa.table({
            "kind": pa.array([s.kind for s, _ in kept], pa.string()),
            "input_ids": pa.array([e["input_ids"] for _, e in kept], pa.list_(pa.int32())),
            "labels": pa.array([e["labels"] for _, e in kept], pa.list_(pa.int32())),
            "prefix_len": pa.array([e["prefix_len"] for _, e in kept], pa.int32()),
            "num_tokens": pa.array([len(e["input_ids"]) for _, e in kept], pa.int32()),
        })


# --------------------------------------------------------------------------------------------------------------
# The driver's side


def _kind_counts(kinds: Any) -> dict[str, int]:
    return {str(kind): int(n) for kind, n in kinds.value_counts().items()}


def _build(config: ExperimentConfig, problems: list[Problem], folder: Path) -> dict[str, Any]:
    """Run the pipeline into `folder`; returns the metadata it writes beside the rows."""
    from clozemath.model.tokenizer import load_tokenizer  # the driver's, not the pipeline's workers'

    tokenizer = load_tokenizer(config.model)  # before Ray starts: a wrong model path fails fast, in one line
    init_ray()
    tokenizer.save_pretrained(folder / TOKENIZER_DIR)  # the encoders load this copy (a GGUF one takes long to read)
    problems_ds = ray.data.from_items(
        [p.to_dict() for p in problems], override_num_blocks=math.ceil(len(problems) / PROBLEMS_PER_BLOCK)
    )
    unbalanced = problems_ds.flat_map(
        samples_of_problem,
        fn_kwargs={
            "method": config.method, "prompt_template": config.data.prompt_template, "seed": config.data.seed,
            "tokenizer_dir": str(folder / TOKENIZER_DIR), "max_length": config.data.max_length,
        },
    ).materialize()
    stats = unbalanced.select_columns(["kind", SENTINELS]).to_pandas()  # two small columns: one pass, no shuffle
    num_sentinels = int(stats[SENTINELS].max()) if len(stats) else 0
    repeats = lm_repeats(_kind_counts(stats["kind"]), config.method.lm_share)
    balanced = unbalanced.flat_map(
        balanced_copies, fn_kwargs={"repeats": repeats, "seed": config.data.seed}
    ).materialize()
    encoded = balanced.map_batches(
        EncodeSamples,
        fn_constructor_kwargs={
            "tokenizer_dir": str(folder / TOKENIZER_DIR),
            "eos_token": config.model.eos_token,
            "num_sentinels": num_sentinels,
            "max_length": config.data.max_length,
        },
        batch_size=ENCODE_BATCH,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=MAX_ENCODERS),
    )
    encoded.write_parquet(str(folder / ENCODED_DIR))
    rows = _write_in_canonical_order(folder / ENCODED_DIR, folder / ROWS_DIR)
    kinds = dict(sorted(Counter(rows.column("kind").to_pylist()).items()))
    return {
        "num_rows": rows.num_rows,
        "num_sentinels": num_sentinels,
        "kinds": kinds,
        "dropped_for_length": balanced.count() - rows.num_rows,
        "num_tokens": int(pa.compute.sum(rows.column("num_tokens")).as_py() or 0),
    }


def canonical_order(table: pa.Table) -> list[int]:
    """An order of the rows that their contents alone decide: by a hash of each row's token ids, labels and prefix
    length (identical rows, an LM sample's copies, are interchangeable)."""
    keys = []
    for ids, labels, prefix_len in zip(*(table.column(name).to_numpy(zero_copy_only=False) for name in TOKEN_COLUMNS)):
        digest = hashlib.blake2b(ids.tobytes(), digest_size=8)
        digest.update(labels.tobytes())
        digest.update(int(prefix_len).to_bytes(8, "little"))
        keys.append(digest.digest())
    return sorted(range(len(keys)), key=keys.__getitem__)


def _write_in_canonical_order(encoded: Path, rows: Path) -> pa.Table:
    """Rewrite the files Ray Data wrote into `rows/`, the rows in `canonical_order` and `ROWS_PER_FILE` to a file;
    returns them. Ray Data hands a step's outputs on in the order its tasks finish (with `preserve_order` too, two
    batches of one block were seen to swap), and the workers' data order is a permutation of the rows in the order
    the cache holds them (and their shares, under Ray Data's streaming split, follow its files): so a set prepared
    afresh, on any machine, is the same files."""
    table = pa.concat_tables([pq.read_table(file) for file in sorted(encoded.glob("*.parquet"))])
    table = table.take(canonical_order(table))
    rows.mkdir()
    for part, start in enumerate(range(0, max(table.num_rows, 1), ROWS_PER_FILE)):
        pq.write_table(table.slice(start, ROWS_PER_FILE), rows / f"part-{part:05d}.parquet")
    shutil.rmtree(encoded)
    return table


def _build_once(config: ExperimentConfig, problems: list[Problem], folder: Path) -> bool:
    """Build the set into `folder` unless an identical run has: one run at a time per key (the others wait, then find
    it built), different keys at once. Whether this run built it."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder.with_name(f".{folder.name}.lock"))):  # the kernel's lock: it ends with its process
        if (folder / META_FILE).is_file():
            return False
        remove_abandoned_staging(folder.parent)  # what runs killed midway left
        with staging_folder(folder) as staging:
            meta = _build(config, problems, staging)
            (staging / META_FILE).write_text(json.dumps(meta, indent=1))
            if not folder.exists():  # else a run on another machine finished first (a file system whose locks do
                os.replace(staging, folder)  # not reach across machines): keep its cache
    return True


def preprocess(config: ExperimentConfig, cache_root: Path) -> TokenizedSet:
    """The run's token ids, from the cache when an identical run made them before or while this one waited for it
    (Ray is started if needed)."""
    data = config.data
    problems = load_problems(data.dataset, data.split, data.path, data.limit)
    folder = cache_root / cache_key(config, problems)
    from_cache = (folder / META_FILE).exists() or not _build_once(config, problems, folder)
    return TokenizedSet(folder=folder, from_cache=from_cache, **_cached(folder))


_META_TYPES = {"num_rows": int, "num_sentinels": int, "kinds": dict, "dropped_for_length": int, "num_tokens": int}


def _cached(folder: Path) -> dict[str, Any]:
    """A cached set's metadata, checked against its rows (their files' footers: as many rows as it says); a damaged
    one (a crash or a stray write) is an error naming it and the way out."""
    def damaged(problem: str) -> ClozeMathError:
        return ClozeMathError(f"{folder}: a damaged preprocessing cache ({problem}): remove it and run again (the "
                              "set is prepared afresh)")

    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise damaged(f"{META_FILE} cannot be read: {getattr(exc, 'strerror', None) or 'not JSON'}") from None
    if not isinstance(meta, dict) or meta.keys() != _META_TYPES.keys() or not all(
            isinstance(meta[key], kind) for key, kind in _META_TYPES.items()):
        raise damaged(f"{META_FILE} is not what preprocessing writes")
    files = sorted((folder / ROWS_DIR).glob("*.parquet"))
    try:
        rows = sum(pq.read_metadata(file).num_rows for file in files)
    except (OSError, pa.ArrowException) as exc:
        raise damaged(f"its rows cannot be read: {str(exc).splitlines()[0][:200]}") from None
    if rows != meta["num_rows"]:
        raise damaged(f"{rows} rows in {ROWS_DIR}/, {meta['num_rows']} in {META_FILE}")
    return meta
