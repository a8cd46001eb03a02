"""fw_gemm.linear (fw/csrc/gemm.cpp): x . W^T for a plain bf16 weight, against float32 F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fw.sdk import native

SOURCE = native.INCLUDE / "gemm.cpp"


@pytest.fixture(scope="module")
def linear():
    if not native.load("fw_gemm", SOURCE):
        pytest.skip("no C++ compiler: the native GEMM cannot be built here (the torch paths serve)")
    return torch.ops.fw_gemm.linear


def _case(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1_000_003 + m * 10_007 + n * 101 + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g)
    return x, w, b


def _slack(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What float32 summation in another order may change: 2 K u of the sum of the terms' magnitudes."""
    bound = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    return 2 * max(x.shape[1], 1) * 2.0**-24 * bound


def _check(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == ref.shape and out.dtype == x.dtype
    slack = _slack(x, w, b)
    if out.dtype == torch.float32:
        assert ((out - ref).abs() <= 1e-4 * ref.abs() + slack).all()
        return
    # bf16: the reference rounded, give or take one bf16 ulp (the float32 sums may straddle a rounding point).
    rounded = ref.bfloat16().float()
    top = torch.maximum(out.float().abs(), rounded.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    ulp = torch.exp2(torch.floor(torch.log2(top)) - 7)
    assert ((out.float() - rounded).abs() <= ulp + slack).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k", [64, 130, 896])
@pytest.mark.parametrize("n", [16, 100, 1152])
@pytest.mark.parametrize("m", [1, 3, 16, 37, 128, 257])
def test_matches_float32_linear(linear, m, n, k, with_bias, dtype):
    x, w, b = _case(m, n, k)
    x = x.to(dtype)
    bias = b if with_bias else None
    _check(linear(x, w, bias), x, w, bias)


@pytest.mark.parametrize("m", [1, 37, 128])
def test_bf16_output_is_the_float32_output_rounded_to_nearest_even(linear, m):
    x, w, b = _case(m, 1152, 896, seed=1)
    exact = linear(x.float(), w, b)  # the same float32 sums: x is widened exactly
    assert torch.equal(linear(x, w, b).view(torch.int16), exact.bfloat16().view(torch.int16))


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_bias_of_any_float_dtype(linear, bias_dtype):
    x, w, b = _case(37, 100, 130, seed=2)
    bias = b.to(bias_dtype)
    out = linear(x, w, bias)
    _check(out, x, w, bias.float())
    assert torch.equal(out, linear(x, w, bias.float()))


def test_strided_inputs_give_the_contiguous_result(linear):
    x, w, b = _case(37, 100, 130, seed=3)
    xt = x.t().contiguous().t()  # same values, column-major
    wt = w.t().contiguous().t()
    assert torch.equal(linear(xt, wt, b), linear(x, w, b))


def test_result_does_not_depend_on_the_thread_count(linear):
    x, w, b = _case(64, 1000, 300, seed=4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w, b)
        torch.set_num_threads(max(2, threads))
        many = linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_empty_sizes(linear):
    x, w, b = _case(5, 20, 0)
    assert torch.equal(linear(x, w, b), b.bfloat16().expand(5, 20))  # K = 0: the bias alone
    assert torch.equal(linear(x.float(), w, None), torch.zeros(5, 20))
    assert linear(torch.zeros(0, 8).bfloat16(), torch.zeros(4, 8).bfloat16(), None).shape == (0, 4)
    assert linear(torch.zeros(3, 8), torch.zeros(0, 8).bfloat16(), None).shape == (3, 0)


def test_rejects_mismatched_arguments(linear):
    x, w, b = _case(4, 16, 32)
    with pytest.raises(RuntimeError, match="input size"):
        linear(x, w[:, :16], None)
    with pytest.raises(RuntimeError, match="bias"):
        linear(x, w, b[:8])
    with pytest.raises(RuntimeError, match="weight"):
        linear(x, w.float(), None)


def test_avx2_path_is_built_where_the_cpu_has_it(linear):
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if not flags:
        pytest.skip("no CPU flags listed")
    assert torch.ops.fw_gemm.supported() == ("avx2" in flags and "fma" in flags)
