"""Optimizer updates, one small group of ops per parameter (phase `update`), PyTorch's
formulas (torch.optim.SGD, Adam and AdamW, no dampening, no Nesterov, no amsgrad):

- sgd:      g = g + wd p;  p' = p - lr * g
- momentum: g = g + wd p;  b' = momentum * b + g;  p' = p - lr * b'      (state momentum_buffer)
- adam:     g = g + wd p;  m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g^2;  t' = t + 1;
            p' = p - lr / (1 - b1^t') * m' / (sqrt(v') / sqrt(1 - b2^t') + eps)
                                                                (states exp_avg, exp_avg_sq, step)
- adamw:    adam with decoupled weight decay: p is first scaled by (1 - lr wd), g is not changed

The hyperparameters (lr, momentum, beta1, beta2, eps, weight_decay) are tensors of the step,
not constants: initializers of kind `hyperparameter` named `memsched.<name>` (one per float
dtype the parameters use: `memsched.<name>.<dtype>` beside float32), which a trainer writes
before each step (a learning-rate schedule runs with no recompile). Their compile-time values
are the initializers' values. Weight decay ops exist only where the step was built with a
weight decay above zero: the step's structure is fixed, its values are not.

States are zero-initialised initializers `<param>.<state>` of kind optimizer_state; the
group's outputs are `<param>.updated` and `<param>.<state>.updated` (graph outputs, to be
fed back as the next step's parameters and states).
"""
from __future__ import annotations

from memsched.step_info import OPTIMIZER_STATES

OPTIMIZERS = ("none", "sgd", "momentum", "adam", "adamw")
STATES = OPTIMIZER_STATES
# the hyperparameters each optimizer reads (weight_decay only where it is above zero)
HYPERPARAMETERS = {"none": (), "sgd": ("lr", "weight_decay"), "momentum": ("lr", "momentum", "weight_decay"),
                   "adam": ("lr", "beta1", "beta2", "eps", "weight_decay"),
                   "adamw": ("lr", "beta1", "beta2", "eps", "weight_decay")}


def hyperparameter_values(optimizer: str, hyper: dict) -> dict[str, float]:
    """The compile-time value of each hyperparameter the step of `optimizer` reads."""
    values = {"lr": hyper["lr"], "momentum": hyper["momentum"], "beta1": hyper["betas"][0],
              "beta2": hyper["betas"][1], "eps": hyper["eps"], "weight_decay": hyper["weight_decay"]}
    names = [n for n in HYPERPARAMETERS[optimizer] if n != "weight_decay" or hyper["weight_decay"] > 0]
    return {n: float(values[n]) for n in names}


def update_outputs(optimizer: str, param: str) -> list[str]:
    """The graph outputs the update of `param` produces, in order."""
    if optimizer == "none":
        return [f"{param}.grad"]
    return [f"{param}.updated"] + [f"{param}.{s}.updated" for s in STATES[optimizer]]


def emit_update(em, optimizer: str, param: str, grad: str, hyper: dict) -> list[str]:
    """Emit the update of `param` from `grad`; return its outputs (see update_outputs)."""
    outputs = update_outputs(optimizer, param)
    values = hyperparameter_values(optimizer, hyper)
    lr = em.hyperparameter("lr", values["lr"], param)
    decay = em.hyperparameter("weight_decay", values["weight_decay"], param) if "weight_decay" in values else None
    with em.scope(f"{param}/update"):
        if decay is not None and optimizer != "adamw":       # L2 penalty in the gradient, as torch.optim does
            grad = em.op("Add", [grad, em.op("Mul", [param, decay])])
        if optimizer == "sgd":
            em.op("Sub", [param, em.op("Mul", [grad, lr])], outputs=[outputs[0]], kind="output")
        elif optimizer == "momentum":
            buffer = em.state(f"{param}.momentum_buffer", em.shape(param), param)
            momentum = em.hyperparameter("momentum", values["momentum"], param)
            new_buffer = em.op("Add", [em.op("Mul", [buffer, momentum]), grad], outputs=[outputs[1]], kind="output")
            em.op("Sub", [param, em.op("Mul", [new_buffer, lr])], outputs=[outputs[0]], kind="output")
        elif optimizer in ("adam", "adamw"):
            if decay is not None:                             # AdamW: p * (1 - lr * wd) first
                one = em.scalar(1, param)
                param = em.op("Mul", [param, em.op("Sub", [one, em.op("Mul", [lr, decay])])])
            _adam(em, param, grad, lr, values, outputs)
        else:
            raise ValueError(f"unknown optimizer '{optimizer}'")
    return outputs


def _adam(em, param, grad, lr, values, outputs):
    like = outputs[0].removesuffix(".updated")          # the parameter (param may be its decayed value)
    beta1, beta2 = (em.hyperparameter(n, values[n], like) for n in ("beta1", "beta2"))
    eps = em.hyperparameter("eps", values["eps"], like)
    shape = em.shape(like)
    m, v = em.state(f"{like}.exp_avg", shape, like), em.state(f"{like}.exp_avg_sq", shape, like)
    step = em.state(f"{like}.step", (), like)
    one = em.scalar(1, like)
    new_m = em.op("Add", [em.op("Mul", [m, beta1]),
                          em.op("Mul", [grad, em.op("Sub", [one, beta1])])], outputs=[outputs[1]], kind="output")
    squared = em.op("Mul", [grad, grad])
    new_v = em.op("Add", [em.op("Mul", [v, beta2]),
                          em.op("Mul", [squared, em.op("Sub", [one, beta2])])], outputs=[outputs[2]], kind="output")
    new_step = em.op("Add", [step, one], outputs=[outputs[3]], kind="output")
    correction1 = em.op("Sub", [one, em.op("Pow", [beta1, new_step])])
    correction2 = em.op("Sub", [one, em.op("Pow", [beta2, new_step])])
    step_size = em.op("Div", [lr, correction1])
    denom = em.op("Add", [em.op("Div", [em.op("Sqrt", [new_v]), em.op("Sqrt", [correction2])]), eps])
    em.op("Sub", [param, em.op("Mul", [em.op("Div", [new_m, denom]), step_size])], outputs=[outputs[0]],
          kind="output")
