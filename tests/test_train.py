"""Training with a plan, as a PyTorch user would: scikit-learn's digits, the bundled MLP and a
conv-BN-ReLU network exported by torch, trained by memsched's Trainer and by torch.optim from
the same initial weights on the same batches."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from memsched.data import batches
from memsched.emit import write_plan
from memsched.errors import UserError
from memsched.inference import export_inference
from memsched.runtime import Trainer
from memsched.passes.pipeline import compile as compile_plan

from . import digits

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

BATCH = 64
TIME_LIMIT = 10.0


@pytest.fixture(scope="module")
def data():
    return digits.split()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Both sides on one thread: a float32 run's sums then do not depend on the machine's cores,
    so two runs that drift apart over hundreds of steps drift alike everywhere."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory):
    from memsched.models.mlp import mlp

    model = mlp(batch=BATCH, size=8)
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    onnx.save(model, path)
    return model, path


@pytest.fixture(scope="module")
def cnn_model(tmp_path_factory):
    from memsched.torch import export_for_training

    module = digits.conv_bn_net()
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    export_for_training(module, torch.zeros(BATCH, 1, 8, 8), path, input_names=["input"], output_names=["logits"])
    return module, path


_PLANS: dict = {}


def plan_of(path, optimizer="momentum", lr=0.05, budget="60%", **options):
    """The plan of the model at `path`'s training step (compiled once per options in this module)."""
    key = (str(path), optimizer, lr, budget, tuple(sorted(options.items())))
    if key not in _PLANS:
        dims = {"batch": BATCH} if "cnn" in str(path) else None
        _PLANS[key] = compile_plan(str(path), dims=dims, train=True, optimizer=optimizer, lr=lr, budget=budget,
                                   time_limit=TIME_LIMIT, training_options=options or None).plan
    return _PLANS[key]


def epoch_batches(data, epochs, seed=1):
    return [b for e in range(epochs) for b in batches(data, BATCH, e, shuffle=True, seed=seed)]


def test_the_mlp_trains_as_pytorch_does_and_its_model_runs_in_plain_onnx_runtime(data, mlp_model, tmp_path):
    train, test = data
    model, path = mlp_model
    plan = plan_of(path)
    assert plan.budget is not None and {"swap", "recompute"} & set(plan.notes)    # 60% needs more than order
    steps = epoch_batches(train, 20)
    with Trainer(plan, threads=1) as trainer:
        ours = [trainer.step(batch).loss for batch in steps]
        saved = export_inference(trainer.graph, trainer.state_dict(), tmp_path / "trained.onnx")
    named = digits.mlp_module(model)
    theirs = digits.torch_losses(named.module, steps, "momentum", 0.05)
    assert np.abs(np.subtract(ours[:100], theirs[:100])).max() <= 1e-4
    accuracy, reference = digits.onnx_accuracy(saved, test), digits.torch_accuracy(named.module, test)
    assert accuracy >= 0.97 and abs(accuracy - reference) <= 0.005, (accuracy, reference)


def test_a_conv_bn_net_trains_as_pytorch_does_running_statistics_included(data, cnn_model, tmp_path):
    """Against PyTorch in float64 (the same module, weights and batches): PyTorch's own float32
    run drifts from it by 1e-3 in loss within 50 steps on an AVX-512 CPU (its conv and
    BatchNorm kernels sum in other orders), while memsched's float32 step stays within 1e-6."""
    train, test = data
    module, path = cnn_model
    plan = plan_of(path)
    steps = epoch_batches(train, 20)
    exact = [{**batch, "input": batch["input"].astype(np.float64)} for batch in steps]
    reference = digits.conv_bn_net().double()     # the same seed: the same initial weights as the export
    run = digits.TorchRun(reference, "momentum", 0.05)
    theirs = run.losses(exact[:50])
    with Trainer(plan, threads=1) as trainer:
        ours = [trainer.step(batch).loss for batch in steps[:50]]
        state = trainer.state_dict()
        torch_state = reference.state_dict()
        buffers = [name for name in state if "running" in name]
        assert len(buffers) == 4          # two BatchNorms, mean and variance each
        for name in buffers:              # PyTorch's momentum 0.1, unbiased running variance
            assert np.abs(state[name] - torch_state[name].numpy()).max() <= 1e-5, name
        ours += [trainer.step(batch).loss for batch in steps[50:]]
        saved = export_inference(trainer.graph, trainer.state_dict(), tmp_path / "trained.onnx")
    theirs += run.losses(exact[50:100])
    assert np.abs(np.subtract(ours[:100], theirs[:100])).max() <= 1e-4
    inference = onnx.load(saved)
    assert [n.op_type for n in inference.graph.node].count("BatchNormalization") == 2
    assert all(len(n.output) == 1 for n in inference.graph.node if n.op_type == "BatchNormalization")
    assert inference.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    run.losses(exact[100:])
    accuracy = digits.onnx_accuracy(saved, test)
    expected = digits.torch_accuracy(reference, {**test, "input": test["input"].astype(np.float64)})
    assert accuracy >= 0.95 and abs(accuracy - expected) <= 0.005, (accuracy, expected)


def test_a_swapping_plan_trains_bit_for_bit_as_the_order_reuse_plan(data, mlp_model):
    train, _ = data
    _, path = mlp_model
    swapping, whole = plan_of(path, budget="60%"), plan_of(path, budget=None)
    assert any(s.kind == "swap_out" for s in swapping.schedule)
    assert not any(s.kind == "swap_out" for s in whole.schedule)
    steps = epoch_batches(train, 2)
    with Trainer(swapping) as a, Trainer(whole) as b:
        for batch in steps:
            assert a.step(batch).loss == b.step(batch).loss
        assert all(np.array_equal(value, b.state_dict()[name]) for name, value in a.state_dict().items())


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_a_checkpoint_resumes_bit_for_bit(data, mlp_model, tmp_path, optimizer):
    train, _ = data
    _, path = mlp_model
    # the momentum plan swaps (the 60% plan of the tests above); the others hold every tensor
    plan = plan_of(path) if optimizer == "momentum" else plan_of(path, optimizer=optimizer, lr=0.01, budget=None)
    steps = epoch_batches(train, 1)[:12]
    with Trainer(plan) as whole:
        expected = [whole.step(batch).loss for batch in steps]
        final = whole.state_dict()
    with Trainer(plan) as first:
        losses = [first.step(batch).loss for batch in steps[:5]]
        first.save_checkpoint(tmp_path / "ck.safetensors", {"epoch": 0})
    with Trainer(plan) as resumed:                    # a new process would build its trainer anew
        assert resumed.load_checkpoint(tmp_path / "ck.safetensors") == {"epoch": "0"}
        assert resumed.step_count == 5
        losses += [resumed.step(batch).loss for batch in steps[5:]]
        assert losses == expected
        assert all(np.array_equal(value, final[name]) for name, value in resumed.state_dict().items())


def test_a_learning_rate_schedule_and_weight_decay_reach_the_fused_update(data, mlp_model):
    from memsched import lr_schedules

    train, _ = data
    model, path = mlp_model
    plan = plan_of(path, optimizer="sgd", lr=0.1, budget=None)
    assert plan.graph.metadata.get("memsched.fused_updates")        # the Gemm reads the step's lr
    steps = epoch_batches(train, 2)
    schedule = lr_schedules.parse("warmup:5,cosine:0.01", 0.1, len(steps))
    with Trainer(plan, lr_schedule=schedule) as trainer:
        ours = [trainer.step(batch) for batch in steps]
    assert [s.lr for s in ours[:3]] == pytest.approx([0.02, 0.04, 0.06])
    theirs = digits.torch_losses(digits.mlp_module(model).module, steps, "sgd", schedule)
    assert np.abs(np.subtract([s.loss for s in ours], theirs)).max() <= 1e-4
    constant = digits.torch_losses(digits.mlp_module(model).module, steps, "sgd", 0.1)
    assert np.abs(np.subtract(constant, theirs)).max() > 1e-3         # the schedule changed the run


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_weight_decay_as_pytorch_defines_it(data, mlp_model, optimizer):
    train, _ = data
    model, path = mlp_model
    lr = 0.05 if optimizer == "sgd" else 0.001
    plan = plan_of(path, optimizer=optimizer, lr=lr, budget=None, weight_decay=0.1)
    steps = epoch_batches(train, 1)
    with Trainer(plan) as trainer:
        assert trainer.hyperparameters["weight_decay"] == 0.1
        ours = [trainer.step(batch).loss for batch in steps]
    theirs = digits.torch_losses(digits.mlp_module(model).module, steps, optimizer, lr, weight_decay=0.1)
    assert np.abs(np.subtract(ours, theirs)).max() <= 1e-4


def test_weights_load_from_a_pytorch_state_dict_and_an_onnx_model(data, cnn_model, tmp_path):
    train, _ = data
    module, path = cnn_model
    plan = plan_of(path, budget=None)
    other = digits.conv_bn_net(seed=7)
    with Trainer(plan) as trainer:
        loaded = trainer.load_weights(other.state_dict())
        assert "0.weight" in loaded and "1.running_mean" in loaded
        assert np.array_equal(trainer.state_dict()["0.weight"], other.state_dict()["0.weight"].numpy())
        first = trainer.step(train and epoch_batches(train, 1)[0]).loss
    expected = digits.torch_losses(digits.conv_bn_net(seed=7), epoch_batches(train, 1)[:1], "momentum", 0.05)
    assert first == pytest.approx(expected[0], abs=1e-5)
    with Trainer(plan) as trainer:
        assert "0.weight" in trainer.load_weights(path)          # the model's own weights, by name
        with pytest.raises(UserError, match="none of the given weights"):
            trainer.load_weights({"nothing": np.zeros(3)})
        with pytest.raises(UserError, match="has shape"):
            trainer.load_weights({"0.weight": np.zeros(3)})


def test_every_bad_batch_is_one_clear_error(data, mlp_model):
    train, _ = data
    _, path = mlp_model
    batch = epoch_batches(train, 1)[0]
    with Trainer(plan_of(path, budget=None)) as trainer:
        cases = [
            ({"input": batch["input"]}, "the batch has no 'labels'"),
            ({**batch, "extra": batch["labels"]}, "no input named 'extra'"),
            ({**batch, "input": batch["input"][:10]}, r"a batch of 10 \(the plan's batch size is 64\)"),
            ({**batch, "input": batch["input"].astype(np.float64)}, "must be float32, not float64"),
            ({**batch, "labels": batch["labels"].astype(np.int32)}, "must be int64, not int32"),
            ({**batch, "input": batch["input"].reshape(64, 64)}, "must have shape"),
            ([batch["input"], batch["labels"]], "a batch is a mapping"),
        ]
        for bad, message in cases:
            with pytest.raises(UserError, match=message):
                trainer.step(bad)
        for bad_lr in (float("nan"), -0.1, "fast"):
            trainer.hyperparameters["lr"] = bad_lr
            with pytest.raises(UserError, match="hyperparameter lr must be a finite number from 0 up"):
                trainer.step(batch)
        trainer.hyperparameters["lr"] = np.float32(0.05)     # any real number type
        assert trainer.step_count == 0                      # nothing ran
        fortran = {**batch, "input": np.asfortranarray(batch["input"])}
        assert trainer.step(fortran).loss == pytest.approx(trainer_loss(path, batch), abs=0)
        with pytest.raises(UserError, match="no output named"):
            trainer.step(batch, outputs=["nothing"])


def trainer_loss(path, batch) -> float:
    with Trainer(plan_of(path, budget=None)) as trainer:
        return trainer.step(batch).loss


def test_a_torch_tensor_batch_and_a_fresh_batch_every_step(data, mlp_model):
    """Each step reads the batch it is given (not the first one, not a stale copy)."""
    train, _ = data
    _, path = mlp_model
    steps = epoch_batches(train, 1)[:3]
    with Trainer(plan_of(path, budget=None)) as a, Trainer(plan_of(path, budget=None)) as b:
        tensors = [a.step({k: torch.from_numpy(v) for k, v in s.items()}).loss for s in steps]
        arrays = [b.step(s).loss for s in steps]
    assert tensors == arrays and len(set(arrays)) == 3
    with Trainer(plan_of(path, budget=None)) as trainer:      # read in place: no copy of a C-ordered batch
        batch = steps[0]
        trainer.step(batch)
        assert np.shares_memory(trainer._runner.host_inputs["input"], batch["input"])
        strided = {**batch, "input": np.asfortranarray(batch["input"])}
        trainer.step(strided)
        assert not np.shares_memory(trainer._runner.host_inputs["input"], strided["input"])


def test_an_old_or_inference_plan_is_refused_for_training(mlp_model, tmp_path):
    _, path = mlp_model
    forward = compile_plan(str(path), time_limit=TIME_LIMIT).plan
    with pytest.raises(UserError, match="not a training step"):
        Trainer(forward)
    written = write_plan(plan_of(path, budget=None), tmp_path / "plan.onnx")
    with Trainer(written) as trainer:                    # a plan read back from its file trains too
        assert trainer.info.parameters[0] == "fc1.weight"


def test_a_plan_holding_other_weights_is_the_same_plan(mlp_model, tmp_path):
    """Trained weights written into a plan file with the onnx package (a bias of 10 values
    included) leave its digest alone; an edited constant still does not."""
    from onnx import numpy_helper

    from memsched.emit import read_plan

    _, path = mlp_model
    written = write_plan(plan_of(path, budget=None), tmp_path / "plan.onnx")
    model = onnx.load(written)
    inits = {init.name: init for init in model.graph.initializer}
    for name in ("fc3.bias", "fc1.weight", "memsched.lr"):
        value = numpy_helper.to_array(inits[name]) + 1
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    onnx.save(model, tmp_path / "trained.onnx")
    with Trainer(tmp_path / "trained.onnx") as trainer:
        assert np.array_equal(trainer.state_dict()["fc3.bias"], numpy_helper.to_array(inits["fc3.bias"]))
    constant = next(init for init in model.graph.initializer if init.name.startswith("memsched.const"))
    constant.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(constant) + 1, constant.name))
    onnx.save(model, tmp_path / "edited.onnx")
    with pytest.raises(UserError, match="ops, shapes, constants or memsched metadata were edited"):
        read_plan(tmp_path / "edited.onnx")


def test_frozen_weights_load_and_loaded_state_is_a_copy(data, mlp_model, tmp_path):
    """Fine-tuning with a frozen layer starts from the loaded weights of that layer too; a
    loaded 0-d state keeps its shape (a checkpoint written from it loads again); the loaded
    values are copies (changing the caller's arrays changes nothing)."""
    train, _ = data
    model, path = mlp_model
    frozen = compile_plan(str(path), train=True, optimizer="adam", lr=0.01, freeze=("fc1.*",),
                          time_limit=TIME_LIMIT).plan
    other = {k: v * 0 + 0.01 for k, v in digits.mlp_module(model).state().items()}
    with Trainer(frozen) as trainer:
        assert "fc1.weight" in trainer.fixed_weights and "fc1.weight" not in trainer.info.parameters
        assert "fc1.weight" in trainer.load_weights(other)
        other["fc1.weight"][:] = 5.0                         # the trainer holds its own copy
        trainer.step(epoch_batches(train, 1)[0])
        state = trainer.state_dict()
        assert np.all(state["fc1.weight"] == np.float32(0.01))
        trainer.load_state_dict(state)
        assert trainer.state_dict()["fc2.weight.step"].shape == ()
        trainer.save_checkpoint(tmp_path / "ck.safetensors")
        trainer.load_checkpoint(tmp_path / "ck.safetensors")
        for bad in (None, "0.5", True):
            trainer.hyperparameters["lr"] = bad
            with pytest.raises(UserError, match="must be a finite number"):
                trainer.step(epoch_batches(train, 1)[0])


def test_the_inference_model_turns_dropout_off(tmp_path):
    """A module exported in train mode keeps Dropout with training_mode on in its forward; the
    inference model runs it off, whatever the runtime's optimisations."""
    import onnxruntime as ort
    from torch import nn

    from memsched.torch import export_for_training

    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 10))
    export_for_training(module, torch.zeros(8, 1, 8, 8), tmp_path / "m.onnx", input_names=["input"],
                        output_names=["logits"])
    plan = compile_plan(str(tmp_path / "m.onnx"), dims={"batch": 8}, train=True, time_limit=TIME_LIMIT).plan
    with Trainer(plan) as trainer:
        saved = export_inference(trainer.graph, trainer.state_dict(), tmp_path / "inference.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(saved), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).random((8, 1, 8, 8), dtype=np.float32)
    assert np.array_equal(session.run(None, {"input": x})[0], session.run(None, {"input": x})[0])
    module.eval()
    assert np.allclose(session.run(None, {"input": x})[0], module(torch.from_numpy(x)).detach().numpy(), atol=1e-6)
