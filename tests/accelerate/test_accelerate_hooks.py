"""Two models with two optimizers, a registered custom object and the diffusers-style pre-hooks that
take one model over (saved and loaded by the hooks, the rest by bcp), on 2 processes; and the clear
errors when the accelerator no longer matches the checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import bcp
from accelerate_helpers import Counter, Net, assert_restored, scramble_rng, session, snapshot, train
from models import assert_bitwise, full_state

TAKEN_OVER = "critic.pt"


def build_pair(accelerator, seed: int, counter: Counter) -> tuple:
    torch.manual_seed(seed)
    actor, critic = Net(), nn.Linear(7, 3)
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(actor_opt, step_size=1, gamma=0.5)
    accelerator.register_for_checkpointing(counter)
    return accelerator.prepare(actor, critic, actor_opt, critic_opt, scheduler)


def train_pair(accelerator, actor, critic, actor_opt, critic_opt, scheduler, steps: range) -> None:
    train(accelerator, actor, actor_opt, scheduler, steps)
    for _ in steps:
        loss = critic(torch.ones(4, 7)).pow(2).mean()
        accelerator.backward(loss)
        critic_opt.step()
        critic_opt.zero_grad()


def register_takeover_hooks(accelerator) -> None:
    """As diffusers does: the hooks save and load the second model themselves."""

    def save_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            torch.save(accelerator.unwrap_model(models[1]).state_dict(), os.path.join(output_dir, TAKEN_OVER))
            weights.pop(1)

    def load_hook(models, input_dir):
        critic = models.pop(1)
        accelerator.unwrap_model(critic).load_state_dict(torch.load(os.path.join(input_dir, TAKEN_OVER)))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def two_models_with_hooks(path: str) -> list[str]:
    with session("bcp") as accelerator:
        register_takeover_hooks(accelerator)
        counter = Counter(5)
        actor, critic, actor_opt, critic_opt, scheduler = build_pair(accelerator, 1, counter)
        train_pair(accelerator, actor, critic, actor_opt, critic_opt, scheduler, range(2))
        accelerator.save_state(path)
        saved = snapshot(accelerator, actor, actor_opt, scheduler)
        saved_critic = full_state(critic, critic_opt)

    with session("bcp") as accelerator:
        register_takeover_hooks(accelerator)
        counter = Counter()
        actor, critic, actor_opt, critic_opt, scheduler = build_pair(accelerator, 2, counter)
        scramble_rng()
        accelerator.load_state(path)
        assert_restored(saved, snapshot(accelerator, actor, actor_opt, scheduler))
        assert_bitwise(saved_critic, full_state(critic, critic_opt))
        assert counter.value == 5
        assert critic_opt.param_groups[0]["momentum"] == 0.9

    errors = []
    with session("bcp") as accelerator:  # without the hooks, bcp would have to load the critic
        build_pair(accelerator, 2, Counter())
        with pytest.raises(bcp.MismatchError) as failure:
            accelerator.load_state(path)
        errors.append(str(failure.value))
    with session("bcp") as accelerator:  # one model and optimizer fewer, no custom object
        torch.manual_seed(2)
        model = Net()
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
        with pytest.raises(bcp.MismatchError) as failure:
            accelerator.load_state(path)
        errors.append(str(failure.value))
    return errors


def test_hooks_take_one_model_over_and_bcp_saves_the_rest(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    errors = ranks(2).run(two_models_with_hooks, path)
    assert errors[0] == errors[1]
    assert errors[0][0] == (
        "the accelerator does not match the checkpoint: indices of the models the pre-hooks leave to bcp: "
        f"[0] saved, [0, 1] now (checkpoint {path!r})")
    assert errors[0][1] == (
        "the accelerator does not match the checkpoint: prepared models: 2 saved, 1 now; prepared optimizers: "
        f"2 saved, 1 now; objects registered for checkpointing: 1 saved, 0 now (checkpoint {path!r})")
