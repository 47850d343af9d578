"""What a run or a grid will cost, before anything starts (`clozemath run CONFIG --dry-run`).

For every trial: its samples and tokens (the run's own preprocessing steps on the first `SAMPLE_PROBLEMS` problems,
scaled to the set), the steps its layout makes (the ZeRO stage, row size and compilation the workers would choose on
the card, decided by the workers' own functions: `clozemath.train.layout`), and the time of its parts: training at the
measured tokens/s of its model on the card, evaluation at the measured problems/s, and the fixed costs (workers'
start, model load, the first step's compilation, preprocessing). The grid's wall time is its trials laid on the GPUs
in order, each starting when enough are free, as Tune runs them. The figures come from `configs/throughput.yaml`,
each with its source (mostly a file under `bench/results/`); where one is missing it is derived and the estimate says
how.

Nothing here starts Ray or loads weights: the shapes are built on PyTorch's meta device, and a tokenizer is used only
where it is on this machine (else the shape's own, Llama 3's, and the counts say "estimated"); the caller keeps
transformers off the network (`HF_HUB_OFFLINE`, as the CLI sets it).

Its parts: `throughput` (the table), `shapes` (meta-device shapes, FLOPs a token), `trials` (a trial's counts, layout
and times), `grid` (the schedule on the cluster, the totals, the printout).
"""

from __future__ import annotations

from clozemath.cost.grid import estimate, estimate_text, schedule
from clozemath.cost.shapes import meta_shape, training_flops_per_token
from clozemath.cost.trials import TrialCost

__all__ = ["TrialCost", "estimate", "estimate_text", "meta_shape", "schedule", "training_flops_per_token"]
