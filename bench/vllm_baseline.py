"""vLLM on the prompts `bench/eval_throughput.py` decodes: greedy, beam search and CoT-decoding, written as a user of
vLLM's offline `LLM` would write them, for issue 49's comparison on one card (the wheels: bench/vllm_wheels.txt; the
lease: lease/vllm_lease.sh; why 0.26.0: bench/results/vllm_2026-12-02.md).

- greedy: `LLM.generate` with `SamplingParams(temperature=0)`, every prompt at once (vLLM batches continuously);
- beam: `LLM.beam_search` with `BeamSearchParams(beam_width=...)`, `--batch-size` prompts at a time
  (`concurrency_limit`);
- CoT-decoding (Wang & Zhou 2024) scripted with logprobs: one token of each prompt with its top-k logprobs (the k
  first tokens), then each branch greedily with `logprobs=2` (each step's p(top-1) - p(top-2), CoT-decoding's
  margin); each prompt's answer is its branch of the highest mean margin.

The batch: vLLM's `max_num_seqs` (the rows it decodes at once) is `--batch-size` times the most rows a prompt takes
among the schemes asked (greedy 1, beam `--num-beams`, CoT `--cot-k`), i.e. our batch of prompts in rows: run greedy
in a process of its own for a greedy batch of B rows. Rows stop at the tokenizer's end-of-sequence token (ours
too) and at `max_new_tokens`; the model folder's generation config is not applied (`generation_config="vllm"`),
so no other stop token. FlashInfer's top-k/top-p sampler is off (`VLLM_USE_FLASHINFER_SAMPLER=0`): every request
here is greedy (temperature 0), which never samples, and the sampler's kernels would be JIT-compiled at the engine's
start on a fresh machine (vLLM 0.26 ships no FlashInfer cubins); so is FlashInfer's autotuning at the start
(`enable_flashinfer_autotune=False`): a dense model on a Hopper card attends with FlashAttention 3 (vLLM's first
choice there) and runs none of FlashInfer's kernels.

Causal prompts only (vLLM has no PrefixLM prompts). The model: built by our loader (`clozemath.model.load`), then
written into a folder vLLM reads: a random shape of configs/models (`random_init`) as its config and tokenizer, run
with `load_format="dummy"` (random weights; rows then run to max_new_tokens, as on our side), any other model also
with its bfloat16 weights (a GGUF model dequantized as ours reads it). Each scheme is warmed on the first
`--batch-size` prompts, then timed over all of them.

    python bench/vllm_baseline.py --model llama-3.2-1b-random --schemes greedy --batch-size 64 --limit 512

Needs vllm 0.26.0 (built on torch 2.11 and CUDA 13, as the GPU machine's torch) besides this repository.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.eval_throughput import model_config  # noqa: E402
from clozemath.config import DataConfig  # noqa: E402
from clozemath.data.sources import load_problems  # noqa: E402
from clozemath.eval.evaluate import Prompting, build_prompts, stop_strings  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402
from clozemath.model.speed import PLAIN  # noqa: E402

SCHEMES = ("greedy", "beam", "cot")


@dataclass(frozen=True)
class Decoding:
    """What every request of a run shares: its length and where it stops."""

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]

    def params(self, max_tokens: int | None = None, logprobs: int | None = None) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens or self.max_new_tokens, logprobs=logprobs,
                              stop_token_ids=list(self.stop_token_ids), stop=list(self.stop) or None)


@dataclass(frozen=True)
class Prepared:
    ids: list[list[int]]
    """The prompts' token ids, as our bench builds them."""
    folder: str
    dummy: bool
    """Random weights (`load_format="dummy"`)."""
    decoding: Decoding


def rows_per_prompt(schemes: Sequence[str], num_beams: int, cot_k: int) -> int:
    return max({"greedy": 1, "beam": num_beams, "cot": cot_k}[scheme] for scheme in schemes)


def prepare(spec: str, data: str | None, limit: int, max_new_tokens: int, folder: Path) -> Prepared:
    """The fine-tuned causal prompts of the first `limit` GSM8K test problems, and the model written into `folder`.
    Built on the GPU when there is one (a random shape is built there in seconds, on the CPU in float32 first), and
    freed before vLLM starts (which then starts its engine by spawning, as it does once CUDA is initialised)."""
    import torch

    cfg = model_config(spec).model_copy(update={"dtype": "bfloat16"})
    loaded = load_model(cfg, 0, "cuda" if torch.cuda.is_available() else "cpu", training=False,
                        levers=PLAIN)  # written out for vLLM: transformers' modules, as vLLM reads them
    problems = load_problems("gsm8k", "test", data)
    problems = problems[:limit] if limit else problems
    prompting = Prompting(False, "causal", DataConfig().prompt_template)
    ids = [prompt.ids for prompt in build_prompts(problems, loaded, prompting)]
    loaded.model.config.architectures = [type(loaded.model).__name__]  # vLLM picks its model class by it; a model
    if cfg.random_init:  # built from a config has none until `save_pretrained` writes its weights
        loaded.model.config.save_pretrained(folder)
    else:
        loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    decoding = Decoding(max_new_tokens, (loaded.tokenizer.eos_token_id,), stop_strings("gsm8k", prompting))
    del loaded
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Prepared(ids, str(folder), bool(cfg.random_init), decoding)


def greedy(llm: Any, prompts: list[Any], decoding: Decoding) -> int:
    outputs = llm.generate(prompts, decoding.params(), use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def beam(llm: Any, prompts: list[Any], decoding: Decoding, beams: int, concurrency: int) -> int:
    """Tokens generated by each prompt's best hypothesis (vLLM's sequences hold the prompt's tokens too)."""
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=beams, max_tokens=decoding.max_new_tokens)
    outputs = llm.beam_search(prompts, params, concurrency_limit=concurrency)
    return sum(len(o.sequences[0].tokens) - len(p["prompt_token_ids"]) for o, p in zip(outputs, prompts))


@dataclass(frozen=True)
class Branch:
    first: int
    token_ids: list[int]
    """The tokens after the first."""
    margins: list[float]
    """Each of those tokens' p(top-1) - p(top-2)."""

    @property
    def score(self) -> float:
        return sum(self.margins) / len(self.margins) if self.margins else 0.0


def cot(llm: Any, prompts: list[Any], decoding: Decoding, k: int) -> tuple[int, list[Branch]]:
    """CoT-decoding: each prompt's top-k first tokens (best first), each continued greedily with the top-2 logprobs
    of every step kept; each prompt's answer is its branch of the highest mean margin (what a user keeps). The tokens
    generated over every branch, and the answers."""
    from vllm.inputs import TokensPrompt

    firsts = llm.generate(prompts, decoding.params(max_tokens=1, logprobs=k), use_tqdm=False)
    tops = [sorted(step, key=lambda token: -step[token].logprob)[:k]
            for step in (first.outputs[0].logprobs[0] for first in firsts)]
    branch_prompts = [TokensPrompt(prompt_token_ids=[*prompt["prompt_token_ids"], token])
                      for prompt, tokens in zip(prompts, tops) for token in tokens]
    outputs = iter(llm.generate(branch_prompts, decoding.params(max_tokens=decoding.max_new_tokens - 1, logprobs=2),
                                use_tqdm=False))
    branches = [[Branch(token, list(out.token_ids), [_margin(step) for step in out.logprobs])
                 for token in tokens for out in [next(outputs).outputs[0]]] for tokens in tops]
    tokens = sum(1 + len(branch.token_ids) for each in branches for branch in each)
    return tokens, [max(each, key=lambda branch: branch.score) for each in branches]


def _margin(step: dict[int, Any]) -> float:
    """p(top-1) - p(top-2) from a step's top logprobs (vLLM adds the chosen token's, which may be a third)."""
    top = sorted((entry.logprob for entry in step.values()), reverse=True)[:2]
    return math.exp(top[0]) - (math.exp(top[1]) if len(top) > 1 else 0.0)


def timed(run: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = run()
    return result, time.perf_counter() - started


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b-random",
                        help="a name in configs/models, a model YAML or a local model folder (default: %(default)s)")
    parser.add_argument("--data", help="GSM8K test JSONL or folder (default: $CLOZEMATH_DATA_DIR/gsm8k)")
    parser.add_argument("--limit", type=int, default=512, help="the first N test problems (0: all)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--num-beams", type=int, default=5)
    parser.add_argument("--cot-k", type=int, default=9)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="prompts at a time: max_num_seqs is this times the rows a prompt takes (default: 64)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    args.schemes = args.schemes.split(",")
    if set(args.schemes) - set(SCHEMES):
        parser.error(f"--schemes: any of {', '.join(SCHEMES)}, not {','.join(args.schemes)}")
    if args.batch_size < 1 or args.max_new_tokens < 2:
        parser.error("--batch-size must be at least 1 and --max-new-tokens at least 2 (CoT forces its first token)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    import torch
    import vllm
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as folder:
        prepared = prepare(args.model, args.data, args.limit, args.max_new_tokens, Path(folder))
        max_num_seqs = args.batch_size * rows_per_prompt(args.schemes, args.num_beams, args.cot_k)
        llm, start = timed(lambda: LLM(
            model=prepared.folder, dtype="bfloat16", load_format="dummy" if prepared.dummy else "auto", seed=0,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_model_len=max(map(len, prepared.ids)) + args.max_new_tokens, generation_config="vllm",
            enable_flashinfer_autotune=False))
        prompts = [TokensPrompt(prompt_token_ids=row) for row in prepared.ids]
        decoding = prepared.decoding
        runs: dict[str, Callable[[list[Any]], int]] = {
            "greedy": lambda ps: greedy(llm, ps, decoding),
            "beam": lambda ps: beam(llm, ps, decoding, args.num_beams, args.batch_size),
            "cot": lambda ps: cot(llm, ps, decoding, args.cot_k)[0],
        }
        lines = [f"vLLM {vllm.__version__} (torch {torch.__version__}) on {torch.cuda.get_device_name()}: model "
                 f"`{args.model}` (bfloat16{', dummy weights' if prepared.dummy else ''}), {len(prompts)} GSM8K test "
                 f"problems, fine-tuned causal prompts, batch {args.batch_size} prompts (max_num_seqs "
                 f"{max_num_seqs}), max_new_tokens {args.max_new_tokens}, beams {args.num_beams}, CoT k {args.cot_k}; "
                 f"the engine's start {start:.1f} s.", "",
                 "| scheme | side | settings | problems/s | tokens/s | warm-up s |",
                 "| --- | --- | --- | ---: | ---: | ---: |"]
        print("\n".join(lines), flush=True)
        for scheme in args.schemes:
            _, warm = timed(lambda: runs[scheme](prompts[: args.batch_size]))
            tokens, seconds = timed(lambda: runs[scheme](prompts))
            lines.append(f"| {scheme} | vllm | vLLM {vllm.__version__}, max_num_seqs {max_num_seqs} | "
                         f"{len(prompts) / seconds:.2f} | {tokens / seconds:,.0f} | {warm:.1f} |")
            print(lines[-1], flush=True)
            if args.out:  # rewritten after every scheme: a run cut short keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
