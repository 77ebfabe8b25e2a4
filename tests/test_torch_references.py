"""The PyTorch modules the budget sweep measures PyTorch's peak on are the models memsched
plans: the bundled model's weights load into the module name for name, and the two compute
the same outputs (the module in PyTorch, the bundled model in a plain ONNX Runtime session)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnxruntime
import pytest
from onnx import numpy_helper

from memsched import models

torch = pytest.importorskip("torch")

spec = importlib.util.spec_from_file_location("torch_models", Path(__file__).resolve().parent.parent / "bench" /
                                              "torch_models.py")
torch_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(torch_models)


def _load_bundled(module, model) -> list[str]:
    """Load the bundled model's weights into `module` by name: its parameters and persistent
    buffers (BatchNorm's step counters aside) are the model's weights, name for name and
    shape for shape."""
    weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    state = {name: value for name, value in module.state_dict().items() if not name.endswith("num_batches_tracked")}
    assert set(state) <= set(weights), sorted(set(state) - set(weights))
    assert {name: tuple(value.shape) for name, value in state.items()} == \
        {name: tuple(weights[name].shape) for name in state}
    module.load_state_dict({name: weights[name] for name in state}, strict=False)
    return sorted(set(weights) - set(state))


def _onnx_output(model, feeds: dict) -> np.ndarray:
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def test_milesial_unet_is_the_bundled_unet2d():
    model = models.build("unet2d", batch=2, size=32, width=4, seed=3)
    module = torch_models.milesial_unet(width=4)
    assert _load_bundled(module, model) == []
    module.eval()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        ours = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, _onnx_output(model, {"input": x}), rtol=1e-4, atol=1e-4)
    assert sum(p.numel() for p in torch_models.milesial_unet().parameters()) == 31_037_698


def test_hf_gpt2_is_the_bundled_gpt2():
    sizes = {"layers": 2, "hidden": 16, "heads": 4, "vocab": 37}
    model = models.build("gpt2", batch=2, seq=8, max_positions=12, seed=3, **sizes)
    module = torch_models.hf_gpt2(positions=12, **sizes)
    assert _load_bundled(module, model) == []
    ids = np.random.default_rng(0).integers(0, sizes["vocab"], (2, 8))
    with torch.no_grad():
        ours = module(torch.from_numpy(ids)).numpy().reshape(2, 8, sizes["vocab"])
    np.testing.assert_allclose(ours, _onnx_output(model, {"input_ids": ids}), rtol=1e-4, atol=1e-4)
