"""Training: one worker's loop on a DeepSpeed engine (`loop`), planned by `layout` (row width, compilation, steps),
fed by `batches` (data order, tensors, MFT noise), stepped by `step` (target loss, engine), saved by `checkpoint`;
`packing`, `compilation`, `distributed`, ZeRO settings (`zero`) and compute budgets (`budget`) beside them."""
