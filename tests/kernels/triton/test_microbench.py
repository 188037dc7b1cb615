"""The microbench's arithmetic that runs without a GPU: the fit, the floors' bytes, the configs it prints, its CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from dspark_sidecar.kernels.triton import attention, gemm, microbench  # noqa: E402
from dspark_sidecar.kernels.triton.microbench import (  # noqa: E402
    attention_splits, fit_fixed_and_rate, gemm_bytes, gemm_label, main, norm_bytes, prelude_bytes,
)
from dspark_sidecar.kernels.weights import NormFolded  # noqa: E402


def test_fit_recovers_fixed_cost_and_rate():
    """Points on t = 5 us + bytes / 3.9 TB/s, with +-0.2 us of alternating noise, give both back."""
    pts = [(b, 5e-6 + b / 3.9e12 + (0.2e-6 if i % 2 else -0.2e-6)) for i, b in enumerate((28e6, 75e6, 150e6, 300e6, 450e6))]
    t0, rate = fit_fixed_and_rate(pts)
    assert abs(t0 - 5e-6) < 0.3e-6, t0
    assert abs(rate / 3.9e12 - 1) < 0.02, rate


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_fixed_and_rate([(1e6, 1e-6), (1e6, 2e-6)])


@pytest.mark.parametrize("argv", [["--rows", "8"], ["--rows", "7", "3"], ["--rows", "0"], ["--context", "-1"]])
def test_rows_that_are_not_whole_requests_are_refused_before_the_gpu(argv, capsys):
    """r = rows / 7 requests: 8 rows built 8-row activations beside 7 positions and failed deep in a
    kernel; the flag is refused first, with its name (and on a machine with no GPU, before CUDA)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and argv[0] in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--fit", "--rows", "0"], ["--fit", "--rows", "-7"], ["--fit", "--fit-k", "0"],
                                  ["--fit", "--fit-k", "6144", "-1"]])
def test_fit_refuses_rows_or_k_below_one_before_the_gpu(argv, capsys):
    """--fit skipped the rows check: 0 rows timed launches that return at once, -7 failed in torch.randn
    after the 2 GB bandwidth copy, and K 0 gave every size 0 bytes, refused by the fit only at the end."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and ("--fit-k" if "--fit-k" in argv else "--rows") in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--fit", "--profile", "--rows", "8"], ["--tune", "--fit"], ["--profile", "--tune"]])
def test_only_modes_are_refused_together_before_the_gpu(argv, capsys):
    """--tune, --profile and --fit each run only themselves: --fit --profile skipped the rows check (8 rows
    profiled into a kernel's shape error after the bandwidth copy), and --fit or --profile with --tune
    dropped the tuning without a word."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_json_with_profile_is_refused_before_the_gpu(capsys):
    """--profile prints its figures only: with --json the run ended well and wrote no file."""
    with pytest.raises(SystemExit) as exit_:
        main(["--profile", "--json", "profile.json"])
    assert exit_.value.code == 2 and "--json" in capsys.readouterr().err


def test_json_folder_is_made_before_the_gpu_work(tmp_path, monkeypatch, capsys):
    """The figures were written after every timing, into a folder that had to exist: a missing one raised
    FileNotFoundError at the end, and one that cannot be made is refused by name before the GPU."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["--fit", "--rows", "7", "--json", str(blocker / "fit.json")])
    assert exit_.value.code == 2 and "--json" in capsys.readouterr().err
    monkeypatch.setattr(microbench, "copy_bandwidth", lambda dev: 4e12)
    monkeypatch.setattr(microbench, "bench_fit", lambda rows, k, bw, dev: [dict(op="fit triton", rows=rows, k=k)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "stand-in")
    out = tmp_path / "new" / "fit.json"
    main(["--fit", "--rows", "7", "--fit-k", "6144", "--json", str(out)])
    assert json.loads(out.read_text())["results"] == [dict(op="fit triton", rows=7, k=6144)]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "mxfp8"])
def test_sweep_labels_are_the_configs_launched(fp8, monkeypatch):
    """The MXFP8 SWEEP rows leave their stages to the planner (None): the label printed "stNone" for every
    one of them, not the stage count the launch ran."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(microbench, "_per_call", lambda make, nbytes: (make(), 1e-6)[1])
    launched, printed = [], []
    wdt = "fp8" if fp8 else "bf16"
    microbench._sweep("gate_up norm_linear_swiglu", 56, 6144, 6144, "swiglu", fp8, wdt, 1, launched.append,
                      lambda *a, cfg: printed.append(cfg), None)
    assert len(launched) == len(printed) == len(microbench.SWEEP[wdt])
    for c, label in zip(launched, printed, strict=True):
        assert label == (f"bn{c.block_n} bk{c.block_k} pps{label.split('pps')[1].split()[0]} w{c.num_warps} "
                         f"st{c.num_stages} s{c.split_k}")


def test_swiglu_floor_counts_its_half_width_output():
    """gate|up [2f, k] with SwiGLU writes f columns: the floor counted 2f (too high a floor, too low an x)."""
    rows, f, k = 56, 3072, 6144
    assert gemm_bytes(rows, 2 * f, k, "swiglu", False) == 2 * 2 * f * k + 2 * rows * (k + f)
    assert gemm_bytes(rows, 2 * f, k, "norm", False) == 2 * 2 * f * k + 2 * rows * (k + 2 * f)
    assert gemm_bytes(rows, 2 * f, k, "plain", True) == 2 * f * k + 2 * f * k // 32 + 2 * rows * (k + 2 * f)


def test_norm_and_prelude_floors_count_every_operand():
    """Floor = bytes the op must move, as the GEMMs' count weight, x and output: rms_norm's floor left out
    its weight (7% of its bytes at 7 rows), the prelude's its fp32 cos/sin rows, slots and norm weights."""
    h, d, hq, hk, rot = microbench.H, microbench.D, microbench.HQ, microbench.HK, microbench.ROT
    assert (h, d, hq, hk, rot) == (6144, 128, 16, 1, 64)
    assert norm_bytes(7) == 7 * h * 2 + 7 * h * 2 + h * 2  # x, y, weight in bf16
    # per row: qkv [2304] read, q [16, 128] written, K and V [1, 128] written (bf16); cos and sin [32]
    # (fp32), the int64 slot; then q_norm and k_norm [128] (bf16) once
    assert prelude_bytes(56) == 56 * (2304 * 2 + 2048 * 2 + 2 * 128 * 2 + 2 * 32 * 4 + 8) + 2 * 128 * 2


@pytest.mark.parametrize("kind", ["norm", "swiglu"])
def test_printed_gemm_config_is_the_split_the_launch_uses(kind, monkeypatch):
    """A folded-norm GEMM carries the x^2 column (one more column tile, so fewer K-ranges): the label was
    `plan` without it and printed 4 K-ranges where the launch ran 2 (4 stand-in SMs under the interpreter;
    2 column tiles and 2 programs per SM for qkv, 1 gate|up tile pair at 1 program per SM, its deep pipeline)."""
    rows, k, n_out = 7, 1024, 256
    x = torch.randn(rows, k).to(torch.bfloat16)
    nw = torch.randn(k).to(torch.bfloat16)
    w = NormFolded.fold(torch.randn(n_out, k).to(torch.bfloat16), nw)
    launched = []
    # target: a workspace [split, M, N], or out [M, N] itself when there is one K-range
    monkeypatch.setattr(gemm, "_launch", lambda *a: launched.append(a[7].shape[0] if a[7].dim() == 3 else 1))
    monkeypatch.setattr(gemm, "_finalize", lambda *a, **kw: None)
    gemm.gemm(x, w, nw, 1e-6, swiglu=(1.702, 7.0) if kind == "swiglu" else None)
    assert len(launched) == 1 and launched[0] > 1
    assert f" s{launched[0]} " in gemm_label(x, w, kind)


class _Planned(Exception):
    pass


@pytest.mark.parametrize("context", [0, 60, 100, 4096])
def test_attention_splits_are_the_kernels(context, monkeypatch):
    """The kernel tiles the block table's whole pages less the narrow tile (73 keys at context 60: 2 tiles
    of 64), the label the keys seen less it (60 keys: 1 tile), so it printed 1 split where 2 ran. The
    kernel's own count is caught where paged_window_attention asks num_splits, before any launch."""
    asked = []

    def spy(r, hk, keys, sms, *a):
        asked.append((r, hk, keys, sms))
        raise _Planned

    kv, tables, seq_lens, positions, _ = microbench._kv_step(1, context, torch.device("cpu"))
    q = torch.zeros(7, microbench.HQ, microbench.D, dtype=torch.bfloat16)
    monkeypatch.setattr(attention, "sms_of", lambda t: 132)
    monkeypatch.setattr(attention, "num_splits", spy)
    with pytest.raises(_Planned):
        attention.paged_window_attention(q, kv, positions, seq_lens, tables, 7, microbench.WINDOW, 0.1)
    with pytest.raises(_Planned):
        attention_splits(1, context, 132)
    assert asked[1] == asked[0]
