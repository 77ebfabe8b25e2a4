"""Optimizer updates, one small group of ops per parameter (phase `update`), PyTorch's
formulas without weight decay:

- sgd:      p' = p - lr * g
- momentum: b' = momentum * b + g;  p' = p - lr * b'                     (state momentum_buffer)
- adam:     m' = b1 m + (1-b1) g;  v' = b2 v + (1-b2) g^2;  t' = t + 1;
            p' = p - lr / (1 - b1^t') * m' / (sqrt(v') / sqrt(1 - b2^t') + eps)
                                                                (states exp_avg, exp_avg_sq, step)

States are zero-initialised initializers `<param>.<state>` of kind optimizer_state; the
group's outputs are `<param>.updated` and `<param>.<state>.updated` (graph outputs, to be
fed back as the next step's parameters and states).
"""
from __future__ import annotations

OPTIMIZERS = ("none", "sgd", "momentum", "adam")
STATES = {"none": (), "sgd": (), "momentum": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq", "step")}


def update_outputs(optimizer: str, param: str) -> list[str]:
    """The graph outputs the update of `param` produces, in order."""
    if optimizer == "none":
        return [f"{param}.grad"]
    return [f"{param}.updated"] + [f"{param}.{s}.updated" for s in STATES[optimizer]]


def emit_update(em, optimizer: str, param: str, grad: str, hyper: dict) -> list[str]:
    """Emit the update of `param` from `grad`; return its outputs (see update_outputs)."""
    outputs = update_outputs(optimizer, param)
    lr = em.scalar(hyper["lr"], param)
    with em.scope(f"{param}/update"):
        if optimizer == "sgd":
            em.op("Sub", [param, em.op("Mul", [grad, lr])], outputs=[outputs[0]], kind="output")
        elif optimizer == "momentum":
            buffer = em.state(f"{param}.momentum_buffer", em.shape(param), param)
            new_buffer = em.op("Add", [em.op("Mul", [buffer, em.scalar(hyper["momentum"], param)]), grad],
                               outputs=[outputs[1]], kind="output")
            em.op("Sub", [param, em.op("Mul", [new_buffer, lr])], outputs=[outputs[0]], kind="output")
        elif optimizer == "adam":
            _adam(em, param, grad, lr, hyper, outputs)
        else:
            raise ValueError(f"unknown optimizer '{optimizer}'")
    return outputs


def _adam(em, param, grad, lr, hyper, outputs):
    beta1, beta2 = hyper["betas"]
    shape = em.shape(param)
    m, v = em.state(f"{param}.exp_avg", shape, param), em.state(f"{param}.exp_avg_sq", shape, param)
    step = em.state(f"{param}.step", (), param)
    one = em.scalar(1, param)
    new_m = em.op("Add", [em.op("Mul", [m, em.scalar(beta1, param)]),
                          em.op("Mul", [grad, em.scalar(1 - beta1, param)])], outputs=[outputs[1]], kind="output")
    squared = em.op("Mul", [grad, grad])
    new_v = em.op("Add", [em.op("Mul", [v, em.scalar(beta2, param)]),
                          em.op("Mul", [squared, em.scalar(1 - beta2, param)])], outputs=[outputs[2]], kind="output")
    new_step = em.op("Add", [step, one], outputs=[outputs[3]], kind="output")
    correction1 = em.op("Sub", [one, em.op("Pow", [em.scalar(beta1, param), new_step])])
    correction2 = em.op("Sub", [one, em.op("Pow", [em.scalar(beta2, param), new_step])])
    step_size = em.op("Div", [lr, correction1])
    denom = em.op("Add", [em.op("Div", [em.op("Sqrt", [new_v]), em.op("Sqrt", [correction2])]),
                          em.scalar(hyper["eps"], param)])
    em.op("Sub", [param, em.op("Mul", [em.op("Div", [new_m, denom]), step_size])], outputs=[outputs[0]],
          kind="output")
