"""needle.plan's formulas: the course's numbers exactly, ZeRO's divisions, traffic, the step."""
from __future__ import annotations

from dataclasses import replace

import pytest

from needle.distributed.calibrate import Link, collective_time
from needle.plan.__main__ import main
from needle.plan.model import (
    Device,
    Layout,
    Model,
    Noise,
    PlanError,
    iteration_time,
    memory,
    predict,
    time_to_train,
    traffic,
    years,
)

PSI = 70e9


def test_16_bytes_per_parameter_is_1_12_terabytes_at_70_billion():
    mem = memory(Model.dense(PSI), Layout())
    # 2 weights + 2 gradients (16-bit) + 4 master + 8 Adam moments (fp32)
    assert [mem[k] for k in ("weights", "gradients", "master", "optimizer")] == \
        [2 * PSI, 2 * PSI, 4 * PSI, 8 * PSI]
    assert mem["model_state"] == 1.12e12


def test_zero3_over_64_gpus_holds_17_5_gb_each():
    mem = memory(Model.dense(PSI), Layout(dp=64, zero=3))
    assert mem["model_state"] == 17.5e9
    assert mem["weights"] == 2 * PSI / 64 and mem["optimizer"] == 8 * PSI / 64


@pytest.mark.parametrize("stage,sharded", [(0, ()), (1, ("master", "optimizer")),
                                           (2, ("gradients", "master", "optimizer")),
                                           (3, ("weights", "gradients", "master", "optimizer"))])
def test_each_zero_stage_divides_its_own_terms_by_dp(stage, sharded):
    whole = memory(Model.dense(PSI), Layout())
    mem = memory(Model.dense(PSI), Layout(dp=8, zero=stage))
    for term in ("weights", "gradients", "master", "optimizer"):
        assert mem[term] == whole[term] / (8 if term in sharded else 1), term


def test_the_books_sharding_examples():
    # ZeRO-1 of a 7-billion-parameter model on 8 GPUs: 2 + 2 + 12/8 bytes per parameter
    assert memory(Model.dense(7e9), Layout(dp=8, zero=1))["model_state"] == 38.5e9
    # one million parameters on four workers: 7, 5.5 and 4 million bytes
    one = Model.dense(1e6)
    assert [memory(one, Layout(dp=4, zero=z))["model_state"] for z in (1, 2, 3)] == \
        [7e6, 5.5e6, 4e6]


def test_tensor_and_pipeline_degrees_divide_the_state():
    assert memory(Model.dense(PSI, layers=80), Layout(tp=8, pp=4))["model_state"] == \
        1.12e12 / 32


def test_7e23_flops_at_4e14_per_second_is_about_55_years():
    assert years(7e23 / 4e14) == pytest.approx(55.45, abs=0.01)
    assert 6 * 8e9 * 15e12 == pytest.approx(7.2e23)  # 6 N D for 8B params, 15T tokens


def test_a_transfer_that_cannot_overlap_adds_to_the_compute():
    link = Link.from_bandwidth(100e6)  # 1 MB at 100 MB/s: 10 ms
    assert iteration_time(2e-3, 1_000_000, link) == pytest.approx(0.012, abs=1e-15)
    assert iteration_time(2e-3, 1_000_000, link, overlap=True) == pytest.approx(0.010)


def test_zero3_sends_one_and_a_half_times_what_ddp_sends():
    m = Model.dense(PSI)
    ddp = traffic(m, Layout(dp=8))["dp"]
    assert ddp == 2 * 7 / 8 * 2 * PSI  # ring all-reduce of the 16-bit gradients
    assert traffic(m, Layout(dp=8, zero=3))["dp"] == 1.5 * ddp
    assert traffic(m, Layout(dp=8, zero=1))["dp"] == ddp


def test_time_to_train_counts_whole_steps():
    assert time_to_train(10, 4, 2.0) == 6.0  # 3 steps
    with pytest.raises(PlanError):
        time_to_train(10, 0, 1.0)


def test_checkpointing_keeps_fewer_activations_for_one_more_forward():
    m = Model.dense(1e6, layers=16, width=10, arrays_per_layer=4)
    none = memory(m, Layout(checkpoint="none"), batch=8)["activations"]
    every4 = memory(m, Layout(checkpoint="sqrt"), batch=8)["activations"]
    assert none == 8 * 16 * 10 * 4 * 2
    assert every4 == 8 * (4 * 10 + 4 * 10 * 4) * 2  # 4 kept inputs + one segment of 4
    dev = Device(flops=1e9)
    plain = predict(m, Layout(), dev, Link(), 8)
    again = predict(m, Layout(checkpoint="sqrt"), dev, Link(), 8)
    assert again.parts["backward"][0] == pytest.approx(plain.parts["backward"][0] * 1.5)
    with pytest.raises(PlanError):
        Layout(checkpoint="every:0").check()


def test_a_step_adds_compute_gradient_sync_and_optimizer():
    m = Model.from_shapes("10x10")  # 110 parameters, 200 FLOPs per example forward
    link = Link(alpha=1e-3, beta=1e-6)
    dev = Device(flops=1e6, optimizer_tensor_time=0.5e-3)
    got = predict(m, Layout(dp=2, precision="fp32"), dev, link, batch=10)
    compute = 5 * 200 / 1e6 * 3  # 5 examples per replica, forward + backward (2x)
    sync = collective_time("all_reduce", 110 * 4, 2, link)
    assert sync == pytest.approx(3 * 1e-3 + 440 * 1e-6)  # 2 rounds and the call check
    assert got.step == pytest.approx(compute + sync + 2 * 0.5e-3)
    hidden = predict(m, Layout(dp=2, precision="fp32", overlap=True), dev, link, batch=10)
    assert hidden.step == pytest.approx(compute + (sync - 5 * 200 / 1e6 * 2) + 1e-3)


def test_the_gradient_sync_costs_each_tensor_on_every_replica_only():
    m = Model.from_shapes("10x10,10x4")  # 4 parameter tensors
    dev = Device(flops=1e6, sync_tensor_time=1e-3)
    alone = predict(m, Layout(precision="fp32"), dev, Link(), batch=12)
    assert alone.parts["sync"] == 0.0  # one replica: nothing to synchronize
    dp = predict(m, Layout(dp=3, precision="fp32"), dev, Link(), batch=12)
    assert dp.parts["sync"] == pytest.approx(4e-3)
    cheaper = predict(m, Layout(dp=3, precision="fp32"), replace(dev, sync_tensor_time=0.0),
                      Link(), batch=12)
    assert dp.step - cheaper.step == pytest.approx(4e-3)
    staged = predict(m, Layout(dp=2, pp=2, microbatches=2, precision="fp32"), dev, Link(),
                     batch=12)
    assert staged.parts["sync"] == pytest.approx(2e-3)  # each stage holds 2 of the tensors


def test_pipeline_layout_gives_the_gpipe_bubble():
    m = Model.dense(8e6, layers=4, width=0)
    got = predict(m, Layout(pp=4, microbatches=8, schedule="gpipe"), Device(flops=1e9),
                  Link(), batch=64)
    assert got.bubble == pytest.approx(3 / 11)


def test_noisy_draws_cost_more_than_mean_costs():
    m = Model.from_shapes("10x10,10x10")
    dev, link = Device(flops=1e6), Link(alpha=1e-4, wake=1e-3, spin=1e-4)
    plain = predict(m, Layout(dp=2, precision="fp32"), dev, link, 10)
    noisy = predict(m, Layout(dp=2, precision="fp32"), dev, link, 10,
                    noise=Noise(compute=[0.5, 1.5]), draws=50)
    assert noisy.parts["draws"] == 50 and noisy.step > plain.step


def test_the_command_line_prints_the_course_numbers(capsys):
    assert main(["--params", "70e9"]) == 0
    assert "total 1,120.00" in capsys.readouterr().out
    assert main(["--params", "70e9", "--dp", "64", "--zero", "3"]) == 0
    assert "total 17.50" in capsys.readouterr().out
    assert main(["--total-flops", "7e23", "--flops", "4e14"]) == 0
    assert "= 55.5 years" in capsys.readouterr().out
    assert main(["--compute-time", "2e-3", "--step-bytes", "1e6", "--bandwidth", "1e8",
                 "--latency", "0"]) == 0
    assert "= 12 ms serial, 10 ms overlapped" in capsys.readouterr().out
    assert main(["--params", "70e9", "--zero", "4"]) == 2


def test_the_command_line_reads_a_calibration(tmp_path, capsys):
    from needle.plan.calibration import Calibration

    path = str(tmp_path / "cal.json")
    Calibration(Link(alpha=1e-4, beta=1e-9), Device(flops=1e9, op_time=1e-5),
                Noise(compute=[1.0, 2.0])).save(path)
    assert main(["--calibration", path, "--layers", "64x100,100x10", "--dp", "2",
                 "--batch", "64", "--draws", "20", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"draws": 20' in out and '"seconds"' in out
