"""TF32 for fp32 matmuls on CUDA unless ``training.use_deter_comp`` (decided from the device type, so it is
checked here on a cuda-typed device without a GPU)."""

from __future__ import annotations

import pytest
import torch

from mm_core.train.precision import set_fp32_precision, use_tf32


@pytest.fixture
def restore_precision():
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_tf32_only_on_cuda_and_not_deterministic():
    assert use_tf32(torch.device("cuda", 0), deterministic=False)
    assert use_tf32(torch.device("cuda"), deterministic=False)
    assert not use_tf32(torch.device("cuda", 0), deterministic=True)
    for kind in ("cpu", "meta", "xpu"):
        assert not use_tf32(torch.device(kind), deterministic=False)


def test_worker_start_sets_high_matmul_precision_on_cuda_only(restore_precision):
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    assert "cpu default" in set_fp32_precision(torch.device("cpu"), False)
    assert torch.get_float32_matmul_precision() == "highest"
    assert "full fp32" in set_fp32_precision(torch.device("cuda", 0), True)
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    assert "TF32" in set_fp32_precision(torch.device("cuda", 0), False)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
