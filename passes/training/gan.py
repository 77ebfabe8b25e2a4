"""build_gan_step: one GAN training iteration (a generator G and a discriminator D) as ONE
Graph of standard ONNX ops, for `memsched train-graph --gan G.onnx D.onnx`.

The iteration is the standard alternating one (the PyTorch DCGAN example's loop body), with
binary cross-entropy on logits (D ends in a logit; `loss.bce_with_logits`):

1. fake = G(z), once; D's loss on the real batch (label 1) and on fake (label 0),
   loss_D = bce(D(real), 1) + bce(D(fake), 0), with fake held constant (G gets no gradient
   from it, as `fake.detach()`); D's gradient and D's update;
2. G's loss through D with D's UPDATED weights, loss_G = bce(D'(fake), 1) (the non-saturating
   loss), its gradient flowing back through D' into G (D' gets none); G's update.

D runs three times: on the real batch and on fake with its weights (each with its own batch
statistics, as the example's two calls do), and on fake with the updated weights. G's forward
activations, made once, serve both its first use and its backward pass after D's update.

Interface:
- inputs: `z` (G's input) and `real` (a batch of D's input);
- outputs: `loss_D`, `loss_G`, then D's update outputs and G's (`<param>.updated` and the
  optimizer's `<param>.<state>.updated`, see optimizer.update_outputs), D's first;
- names: G's tensors and ops take the prefix `G/`, D's parameters, buffers and constants `D/`;
  the three uses of D name their ops and activations `D/real/`, `D/fake/` and `D/gen/`.

Metadata as for a single model's step (see the package doc): grad roles, and
`memsched.training` with loss bce_with_logits, the optimizer's options, "parameters" (D's,
then G's) and "gan": {"discriminator": [D's parameters], "generator": [G's parameters]}.
Phases: forward, loss, backward and update for D's step, then the same four for G's; the
forward ops of D' read D's updated weights, so they follow D's update.
"""
from __future__ import annotations

from onnx import TensorProto

from memsched.errors import UserError
from memsched.ir import Graph, Op, Tensor

from memsched.passes.training.builder import (_assemble, _check_control_flow, _check_options, _check_supported,
                                              _emit_backward, _emit_forward, _reaching_output, _requiring_grad,
                                              _trainable, _training_opset, emit_updates, needed_ops, taken_names)
from memsched.passes.training.emitter import Emitter
from memsched.passes.training.fuse import fuse_patterns
from memsched.passes.training.loss import bce_with_logits
from memsched.passes.training.optimizer import update_outputs
from memsched.dtypes import FLOAT_TYPES
from memsched.passes.training.simplify import drop_no_ops

LOSS = "bce_with_logits"
OUTPUTS = ("loss_D", "loss_G")
INPUTS = ("z", "real")
USES = ("real", "fake", "gen")     # D on the real batch, on G(z), and with its updated weights on G(z)


def build_gan_step(generator: Graph, discriminator: Graph, optimizer: str = "sgd", lr: float = 0.01, *,
                   momentum: float = 0.9, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   fuse: bool = True) -> Graph:
    """The GAN iteration of `generator` and `discriminator` (see the module doc). Raises
    UserError where the two do not fit together (G's output is not D's input) or a model
    cannot be differentiated, before anything is built."""
    hyper = _check_options(LOSS, optimizer, lr, momentum, betas, eps)
    if optimizer == "none":
        raise UserError("a GAN step updates D before G's loss reads it: choose --optimizer sgd, momentum or adam")
    opset = max(_training_opset(generator), _training_opset(discriminator))
    g, d = drop_no_ops(generator), drop_no_ops(discriminator)
    _check_pair(g, d)
    d_own = _trainable(d, _reaching_output(d, d.outputs[0]), ())
    g_own = _trainable(g, _reaching_output(g, g.outputs[0]), ())
    _check_free_names(d, optimizer, d_own, "discriminator")
    _check_free_names(g, optimizer, g_own, "generator")
    d_params = [_prefixed("D/", p) for p in d_own]
    g_params = [_prefixed("G/", p) for p in g_own]
    source, logits = _compose(g, d, {p: update_outputs(optimizer, p)[0] for p in d_params})
    source, fusions = fuse_patterns(source) if fuse else (source, {})

    live_d = _reaching_output(source, logits["real"]) | _reaching_output(source, logits["fake"])
    live_g = _reaching_output(source, logits["gen"])
    requiring_d, requiring_g = _requiring_grad(source, d_params), _requiring_grad(source, g_params)
    needed_d, needed_g = needed_ops(source, live_d, requiring_d), needed_ops(source, live_g, requiring_g)
    needed_names = {op.name for op in needed_d + needed_g}
    needed = [op for op in source.ops if op.name in needed_names]
    _check_control_flow(source, live_d | live_g, needed)
    em = Emitter(source, opset, fusions)
    em.carry_statistics = False     # D's BatchNorms run three times a step: their running statistics stay as given
    _check_supported(em, needed)

    after_update = _reading_updated(source, d_params, optimizer)
    outputs = list(OUTPUTS)
    roles: dict[str, dict] = {}
    # D's step: G's forward and D's two uses, D's loss, its backward and update
    _emit_forward(em, source.replace(ops=[op for op in source.ops if op.name not in after_update]), needed)
    em.phase = "loss"
    with em.scope("D/loss"):
        real_loss, real_grad = bce_with_logits(em, logits["real"], em.scalar(1, logits["real"]))
        fake_loss, fake_grad = bce_with_logits(em, logits["fake"], em.scalar(0, logits["fake"]))
        em.op("Add", [real_loss, fake_loss], outputs=[OUTPUTS[0]], kind="output")
    em.phase = "backward"
    with em.scope("D/loss/grad"):
        seeds = {logits["real"]: real_grad(), logits["fake"]: fake_grad()}
    grads, step_roles = _emit_backward(em, source, needed_d, d_params, requiring_d, seeds)
    roles.update(step_roles)
    outputs += emit_updates(em, optimizer, d_params, grads, hyper, roles)
    # G's step: D' on G's output, G's loss, the backward through D' into G, G's update
    em.phase = "forward"
    _emit_forward(em, source.replace(ops=[op for op in source.ops if op.name in after_update]), needed)
    em.phase = "loss"
    with em.scope("G/loss"):
        gen_loss, gen_grad = bce_with_logits(em, logits["gen"], em.scalar(1, logits["gen"]))
        em.op("Identity", [gen_loss], outputs=[OUTPUTS[1]], kind="output")
    em.phase = "backward"
    with em.scope("G/loss/grad"):
        seeds = {logits["gen"]: gen_grad()}
    grads, step_roles = _emit_backward(em, source, needed_g, g_params, requiring_g, seeds)
    roles.update(step_roles)
    outputs += emit_updates(em, optimizer, g_params, grads, hyper, roles)
    training = {"loss": LOSS, "optimizer": optimizer, **hyper,
                "gan": {"discriminator": d_params, "generator": g_params}}
    return _assemble(source, em, [], outputs, d_params + g_params, roles, opset, training)


# ---- checks -----------------------------------------------------------------------------------
def _check_pair(g: Graph, d: Graph) -> None:
    """One float input and output each, G's output shaped and typed as D's input."""
    for graph, who in ((g, "generator"), (d, "discriminator")):
        if len(graph.inputs) != 1 or not graph.outputs:
            raise UserError(f"the {who} must have one input and an output; '{graph.name}' has "
                            f"{len(graph.inputs)} inputs and {len(graph.outputs)} outputs")
        for name in (graph.inputs[0], graph.outputs[0]):
            if graph.tensors[name].dtype not in FLOAT_TYPES:
                raise UserError(f"the {who}'s '{name}' is not a float tensor")
    image, wanted = g.tensors[g.outputs[0]], d.tensors[d.inputs[0]]
    if (image.shape, image.dtype) != (wanted.shape, wanted.dtype):
        raise UserError(f"the generator's output '{image.name}' ({list(image.shape)}, {image.dtype_name}) is not "
                        f"what the discriminator takes as '{wanted.name}' ({list(wanted.shape)}, "
                        f"{wanted.dtype_name}): export both at the same batch, size and dtype")


def _check_free_names(graph: Graph, optimizer: str, params: list[str], who: str) -> None:
    """The names the step gives a model's gradients, optimizer states and updated weights are
    free in it (the step prefixes them all alike; its inputs and losses have no prefix)."""
    taken = taken_names(graph, optimizer, params)
    if taken:
        raise UserError(f"the {who} already has tensors named {', '.join(repr(n) for n in taken[:5])}, "
                        f"which the GAN step needs for its own")


# ---- composition ------------------------------------------------------------------------------
def _compose(g: Graph, d: Graph, updated: dict[str, str]) -> tuple[Graph, dict[str, str]]:
    """The forward graph of the iteration: G, then D on `real`, on G's output and (reading
    D's parameters under their `updated` names) on G's output again. Returns it and the
    logits of each use of D."""
    tensors: dict[str, Tensor] = {}
    ops: list[Op] = []
    g_names = _names(g, "G/", {g.inputs[0]: INPUTS[0]})
    _copy_ops(g, g_names, "G/", ops, tensors)
    fake = g_names[g.outputs[0]]
    logits = {}
    for use in USES:
        names = _names(d, f"D/{use}/", {d.inputs[0]: INPUTS[1] if use == "real" else fake})
        static = {t.name: _prefixed("D/", t.name) for t in d.tensors.values() if t.is_static}
        if use == "gen":
            static = {name: updated.get(prefixed, prefixed) for name, prefixed in static.items()}
        names.update(static)
        _copy_ops(d, names, f"D/{use}/", ops, tensors)
        logits[use] = names[d.outputs[0]]
    for param, name in updated.items():       # made by D's update, declared here for the analysis
        tensors[name] = Tensor(name, tensors[param].shape, tensors[param].dtype, "activation")
    for name in INPUTS:
        tensors[name].kind = "input"
    base_dir = g.base_dir if g.base_dir == d.base_dir else None
    external = any(t.data is not None and t.data.data_location == TensorProto.EXTERNAL for t in tensors.values())
    if base_dir is None and external:
        raise UserError("the generator and the discriminator keep external weights in different folders: "
                        "save both with their weights inside, or in one folder")
    graph = Graph(ops, tensors, list(INPUTS), list(logits.values()), name=f"gan_{g.name}_{d.name}",
                  opset_imports={"": max(g.opset_imports.get("", 0), d.opset_imports.get("", 0))},
                  ir_version=max(g.ir_version, d.ir_version), base_dir=base_dir)
    return graph, logits


def _names(graph: Graph, prefix: str, fixed: dict[str, str]) -> dict[str, str]:
    """tensor -> its name in the composed graph: `fixed` ones as given, the rest prefixed."""
    return {name: fixed.get(name, _prefixed(prefix, name)) for name in graph.tensors}


def _prefixed(prefix: str, name: str) -> str:
    """`prefix` + `name`, one '/' between them where torch's name begins with one ('/main.0/Conv')."""
    return prefix[:-1] + name if name.startswith("/") else prefix + name


def _copy_ops(graph: Graph, names: dict[str, str], prefix: str, ops: list[Op], tensors: dict[str, Tensor]) -> None:
    for name, t in graph.tensors.items():
        if names[name] not in tensors:
            tensors[names[name]] = Tensor(names[name], t.shape, t.dtype, t.kind, _renamed(t.data, names[name]))
    for op in graph.ops:
        ops.append(Op(_prefixed(prefix, op.name), op.op_type, [names[t] if t else t for t in op.inputs],
                      [names[t] if t else t for t in op.outputs], dict(op.attributes), op.domain))


def _renamed(data, name):
    """An initializer proto under its new name (the graph's TensorProto keeps the tensor's name)."""
    if data is None:
        return None
    copy = type(data)()
    copy.CopyFrom(data)
    copy.name = name
    return copy


# ---- analysis ---------------------------------------------------------------------------------
def _reading_updated(graph: Graph, d_params: list[str], optimizer: str) -> set[str]:
    """Ops that read D's updated weights, directly or through other such ops (D' on G(z))."""
    tainted = {update_outputs(optimizer, p)[0] for p in d_params}
    names = set()
    for op in graph.ops:
        if tainted.intersection(op.present_inputs):
            names.add(op.name)
            tainted.update(op.present_outputs)
    return names
