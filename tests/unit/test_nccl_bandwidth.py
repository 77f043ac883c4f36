"""Bus bandwidth formula, thresholds and the nccl-tests parser, checked against real runs."""

from __future__ import annotations

import pytest
from conftest import REAL_FIXTURES

from slurm_resilience.config import Config, load_text
from slurm_resilience.config.loader import ConfigError
from slurm_resilience.config.nccl import GIB, NcclThreshold
from slurm_resilience.nccl import bandwidth as bw

NCCL_TESTS = REAL_FIXTURES / "nccl-tests"
DGX = NCCL_TESTS / "all_reduce_perf_dgx-h100-8gpu-single-node_nvidia-dgxc-benchmarking.txt"
P5 = NCCL_TESTS / "all_reduce_perf_p5-48xlarge-h100_aws-batch_mpirun-prefixed_table-only.txt"


def test_bus_factor_is_two_n_minus_one_over_n() -> None:
    """2(n-1)/n: 0 for one rank, 1 for two, 1.75 for eight."""
    assert bw.bus_factor(1) == 0.0
    assert bw.bus_factor(2) == 1.0
    assert bw.bus_factor(8) == 1.75
    with pytest.raises(ValueError):
        bw.bus_factor(0)


def test_busbw_of_a_known_case() -> None:
    """16 GiB in 62.648 ms over 8 ranks is 274 GB/s algbw and 480 GB/s busbw."""
    size = 17179869184
    assert bw.algbw_gbps(size, 62648e-6) == pytest.approx(274.23, abs=0.01)
    assert bw.busbw_gbps(size, 62648e-6, 8) == pytest.approx(479.90, abs=0.01)


@pytest.mark.parametrize("path", [DGX, P5], ids=["dgx-h100", "p5-h100"])
def test_formula_matches_real_all_reduce_perf_tables(path: object) -> None:
    """Every row of real 8xH100 nccl-tests runs: our algbw and busbw from size and time
    agree with what nccl-tests printed (to its rounding)."""
    rows = bw.parse_all_reduce_perf(path.read_text())  # type: ignore[attr-defined]
    assert len(rows) == 32 and rows[0].size == 8 and rows[-1].size == 16 * GIB
    for row in rows:
        if row.algbw < 1:  # tiny sizes: printed to 2 decimals, the ratio is noise
            continue
        algbw = bw.algbw_gbps(row.size, row.time_us * 1e-6)
        # Times of big sizes are printed with 4-5 significant digits.
        assert algbw == pytest.approx(row.algbw, rel=2e-3, abs=0.006)
        assert bw.busbw_gbps(row.size, row.time_us * 1e-6, 8) == pytest.approx(
            row.busbw, rel=2e-3, abs=0.011)
        # Both printed to 0.01: 1.75 x 0.005 + 0.005 of rounding at most.
        assert row.algbw * bw.bus_factor(8) == pytest.approx(row.busbw, abs=0.014)


def test_real_h100_runs_pass_the_shipped_h100_threshold() -> None:
    """The shipped 8xH100 figure (460 GB/s at 16 GiB) is met by both real healthy runs,
    and would catch a run at 256 MiB, which is far from peak."""
    threshold = bw.pick_threshold(Config().nccl.thresholds, "NVIDIA H100 80GB HBM3", 8,
                                  "intra-node")
    assert threshold is not None and threshold.size == 16 * GIB
    for path in (DGX, P5):
        rows = bw.parse_all_reduce_perf(path.read_text())
        ms = [bw.Measurement(r.size, r.time_us * 1e-6, 8) for r in rows]
        verdict = bw.compare(ms, threshold, "intra-node")
        assert verdict.ok, verdict.reason
        assert 475 < verdict.measured_gbps < 485
        small = [m for m in ms if m.size == 256 * 1024**2]
        assert not bw.compare(small, threshold, "intra-node").ok


def test_rank_count_from_the_device_list() -> None:
    """The dgx run lists 8 ranks; the table-only p5 capture has no header."""
    assert bw.parse_rank_count(DGX.read_text()) == 8
    assert bw.parse_rank_count(P5.read_text()) is None


def test_compare_reason_names_measured_and_expected() -> None:
    """A slow node's reason reads like `nccl allreduce 212 GB/s < 460 (8xH100, 16GiB)`."""
    t = NcclThreshold("H100", 8, 460.0, 16 * GIB)  # type: ignore[arg-type]
    seconds = 16 * GIB / (212e9 / 1.75)
    verdict = bw.compare([bw.Measurement(16 * GIB, seconds, 8)], t, "intra-node")
    assert not verdict.ok
    assert verdict.reason == "nccl allreduce 212 GB/s < 460 (8xH100, 16GiB)"
    ib = bw.compare([bw.Measurement(16 * GIB, seconds, 8)], t, "ib-loopback")
    assert ib.reason.startswith("nccl ib-loopback allreduce 212 GB/s < 460")


def test_compare_uses_the_largest_size_when_the_thresholds_size_was_not_run() -> None:
    """Thresholds hold at their size; without it the closest to peak (largest) is used."""
    t = NcclThreshold("cpu", 2, 0.5, 16 * GIB)  # type: ignore[arg-type]
    ms = [bw.Measurement(1024, 1e-3, 2), bw.Measurement(1024**2, 1e-3, 2)]
    verdict = bw.compare(ms, t, "intra-node")
    assert verdict.size == 1024**2 and verdict.ok
    assert verdict.reason == "nccl allreduce 1.05 GB/s >= 0.5 (2xcpu, 1MiB)"


def test_model_matching_is_by_word() -> None:
    """H100 matches the driver's name for an H100 but not a GH100 or an H1000."""
    assert bw.model_matches("H100", "NVIDIA H100 80GB HBM3")
    assert bw.model_matches("h100", "NVIDIA H100 80GB HBM3")
    assert not bw.model_matches("H100", "NVIDIA GH100")
    assert not bw.model_matches("H100", "NVIDIA H1000")
    thresholds = Config().nccl.thresholds
    assert bw.pick_threshold(thresholds, "NVIDIA A100-SXM4-80GB", 8, "intra-node") is not None
    assert bw.pick_threshold(thresholds, "NVIDIA A100-SXM4-80GB", 4, "intra-node") is None
    assert bw.pick_threshold(thresholds, "NVIDIA H100 80GB HBM3", 8, "ib-loopback") is None


def test_pcie_and_nvl_boards_do_not_get_sxm_thresholds() -> None:
    """H100 PCIe, H200 NVL and A100-PCIE match no shipped entry; B200 and GB200 have their
    own, and the H200 figure is aznhc's 431 GB/s."""
    thresholds = Config().nccl.thresholds
    for name in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL",
                 "NVIDIA A100-PCIE-40GB"):
        assert bw.pick_threshold(thresholds, name, 8, "intra-node") is None, name
    assert bw.model_matches("H100 PCIe", "NVIDIA H100 PCIe")
    h200 = bw.pick_threshold(thresholds, "NVIDIA H200", 8, "intra-node")
    assert h200 is not None and h200.min_busbw_gbps == 431.0
    b200 = bw.pick_threshold(thresholds, "NVIDIA B200", 8, "intra-node")
    gb200 = bw.pick_threshold(thresholds, "NVIDIA GB200", 4, "intra-node")
    assert b200 is not None and b200.model == "B200"
    assert gb200 is not None and gb200.model == "GB200"


def test_size_and_rate_formatting() -> None:
    """Sizes print in binary units, rates with three significant digits."""
    assert bw.fmt_size(16 * GIB) == "16GiB"
    assert bw.fmt_size(1536 * 1024) == "1.5MiB"
    assert bw.fmt_size(100) == "100B"
    assert bw.fmt_gbps(212.4) == "212"
    assert bw.fmt_gbps(0.8123) == "0.812"


def test_config_loads_thresholds_and_rejects_gloo_with_ib_loopback() -> None:
    """The nccl section loads sizes like 16GiB and refuses ib-loopback on gloo."""
    cfg = load_text(Config, "nccl:\n  sizes: [1MiB, 16GiB]\n  thresholds:\n"
                            "    - {model: cpu, gpus: 2, min_busbw_gbps: 0.1, size: 1MiB}\n")
    assert cfg.nccl.sizes == (1024**2, 16 * GIB)
    assert cfg.nccl.thresholds[0].variant == "intra-node"
    with pytest.raises(ConfigError, match="ib-loopback needs backend nccl"):
        load_text(Config, "nccl:\n  backend: gloo\n  variants: [ib-loopback]\n")
    with pytest.raises(ConfigError, match=r"nccl\.thresholds\[0\]: missing required key"):
        load_text(Config, "nccl:\n  thresholds:\n    - {model: cpu}\n")
