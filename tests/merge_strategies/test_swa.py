"""Server-side SWA (``--swa-start``): the running mean, its checkpoint, its settings."""

import pytest
import torch

import strategies
from fedavg.config.settings import RunConfig
from fedavg.run import resume
from fedavg.run.lifecycle import RunState
from fedavg.run.server_app import ServerRun
from fedavg.util.errors import UserError
from strategies.swa import WeightAverage


def _models():
    return [{"w": torch.tensor([1.0, 2.0]), "h": torch.tensor([0.5], dtype=torch.float16),
             "n": torch.tensor(3)},
            {"w": torch.tensor([3.0, 6.0]), "h": torch.tensor([1.5], dtype=torch.float16),
             "n": torch.tensor(5)},
            {"w": torch.tensor([5.0, 1.0]), "h": torch.tensor([4.0], dtype=torch.float16),
             "n": torch.tensor(1)}]


def test_running_mean_by_hand():
    avg = WeightAverage()
    a, b, c = _models()
    first = avg.add(a)
    assert torch.equal(first["w"], a["w"]) and first["w"] is not a["w"]
    second = avg.add(b)
    assert torch.equal(second["w"], torch.tensor([2.0, 4.0]))  # (1+3)/2, (2+6)/2
    third = avg.add(c)
    assert torch.equal(third["w"], torch.tensor([3.0, 3.0]))  # (1+3+5)/3, (2+6+1)/3
    assert torch.equal(third["h"], torch.tensor([2.0], dtype=torch.float16))  # 6/3, kept fp16
    assert third["n"].item() == 1 and third["n"].dtype == torch.int64  # a counter: the latest
    assert avg.count == 3
    a["w"] += 100  # the average holds copies
    assert torch.equal(avg.mean()["w"], torch.tensor([3.0, 3.0]))


def test_models_that_do_not_fit_are_refused():
    avg = WeightAverage()
    with pytest.raises(strategies.MergeError, match="no model averaged yet"):
        avg.mean()
    avg.add({"w": torch.zeros(2)})
    with pytest.raises(strategies.MergeError, match=r"'w' is \(3,\) torch.float32, expected "
                                                    r"\(2,\) torch.float32"):
        avg.add({"w": torch.zeros(3)})
    with pytest.raises(strategies.MergeError, match=r"missing \['w'\], unexpected \['v'\]"):
        avg.add({"v": torch.zeros(2)})
    with pytest.raises(strategies.MergeError, match="NaN or infinite values in 'w'"):
        avg.add({"w": torch.tensor([0.0, float("nan")])})
    assert avg.count == 1  # nothing refused was counted


def test_the_average_through_a_checkpoint_file_continues_exactly(tmp_path):
    """Resumed after two models, the mean of three is bit for bit the unbroken one's."""
    g = torch.Generator().manual_seed(0)
    models = [{"w": torch.randn(5, generator=g), "n": torch.tensor(i)} for i in range(3)]
    unbroken = WeightAverage()
    for m in models:
        want = unbroken.add(m)

    first = WeightAverage()
    for m in models[:2]:
        first.add(m)
    config = RunConfig().replace(rounds=3, swa_start=1)
    ckpt = resume.capture(2, models[1], config, strategies.get("fedavg"),
                          [_rec(1), _rec(2)], [], swa=first)
    resume.save(tmp_path, ckpt)
    back = resume.load(tmp_path)
    assert back.swa["w"].dtype == torch.float64  # the exact mean
    assert resume.averaged_rounds(back.run_config().merge.swa_start, back.round) == 2
    again = WeightAverage()
    again.load(back.swa, 2, models[0])
    got = again.add(models[2])
    assert torch.equal(got["w"], want["w"]) and got["w"].dtype == torch.float32


def _rec(r):
    return {"round": r, "accuracy": 0.5, "loss": 1.0, "train_loss": 1.2, "num_nodes": 2,
            "num_failed": 0, "wall_s": 0.1, "train_s": 0.05}


def test_a_checkpoint_without_an_average_still_loads_and_a_broken_one_is_damage(tmp_path):
    plain = resume.capture(1, {"w": torch.ones(2)}, RunConfig(), strategies.get("fedavg"),
                           [_rec(1)], [])
    resume.save(tmp_path, plain)
    back = resume.load(tmp_path)
    assert back.swa == {}

    avg = WeightAverage()
    avg.add({"w": torch.ones(2)})
    # an average in a run without --swa-start
    ckpt = resume.capture(1, {"w": torch.ones(2)}, RunConfig(), strategies.get("fedavg"),
                          [_rec(1)], [], swa=avg)
    resume.save(tmp_path, ckpt)
    with pytest.raises(UserError, match=r"is damaged.*weight average in 1 tensors where "
                                        r"--swa-start None after round 1 averages 0 models"):
        resume.load(tmp_path)
    # no average where --swa-start 1 after round 1 makes one
    ckpt = resume.capture(1, {"w": torch.ones(2)}, RunConfig().replace(swa_start=1),
                          strategies.get("fedavg"), [_rec(1)], [])
    resume.save(tmp_path, ckpt)
    with pytest.raises(UserError, match=r"is damaged.*weight average in 0 tensors where "
                                        r"--swa-start 1 after round 1 averages 1 models"):
        resume.load(tmp_path)


def test_averaged_rounds_by_hand():
    assert resume.averaged_rounds(None, 7) == 0
    assert resume.averaged_rounds(3, 2) == 0  # not started yet
    assert resume.averaged_rounds(3, 3) == 1
    assert resume.averaged_rounds(3, 6) == 4  # rounds 3, 4, 5, 6


def _server(tmp_path, **settings):
    return ServerRun(RunConfig().replace(**settings), None, tmp_path, RunState())


def test_resume_checks_the_average_against_the_model(tmp_path):
    model = {"w": torch.zeros(2)}
    run = _server(tmp_path, rounds=6, swa_start=3)
    ckpt = resume.Checkpoint(round=4, model=model, config={},
                             swa={"w": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(UserError, match=r"damaged: the saved weight average: 'w' is \(3,\)"):
        run._resume_swa(ckpt, model)
    ckpt.swa = {"w": torch.tensor([1.0, 3.0], dtype=torch.float64)}
    run._resume_swa(ckpt, model)
    assert run.swa.count == 2 and torch.equal(run.swa.mean()["w"], torch.tensor([1.0, 3.0]))
    before = resume.Checkpoint(round=2, model=model, config={})  # averaging not started yet
    fresh = _server(tmp_path, rounds=6, swa_start=3)
    fresh._resume_swa(before, model)
    assert fresh.swa.count == 0


@pytest.mark.parametrize("settings, message", [
    ({"swa_start": 0}, r"--swa-start must be a round from 1 to --rounds 10 \(got 0\)"),
    ({"swa_start": 11}, r"--swa-start must be a round from 1 to --rounds 10 \(got 11\)"),
    ({"swa_start": 1, "strategy": "ensemble", "rounds": 1},
     "--swa-start averages the models of several rounds; ensemble is a one-shot merge"),
])
def test_bad_swa_settings_say_what_to_change(settings, message):
    with pytest.raises(UserError, match=message):
        RunConfig().replace(**settings).validate()
    assert RunConfig().replace(swa_start=10).validate().merge.swa_start == 10
