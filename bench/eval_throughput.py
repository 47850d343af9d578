"""Evaluation throughput: `clozemath.eval.decode` against transformers' own batched `model.generate`.

Problems per second on the GSM8K test problems for greedy, beam search and CoT-decoding, with the same model, prompts,
batch size and settings on every side: ours (CUDA graphs over a static cache on a GPU), our eager side (by default
the same static-cache steps run without graphs; `--eager-engine eager`: the DynamicCache loop CPU runs), and
`generate`. The reference is what lm-evaluation-harness's HF backend runs: prompts
sorted longest first, batches of `--batch-size` left-padded, one `model.generate` call per batch (greedy, or
`num_beams`). CoT-decoding has no `generate` equivalent; its reference is one forward pass for the top-k first
tokens, then k `generate` calls per batch, one per forced first token (each with the per-step scores, from which the
branch margins are computed).

Agreement with generate: greedy, the share of problems whose generated tokens are identical (up to where ours
stopped); beam, the share with the same text; CoT, the share whose k branches all have identical tokens. Agreement
with our eager engine: the share with identical tokens (every branch's, for CoT). Bidirectional prompts have no
`generate` counterpart: the reference stays causal and agreement is not measured.

    python bench/eval_throughput.py --out bench/results/eval_throughput_<gpu>.md
    python bench/eval_throughput.py --model tiny-llama --limit 4 --max-new-tokens 8   # a CPU smoke run

Needs torch, transformers, peft, tokenizers and this repository only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel
from transformers import LogitsProcessor, LogitsProcessorList

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clozemath.config import ModelConfig, read_yaml  # noqa: E402
from clozemath.data.sources import DATA_DIR_ENV, Problem, load_problems  # noqa: E402
from clozemath.eval.decode import SDPA_BACKENDS, Generation, decode  # noqa: E402
from clozemath.eval.evaluate import Prompting, build_prompts, stop_strings  # noqa: E402
from clozemath.eval.prompts import DEFAULT_TEMPLATE  # noqa: E402
from clozemath.tasks import answer_span, get_task  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402

SCHEMES = ("greedy", "beam", "cot")


def model_config(spec: str) -> ModelConfig:
    """A name in configs/models, a model YAML, or a local model folder (config.json inside)."""
    folder = Path(spec)
    if (folder / "config.json").is_file():
        return ModelConfig(name=folder.name, path=str(folder))
    path = folder if spec.endswith((".yaml", ".yml")) else ROOT / "configs" / "models" / f"{spec}.yaml"
    return ModelConfig.model_validate(read_yaml(path))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], object]) -> tuple[object, float]:
    synchronize(device)
    started = time.perf_counter()
    result = run()
    synchronize(device)
    return result, time.perf_counter() - started


# --------------------------------------------------------------------------------------------------------------
# The reference: batched model.generate, as lm-evaluation-harness's HF backend calls it


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    batch_size: int
    num_beams: int
    cot_k: int
    stop: tuple[str, ...]
    eos_ids: tuple[int, ...]
    pad_id: int


def length_batches(prompts: Sequence[list[int]], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def left_padded(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def generate(model, tokenizer, ids: torch.Tensor, mask: torch.Tensor, settings: Settings, new_tokens: int, **kwargs):
    stops = {"stop_strings": list(settings.stop), "tokenizer": tokenizer} if settings.stop else {}
    return model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None,
        top_k=None, pad_token_id=settings.pad_id, eos_token_id=list(settings.eos_ids), use_cache=True, **stops,
        **kwargs,
    )


def until_eos(row: list[int], eos_ids: Sequence[int]) -> list[int]:
    ends = [i for i, token in enumerate(row) if token in eos_ids]
    return row[: ends[0]] if ends else row


def reference_greedy_or_beam(model, tokenizer, prompts, settings: Settings, num_beams: int) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]
    for indices in length_batches(prompts, settings.batch_size):
        ids, mask = left_padded([prompts[i] for i in indices], settings.pad_id, model.device)
        out = generate(model, tokenizer, ids, mask, settings, settings.max_new_tokens, num_beams=num_beams)
        for index, row in zip(indices, out[:, ids.shape[1] :].tolist()):
            results[index] = until_eos(row, settings.eos_ids)
    return results


class MarginRecorder(LogitsProcessor):
    """Each step's margin p(top-1) - p(top-2), the work CoT-decoding does per step to score a branch."""

    def __init__(self) -> None:
        self.margins: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        top2 = scores.float().softmax(dim=-1).topk(2, dim=-1).values
        self.margins.append(top2[:, 0] - top2[:, 1])
        return scores


def reference_cot(model, tokenizer, prompts, settings: Settings) -> list[list[list[int]]]:
    """Each prompt's k branches (first token included): a forward pass for the top-k first tokens, then one greedy
    `generate` per forced first token, recording the margins as it goes."""
    results: list[list[list[int]]] = [[] for _ in prompts]
    for indices in length_batches(prompts, settings.batch_size):
        ids, mask = left_padded([prompts[i] for i in indices], settings.pad_id, model.device)
        with torch.inference_mode():
            first = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
        firsts = first.topk(settings.cot_k, dim=-1).indices
        forced_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        for j in range(settings.cot_k):
            forced = torch.cat([ids, firsts[:, j : j + 1]], dim=1)
            out = generate(
                model, tokenizer, forced, forced_mask, settings, settings.max_new_tokens - 1,
                logits_processor=LogitsProcessorList([MarginRecorder()]),
            )
            for index, row in zip(indices, out[:, ids.shape[1] :].tolist()):
                results[index].append(until_eos(row, settings.eos_ids))
    return results


# --------------------------------------------------------------------------------------------------------------
# Agreement


def same_tokens(ours: Generation, theirs: list[int]) -> bool:
    """Identical up to where ours stopped (a stop string ends ours early; generate stops a batch only when all rows
    have), and ending there too when ours ended at end-of-sequence."""
    n = len(ours.token_ids)
    return ours.token_ids == theirs[:n] and (ours.finish_reason != "eos" or len(theirs) == n)


def beam_text(tokenizer, theirs: list[int], stop: Sequence[str]) -> str:
    text = tokenizer.decode(theirs, skip_special_tokens=True)
    cuts = [i for s in stop if (i := text.find(s)) >= 0]
    return text[: min(cuts)] if cuts else text


def agreement(scheme: str, ours: list[Generation], theirs: list, tokenizer, stop: Sequence[str]) -> float:
    if scheme == "greedy":
        same = [same_tokens(o, t) for o, t in zip(ours, theirs)]
    elif scheme == "beam":
        same = [o.text == beam_text(tokenizer, t, stop) for o, t in zip(ours, theirs)]
    else:
        same = [all(same_tokens(b, t) for b, t in zip(o.branches or [], branches)) for o, branches in zip(ours, theirs)]
    return sum(same) / len(same)


# --------------------------------------------------------------------------------------------------------------
# The run


def same_as_eager(ours: list[Generation], eager: list[Generation]) -> float:
    def tokens(generation: Generation) -> list[list[int]]:
        return [branch.token_ids for branch in generation.branches or [generation]]

    same = [tokens(o) == tokens(e) for o, e in zip(ours, eager)]
    return sum(same) / len(same)


def ours(
    model, tokenizer, prompts, scheme: str, settings: Settings, attention: str, engine: str = "auto"
) -> list[Generation]:
    return decode(
        model, tokenizer, prompts, scheme, max_new_tokens=settings.max_new_tokens, stop=settings.stop,
        eos_token_ids=list(settings.eos_ids), prompt_attention=attention, batch_size=settings.batch_size,
        num_beams=settings.num_beams, cot_k=settings.cot_k, answer_span=partial(answer_span, "gsm8k"),
        normalize_answer=get_task("gsm8k").answer_key, engine=engine,
    )


def reference(model, tokenizer, prompts, scheme: str, settings: Settings):
    if scheme == "cot":
        return reference_cot(model, tokenizer, prompts, settings)
    return reference_greedy_or_beam(model, tokenizer, prompts, settings, settings.num_beams if scheme == "beam" else 1)


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def problems_of(args: argparse.Namespace) -> list[Problem]:
    problems = load_problems("gsm8k", "test", args.data)
    return problems[: args.limit] if args.limit else problems


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b-random",
                        help="a name in configs/models, a model YAML or a local model folder (default: %(default)s)")
    parser.add_argument("--data", help=f"GSM8K test JSONL or folder (default: ${DATA_DIR_ENV}/gsm8k)")
    parser.add_argument("--limit", type=int, help="the first N test problems (default: all 1319)")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="prompts per batch, on every side (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--num-beams", type=int, default=5)
    parser.add_argument("--cot-k", type=int, default=9)
    parser.add_argument("--prompt-attention", choices=["causal", "bidirectional"], default="causal")
    parser.add_argument("--prompt", choices=["finetuned", "few-shot"], default="finetuned",
                        help="`P<SEP>` token ids (short), or the GSM8K 5-shot prompt with its stop strings")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--eager-engine", choices=["static", "eager"], default="static",
                        help="the side without CUDA graphs: static, the graph engine's own steps run eagerly (the same "
                        "kernels, so agreement measures what the graphs change); eager, the DynamicCache loop CPU runs "
                        "(sdpa attention, so bfloat16 rounding differs) (default: %(default)s)")
    parser.add_argument("--no-reference", action="store_true", help="time ours only")
    parser.add_argument("--reference-no-cudnn", action="store_true",
                        help="run generate under decode's sdpa backends too (no cuDNN attention), for a like-for-like"
                        " comparison; by default generate runs as lm-evaluation-harness runs it")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    unknown = set(args.schemes.split(",")) - set(SCHEMES)
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (the CoT reference forces the first token)")
    if unknown:
        parser.error(f"unknown scheme(s) {', '.join(sorted(unknown))} (known: {', '.join(SCHEMES)})")
    if args.data is None and not os.environ.get(DATA_DIR_ENV):
        os.environ[DATA_DIR_ENV] = str(ROOT.parent / "shared" / "data")
    return args


def header(args: argparse.Namespace, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, n: int) -> list[str]:
    note = " A random model never emits EOS: every row runs to max_new_tokens." if cfg.random_init else ""
    return [
        f"Evaluation throughput on {gpu_name(device)}: model `{cfg.name}` ({str(dtype).removeprefix('torch.')}, "
        f"{cfg.attn_implementation}), {n} GSM8K test problems, {args.prompt} prompts with {args.prompt_attention} "
        f"attention, batch {args.batch_size} prompts, max_new_tokens {args.max_new_tokens}, beams {args.num_beams}, "
        f"CoT k {args.cot_k}. Our eager side: the `{args.eager_engine}` engine.{note}",
        "",
        "| GPU | scheme | prompt attention | ours problems/s | our eager problems/s | generate problems/s | speedup "
        "| agreement with generate | agreement with our eager |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(args.model).model_copy(update={"dtype": args.dtype, "attn_implementation": args.attn})
    loaded = load_model(cfg, 0, device, training=False)
    model, tokenizer = loaded.model, loaded.tokenizer
    problems = problems_of(args)
    prompting = Prompting(args.prompt == "few-shot", args.prompt_attention, DEFAULT_TEMPLATE)
    prompts = [prompt.ids for prompt in build_prompts(problems, loaded, prompting)]
    settings = Settings(
        args.max_new_tokens, args.batch_size, args.num_beams, args.cot_k, stop_strings("gsm8k", prompting),
        (tokenizer.eos_token_id,), tokenizer.pad_token_id,  # load_model gives the model the tokenizer's EOS
    )
    lines = header(args, cfg, device, model.dtype, len(problems))
    print("\n".join(lines), flush=True)
    name = gpu_name(device)
    warmup = prompts[: min(len(prompts), 2)]
    for scheme in args.schemes.split(","):
        warm = replace(settings, max_new_tokens=2)
        ours(model, tokenizer, warmup, scheme, warm, args.prompt_attention)
        our_generations, our_seconds = timed(
            device, lambda: ours(model, tokenizer, prompts, scheme, settings, args.prompt_attention)
        )
        speed = len(prompts) / our_seconds
        eager, eager_seconds = timed(
            device, lambda: ours(model, tokenizer, prompts, scheme, settings, args.prompt_attention, args.eager_engine)
        )
        cells = [f"{speed:.2f}", f"{len(prompts) / eager_seconds:.2f}", "-", "-", "-"]
        if not args.no_reference:
            backends = sdpa_kernel(SDPA_BACKENDS) if args.reference_no_cudnn else nullcontext()
            with backends:
                reference(model, tokenizer, warmup, scheme, warm)
                theirs, their_seconds = timed(device, lambda: reference(model, tokenizer, prompts, scheme, settings))
            their_speed = len(prompts) / their_seconds
            cells[2:] = [
                f"{their_speed:.2f}{' (no cuDNN)' if args.reference_no_cudnn else ''}", f"{speed / their_speed:.2f}x",
                f"{100 * agreement(scheme, our_generations, theirs, tokenizer, settings.stop):.1f}%"
                if args.prompt_attention == "causal" else "n/a (generate is causal)",
            ]
        row = f"| {name} | {scheme} | {args.prompt_attention} | {' | '.join(cells)} | "
        row += f"{100 * same_as_eager(our_generations, eager):.1f}% |"
        lines.append(row)
        print(row, flush=True)
        if args.out:  # rewritten after every scheme: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
