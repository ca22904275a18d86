# .venv/bin/python -m pytest -q tests/test_optimizer.py
"""train.optimizer: muon (eagle3lib/training/optimizer.py): Muon steps the drafter's weight matrices but the lm_head,
AdamW the rest; its state survives a checkpoint exactly; a checkpoint of one optimizer is not resumed by the other."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from train_fixtures import cached_store, make_run_dir

from eagle3lib.config.stages import open_stage
from eagle3lib.model.checkpoint import CheckpointError
from eagle3lib.training import distributed as dist
from eagle3lib.training.loop import train
from eagle3lib.training.optimizer import make_optimizer, muon_split


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(12, 8, bias=False)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 20, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.fc(x)))


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_muon_takes_the_matrices_but_the_head_and_its_state_round_trips():
    torch.manual_seed(0)
    model = Small()
    assert muon_split(model.named_parameters()) == (["fc.weight"], ["norm.weight", "norm.bias", "lm_head.weight"])
    opt = make_optimizer(model, "muon", 1e-2, (0.9, 0.95), 0.0, foreach=False)
    assert [type(o).__name__ for o in opt.parts] == ["Muon", "AdamW"]
    x = torch.randn(32, 12)  # a gradient of full rank
    before = model.fc.weight.detach().clone()
    _step(model, opt, x)
    # Muon's step on a matrix is orthogonalised: its singular values within a few x of each other (five Newton-Schulz
    # iterations do not lift a direction the gradient nearly lacks all the way), the gradient's ~10^7 apart (the
    # norm after fc removes one direction)
    s = torch.linalg.svdvals(model.fc.weight.detach() - before)
    g = torch.linalg.svdvals(model.fc.weight.grad)
    assert float(s.max() / s.min()) < 10 and float(g.max() / g.min()) > 1e4
    _step(model, opt, x)
    buf = io.BytesIO()  # through bytes, as a checkpoint's training_state.pt (the live state holds the live tensors)
    torch.save(dist.optimizer_state(model, opt), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    twin = copy.deepcopy(model)
    twin_opt = make_optimizer(twin, "muon", 1e-2, (0.9, 0.95), 0.0, foreach=False)
    dist.load_optimizer_state(twin, twin_opt, state)
    _step(model, opt, x)
    _step(twin, twin_opt, x)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the momentum came back: the same next step


def test_fsdp_is_refused_by_name():
    from eagle3lib.config.train import TrainConfig

    with pytest.raises(ValueError, match="train.optimizer: muon orthogonalises whole matrices"):
        TrainConfig(optimizer="muon", distributed="fsdp", nproc_per_node=2, batch_rows=2)


@pytest.mark.slow
def test_the_train_stage_trains_with_muon_and_refuses_an_adamw_resume(tmp_path, tiny_verifier):
    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    over = {"train.optimizer": "muon", "train.max_steps": 4, "train.ckpt_every": 2, "train.nproc_per_node": 1,
            "train.log_every": 1}
    figures = train(open_stage("train", "tiny", run, over))["figures"]
    assert figures["steps"] == 4
    state = torch.load(run / "train" / "checkpoints" / "step_00000002" / "training_state.pt", weights_only=True)
    assert state["optimizer_name"] == "muon"
    muon_group, adamw_group = state["optimizer"]["param_groups"]
    assert any("fc.weight" in n for n in muon_group["params"]) and all("lm_head" not in n for n in muon_group["params"])
    assert any("lm_head" in n for n in adamw_group["params"])
    with pytest.raises(CheckpointError, match=r"train.optimizer: checkpoint 'muon', now 'adamw'"):
        train(open_stage("train", "tiny", run, {**over, "train.optimizer": "adamw", "train.max_steps": 6}))
