"""passes.training: turn a forward graph into one training step of standard ONNX ops.

`build_training_step(graph, loss, optimizer, lr, freeze)` returns forward + loss + backward
(+ optimizer update) as ONE Graph of default-domain ops (opset >= 17, no com.microsoft,
no onnxruntime-training) that ONNX Runtime runs as it is.

The op order is the frameworks' order, the baseline the planner improves on: the forward
ops, the loss, the backward ops in reverse order of the forward, then every optimizer
update at the end (`loss.backward(); optimizer.step()`). Each op carries its phase
(forward, loss, backward, update); gradient tensors are of kind `gradient` (activation
gradients and backward temporaries) or `param_grad` (parameter gradients), optimizer
states of kind `optimizer_state` (zero-initialised initializers `<param>.<state>`).

Interface (other tools depend on it):
- inputs: the model's inputs, plus `labels` (int64, cross_entropy) or `targets` (mse);
- outputs: `loss`, then per trainable parameter (in order of first use) `<param>.grad`
  (optimizer none) or `<param>.updated` followed by `<param>.<state>.updated` for each of
  its states (momentum: momentum_buffer; adam: exp_avg, exp_avg_sq, step).
- trainable parameters: float initializers of rank >= 1 that reach the loss through
  differentiable inputs, less BN running statistics (kind buffer) and `freeze` patterns.

Metadata (graph.metadata, kept in ONNX metadata_props):
- `memsched.grad_roles`: JSON {op name: {"role": "dW" | "dX" | "shared", "layer": forward
  op name, "param": parameter name}} for the backward ops of every forward op with a
  trainable parameter input: dW ops feed only that parameter's gradient, dX ops only the
  layer's input gradients ("param" is then the layer's first trainable parameter), shared
  ops both (a norm's xhat, which its scale and input gradients share). Update ops:
  {"role": "update", "param": name}.
- `memsched.training`: JSON {"loss", "optimizer", "lr", "momentum", "betas", "eps",
  "parameters": [trainable parameters in output order], "inputs": [extra inputs]}.
- `memsched.batch_statistics`: JSON {BN name: {"forward": [batch mean, variance],
  "backward": [sum of dy, sum of dy * xhat]}}: what synchronised BatchNorm averages across
  data-parallel workers (memsched.data_parallel.batch_statistics).

Training semantics: BatchNormalization normalises with batch statistics and updates its
running statistics with its momentum (PyTorch's train mode: the unbiased batch variance), as
`<buffer>.updated` outputs carried to the next step; Dropout follows the node's own
training_mode input (with a mask kept for the backward pass when it drops anything).

What the backward keeps: a BatchNormalization that feeds a ReLU or ReLU6 keeps its normalised
input alone (bn_relu), and values cheap ops make from tensors the backward keeps anyway (GELU
and LayerNorm outputs, a BN output and its activation) are derived again right before their
backward readers instead of kept (rederive), where that lowers the step's peak.

Gradient rules live in rules_elementwise, rules_shape and rules_nn, registered by op type
in registry.RULES; losses in loss, optimizers in optimizer.
"""
from memsched.passes.training.builder import GRAD_ROLES_KEY, TRAINING_KEY, build_training_step, describe
from memsched.passes.training.loss import LOSSES
from memsched.passes.training.optimizer import OPTIMIZERS
from memsched.passes.training.registry import RULES

__all__ = ["build_training_step", "describe", "GRAD_ROLES_KEY", "TRAINING_KEY", "LOSSES", "OPTIMIZERS", "RULES"]
