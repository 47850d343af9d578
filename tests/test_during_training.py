"""Evaluation during training (the paper's Figure 3) on a tiny model being trained: which problems, when, and how the
ranks' counts add up (no Ray: the sum over ranks is handed in)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clozemath.errors import ClozeMathError
from clozemath.eval.during_training import evaluate_step, step_evaluation
from clozemath.eval.evaluate import eval_problems
from clozemath.model.load import load_model
from clozemath.plan import load_config

SMOKE = Path(__file__).resolve().parents[1] / "configs" / "experiments" / "smoke.yaml"
SETS = "eval.sets=[{dataset: gsm8k, limit: 40, decodings: [beam]}, {dataset: gsm_p1, per_template: 1}]"


@pytest.fixture(scope="module")
def config():
    torch.set_num_threads(1)
    return load_config(SMOKE, [SETS, "eval.decodings=[greedy,beam]", "eval.num_beams=2", "eval.max_new_tokens=4",
                               "eval.every_steps=3", "eval.during_training_limit=5"])


def test_the_first_sets_first_decoding_on_one_subset_every_n_steps_and_after_the_last(config) -> None:
    evaluation = step_evaluation(config)
    assert (evaluation.set_name, evaluation.decoding) == ("gsm8k", "beam")
    chosen = eval_problems(config.eval.sets[0].model_copy(update={"limit": 5}))
    assert [p.id for p in evaluation.problems] == [p.id for p in chosen]
    assert [step for step in range(1, 11) if evaluation.due(step, total_steps=10)] == [3, 6, 9, 10]
    never = config.eval.model_copy(update={"every_steps": None})
    assert step_evaluation(config.model_copy(update={"eval": never})) is None


def test_shares_of_the_budget_put_every_run_at_the_same_points_of_its_steps(config) -> None:
    """`every_share: 0.25` of 10 steps: 2.5, 5, 7.5, 10 rounded halves up -> 3, 5, 8, 10; of 685 at 0.1: 68.5 -> 69,
    137, 205.5 -> 206, ..., 685; a run shorter than the shares still ends with its last step."""
    shares = config.eval.model_copy(update={"every_steps": None, "every_share": 0.25})
    evaluation = step_evaluation(config.model_copy(update={"eval": shares}))
    assert [step for step in range(1, 11) if evaluation.due(step, total_steps=10)] == [3, 5, 8, 10]
    tenths = shares.model_copy(update={"every_share": 0.1})
    assert tenths.during_training_steps(685) == [69, 137, 206, 274, 343, 411, 480, 548, 617, 685]
    assert shares.during_training_steps(2) == [1, 2]
    assert shares.model_copy(update={"every_share": 0.3}).during_training_steps(7) == [2, 4, 6, 7]
    with pytest.raises(ClozeMathError, match="`every_steps` and `every_share` both say when"):
        load_config(SMOKE, ["eval.every_steps=3", "eval.every_share=0.1"])
    with pytest.raises(ClozeMathError, match="every_share"):
        load_config(SMOKE, ["eval.every_share=0"])


@pytest.mark.parametrize(("zero_stage", "expected_total"), [(2, 2 * 2), (3, 5)])
def test_ranks_share_the_problems_and_sum_their_counts(config, zero_stage: int, expected_total: int) -> None:
    """Rank 1 of 2: under ZeRO-2 it decodes problems 1 and 3 and the (stand-in) sum doubles its counts; under ZeRO-3
    every rank decodes all five in step and nothing is summed."""
    config = config.model_copy(update={"train": config.train.model_copy(update={"zero_stage": zero_stage})})
    loaded = load_model(config.model, num_sentinels=2, device="cpu", training=True)
    summed = []

    def double(counts: list[float]) -> list[float]:
        summed.append(counts)
        return [2 * count for count in counts]

    values = evaluate_step(step_evaluation(config), loaded, config, rank=1, world_size=2, sum_over_ranks=double)
    assert values["curve/gsm8k/beam/total"] == expected_total  # apart from the final full-set eval/... metrics
    assert [total for _, total in summed] == ([] if zero_stage == 3 else [2.0])  # this rank's 2 problems, summed once
    assert values["curve/gsm8k/beam/accuracy"] == values["curve/gsm8k/beam/correct"] / expected_total
    assert loaded.model.training  # back to training



@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_model_readied_for_the_graph_engine_decodes_todays_tokens_and_trains_on_as_it_was(config, tied) -> None:
    """What a CUDA worker under ZeRO-2 does to its model for an evaluation during training (`decoding_in_training`
    for the graph engine), here in float32 on the CPU with the static engine (the graph engine's steps, not captured).
    The model is in training: LoRA and the special-token rows (in its prompts) moved off their start, an optimizer
    step taken. While it decodes, the special rows are in the matrices themselves, and greedy gives the tokens of
    today's path (the eager engine, the rows written over the matrices at every forward). After it: every parameter
    and buffer as before to the bit, requires_grad too, the trained tensors the very ones the optimizer holds, its
    state unchanged, train mode and training's attention back."""
    from clozemath.eval.decoding import DecodeSettings, decode
    from clozemath.train.inference import decoding_in_training

    model_cfg = config.model.model_copy(update={"random_init": {**config.model.random_init,
                                                                "tie_word_embeddings": tied}})
    loaded = load_model(model_cfg, num_sentinels=2, device="cpu", training=True)
    model, specials = loaded.model, sorted(loaded.specials.trainable_ids)
    model.set_attn_implementation("eager")  # training's own, to be given back
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in trained:
            parameter.add_(0.5 * torch.randn(parameter.shape, generator=generator))
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    ids = torch.tensor([[5, specials[0], 17, 29, specials[-1], 41, 7, 3]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    before = {name: tensor.clone() for name, tensor in [*model.named_parameters(remove_duplicate=False),
                                                        *model.named_buffers()]}
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)}
    held = [(id(p), p.data_ptr()) for group in optimizer.param_groups for p in group["params"]]
    optimizer_state = {index: {key: value.clone() for key, value in state.items()}
                       for index, state in optimizer.state_dict()["state"].items()}
    prompts = [[9, specials[0], 33, 12, specials[1]], [specials[-1], 101, 55], [7, 8, specials[0], 250, 31, 2, 64]]

    def greedy(engine: str) -> list[list[int]]:
        settings = DecodeSettings(max_new_tokens=6, batch_size=2, engine=engine, eos_token_ids=[])
        return [g.token_ids for g in decode(model, loaded.tokenizer, prompts, "greedy", settings)]

    with decoding_in_training(model, "eager"):  # today's path, for every engine
        today = greedy("eager")
    with decoding_in_training(model, "static"):
        for layer in [model.get_input_embeddings()] + ([] if tied else [model.get_output_embeddings()]):
            rows = layer.token_adapter.trainable_tokens_delta["default"]
            assert torch.equal(layer.token_adapter.base_layer.weight[specials], rows)
        readied = greedy("static")
    assert readied == today
    assert any(token in specials for tokens in today for token in tokens)  # the output rows pick tokens too
    assert model.training and model.config._attn_implementation == "eager"
    after = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers()])
    assert after.keys() == before.keys()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    assert {name: p.requires_grad for name, p in model.named_parameters(remove_duplicate=False)} == requires_grad
    assert [(id(p), p.data_ptr()) for group in optimizer.param_groups for p in group["params"]] == held
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(state[index][key], value) for index, kept in optimizer_state.items()
               for key, value in kept.items())


def test_the_compiled_layers_are_set_aside_for_decoding_and_train_on_without_compiling_again() -> None:
    """A model whose decoder layers training compiled (`compile_decoder_layers` outside ZeRO-3), readied for the graph
    engine: forwards of decoding's shapes compile nothing (each shape would compile anew, and a CUDA graph would
    capture the compiled code), and the training forward after runs the same compiled layers: nothing compiles
    again, and only a new training shape compiles."""
    from test_train import tiny_peft_model
    from torch._dynamo.testing import CompileCounter

    from clozemath.train.compilation import decoder_layers
    from clozemath.train.inference import decoding_in_training

    model = tiny_peft_model(dropout=0.0)
    counter = CompileCounter()
    for layer in decoder_layers(model):
        layer.compile(backend=counter, dynamic=False)  # as `compile_decoder_layers`, with a backend that counts
    ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    compiled = counter.frame_count
    assert compiled > 0
    with decoding_in_training(model, "graphs"), torch.inference_mode():
        for width in (5, 9):
            model(input_ids=ids[:1, :width])
    assert counter.frame_count == compiled
    model(input_ids=ids, labels=ids).loss.backward()
    assert counter.frame_count == compiled
    model(input_ids=ids[:, :7], labels=ids[:, :7])  # a training shape not seen yet: the layers are compiled again
    assert counter.frame_count > compiled
