"""vLLM on the prompts `bench/eval_throughput.py` decodes: greedy, beam search and CoT-decoding, written as a user of
vLLM's offline `LLM` would write them, for issue 49's comparison on one card (not yet run: see
bench/results/decode_flex_h200_2026-12-02/README.md for why, and for the wheels it needs).

- greedy: `LLM.generate` with `SamplingParams(temperature=0)`, every prompt at once (vLLM batches continuously);
- beam: `LLM.beam_search` with `BeamSearchParams(beam_width=5)`;
- CoT-decoding (Wang & Zhou 2024) scripted with logprobs: one token of each prompt with its top-k logprobs (the k
  first tokens), then each branch greedily with `logprobs=2` (each step's p(top-1) - p(top-2), CoT-decoding's margin).

Causal prompts only (vLLM has no PrefixLM prompts). The model: a folder vLLM can read, or a random shape of
configs/models (`random_init`), written as a config and tokenizer and run with `load_format="dummy"` (random weights;
as on our side, rows then run to max_new_tokens). Each scheme is warmed on the first `--batch-size` prompts, then timed
over all of them.

    python bench/vllm_baseline.py --model llama-3.2-1b-random --schemes greedy,beam,cot --limit 512

Needs vllm (0.26.0 is the last release built on torch 2.11) besides this repository.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.eval_throughput import model_config  # noqa: E402
from clozemath.config import DataConfig  # noqa: E402
from clozemath.data.sources import load_problems  # noqa: E402
from clozemath.eval.evaluate import Prompting, build_prompts  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402

SCHEMES = ("greedy", "beam", "cot")


def prompt_ids(spec: str, data: str | None, limit: int, folder: Path) -> tuple[list[list[int]], str, bool]:
    """The fine-tuned prompts' token ids (as our bench builds them), the folder vLLM loads, and whether its weights
    are random (`load_format="dummy"`): a random shape is written there as its config and tokenizer."""
    cfg = model_config(spec)
    loaded = load_model(cfg, 0, "cpu", training=False)
    problems = load_problems("gsm8k", "test", data)
    problems = problems[:limit] if limit else problems
    prompting = Prompting(False, "causal", DataConfig().prompt_template)
    ids = [prompt.ids for prompt in build_prompts(problems, loaded, prompting)]
    if not cfg.random_init:
        return ids, str(cfg.path), False
    loaded.model.config.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return ids, str(folder), True


def greedy(llm: Any, prompts: list[Any], max_new_tokens: int) -> int:
    from vllm import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_new_tokens), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def beam(llm: Any, prompts: list[Any], max_new_tokens: int, beams: int) -> int:
    from vllm.sampling_params import BeamSearchParams

    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=beams, max_tokens=max_new_tokens))
    return sum(len(o.sequences[0].tokens) for o in outputs)


def cot(llm: Any, prompts: list[Any], max_new_tokens: int, k: int) -> int:
    """CoT-decoding's branches and their margins: the top-k first tokens, then each branch greedily, its steps'
    top-2 logprobs kept (the margins a user scores answers with)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    firsts = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=k), use_tqdm=False)
    branches = [
        TokensPrompt(prompt_token_ids=[*prompt["prompt_token_ids"], token])
        for prompt, first in zip(prompts, firsts)
        for token in sorted(first.outputs[0].logprobs[0], key=lambda t: -first.outputs[0].logprobs[0][t].logprob)[:k]
    ]
    outputs = llm.generate(branches, SamplingParams(temperature=0.0, max_tokens=max_new_tokens - 1, logprobs=2),
                           use_tqdm=False)
    margins = [[_margin(step) for step in o.outputs[0].logprobs] for o in outputs]  # what each branch is scored by
    return sum(1 + len(branch) for branch in margins)


def _margin(step: dict[int, Any]) -> float:
    """p(top-1) - p(top-2) from a step's top logprobs."""
    top = sorted((entry.logprob for entry in step.values()), reverse=True)[:2]
    return math.exp(top[0]) - (math.exp(top[1]) if len(top) > 1 else 0.0)


def timed(run: Callable[[], int]) -> tuple[int, float]:
    started = time.perf_counter()
    tokens = run()
    return tokens, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b-random", help="a name in configs/models or a model YAML")
    parser.add_argument("--data", help="GSM8K test JSONL or folder (default: $CLOZEMATH_DATA_DIR/gsm8k)")
    parser.add_argument("--limit", type=int, default=512, help="the first N test problems (0: all)")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-beams", type=int, default=5)
    parser.add_argument("--cot-k", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=64, help="prompts of the warm-up")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    args = parser.parse_args(argv)

    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as folder:
        ids, path, dummy = prompt_ids(args.model, args.data, args.limit, Path(folder))
        llm = LLM(model=path, dtype="bfloat16", load_format="dummy" if dummy else "auto", seed=0,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  max_model_len=max(map(len, ids)) + args.max_new_tokens)
        prompts = [TokensPrompt(prompt_token_ids=row) for row in ids]
        runs = {
            "greedy": lambda ps: greedy(llm, ps, args.max_new_tokens),
            "beam": lambda ps: beam(llm, ps, args.max_new_tokens, args.num_beams),
            "cot": lambda ps: cot(llm, ps, args.max_new_tokens, args.cot_k),
        }
        print("| scheme | side | problems/s | tokens/s | warm-up s |")
        print("| --- | --- | ---: | ---: | ---: |")
        for scheme in args.schemes.split(","):
            _, warm = timed(lambda: runs[scheme](prompts[: args.batch_size]))
            tokens, seconds = timed(lambda: runs[scheme](prompts))
            print(f"| {scheme} | vllm | {len(prompts) / seconds:.2f} | {tokens / seconds:,.0f} | {warm:.1f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
