"""Checkpoint building blocks in one process: the resharding-safe data position, pickle-free state, the
``training.*`` checkpoint switches, the on-disk layout and asynchronous saves."""

from __future__ import annotations

import re
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch
from _mm import QUICKSTART, REPO
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from mm_core.checkpoint import (
    CheckpointSaver,
    ModelParts,
    RNGState,
    TrainingState,
    TrainProgress,
    load_checkpoint,
    read_latest,
    resolve_load_path,
    save_checkpoint,
    set_deterministic,
)
from mm_core.checkpoint.json_state import merge, split
from mm_core.config.schema import DataConfig
from mm_core.data import EpochIterator, build_dataloader
from mm_core.errors import CheckpointError

# ----------------------------------------------------------------------------------------- data position


class Ids(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.tensor([float(i)]), "sample_id": i}


def _iterators(n: int, dp: int, mbs: int, *, workers: int = 0, drop_last: bool = True) -> list[EpochIterator]:
    cfg = DataConfig.model_validate(
        {
            "dataset_param": {"dataset_type": "ids"},
            "dataloader_param": {"num_workers": workers, "drop_last": drop_last},
        }
    )
    ds = Ids(n)
    return [
        EpochIterator(
            build_dataloader(
                ds,
                torch.utils.data.default_collate,
                cfg,
                micro_batch_size=mbs,
                dp_size=dp,
                dp_rank=r,
                seed=7,
            )
        )
        for r in range(dp)
    ]


def _take(its: list[EpochIterator], steps: int) -> list[int]:
    """``steps`` global micro-batches from every rank (as the lock-stepped trainer consumes them)."""
    out: list[int] = []
    for _ in range(steps):
        for it in its:
            out += next(it)["sample_id"].tolist()
    return out


@pytest.mark.parametrize("new_dp,new_mbs,workers", [(1, 4, 0), (4, 1, 0), (4, 2, 2), (2, 2, 0)])
def test_data_position_reshards_without_repeats_or_skips(new_dp, new_mbs, workers):
    n = 50
    before = _take(_iterators(n, 2, 2), 5)  # 2 ranks x 2 samples x 5 steps = 20 samples of epoch 0
    saved = _iterators(n, 2, 2)
    _take(saved, 5)
    states = [it.state_dict() for it in saved]
    assert all(torch.equal(s["consumed"], states[0]["consumed"]) for s in states)  # global, same on all ranks
    assert int(states[0]["consumed"]) == 20 and int(states[0]["epoch"]) == 0
    resumed = _iterators(n, new_dp, new_mbs, workers=workers)
    for it in resumed:
        it.load_state_dict(states[0])
    per_step = new_dp * new_mbs
    after = _take(resumed, (n - 20) // per_step)  # the rest of epoch 0, in whole global micro-batches
    seen = before + after
    assert len(seen) == len(set(seen)), "a sample was seen twice within the epoch"
    assert len(seen) == 20 + (n - 20) // per_step * per_step  # only the last partial global batch is dropped
    # the global order is one seeded permutation: the resumed run reads on exactly where the first stopped
    assert set(seen) == set(resumed[0].sampler.global_order()[: len(seen)].tolist())


def test_data_same_layout_resume_is_identical_and_crosses_epochs():
    straight = _take(_iterators(30, 2, 2, drop_last=False), 20)  # 30 samples / 4 per step: several epochs
    first = _iterators(30, 2, 2, drop_last=False)
    head = _take(first, 9)
    state = first[0].state_dict()
    again = _iterators(30, 2, 2, drop_last=False)
    for it in again:
        it.load_state_dict(state)
    assert head + _take(again, 11) == straight
    assert int(again[0].state_dict()["epoch"]) >= 2


def test_loader_does_not_touch_the_global_torch_rng():
    torch.manual_seed(0)
    its = _iterators(20, 1, 2)
    expected = torch.rand(3)
    torch.manual_seed(0)
    its = _iterators(20, 1, 2)
    _take(its, 12)  # crosses epochs: new iterators each time
    assert torch.equal(torch.rand(3), expected)


def test_loader_workers_are_forked():
    """Ranks that ``mm train`` starts are spawned processes, whose default is to spawn workers too (each
    importing torch and the plugins again at every epoch start); the loader forks them, as in torchrun's."""
    its = _iterators(8, 1, 2, workers=1)
    assert its[0].loader.multiprocessing_context.get_start_method() == "fork"
    assert _take(its, 6)  # they deliver, across an epoch start


class MixedIds(Ids):
    """Three sources (10, 25, 15 samples) mixed 3:1:1, so source 0 is up-sampled and the others down; sample
    ``i`` has ``1 + i % 7`` tokens."""

    source_sizes = (10, 25, 15)
    source_weights = (3.0, 1.0, 1.0)

    def __init__(self) -> None:
        super().__init__(sum(self.source_sizes))

    def sample_lengths(self) -> np.ndarray:
        return 1 + np.arange(self.n) % 7


def _loaders(ds, dp: int, mbs: int = 1, *, workers: int = 0, **dataloader) -> list[EpochIterator]:
    cfg = DataConfig.model_validate(
        {
            "dataset_param": {"dataset_type": "ids"},
            "dataloader_param": {"num_workers": workers, **dataloader},
        }
    )
    return [
        EpochIterator(
            build_dataloader(
                ds, torch.utils.data.default_collate, cfg, micro_batch_size=mbs, dp_size=dp, dp_rank=r, seed=7
            )
        )
        for r in range(dp)
    ]


def _take_in_order(its: list[EpochIterator], steps: int, mbs: int | None) -> list[int]:
    """``steps`` global micro-batches, put back in global-order sequence: fixed batches (``mbs``) interleave
    the ranks (rank r reads every dp-th sample), token-budget batches (``mbs`` None) follow each other."""
    out: list[int] = []
    for _ in range(steps):
        batches = [next(it)["sample_id"].tolist() for it in its]
        if mbs is None:
            out += [i for b in batches for i in b]
        else:
            out += [b[i] for i in range(mbs) for b in batches]
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("new_dp,new_mbs", [(1, 4), (4, 1)])
def test_mixed_order_reshards_without_repeats_or_skips(new_dp, new_mbs, workers):
    ds = MixedIds()
    straight = _take_in_order(_loaders(ds, 2, 2), 20, 2)  # 80 samples: epoch 0 (48 of 50) and into epoch 1
    saved = _loaders(ds, 2, 2)
    head = _take_in_order(saved, 5, 2)
    state = saved[0].state_dict()
    resumed = _loaders(ds, new_dp, new_mbs, workers=workers)
    for it in resumed:
        it.load_state_dict(state)
    assert head + _take_in_order(resumed, 15, new_mbs) == straight
    counts = Counter(straight[:48])  # epoch 0: source 0 (ids 0-9) drawn 3x as often as the others
    assert sum(counts[i] for i in range(10)) > sum(counts[i] for i in range(10, 50)) // 2
    assert int(resumed[0].state_dict()["epoch"]) == 1


def _budget_epoch(dp: int, *, workers: int = 0, state=None, steps: int | None = None, **dl) -> tuple:
    """Read ``steps`` global micro-batches (default: to the end of the epoch) of MixedIds with a budget of
    12 tokens per micro-batch; the samples in global order, the iterators and the micro-batch sizes."""
    its = _loaders(MixedIds(), dp, workers=workers, max_tokens_per_batch=12, dynamic_batch_buffer=8, **dl)
    if state is not None:
        for it in its:
            it.load_state_dict(state)
    if steps is None:
        its[0].sampler.set_position(int(its[0].epoch), its[0].consumed)
        steps = len(its[0].sampler)
    return _take_in_order(its, steps, None), its


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("new_dp", [1, 3, 4])
def test_token_budget_position_reshards_without_repeats_or_skips(new_dp, workers):
    head, saved = _budget_epoch(2, steps=6)
    state = saved[0].state_dict()
    assert all(torch.equal(it.state_dict()["consumed"], state["consumed"]) for it in saved)
    assert int(state["consumed"]) == len(head)  # the exact position, though micro-batches vary in size
    tail, resumed = _budget_epoch(new_dp, workers=workers, state=state)
    seen = head + tail
    order = resumed[0].sampler.global_order().tolist()
    assert seen == order[: len(seen)]  # the resumed run reads on exactly where the first stopped
    assert len(order) - len(seen) < new_dp  # at most one global micro-batch that could not feed every rank
    assert int(resumed[0].state_dict()["epoch"]) == 0  # the epoch is not over until the next batch is asked


def test_token_budget_batches_count_consumed_samples_across_epochs():
    _, its = _budget_epoch(2, steps=0, drop_last=False)
    positions, counted = [], 0
    for _ in range(40):  # about two epochs
        for it in its:
            next(it)
        counted += its[0].take_samples_consumed()
        positions.append((its[0].epoch, its[0].consumed))
        assert all(it.consumed == its[0].consumed for it in its)
    ends = [c for (e, c), (e2, _) in zip(positions, positions[1:]) if e2 != e]
    assert ends and all(c == 50 for c in ends)  # every epoch consumed whole: padding is not counted
    assert counted == sum(ends) + positions[-1][1]
    assert its[0].take_samples_consumed() == 0


# ------------------------------------------------------------------------------------------- no pickle


def test_json_state_roundtrip_and_refuses_objects():
    state = {
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["a.w", "b.w"], "x": None}],
        "state": {"a.w": {"step": torch.tensor(3.0), "m": torch.ones(2)}},
        "by_int": {0: torch.zeros(1), 1: "one"},
        "inf": float("inf"),
    }
    skeleton, tensors = split(state)
    back = merge(skeleton, tensors)
    assert back["param_groups"][0]["betas"] == (0.9, 0.95) and back["by_int"][1] == "one"
    assert torch.equal(back["state"]["a.w"]["m"], torch.ones(2)) and back["inf"] == float("inf")
    with pytest.raises(CheckpointError, match="pickled"):
        split({"f": object()})


class Tiny(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        if extra:
            self.b = nn.Linear(4, 2)


def _ts(model: nn.Module, step: int = 0) -> TrainingState:
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.a(torch.ones(1, 4)).sum().backward()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    opt.step()
    sched.step()
    return TrainingState(
        model=model,
        optimizer=opt,
        scheduler=sched,
        progress=TrainProgress(step=step),
        rng=RNGState(torch.device("cpu")),
    )


def test_checkpoint_has_no_pickled_values_and_restores_everything(tmp_path):
    torch.manual_seed(1)
    ts = _ts(Tiny(), step=3)
    save_checkpoint(tmp_path, 3, ts)
    metadata = FileSystemReader(str(tmp_path / "step_3")).read_metadata().state_dict_metadata
    assert not [k for k, v in metadata.items() if isinstance(v, BytesStorageMetadata)]
    assert {"optimizer.json", "scheduler.json", "rng_rank0.torch_cpu", "progress.step"} <= set(metadata)
    expected_rand = torch.rand(2)  # what the generator gives right after the save

    torch.manual_seed(99)
    other = _ts(Tiny())
    other.optimizer.param_groups[0]["lr"] = 5.0
    report = load_checkpoint(tmp_path / "step_3", other)
    assert other.progress.step == 3 and report["saved_world_size"] == 1
    assert torch.equal(other.model.a.weight, ts.model.a.weight)
    assert other.optimizer.param_groups[0]["lr"] == ts.optimizer.param_groups[0]["lr"]
    exp = other.optimizer.state[other.model.a.weight]["exp_avg"]
    assert torch.equal(exp, ts.optimizer.state[ts.model.a.weight]["exp_avg"])
    assert other.scheduler.last_epoch == ts.scheduler.last_epoch == 1
    assert torch.equal(torch.rand(2), expected_rand)  # the RNG continues exactly


def test_a_tasks_further_models_are_stored_beside_the_main_one(tmp_path):
    torch.manual_seed(1)
    ts = _ts(Tiny(), step=2)
    critic = _ts(Tiny())
    ts.extra["critic"] = ModelParts(critic.model, critic.optimizer, critic.scheduler)
    save_checkpoint(tmp_path, 2, ts)
    save_checkpoint(tmp_path / "gan", 2, ts, config_text="training:\n  task: gan\n")
    metadata = FileSystemReader(str(tmp_path / "step_2")).read_metadata().state_dict_metadata
    assert {"model.a.weight", "critic.a.weight", "critic.a.bias"} <= set(metadata)
    assert {"optimizer.json", "optimizer_critic.json", "scheduler.json", "scheduler_critic.json"} <= set(
        metadata
    )

    torch.manual_seed(99)
    other, other_critic = _ts(Tiny()), _ts(Tiny())
    other.extra["critic"] = ModelParts(other_critic.model, other_critic.optimizer, other_critic.scheduler)
    report = load_checkpoint(tmp_path / "step_2", other)
    assert {"model", "critic", "optimizer", "optimizer_critic", "scheduler_critic"} <= set(report["loaded"])
    for a, b in zip(other_critic.model.parameters(), critic.model.parameters()):
        assert torch.equal(a, b)
    exp = other_critic.optimizer.state[other_critic.model.a.weight]["exp_avg"]
    assert torch.equal(exp, critic.optimizer.state[critic.model.a.weight]["exp_avg"])

    # a checkpoint without the critic: strict names the task's model; non-strict reports its tensors
    save_checkpoint(tmp_path / "plain", 1, TrainingState(model=Tiny()))
    lone = TrainingState(model=Tiny(), extra={"critic": ModelParts(Tiny())})
    with pytest.raises(CheckpointError, match="does not match the task.s model .critic.*a.weight"):
        load_checkpoint(tmp_path / "plain" / "step_1", lone)
    report = load_checkpoint(tmp_path / "plain" / "step_1", lone, strict=False)
    assert sorted(report["missing_model_keys"]) == ["critic.a.bias", "critic.a.weight"]

    # the reverse: the critic's checkpoint resumed by a task that builds the main model only (a vocoder run's
    # discriminator under the standard task): strict names the model and the task that saved it
    plain = _ts(Tiny())
    with pytest.raises(
        CheckpointError, match=r"also holds 'critic'.*training.task: gan\).*load_strict: false"
    ):
        load_checkpoint(tmp_path / "gan" / "step_2", plain)
    report = load_checkpoint(tmp_path / "gan" / "step_2", plain, strict=False)
    assert torch.equal(plain.model.a.weight, ts.model.a.weight) and "critic" not in report["loaded"]


def test_no_save_and_no_load_switches(tmp_path):
    ts = _ts(Tiny(), step=1)
    save_checkpoint(tmp_path, 1, ts, save_optim=False, save_rng=False)
    keys = set(FileSystemReader(str(tmp_path / "step_1")).read_metadata().state_dict_metadata)
    assert not any(k.startswith(("optimizer", "rng_rank")) for k in keys)
    save_checkpoint(tmp_path, 2, ts)
    fresh = _ts(Tiny())
    before = fresh.optimizer.state[fresh.model.a.weight]["exp_avg"].clone()
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    report = load_checkpoint(tmp_path / "step_2", fresh, load_optim=False, load_rng=False)
    assert "optimizer" not in report["loaded"] and "rng_rank0" not in report["loaded"]
    assert torch.equal(fresh.optimizer.state[fresh.model.a.weight]["exp_avg"], before)
    assert torch.equal(fresh.model.a.weight, ts.model.a.weight)
    assert torch.equal(torch.rand(2), expected)


def test_load_strict_lists_missing_and_unexpected_keys(tmp_path):
    save_checkpoint(tmp_path, 1, _ts(Tiny(extra=True)))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / "step_1", TrainingState(model=Tiny()), strict=True)
    msg = str(err.value)
    assert (
        "Unexpected in the checkpoint: b.bias, b.weight" in msg and "Missing from the checkpoint: none" in msg
    )
    assert "training.load_strict" in msg
    (tmp_path / "two").mkdir()
    save_checkpoint(tmp_path / "two", 1, TrainingState(model=Tiny()))
    with pytest.raises(CheckpointError, match="Missing from the checkpoint: b.bias, b.weight"):
        load_checkpoint(tmp_path / "two" / "step_1", TrainingState(model=Tiny(extra=True)))
    report = load_checkpoint(tmp_path / "two" / "step_1", TrainingState(model=Tiny(extra=True)), strict=False)
    assert report["missing_model_keys"] == ["b.bias", "b.weight"]


def test_layout_total_limit_auto_and_partial(tmp_path):
    assert resolve_load_path("auto", str(tmp_path)) is None  # fresh start
    ts = TrainingState(model=Tiny())
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, ts, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_3", "step_4"]
    (tmp_path / ".step_5.partial").mkdir()  # a save that died
    assert resolve_load_path("auto", str(tmp_path)).name == "step_4"
    assert read_latest(tmp_path).name == "step_4"
    with pytest.raises(CheckpointError, match="training.load: auto needs training.save"):
        resolve_load_path("auto", None)


def test_async_save_stages_a_copy_and_moves_latest_only_when_done(tmp_path):
    model = Tiny()
    ts = TrainingState(model=model)
    saver = CheckpointSaver(tmp_path, async_save=True)
    saver.save(1, ts)
    saver.wait()
    assert read_latest(tmp_path).name == "step_1"
    snapshot = model.a.weight.detach().clone()
    saver.save(2, ts)
    with torch.no_grad():
        model.a.weight.add_(1.0)  # training goes on while the save is written
    assert read_latest(tmp_path).name == "step_1"  # not moved before the save is complete and finished
    saver.close()
    assert read_latest(tmp_path).name == "step_2"
    fresh = TrainingState(model=Tiny())
    load_checkpoint(tmp_path / "step_2", fresh)
    assert torch.equal(fresh.model.a.weight, snapshot)


def test_use_deter_comp_switches_deterministic_algorithms():
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


def test_dropout_is_active_in_training_mode(monkeypatch):
    """The exact-resume test enables attention dropout on the tiny Qwen3; make sure it really drops."""
    from mm_core.config import load_config
    from mm_core.models import ModelHub

    monkeypatch.chdir(REPO)  # the quickstart config's paths are relative to the repository root
    cfg = load_config(QUICKSTART, ["model.config_overrides.attention_dropout=0.5"])
    model = ModelHub.build(cfg.model)
    ids = torch.arange(16).view(1, 16)
    model.train()
    a, b = model(input_ids=ids).logits, model(input_ids=ids).logits
    assert not torch.equal(a, b)
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_every_torch_load_is_weights_only():
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "*.py"], cwd=REPO, capture_output=True, text=True
    ).stdout.split()
    bad = []
    for name in files:
        path = REPO / name
        if not path.is_file():
            continue
        for m in re.finditer(r"torch\.load\(([^)]*)\)", path.read_text(encoding="utf-8", errors="replace")):
            if "weights_only=True" not in m.group(1):
                bad.append(f"{name}: {m.group(0)[:80]}")
    assert not bad, bad
