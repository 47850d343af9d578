"""Decoding throughput: `clozemath.eval.decoding` against transformers' `model.generate`, at its best, on the same
problems, prompts, batches and card.

Problems per second and generated tokens per second on the GSM8K test problems for greedy decoding, beam search and
CoT-decoding, on every side:

- `ours`: `decode` (CUDA graphs over a static cache on a GPU; the eager DynamicCache loop on CPU);
- `eager`: our eager side, for agreement (`--eager-engine static`: the graph engine's own steps run without graphs;
  `eager`: the DynamicCache loop);
- `generate`: `model.generate` with its default (dynamic) cache, batches of `--batch-size` prompts sorted longest
  first and left-padded (as lm-evaluation-harness's HF backend batches them);
- `generate-static`: `model.generate(cache_implementation="static")`, which transformers 5.x compiles itself on a GPU
  (`generation_config.compile_config`, default `CompileConfig`: inductor, mode "reduce-overhead", i.e. CUDA graphs),
  with `max_cache_len` set to the longest prompt + `max_new_tokens` so that every batch of the set shares one cache
  shape (transformers' advice against recompiling). Its first pass over the set (compiling every shape it meets) is
  timed and reported apart; the rate is its second pass's.

`generate` runs under the same sdpa backends as ours (`decoding.SDPA_BACKENDS`: not cuDNN's, which plans every new
shape), unless `--reference-cudnn`. Every side is first warmed on the set's first batch (`--warmup-tokens` new
tokens; ours at full length, so that the attention it compiles for the run's shapes is compiled before the timed
pass, and that warm-up's time is printed). Beam search is `generate(num_beams=...)`. CoT-decoding has no `generate` of
its own: one forward pass gives each prompt's top-k first tokens, then one `generate` over the k x B branch rows (each
prompt's k copies with their forced first token, left-padded), recording each step's margin p(top-1) - p(top-2) as
CoT-decoding scores with.

Each row also gives the bytes a decoding step must read (`bench/limits.py`: the weights once, plus the live rows'
key-value cache at their mean live context) and the share of the card's memory bandwidth that makes over the pass.
The bytes come from ours' generated lengths on our batches, which are generate's batches too (the same size and order).

Agreement with ours: greedy, the share of problems whose tokens are identical (up to where ours stopped); beam, the
share with the same text; CoT, the share whose k branches all have identical tokens. Bidirectional prompts have no
`generate` counterpart: its prompts stay causal and agreement is not measured.

    python bench/eval_throughput.py --schemes greedy --batch-size 64 --out bench/results/x.md --speed-json
    python bench/eval_throughput.py --model tiny-llama --limit 4 --max-new-tokens 8   # a CPU smoke run

`--profile DIR` adds one more pass of ours over the first batch under torch.profiler, per scheme (bench/profiling.py).
`--levers off,fused,liger,both` runs ours once per speed lever of a model loaded for inference (`clozemath.model.speed`:
fused q/k/v and gate/up products, liger-kernel's kernels), in this process, on copies of the loaded model (all held at
once: an auto batch is sized with them in memory); each lever's row gives its tokens' agreement with the first's.
Without it ours runs as `clozemath` decodes (`default`: liger's kernels on a GPU with liger-kernel, none on a CPU).

Needs torch, transformers, peft, tokenizers and this repository only.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel
from transformers import LogitsProcessor, LogitsProcessorList

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.limits import (  # noqa: E402
    BANDWIDTH_CONVENTION, MEMORY_BANDWIDTH, Traffic, decode_traffic, decode_weight_bytes, kv_bytes_per_position,
)
from bench.profiling import activities, profile_summary  # noqa: E402
from bench.speed_record import SPEED_JSON, Headline, Side, command_line, failure_note, record  # noqa: E402
from clozemath.config import DataConfig, ModelConfig  # noqa: E402
from clozemath.data.sources import DATA_DIR_ENV, Problem, load_problems  # noqa: E402
from clozemath.eval.decoding import (  # noqa: E402
    SDPA_BACKENDS, DecodeSettings, Generation, ModelShape, decode, get_decoding,
)
from clozemath.eval.decoding.batching import batch_size as choose_batch_size  # noqa: E402
from clozemath.eval.evaluate import Prompting, build_prompts, stop_strings  # noqa: E402
from clozemath.errors import ClozeMathError  # noqa: E402
from clozemath.files import write_text_atomic  # noqa: E402
from clozemath.model.load import load_model  # noqa: E402
from clozemath.model.speed import PLAIN, SpeedLevers, apply_levers, inference_levers  # noqa: E402
from clozemath.safe_yaml import read_yaml  # noqa: E402
from clozemath.tasks import answer_span, get_task  # noqa: E402
from clozemath.train.flops import card_value  # noqa: E402

SCHEMES = ("greedy", "beam", "cot")
"""The decodings this bench has a reference for (`generate`, greedy or beam; CoT over it): a subset of the registry's
(`decoding_names()`), not its list."""
SIDES = ("ours", "eager", "generate", "generate-static")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LEVERS = {
    "default": inference_levers(DEVICE),
    "off": PLAIN,
    "fused": SpeedLevers(fused_projections=True),
    "liger": SpeedLevers(liger_kernels=True),
    "both": SpeedLevers(fused_projections=True, liger_kernels=True),
}
"""`--levers`: the speed levers of a model loaded for inference (`clozemath.model.speed`) ours runs with; `default`:
what `clozemath` gives a model it loads for inference on this machine's device (liger's kernels on a GPU with
liger-kernel installed, none on a CPU)."""
DEFAULT_PROBLEMS = 512


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


def timed(device: torch.device, run: Callable[[], Any]) -> tuple[Any, float]:
    synchronize(device)
    started = time.perf_counter()
    result = run()
    synchronize(device)
    return result, time.perf_counter() - started


# --------------------------------------------------------------------------------------------------------------
# The reference: batched model.generate


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int
    batch_size: int
    num_beams: int
    cot_k: int
    stop: tuple[str, ...]
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab: int
    """Ids the tokenizer has (the model's rows past them only align its matrices)."""
    static_cache_len: int | None = None
    """`generate(cache_implementation="static", max_cache_len=...)`; None: the default dynamic cache."""


def length_batches(prompts: Sequence[list[int]], batch_size: int) -> list[list[int]]:
    """Prompt indices, longest first, cut into batches (ours batches the same way)."""
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def left_padded(prompts: Sequence[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def generate(model, tokenizer, ids: torch.Tensor, mask: torch.Tensor, settings: Settings, new_tokens: int, **kwargs):
    stops = {"stop_strings": list(settings.stop), "tokenizer": tokenizer} if settings.stop else {}
    if settings.static_cache_len is not None:
        kwargs.update(cache_implementation="static", max_cache_len=settings.static_cache_len)
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
    """Each prompt's k branches (first token included): a forward pass for each prompt's top-k first tokens (among
    the tokenizer's ids), then ONE greedy `generate` over the batch's k x B branch rows, recording the margins."""
    results: list[list[list[int]]] = [[] for _ in prompts]
    k = settings.cot_k
    for indices in length_batches(prompts, settings.batch_size):
        ids, mask = left_padded([prompts[i] for i in indices], settings.pad_id, model.device)
        with torch.inference_mode():
            first = model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
            first[:, settings.vocab :] = -float("inf")
            firsts = first.topk(k, dim=-1).indices.tolist()
        branches = [prompts[i] + [token] for i, tokens in zip(indices, firsts) for token in tokens]
        forced, forced_mask = left_padded(branches, settings.pad_id, model.device)
        out = generate(model, tokenizer, forced, forced_mask, settings, settings.max_new_tokens - 1,
                       logits_processor=LogitsProcessorList([MarginRecorder()]))
        continued = out[:, forced.shape[1] :].tolist()
        for row, (index, tokens) in enumerate(zip(indices, firsts)):
            for j, token in enumerate(tokens):
                results[index].append([token] + until_eos(continued[row * k + j], settings.eos_ids))
    return results


def reference(model, tokenizer, prompts, scheme: str, settings: Settings):
    if scheme == "cot":
        return reference_cot(model, tokenizer, prompts, settings)
    return reference_greedy_or_beam(model, tokenizer, prompts, settings, settings.num_beams if scheme == "beam" else 1)


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


def same_as_ours(ours: list[Generation], other: list[Generation]) -> float:
    """The share of prompts whose tokens (every branch's) are ours'."""
    def tokens(generation: Generation) -> list[list[int]]:
        return [branch.token_ids for branch in generation.branches or [generation]]

    same = [tokens(o) == tokens(e) for o, e in zip(ours, other)]
    return sum(same) / len(same)


# --------------------------------------------------------------------------------------------------------------
# What a pass must read


def generated_length(generation: Generation, max_new_tokens: int) -> int:
    """Tokens the row generated: its ids, and the end-of-sequence token it stopped at."""
    return min(len(generation.token_ids) + (generation.finish_reason == "eos"), max_new_tokens)


def traffic_of(scheme: str, generations: list[Generation], prompts: Sequence[list[int]], settings: Settings,
               weight_bytes: int, kv_position_bytes: int) -> Traffic:
    """The pass's bytes (`bench.limits.decode_traffic`) over `length_batches`: each prompt's rows (`Decoding.copies`)
    as long as what it generated: greedy's one; beam's, the chosen hypothesis' (the other beams' lengths are not
    returned); CoT's, each its branch's."""
    copies = get_decoding(scheme).copies(decode_settings(settings, "causal"), settings.vocab)
    batches = []
    for indices in length_batches(prompts, settings.batch_size):
        batch = []
        for i in indices:
            generation = generations[i]
            outputs = generation.branches if scheme == "cot" and generation.branches else [generation]
            lengths = [generated_length(o, settings.max_new_tokens) for o in outputs]
            batch.append((len(prompts[i]), [lengths[row % len(lengths)] for row in range(copies)]))
        batches.append(batch)
    return decode_traffic(batches, weight_bytes, kv_position_bytes)


def generated_tokens(scheme: str, generations: list[Generation], max_new_tokens: int) -> int:
    outputs = [b for g in generations for b in (g.branches or [g])] if scheme == "cot" else generations
    return sum(generated_length(o, max_new_tokens) for o in outputs)


# --------------------------------------------------------------------------------------------------------------
# The run


def decode_settings(settings: Settings, attention: str, engine: str = "auto") -> DecodeSettings:
    """Our decoder's settings for the bench's."""
    return DecodeSettings(
        max_new_tokens=settings.max_new_tokens, stop=settings.stop, eos_token_ids=list(settings.eos_ids),
        prompt_attention=attention, batch_size=settings.batch_size, num_beams=settings.num_beams, cot_k=settings.cot_k,
        answer_span=partial(answer_span, "gsm8k"), normalize_answer=get_task("gsm8k").answer_key, engine=engine,
    )


def ours(model, tokenizer, prompts, scheme: str, settings: Settings, attention: str, engine: str = "auto"):
    return decode(model, tokenizer, prompts, scheme, decode_settings(settings, attention, engine))


def gpu_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"


def problems_of(args: argparse.Namespace) -> list[Problem]:
    problems = load_problems("gsm8k", "test", args.data)
    return problems[: args.limit] if args.limit else problems


def batch_rows(batch_size: str, model, prompts: Sequence[list[int]], max_new_tokens: int, copies: int,
               shared: bool) -> int:
    """Prompts a batch: the number given, or what `decode(batch_size="auto")` would pick now (`copies` rows a prompt,
    `shared` or not: `Decoding.shares_prompt`), handed to every side alike."""
    return choose_batch_size("auto" if batch_size == "auto" else int(batch_size), model, list(prompts),
                             max_new_tokens, copies, shared)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b-random",
                        help="a name in configs/models, a model YAML or a local model folder (default: %(default)s)")
    parser.add_argument("--path", help="override the model config's path (e.g. a folder holding the SmolLM2 GGUF)")
    parser.add_argument("--data", help=f"GSM8K test JSONL or folder (default: ${DATA_DIR_ENV}/gsm8k)")
    parser.add_argument("--limit", type=int, default=DEFAULT_PROBLEMS,
                        help="the first N test problems (default: %(default)s; 0: all 1,319)")
    parser.add_argument("--batch-size", default="64",
                        help="prompts a batch on every side: a number, or auto (ours' memory-sized choice) "
                        "(default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="(default: %(default)s)")
    parser.add_argument("--schemes", default=",".join(SCHEMES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--sides", default=",".join(SIDES),
                        help="comma-separated, ours always among them (default: %(default)s)")
    parser.add_argument("--levers", default="default",
                        help=f"comma-separated, of {', '.join(LEVERS)}: ours once with each (the first: the reference "
                        "of the other rows and of every other side), each lever's model a copy of the loaded one with "
                        "its levers applied, all in memory at once (default: %(default)s)")
    parser.add_argument("--num-beams", type=int, default=5)
    parser.add_argument("--cot-k", type=int, default=9)
    parser.add_argument("--prompt-attention", choices=["causal", "bidirectional"], default="causal")
    parser.add_argument("--prompt", choices=["finetuned", "few-shot"], default="finetuned",
                        help="`P<SEP>` token ids (short), or the GSM8K 5-shot prompt with its stop strings")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--eager-engine", choices=["static", "eager"], default="static",
                        help="our side without CUDA graphs: static, the graph engine's own steps run eagerly (the same "
                        "kernels, so agreement measures what the graphs change); eager, the DynamicCache loop CPU runs "
                        "(default: %(default)s)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="new tokens of every side's warm-up on the first batch (default: %(default)s)")
    parser.add_argument("--reference-cudnn", action="store_true",
                        help="let generate use cuDNN's attention too (as lm-evaluation-harness runs it); by default it "
                        "runs under ours' sdpa backends")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--profile", type=Path,
                        help="write, per scheme, a profile of one more pass of ours over the first batch (the GPU's "
                        "busy share, the costliest kernels, the host's side) and its trace into this folder")
    parser.add_argument("--speed-json", nargs="?", const=str(SPEED_JSON), type=Path,
                        help=f"record the headline ratios in this file (default when given: {SPEED_JSON})")
    args = parser.parse_args(argv)
    schemes, sides = args.schemes.split(","), args.sides.split(",")
    if args.max_new_tokens < 2:
        parser.error("--max-new-tokens must be at least 2 (the CoT reference forces the first token)")
    if set(schemes) - set(SCHEMES):
        unknown = ", ".join(sorted(set(schemes) - set(SCHEMES)))
        parser.error(f"unknown scheme(s) {unknown} (known: {', '.join(SCHEMES)})")
    if set(sides) - set(SIDES) or "ours" not in sides:
        parser.error(f"--sides: ours and any of {', '.join(SIDES[1:])}")
    levers = args.levers.split(",")
    if set(levers) - set(LEVERS) or len(set(levers)) != len(levers):
        parser.error(f"--levers: distinct names among {', '.join(LEVERS)}, not '{args.levers}'")
    if args.batch_size != "auto" and not (args.batch_size.isdigit() and int(args.batch_size) > 0):
        parser.error(f"--batch-size: a positive number or auto, not '{args.batch_size}'")
    args.schemes, args.sides, args.levers = schemes, sides, levers
    if args.data is None and not os.environ.get(DATA_DIR_ENV):
        os.environ[DATA_DIR_ENV] = str(ROOT.parent / "shared" / "data")
    return args


def header(args: argparse.Namespace, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, n: int,
           weight_bytes: int) -> list[str]:
    note = " A random model never emits EOS: every row runs to max_new_tokens." if cfg.random_init else ""
    cudnn = "with cuDNN's attention allowed" if args.reference_cudnn else "under ours' sdpa backends (no cuDNN)"
    return [
        f"Decoding throughput on {gpu_name(device)}: model `{cfg.name}` ({str(dtype).removeprefix('torch.')}, "
        f"{cfg.attn_implementation}, {weight_bytes / 1e9:.2f} GB of weights a step), {n} GSM8K test problems, "
        f"{args.prompt} prompts with {args.prompt_attention} attention, batch {args.batch_size} prompts, "
        f"max_new_tokens {args.max_new_tokens}, beams {args.num_beams}, CoT k {args.cot_k}. generate runs {cudnn}; "
        f"every side warmed on the first batch first. Our eager side: the `{args.eager_engine}` engine. Ours' levers "
        f"(`clozemath.model.speed`): {', '.join(args.levers)}; every other side runs the first's model.{note}",
        "",
        f"{BANDWIDTH_CONVENTION}.",
        "",
        "| scheme | side | settings | problems/s | tokens/s | first pass s | GB/step (live rows x context) "
        "| bandwidth | ours vs this | agreement with ours |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]


@dataclass
class Measured:
    side: str
    settings: str
    seconds: float
    first_pass_seconds: float | None = None
    agreement: str = "-"
    failed: str | None = None


def lever_settings(lever: str, args: argparse.Namespace, rows: int) -> str:
    levers = LEVERS[lever]
    return side_settings("ours", args, rows) + ("" if levers == PLAIN else f", {levers.describe()}")


def side_settings(side: str, args: argparse.Namespace, rows: int) -> str:
    return {
        "ours": f"clozemath decode, batch {rows}",
        "eager": f"clozemath decode, engine {args.eager_engine}, batch {rows}",
        "generate": f"HF generate, dynamic cache, batch {rows}",
        "generate-static": f"HF generate, static cache (compiled by transformers), batch {rows}",
    }[side]


def run_scheme(scheme: str, args: argparse.Namespace, models: dict[str, Any], tokenizer, prompts, base: Settings
               ) -> tuple[list[Measured], Settings, list[Generation]]:
    """Every side on `scheme`; ours once a lever (`models`: each lever's model, the first the reference of every
    ratio and agreement, and the model of every other side), each warmed on the first batch before its timed pass."""
    model = next(iter(models.values()))
    device = model.device
    decoding = get_decoding(scheme)
    copies = decoding.copies(decode_settings(base, args.prompt_attention), base.vocab)
    rows = batch_rows(args.batch_size, model, prompts, base.max_new_tokens, copies, decoding.shares_prompt)
    settings = replace(base, batch_size=rows)
    first_batch = [prompts[i] for i in length_batches(prompts, rows)[0]]
    warm = replace(settings, max_new_tokens=max(2, min(args.warmup_tokens, settings.max_new_tokens)))
    attention = args.prompt_attention

    def warmed_and_timed(lever: str, lever_model) -> tuple[list[Generation], float]:
        _, warm_seconds = timed(device, lambda: ours(lever_model, tokenizer, first_batch, scheme, settings, attention))
        print(f"{scheme}: ours' ({lever}) warm-up over the first batch (full length: its compiles, at the run's "
              f"shapes): {warm_seconds:.1f} s", flush=True)
        return timed(device, lambda: ours(lever_model, tokenizer, prompts, scheme, settings, attention))

    levers = list(models)
    our_generations, our_seconds = warmed_and_timed(levers[0], model)
    measured = [Measured("ours", lever_settings(levers[0], args, rows), our_seconds)]
    if args.profile:
        profile_pass(args.profile, scheme, device, lambda: ours(model, tokenizer, first_batch, scheme, settings,
                                                                attention))
    for lever in levers[1:]:
        generations, seconds = warmed_and_timed(lever, models[lever])
        measured.append(Measured(f"ours {lever}", lever_settings(lever, args, rows), seconds,
                                 agreement=f"{100 * same_as_ours(our_generations, generations):.1f}%"))
    if "eager" in args.sides:
        ours(model, tokenizer, first_batch, scheme, warm, attention, args.eager_engine)
        eager, seconds = timed(
            device, lambda: ours(model, tokenizer, prompts, scheme, settings, attention, args.eager_engine))
        measured.append(Measured("eager", side_settings("eager", args, rows), seconds,
                                 agreement=f"{100 * same_as_ours(our_generations, eager):.1f}%"))

    def backends() -> Any:
        return nullcontext() if args.reference_cudnn else sdpa_kernel(SDPA_BACKENDS)

    for side in ("generate", "generate-static"):
        if side not in args.sides:
            continue
        static_len = max(map(len, prompts)) + 1 + settings.max_new_tokens if side == "generate-static" else None
        theirs_settings = replace(settings, static_cache_len=static_len)
        try:
            with backends():
                if static_len is None:
                    reference(model, tokenizer, first_batch, scheme, warm)
                    first_pass = None
                else:  # the first pass over the whole set compiles every shape it meets
                    _, first_pass = timed(device, lambda: reference(model, tokenizer, prompts, scheme, theirs_settings))
                theirs, seconds = timed(device, lambda: reference(model, tokenizer, prompts, scheme, theirs_settings))
        except Exception as exc:  # noqa: BLE001  a side that breaks leaves its line in the table, not the whole run
            traceback.print_exc()
            measured.append(Measured(side, side_settings(side, args, rows), float("nan"), failed=failure_note(exc)))
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        agreed = (f"{100 * agreement(scheme, our_generations, theirs, tokenizer, settings.stop):.1f}%"
                  if attention == "causal" else "n/a (generate is causal)")
        measured.append(Measured(side, side_settings(side, args, rows), seconds, first_pass, agreed))
    return measured, settings, our_generations


def profile_pass(folder: Path, scheme: str, device: torch.device, run: Callable[[], Any]) -> None:
    """One decoding pass under torch.profiler: `folder/<scheme>.txt` (what held the pass up) and its trace. Kernels
    replayed from CUDA graphs are recorded one by one (CUPTI traces graph launches)."""
    folder.mkdir(parents=True, exist_ok=True)
    with torch.profiler.profile(activities=activities(device)) as prof:
        _, seconds = timed(device, run)
    write_text_atomic(folder / f"{scheme}.txt", profile_summary(prof, 1000 * seconds, device, span="decoding pass"))
    prof.export_chrome_trace(str(folder / f"{scheme}.trace.json"))


def table_rows(scheme: str, measured: list[Measured], n: int, tokens: int, traffic: Traffic,
               bandwidth: float | None) -> list[str]:
    lines = []
    our_rate = n / measured[0].seconds
    for m in measured:
        if m.failed:
            lines.append(f"| {scheme} | {m.side} | {m.settings}, failed: {m.failed} |" + " - |" * 7)
            continue
        rate = n / m.seconds
        share = f"{traffic.bandwidth_share(m.seconds, bandwidth):.1%}" if bandwidth else "n/a"
        first = "-"
        if m.first_pass_seconds is not None:  # the first pass compiles (on a GPU), then runs as the timed one does
            compiling = m.first_pass_seconds - m.seconds
            first = f"{m.first_pass_seconds:.1f}" + (f" (compiling ~{compiling:.1f})" if compiling > 0 else "")
        lines.append(
            f"| {scheme} | {m.side} | {m.settings} | {rate:.2f} | {tokens / m.seconds:,.0f} | {first} | "
            f"{traffic.bytes_per_step / 1e9:.3f} ({traffic.mean_live_rows:.0f} x {traffic.mean_context:.0f}) | "
            f"{share} | {our_rate / rate:.2f}x | {m.agreement} |"
        )
    return lines


def headline(scheme: str, measured: list[Measured], n: int, args: argparse.Namespace, model_name: str, card: str,
             traffic: Traffic, bandwidth: float | None, argv: list[str]) -> Headline | None:
    """Ours against the fastest generate (its warm rate)."""
    theirs = [m for m in measured if m.side.startswith("generate") and not m.failed]
    if not theirs:
        return None
    best = min(theirs, key=lambda m: m.seconds)

    def side(m: Measured) -> Side:
        extra: dict[str, Any] = {"agreement_with_ours": m.agreement} if m.side != "ours" else {}
        if bandwidth:
            extra["bandwidth_share"] = round(traffic.bandwidth_share(m.seconds, bandwidth), 4)
        if m.first_pass_seconds is not None:
            extra["first_pass_s"] = round(m.first_pass_seconds, 1)
        return Side(m.side, m.settings, round(n / m.seconds, 2), "problems/s", extra)

    claim = (f"{scheme} decoding of {n} GSM8K problems, batch {args.batch_size}, max_new_tokens "
             f"{args.max_new_tokens}, against HF generate's fastest")
    return Headline(claim, model_name, card, side(measured[0]), side(best), command_line("eval_throughput.py", argv))


def lever_models(model, levers: Sequence[str]) -> dict[str, Any]:
    """Each lever's model: copies of the plain `model` for all but the first, which is `model` itself, each with its
    levers applied."""
    copies = [copy.deepcopy(model) for _ in levers[1:]]
    return {lever: apply_levers(each, LEVERS[lever]) for lever, each in zip(levers, [model, *copies])}


def run(argv: list[str]) -> int:
    args = parse_args(argv)
    device = DEVICE
    cfg = model_config(args.model).model_copy(update={"dtype": args.dtype, "attn_implementation": args.attn})
    if args.path:
        cfg = cfg.model_copy(update={"path": args.path})
    loaded = load_model(cfg, 0, device, training=False, levers=PLAIN)
    model, tokenizer = loaded.model, loaded.tokenizer
    models = lever_models(model, args.levers)
    problems = problems_of(args)
    prompting = Prompting(args.prompt == "few-shot", args.prompt_attention, DataConfig().prompt_template)
    prompts = [prompt.ids for prompt in build_prompts(problems, loaded, prompting)]
    base = Settings(
        args.max_new_tokens, 0, args.num_beams, args.cot_k, stop_strings("gsm8k", prompting),
        (tokenizer.eos_token_id,), tokenizer.pad_token_id, len(tokenizer),  # load_model gives the model the EOS
    )
    shape = ModelShape.of(model)
    weight_bytes = decode_weight_bytes(model)
    kv_position_bytes = kv_bytes_per_position(shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes)
    bandwidth = card_value(MEMORY_BANDWIDTH, gpu_name(device))
    model_name = args.model + (f" ({args.path})" if args.path else "")
    lines = header(args, cfg, device, model.dtype, len(problems), weight_bytes)
    print("\n".join(lines), flush=True)
    found: list[Headline] = []
    failed = False
    for scheme in args.schemes:
        try:
            measured, settings, generations = run_scheme(scheme, args, models, tokenizer, prompts, base)
        except Exception as exc:  # noqa: BLE001  ours broke: the scheme's line says so, the other schemes run
            traceback.print_exc()
            new_lines = [f"| {scheme} | ours | failed: {failure_note(exc)} |" + " - |" * 7]
            measured = []
        else:
            traffic = traffic_of(scheme, generations, prompts, settings, weight_bytes, kv_position_bytes)
            tokens = generated_tokens(scheme, generations, settings.max_new_tokens)
            new_lines = table_rows(scheme, measured, len(prompts), tokens, traffic, bandwidth)
            new = headline(scheme, measured, len(prompts), args, model_name, gpu_name(device), traffic, bandwidth,
                           argv)
            found += [new] if new else []
        failed = failed or not measured or any(m.failed for m in measured)
        for line in new_lines:
            lines.append(line)
            print(line, flush=True)
        if args.out:  # rewritten after every scheme: a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.out, "\n".join(lines) + "\n")
    if args.speed_json and found:
        record(found, args.speed_json)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except ClozeMathError as exc:
        print(f"eval_throughput: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
