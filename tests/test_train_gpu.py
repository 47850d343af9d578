"""On a GPU with liger-kernel (`pip install 'clozemath[gpu]'`): the fused linear + cross-entropy gives the loss and
the gradients (LoRA and the special-token rows) of the unfused `TargetLoss`."""

from __future__ import annotations

import pytest
import torch

from clozemath.data.tokenize import collate
from clozemath.train.step import TargetLoss
from tests.test_train import PAD, copy_rows, tiny_peft_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_fused_loss_equals_the_unfused_one(tied: bool) -> None:
    pytest.importorskip("liger_kernel")
    batch = {k: v.cuda() for k, v in collate(copy_rows(8), PAD).items()}
    inputs = {"input_ids": batch["input_ids"], "labels": batch["labels"], "attention_mask": batch["attention_mask"]}
    results = []
    for fused in (False, True):
        model = tiny_peft_model(tied=tied).cuda()
        torch.manual_seed(0)  # the same LoRA dropout in both
        loss = TargetLoss(model, fused=fused)(**inputs)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
    (loss, grads), (fused_loss, fused_grads) = results
    assert torch.allclose(loss, fused_loss, rtol=1e-4, atol=1e-5)
    assert grads.keys() == fused_grads.keys() and any("trainable_tokens" in name for name in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, fused_grads[name], rtol=1e-3, atol=1e-5), name
