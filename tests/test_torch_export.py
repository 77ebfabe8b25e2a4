"""memsched.torch.export_for_training: the legacy exporter's graph, as memsched trains it."""
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import helper, numpy_helper

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from memsched import frontend  # noqa: E402
from memsched.errors import UserError  # noqa: E402
from memsched.torch import STATE_DICT_NAMES_KEY, export_for_training, state_dict_names  # noqa: E402
from memsched.runtime import Trainer  # noqa: E402
from memsched.passes.training import TRAINING_KEY, build_training_step  # noqa: E402

BATCH = 4


class SmallCNN(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, stride=2), nn.BatchNorm2d(16, momentum=0.2)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.drop(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)))


def trained_cnn(dropout: float = 0.0) -> SmallCNN:
    """A SmallCNN whose BN running statistics are not the initial ones (one train-mode forward)."""
    torch.manual_seed(0)
    module = SmallCNN(dropout)
    with torch.no_grad():
        module.train()(torch.randn(8, 1, 12, 12))
        for bn in (module.bn1, module.bn2):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return module


def example() -> torch.Tensor:
    return torch.randn(BATCH, 1, 12, 12, generator=torch.Generator().manual_seed(1))


def dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(module, the exported ModelProto, its path, the module's state_dict before the export)."""
    module = trained_cnn()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    returned = export_for_training(module, (example(),), path, input_names=["input"], output_names=["logits"])
    assert returned == str(path)
    return module, onnx.load(returned), returned, before


def test_batchnorm_and_state_dict_names_are_kept(exported):
    module, model, path, before = exported
    bns = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(bns) == 2
    assert not any(n.op_type == "Conv" and len(n.input) == 3 and n.input[1].startswith("onnx::")
                   for n in model.graph.node)
    momentum = {n.input[1].split(".")[0]: next(helper.get_attribute_value(a) for a in n.attribute
                                               if a.name == "momentum") for n in bns}
    assert momentum == pytest.approx({"bn1": 0.9, "bn2": 0.8})
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    state = module.state_dict()
    wanted = [k for k in state if not k.endswith("num_batches_tracked")]
    assert sorted(wanted) == sorted(inits)
    for key in wanted:
        np.testing.assert_array_equal(inits[key], state[key].numpy(), err_msg=key)
        assert torch.equal(state[key], before[key]), f"{key} changed by the export"
    assert torch.equal(state["bn1.num_batches_tracked"], before["bn1.num_batches_tracked"])
    assert [i.name for i in model.graph.input] == ["input"] and dims(model.graph.input[0]) == ["batch", 1, 12, 12]
    assert [o.name for o in model.graph.output] == ["logits"] and dims(model.graph.output[0])[0] == "batch"
    assert model.opset_import[0].version == 17 and model.ir_version <= 10
    assert STATE_DICT_NAMES_KEY not in {p.key for p in model.metadata_props}
    assert module.training and all(m.training for m in module.modules())
    assert "forward" not in module.__dict__
    assert sorted(p.name for p in Path(path).parent.iterdir()) == ["cnn.onnx"]


def training_step(path: str):
    graph = frontend.load(path, {"batch": BATCH})
    return build_training_step(graph, loss="cross_entropy", optimizer="sgd", lr=0.1)


def test_training_step_trains_the_module_parameters(exported):
    module, _, path, _ = exported
    step = training_step(path)
    parameters = json.loads(step.metadata[TRAINING_KEY])["parameters"]
    assert sorted(parameters) == sorted(name for name, _ in module.named_parameters())


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_step_loss_is_pytorch_train_mode_loss(tmp_path, mode):
    """memsched normalises with batch statistics whatever the BN's training_mode: a module
    exported in eval mode trains as PyTorch's train mode does too."""
    module = trained_cnn()
    module.train(mode == "train")
    path = export_for_training(module, example(), tmp_path / "cnn.onnx")
    model = onnx.load(path)
    modes = {helper.get_attribute_value(a) for n in model.graph.node if n.op_type == "BatchNormalization"
             for a in n.attribute if a.name == "training_mode"}
    assert modes == {1 if mode == "train" else 0}
    assert module.training == (mode == "train")
    step = training_step(path)
    session = onnxruntime.InferenceSession(step.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    x = example()
    y = torch.randint(0, 10, (BATCH,), generator=torch.Generator().manual_seed(2))
    (loss,) = session.run(["loss"], {"x": x.numpy(), "labels": y.numpy()})
    with torch.no_grad():
        expected = F.cross_entropy(module.train()(x), y).item()
    assert abs(float(loss) - expected) < 1e-5


def test_dropout_follows_the_module_state(tmp_path):
    module = trained_cnn(dropout=0.5)
    ops = {}
    for mode in (True, False):
        module.train(mode)
        model = onnx.load(export_for_training(module, example(), tmp_path / f"{mode}.onnx"))
        ops[mode] = [n.op_type for n in model.graph.node]
        assert module.training == mode
        assert [o.name for o in model.graph.output] == ["output"]
        assert [i.name for i in model.graph.input] == ["x"]
    assert "Dropout" in ops[True] and "Dropout" not in ops[False]
    assert ops[True].count("BatchNormalization") == ops[False].count("BatchNormalization") == 2


def test_equal_valued_parameters_stay_apart_in_eval_mode(tmp_path):
    """torch's deduplicate_initializers pass would merge the two fresh BNs' ones and zeros."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    model = onnx.load(export_for_training(module, torch.randn(2, 1, 8, 8), tmp_path / "m.onnx"))
    assert "Identity" not in [n.op_type for n in model.graph.node]
    assert sorted(i.name for i in model.graph.initializer) == sorted(
        k for k in module.state_dict() if not k.endswith("num_batches_tracked"))
    assert [i.name for i in model.graph.input] == ["input"]


def test_export_leaves_the_random_state_alone(tmp_path):
    module = trained_cnn(dropout=0.5)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    export_for_training(module, example(), tmp_path / "m.onnx")
    assert torch.equal(torch.get_rng_state(), state)


class Unexportable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.diff(self.fc(x), dim=-1)


def test_unexportable_module_is_a_user_error(tmp_path):
    module = Unexportable().train()
    with pytest.raises(UserError, match=r"cannot export Unexportable to ONNX: .*aten::diff") as info:
        export_for_training(module, torch.randn(2, 4), tmp_path / "m.onnx")
    assert "\n" not in str(info.value)
    assert module.training and "forward" not in module.__dict__
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("call, message", [
    (lambda p: export_for_training("not a module", torch.randn(1), p), "needs a torch.nn.Module"),
    (lambda p: export_for_training(nn.Linear(2, 2), [1, 2], p), "example_inputs must be"),
    (lambda p: export_for_training(nn.Linear(2, 2), torch.randn(1, 2), p, opset=9), "opset 9"),
    (lambda p: export_for_training(nn.Linear(2, 2), torch.randn(1, 2), p, input_names=["a", "b"]),
     "2 names for 1 example"),
])
def test_bad_arguments_are_user_errors(tmp_path, call, message):
    with pytest.raises(UserError, match=message):
        call(tmp_path / "m.onnx")


def test_state_dict_names_maps_renamed_initializers():
    weight, zeros = torch.arange(6.0).reshape(2, 3), torch.zeros(3)
    state = {"fc.weight": weight, "fc.bias": zeros, "other.bias": torch.zeros(3), "kept": torch.ones(2)}
    graph = helper.make_graph([], "g", [], [], initializer=[
        numpy_helper.from_array(weight.numpy(), "onnx::MatMul_7"),
        numpy_helper.from_array(zeros.numpy(), "onnx::Add_8"),      # two zero biases match: ambiguous
        numpy_helper.from_array(np.ones(2, np.float32), "kept")])
    assert state_dict_names(helper.make_model(graph), state) == {"onnx::MatMul_7": "fc.weight"}


# ---- Hugging Face models (only where transformers is installed) ------------------------------
def hf_model(kind: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=100, max_position_embeddings=32)
        return transformers.BertForSequenceClassification(config)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=100,
                                      max_position_embeddings=32, use_cache=False)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_hugging_face_models_train(tmp_path, kind):
    from memsched.passes.pipeline import compile as compile_plan

    module = hf_model(kind).eval()      # eval: no Dropout, so the loss is deterministic
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 16, dtype=torch.long)
    path = export_for_training(module, (ids, mask), tmp_path / f"{kind}.onnx")
    model = onnx.load(path)
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask"]
    step = training_step_at(path, 2)
    parameters = json.loads(step.metadata[TRAINING_KEY])["parameters"]
    assert sorted(parameters) == sorted(name for name, _ in module.named_parameters())
    with torch.no_grad():
        logits = module(ids, mask).logits
    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(4))
    session = onnxruntime.InferenceSession(step.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
    (loss,) = session.run(["loss"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy(),
                                     "labels": labels.numpy()})
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()
    assert abs(float(loss) - expected) < 1e-5
    # trained with a plan at 60% of the step's peak: the losses of torch.optim's Adam on the same batches
    plan = compile_plan(path, dims={"batch": 2}, train=True, optimizer="adam", lr=1e-3, budget="60%",
                        time_limit=10).plan
    generator = torch.Generator().manual_seed(5)
    batches = [{"input_ids": torch.randint(0, 100, (2, 16), generator=generator), "attention_mask": mask,
                "labels": torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=generator)}
               for _ in range(10)]
    with Trainer(plan) as trainer:
        ours = [trainer.step(batch).loss for batch in batches]
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    theirs = []
    for batch in batches:                  # eval mode: no Dropout on either side
        optimizer.zero_grad()
        out = module(batch["input_ids"], batch["attention_mask"]).logits
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), batch["labels"].reshape(-1))
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    assert np.abs(np.subtract(ours, theirs)).max() < 1e-4, (ours, theirs)


def training_step_at(path: str, batch: int):
    return build_training_step(frontend.load(path, {"batch": batch}), loss="cross_entropy", optimizer="sgd", lr=0.1)

