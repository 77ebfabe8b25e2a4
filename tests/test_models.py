"""The bundled model zoo: every model runs in ONNX Runtime, passes the checker, has the
reference parameter count, computes what its reference computes, and builds deterministically."""
from __future__ import annotations

import functools
import json
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper

from memsched import models
from memsched.models import count_parameters
from memsched.models.cnn import _adaptive_avg_pool
from memsched.models.layers import GraphBuilder

from .conftest import run_cli

SMALL_VOCAB = 1000
# Small configurations for the runtime tests, and the logits shape each must give.
SMALL = {
    "mlp": (dict(batch=4), [4, 10]),
    "vgg16": (dict(batch=2, size=32, hidden=64, classes=10), [2, 10]),
    "resnet18": (dict(batch=2, size=32), [2, 1000]),
    "resnet50": (dict(batch=2, size=32, classes=10), [2, 10]),
    "mobilenetv2": (dict(batch=2, size=32), [2, 1000]),
    "unet2d": (dict(batch=1, size=32, width=16), [1, 2, 32, 32]),
    "unet3d": (dict(batch=1, size=16, width=8), [1, 3, 16, 16, 16]),
    "bert-base": (dict(batch=2, seq=16, layers=2, vocab=SMALL_VOCAB), [2, 2]),
    "gpt2": (dict(batch=2, seq=16, layers=2, vocab=SMALL_VOCAB), [2, 16, SMALL_VOCAB]),
    "dcgan-generator": (dict(batch=2, size=16, nz=16, ngf=8), [2, 3, 16, 16]),
    "dcgan-discriminator": (dict(batch=2, size=16, ndf=8), [2]),
}
OUTPUT_NAMES = {"dcgan-generator": "image"}    # every other model's first output is 'logits'

# Parameter counts of the reference implementations at default size.
REFERENCE_PARAMETERS = {
    # LeNet-300-100 (LeCun et al. 1998): 784*300+300 + 300*100+100 + 100*10+10
    "mlp": 266_610,
    # torchvision.models.<name>() with 1000 classes: sum(p.numel() for p in m.parameters())
    "vgg16": 138_357_544,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "mobilenetv2": 3_504_872,
    # milesial/Pytorch-UNet UNet(n_channels=3, n_classes=2, bilinear=False)
    "unet2d": 31_037_698,
    # HF bert-base-uncased BertModel (encoder + pooler) + classifier nn.Linear(768, 2)
    "bert-base": 109_482_240 + 768 * 2 + 2,
    # HF gpt2 GPT2LMHeadModel: lm_head tied to transformer.wte, no head bias
    "gpt2": 124_439_808,
    # PyTorch examples/dcgan Generator(ngpu) and Discriminator(ngpu) at nz=100, ngf=ndf=64, nc=3
    # (the discriminator's Sigmoid has no parameters)
    "dcgan-generator": 3_576_704,
    "dcgan-discriminator": 2_765_568,
}
# Çiçek et al. (2016), 3 input channels, 3 labels: "19069955 parameters in total", which
# counts no BN affine parameters; the 14 BN layers add gamma and beta on 2,336 channels.
UNET3D_PAPER = dict(channels=3, classes=3)
UNET3D_PAPER_PARAMETERS = 19_069_955 + 2 * 2_336


@functools.lru_cache(maxsize=None)
def small(name: str, **extra) -> onnx.ModelProto:
    """Cached small build; tests must not mutate it."""
    return models.build(name, **SMALL[name][0], **extra)


def session(model: onnx.ModelProto, level=ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def feed(sess: ort.InferenceSession, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    (inp,) = sess.get_inputs()
    if inp.type == "tensor(int64)":
        return {inp.name: rng.integers(0, SMALL_VOCAB, inp.shape)}
    dtype = np.float16 if inp.type == "tensor(float16)" else np.float32
    return {inp.name: rng.standard_normal(inp.shape).astype(dtype)}


def ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def attr(node: onnx.NodeProto, name: str):
    (value,) = [onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == name]
    return value


# -- every model runs -------------------------------------------------------------------
@pytest.mark.parametrize("name", models.NAMES)
def test_small_model_runs_with_static_logits(name):
    model = small(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 17 and model.ir_version == 8
    sess = session(model)
    assert sess.get_providers() == ["CPUExecutionProvider"]
    (logits,) = sess.run(None, feed(sess))
    (declared,) = model.graph.output
    assert declared.name == OUTPUT_NAMES.get(name, "logits")
    assert [d.dim_value for d in declared.type.tensor_type.shape.dim] == SMALL[name][1]
    assert list(logits.shape) == SMALL[name][1]
    # sensible init scale: finite, not collapsed, not exploding
    assert np.isfinite(logits).all() and 1e-4 < np.abs(logits).max() < 100


# -- parameter counts -------------------------------------------------------------------
# Counted on the materialised default-size graph (VGG-16, the largest, builds in ~3 s).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "vgg16" else n
                                  for n in sorted(REFERENCE_PARAMETERS)])
def test_parameter_count_matches_reference(name):
    model = models.build(name)
    assert all(t.raw_data for t in model.graph.initializer)
    assert count_parameters(model) == REFERENCE_PARAMETERS[name]


def test_unet3d_parameter_count_matches_paper():
    model = models.build("unet3d", weights=False, **UNET3D_PAPER)
    assert count_parameters(model) == UNET3D_PAPER_PARAMETERS


@pytest.mark.parametrize("name", models.NAMES)
def test_shape_only_build_is_the_same_graph(name):
    full, bare = small(name), models.build(name, **SMALL[name][0], weights=False)
    assert full.graph.node == bare.graph.node
    assert [(t.name, t.data_type, list(t.dims)) for t in full.graph.initializer] == \
           [(t.name, t.data_type, list(t.dims)) for t in bare.graph.initializer]
    assert all(t.raw_data for t in full.graph.initializer)
    assert not any(t.raw_data for t in bare.graph.initializer)


# -- determinism ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet18", "unet3d", "gpt2"])
def test_same_arguments_give_identical_bytes(name):
    again = models.build(name, **SMALL[name][0])
    assert again.SerializeToString() == small(name).SerializeToString()
    other = models.build(name, **SMALL[name][0], seed=1)
    assert other.SerializeToString() != again.SerializeToString()


# -- torch-export op patterns and names (shape-only graphs at default size) --------------
def test_resnet50_matches_torchvision_export():
    model = models.build("resnet50", weights=False)
    names = {t.name for t in model.graph.initializer}
    assert {"conv1.weight", "bn1.weight", "layer1.0.bn1.running_mean",
            "layer4.2.conv3.weight", "layer1.0.downsample.0.weight", "fc.bias"} <= names
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 53 and all(len(n.input) == 2 for n in convs)   # bias=False
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(bns) == 53 and all(len(n.output) == 1 for n in bns)      # eval form
    # running stats are initializers but buffers, which count_parameters leaves out
    stats = {t.name: math.prod(t.dims) for t in model.graph.initializer
             if t.name.endswith(("running_mean", "running_var"))}
    assert set(stats) == {name for n in bns for name in n.input[3:]}
    total = sum(math.prod(t.dims) for t in model.graph.initializer)
    assert count_parameters(model) == total - sum(stats.values())
    assert not any(a.name == "training_mode" for n in bns for a in n.attribute)
    assert ops(model)[-4:] == ["Relu", "GlobalAveragePool", "Flatten", "Gemm"]
    assert ops(model).count("Add") == 16
    assert model.graph.node[0].name == "/conv1/Conv"


def test_vgg16_pools_as_exported_at_224_and_exactly_when_small():
    default = models.build("vgg16", weights=False)
    (pool,) = [n for n in default.graph.node if n.op_type == "AveragePool"]
    assert attr(pool, "kernel_shape") == [1, 1]
    assert all(len(n.input) == 3 for n in default.graph.node if n.op_type == "Conv")
    assert ops(default).count("Gemm") == 3 and ops(default).count("MaxPool") == 5
    small_vgg = small("vgg16")
    assert "AveragePool" not in ops(small_vgg) and ops(small_vgg).count("MatMul") == 2


def test_adaptive_avg_pool_follows_torch_bins():
    # torch AdaptiveAvgPool2d((7, 7)) on 3x3: bin i = [floor(3i/7), ceil(3(i+1)/7))
    bins = [(0, 1), (0, 1), (0, 2), (1, 2), (1, 3), (2, 3), (2, 3)]
    b = GraphBuilder("pool")
    x = b.input("input", [1, 2, 3, 3])
    model = b.finish(_adaptive_avg_pool(b, "avgpool", x, 3, 7), [1, 2, 7, 7])
    image = np.random.default_rng(0).standard_normal((1, 2, 3, 3)).astype(np.float32)
    (pooled,) = session(model).run(None, {"input": image})
    expected = np.array([[image[..., r0:r1, c0:c1].mean(axis=(-1, -2)) for c0, c1 in bins]
                         for r0, r1 in bins]).transpose(2, 3, 0, 1)
    np.testing.assert_allclose(pooled, expected, rtol=1e-5, atol=1e-6)


def test_mobilenetv2_uses_relu6_and_depthwise_convs():
    model = models.build("mobilenetv2", weights=False)
    assert ops(model).count("Clip") == 35
    depthwise = [n for n in model.graph.node if n.op_type == "Conv" and attr(n, "group") > 1]
    assert len(depthwise) == 17
    assert "features.18.0.weight" in {t.name for t in model.graph.initializer}


def test_bert_export_patterns():
    model = models.build("bert-base", weights=False)
    counts = {op: ops(model).count(op) for op in ("Erf", "Softmax", "LayerNormalization",
                                                  "Gather", "Tanh", "Gemm")}
    assert counts == {"Erf": 12, "Softmax": 12, "LayerNormalization": 25, "Gather": 4,
                      "Tanh": 1, "Gemm": 2}
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    assert shapes["bert.embeddings.word_embeddings.weight"] == [30522, 768]
    assert shapes["bert.encoder.layer.11.attention.self.query.weight"] == [768, 768]
    assert shapes["classifier.weight"] == [2, 768]
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64


def test_gpt2_has_causal_mask_and_tied_head():
    model = models.build("gpt2", weights=False)
    assert ops(model).count("Where") == 12 and ops(model).count("Tanh") == 12
    names = {t.name for t in model.graph.initializer}
    assert not any(name.startswith("lm_head") for name in names)
    head = model.graph.node[-1]
    assert head.op_type == "MatMul" and head.output[0] == "logits"
    producer = {out: n for n in model.graph.node for out in n.output}[head.input[1]]
    assert producer.op_type == "Transpose" and producer.input == ["transformer.wte.weight"]
    users = [n.op_type for n in model.graph.node if "transformer.wte.weight" in n.input]
    assert users == ["Gather", "Transpose"]
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [4, 1024, 50257]


# -- numerics against plain numpy re-implementations of the references ------------------
def _weights(model):
    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}


def _layer_norm(x, w, prefix, eps):
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[prefix + ".weight"] + w[prefix + ".bias"]


def _attention(q, k, v, heads, causal):
    n, length, width = q.shape
    split = lambda t: t.reshape(n, length, heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
    scores = split(q) @ split(k).transpose(0, 1, 3, 2) / np.sqrt(width // heads)
    if causal:
        scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ split(v)).transpose(0, 2, 1, 3).reshape(n, length, width)


TINY = dict(batch=2, seq=8, layers=2, hidden=32, heads=4, vocab=50, max_positions=16)


def test_gpt2_computes_hf_gpt2():
    model = models.build("gpt2", **TINY)
    w = _weights(model)
    ids = np.random.default_rng(3).integers(0, TINY["vocab"], (2, 8))
    (logits,) = session(model).run(None, {"input_ids": ids})
    x = w["transformer.wte.weight"][ids] + w["transformer.wpe.weight"][:8]
    for i in range(TINY["layers"]):
        p = f"transformer.h.{i}"
        conv1d = lambda t, m: t @ w[f"{p}.{m}.weight"] + w[f"{p}.{m}.bias"]  # noqa: E731
        q, k, v = np.split(conv1d(_layer_norm(x, w, f"{p}.ln_1", 1e-5), "attn.c_attn"), 3, -1)
        x = x + conv1d(_attention(q, k, v, TINY["heads"], causal=True), "attn.c_proj")
        y = conv1d(_layer_norm(x, w, f"{p}.ln_2", 1e-5), "mlp.c_fc")
        y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
        x = x + conv1d(y, "mlp.c_proj")
    expected = _layer_norm(x, w, "transformer.ln_f", 1e-5) @ w["transformer.wte.weight"].T
    np.testing.assert_allclose(logits, expected, atol=2e-5)


def test_bert_computes_hf_bert_classifier():
    from math import erf
    model = models.build("bert-base", classes=3, **TINY)
    w = _weights(model)
    ids = np.random.default_rng(4).integers(0, TINY["vocab"], (2, 8))
    (logits,) = session(model).run(None, {"input_ids": ids})
    linear = lambda t, p: t @ w[p + ".weight"].T + w[p + ".bias"]  # noqa: E731
    e = "bert.embeddings"
    x = (w[f"{e}.word_embeddings.weight"][ids] + w[f"{e}.token_type_embeddings.weight"][0]
         + w[f"{e}.position_embeddings.weight"][:8])
    x = _layer_norm(x, w, f"{e}.LayerNorm", 1e-12)
    for i in range(TINY["layers"]):
        p = f"bert.encoder.layer.{i}"
        q, k, v = (linear(x, f"{p}.attention.self.{m}") for m in ("query", "key", "value"))
        y = linear(_attention(q, k, v, TINY["heads"], causal=False), f"{p}.attention.output.dense")
        x = _layer_norm(y + x, w, f"{p}.attention.output.LayerNorm", 1e-12)
        y = linear(x, f"{p}.intermediate.dense")
        y = y * 0.5 * (1 + np.vectorize(erf)(y / np.sqrt(2)))
        x = _layer_norm(linear(y, f"{p}.output.dense") + x, w, f"{p}.output.LayerNorm", 1e-12)
    expected = linear(np.tanh(linear(x[:, 0], "bert.pooler.dense")), "classifier")
    np.testing.assert_allclose(logits, expected, atol=1e-5)


def test_gpt2_is_causal():
    sess = session(small("gpt2"))
    ids = feed(sess)["input_ids"]
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % SMALL_VOCAB
    (before,), (after,) = sess.run(None, {"input_ids": ids}), sess.run(None, {"input_ids": changed})
    np.testing.assert_array_equal(before[:, :-1], after[:, :-1])
    assert np.abs(before[:, -1] - after[:, -1]).max() > 1e-3


# -- batch norm in training mode, float16 -----------------------------------------------
# unet3d is the case where onnxruntime 1.31 goes wrong if the running stats dangle
@pytest.mark.parametrize("name, options", [("resnet18", dict(batch=4, size=32)),
                                           ("unet3d", dict(batch=2, size=16, width=8))])
def test_bn_training_uses_batch_statistics_and_exposes_running_stats(name, options):
    model = models.build(name, bn_training=True, **options)
    onnx.checker.check_model(model, full_check=True)
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert all(len(n.output) == 3 and attr(n, "training_mode") == 1 for n in bns)
    outputs = [o.name for o in model.graph.output]
    assert outputs[0] == "logits"
    assert outputs[1:] == [out for n in bns for out in n.output[1:]]
    sess = session(model)
    inputs = feed(sess)
    first, second = sess.run(None, inputs), sess.run(None, inputs)
    unoptimised = session(model, ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, inputs)
    for a, b, c in zip(first, second, unoptimised):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)
    # the first BN's updated running var is 0.9 * 1 + 0.1 * the batch variance (not 1)
    assert np.abs(first[2] - 1).max() > 1e-2
    (eval_logits,) = session(models.build(name, **options)).run(None, inputs)
    assert np.abs(eval_logits - first[0]).max() > 1e-2


@pytest.mark.parametrize("name", ["resnet18", "gpt2"])
def test_float16_models_run(name):
    model = small(name, dtype="float16")
    assert {t.data_type for t in model.graph.initializer} == {TensorProto.FLOAT16}
    reference_session = session(small(name))
    inputs = feed(reference_session)
    (reference,) = reference_session.run(None, inputs)
    (logits,) = session(model).run(None, {k: v.astype(np.float16) if v.dtype == np.float32
                                          else v for k, v in inputs.items()})
    assert logits.dtype == np.float16 and np.isfinite(logits).all()
    np.testing.assert_allclose(logits.astype(np.float32), reference, atol=0.05)


# -- registry ---------------------------------------------------------------------------
def test_catalog_lists_every_model_with_its_count():
    entries = models.catalog()
    assert [e["name"] for e in entries] == list(models.NAMES) == [
        "mlp", "vgg16", "resnet18", "resnet50", "mobilenetv2", "unet2d", "unet3d",
        "bert-base", "gpt2", "dcgan-generator", "dcgan-discriminator"]
    for entry in entries:
        assert entry["description"]
        assert entry["parameters"] == REFERENCE_PARAMETERS.get(entry["name"],
                                                               entry["parameters"])
        assert "batch" in entry["defaults"] and "weights" not in entry["defaults"]
    by_name = {e["name"]: e for e in entries}
    assert by_name["unet3d"]["parameters"] == count_parameters(
        models.build("unet3d", weights=False))
    assert by_name["gpt2"]["defaults"]["seq"] == 1024
    json.dumps(entries)


@pytest.mark.parametrize("name, options, message", [
    ("resnet51", {}, "unknown model 'resnet51'"),
    ("resnet50", {"seq": 16}, "option 'seq' does not apply to resnet50"),
    ("gpt2", {"classes": 3}, "option 'classes' does not apply to gpt2"),
    ("vgg16", {"bn_training": True}, "option 'bn_training' does not apply to vgg16"),
    ("mlp", {"dtype": "bfloat16"}, "dtype must be one of float32, float16"),
    ("mlp", {"batch": 0}, "batch must be a positive integer"),
    ("unet2d", {"size": 100}, "size must be divisible by 16"),
    ("vgg16", {"size": 16}, "vgg16 needs size >= 32"),
    ("gpt2", {"seq": 2048}, "seq must be in 1..1024"),
])
def test_build_rejects_bad_requests_in_one_line(name, options, message):
    with pytest.raises(ValueError) as error:
        models.build(name, weights=False, **options)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_export_writes_a_loadable_model(tmp_path):
    path = models.export("mlp", tmp_path / "mlp.onnx", batch=2)
    loaded = onnx.load(path)
    assert loaded.SerializeToString() == models.build("mlp", batch=2).SerializeToString()
    assert {p.key: p.value for p in loaded.metadata_props}["memsched.model"] == "mlp"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.onnx"]
    with pytest.raises(ValueError, match="needs weights"):
        models.export("mlp", tmp_path / "bare.onnx", weights=False)


# -- command line -----------------------------------------------------------------------
def test_cli_models_list_json():
    result = run_cli("models", "list", "--json")
    assert result.returncode == 0, result.stderr
    entries = {e["name"]: e for e in json.loads(result.stdout)["models"]}
    assert list(entries) == list(models.NAMES)
    assert entries["resnet50"]["parameters"] == REFERENCE_PARAMETERS["resnet50"]
    assert entries["bert-base"]["description"]


def test_cli_models_list_table():
    result = run_cli("models", "list")
    assert result.returncode == 0, result.stderr
    assert "gpt2" in result.stdout and "124,439,808" in result.stdout


def test_cli_models_export(tmp_path):
    out = tmp_path / "r18.onnx"
    result = run_cli("models", "export", "resnet18", "-o", out, "--batch", "2", "--size", "32")
    assert result.returncode == 0, result.stderr
    assert "11,689,512 parameters" in result.stdout
    expected = models.build("resnet18", batch=2, size=32)
    assert onnx.load(out).SerializeToString() == expected.SerializeToString()


@pytest.mark.parametrize("args, message", [
    (["models", "export", "resnet18", "--layers", "2"], "option 'layers' does not apply to resnet18"),
    (["models", "export", "resnet5"], "unknown model 'resnet5'"),
])
def test_cli_models_export_errors_are_one_line(tmp_path, args, message):
    out = tmp_path / "m.onnx"
    result = run_cli(*args, "-o", out)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


def test_cli_models_export_needs_output():
    result = run_cli("models", "export", "mlp")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "-o/--output" in result.stderr


# -- DCGAN ------------------------------------------------------------------------------
def test_dcgan_layers_follow_the_pytorch_example():
    """64x64: the generator's ConvTransposes 100->512 (4x4), then 4/2/1 up to 3 channels and
    Tanh; the discriminator's Convs 4/2/1 with LeakyReLU(0.2), BN on all but the first, a last
    4x4 conv to one logit per image; no conv has a bias."""
    gen, disc = (models.build(name, weights=False) for name in ("dcgan-generator", "dcgan-discriminator"))
    shapes = [{t.name: list(t.dims) for t in m.graph.initializer} for m in (gen, disc)]
    ups = [n for n in gen.graph.node if n.op_type == "ConvTranspose"]
    assert [shapes[0][n.input[1]] for n in ups] == [[100, 512, 4, 4], [512, 256, 4, 4], [256, 128, 4, 4],
                                                  [128, 64, 4, 4], [64, 3, 4, 4]]
    assert [(attr(n, "strides"), attr(n, "pads")) for n in ups] == [([1, 1], [0] * 4)] + [([2, 2], [1] * 4)] * 4
    assert [n.op_type for n in gen.graph.node if n.op_type in ("BatchNormalization", "Relu", "Tanh")] == \
        ["BatchNormalization", "Relu"] * 4 + ["Tanh"]
    convs = [n for n in disc.graph.node if n.op_type == "Conv"]
    assert [shapes[1][n.input[1]] for n in convs] == [[64, 3, 4, 4], [128, 64, 4, 4], [256, 128, 4, 4],
                                                    [512, 256, 4, 4], [1, 512, 4, 4]]
    assert sum(n.op_type == "BatchNormalization" for n in disc.graph.node) == 3
    assert [attr(n, "alpha") for n in disc.graph.node if n.op_type == "LeakyRelu"] == [pytest.approx(0.2)] * 4
    assert all(len(n.input) == 2 for n in ups + convs)
    assert not any(n.op_type == "Sigmoid" for n in disc.graph.node)
    assert [d.dim_value for d in gen.graph.output[0].type.tensor_type.shape.dim] == [64, 3, 64, 64]
    assert [d.dim_value for d in disc.graph.output[0].type.tensor_type.shape.dim] == [64]


def test_dcgan_init_is_the_examples():
    """Conv weights N(0, 0.02), BN weights N(1, 0.02), BN biases 0 (weights_init)."""
    model = models.build("dcgan-discriminator")
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    conv = values["main.5.weight"]
    assert abs(conv.mean()) < 1e-3 and conv.std() == pytest.approx(0.02, rel=0.02)
    bn = np.concatenate([values[f"main.{i}.weight"] for i in (3, 6, 9)])
    assert abs(bn.mean() - 1) < 0.005 and bn.std() == pytest.approx(0.02, rel=0.15) and bn.std() > 0
    assert not np.concatenate([values[f"main.{i}.bias"] for i in (3, 6, 9)]).any()


@pytest.mark.parametrize("size, message", [(48, "power of two"), (8, ">= 16")])
def test_dcgan_sizes_are_powers_of_two(size, message):
    with pytest.raises(ValueError, match=message):
        models.build("dcgan-generator", size=size, weights=False)
