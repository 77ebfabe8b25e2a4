"""What memsched knows of ONNX op types: the one table every stage reads.

Each set names the op types that share one property the compiler relies on. The memory
model reads the storage rules (views, in place), the cost model the op classes, the
training-step builder and the rewrites the algebraic and per-sample facts, the recompute and
swap planners the replay rule, and the executor what ONNX Runtime does to a node itself.
A fact about an op type lives here and nowhere else; a stage that needs a new one adds it here.
"""
from __future__ import annotations

from .ir import Op
from .onnx_utils import MEMSCHED_DOMAIN

# ---- storage: the memory model's rule 4 --------------------------------------------------------
# Shape-only views: they change no element, so they share their input's storage.
VIEW_OPS = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze"})
# Ops whose output may take the storage of an input of the same size (ONNX Runtime's
# allocation planner allows the same for these).
INPLACE_OPS = VIEW_OPS | frozenset({
    "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Elu", "Selu", "HardSigmoid", "Softplus", "Erf",
    "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Clip", "Add", "Sub", "Mul", "Div", "Pow",
    "Dropout", "Where", "Cast", "ScatterND", "ScatterElements",
})
# In-place ops whose output may take only the storage of their first input (the data they
# scatter into; ONNX Runtime's kernels copy it to the output unless the two are one buffer).
INPLACE_DATA_ONLY = frozenset({"ScatterND", "ScatterElements"})
# In-place ops whose output may overwrite any of their inputs (a binary op reads each element
# of both operands once, at the position it writes); the other in-place ops overwrite their data.
INPLACE_ANY_INPUT = frozenset({"Add", "Sub", "Mul", "Div", "Pow"})


def is_view(op: Op) -> bool:
    """A shape-only view: it shares its input's storage (rule 4), so it costs no bytes and no time."""
    return op.op_type in VIEW_OPS


def overwritable_inputs(op: Op) -> list[str]:
    """The inputs an output of `op` may take the storage of (rule 4), by what the op does:
    none where it does not run in place; a Gemm update only C, the parameter or state it
    updates (the product reads A and B while it writes); a scatter only its data; a binary
    elementwise op, or any other update, any input; Where its two branches; any other in-place
    op its data, the first input."""
    if op.op_type not in INPLACE_OPS and op.phase != "update":
        return []
    if op.op_type == "Gemm":
        return op.inputs[2:3]
    if op.op_type in INPLACE_DATA_ONLY:
        return op.inputs[:1]
    if op.phase == "update" or op.op_type in INPLACE_ANY_INPUT:
        return op.present_inputs
    return op.inputs[1:3] if op.op_type == "Where" else op.inputs[:1]


# ---- values: memsched plans tensors ----------------------------------------------------------------
# Ops that make or read sequences, maps or optionals, whose sizes are not fixed by the step.
NON_TENSOR_OPS = frozenset({
    "SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceAt", "SequenceErase", "SequenceLength",
    "SplitToSequence", "ConcatFromSequence", "SequenceMap", "Optional", "OptionalGetElement",
    "OptionalHasElement", "ZipMap", "CastMap", "DictVectorizer"})


# ---- replay: what recompute and swap-by-recompute may run twice ----------------------------------
# Ops that draw random numbers: a replay would draw other numbers.
RANDOM_OPS = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


def draws_random(op: Op) -> bool:
    """A random op, or a Dropout given a training_mode (it may draw a mask): a replay could differ."""
    return op.op_type in RANDOM_OPS or (op.op_type == "Dropout" and len(op.inputs) > 2 and bool(op.inputs[2]))


# ---- ONNX Runtime: what it does to a node by itself ----------------------------------------------
# Ops whose value the executor writes itself, in schedule order: ONNX Runtime turns a Constant
# node into an initializer when it loads a model, and copies an initializer that is a graph
# output into its bound buffer at the end of the run, not in schedule order, where the plan
# may have reused those bytes since.
CONSTANT_OPS = frozenset({"Constant"})
# Ops that ONNX Runtime's priority order runs ahead of the order given.
HOISTED_OPS = frozenset({"Shape", "Size"})

# ---- cost classes: ops whose time follows one formula (memsched.cost.op_class) -----------------
SHAPE_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Shape", "Size", "Identity", "Constant"})
TRANSCENDENTAL_OPS = frozenset({
    "Exp", "Log", "Tanh", "Sigmoid", "Erf", "Pow", "Softplus", "Softsign", "Elu", "Selu", "Celu", "Gelu",
    "HardSwish", "Mish", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh",
})
ELEMENTWISE_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "ThresholdedRelu", "HardSigmoid",
    "Clip", "Sqrt", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Max", "Min", "Sum", "Mean", "Where",
    "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor", "Cast",
    "CastLike", "Dropout", "IsNaN", "IsInf", "Mod", "BitShift", "Shrink",
}) | TRANSCENDENTAL_OPS
REDUCTION_OPS = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                           "ReduceL2", "ReduceSumSquare", "ArgMax", "ArgMin",
                           "CumSum"})
EXP_REDUCTION_OPS = frozenset({"ReduceLogSumExp", "ReduceLogSum"})   # a log or exp per element, unvectorised
POOL_OPS = frozenset({"MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
NORM_OPS = frozenset({"BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
                      "LpNormalization", "MeanVarianceNormalization"})
SOFTMAX_OPS = frozenset({"Softmax", "LogSoftmax", "Hardmax", "SoftmaxCrossEntropyLoss"})
GATHER_OPS = frozenset({"Gather", "GatherElements", "GatherND", "Scatter", "ScatterElements", "ScatterND",
                        "NegativeLogLikelihoodLoss", "OneHot"})
DATA_OPS = frozenset({"Transpose", "Concat", "Split", "Slice", "Pad", "Expand", "Tile", "Resize", "Upsample",
                      "DepthToSpace", "SpaceToDepth", "ConstantOfShape", "Range", "Trilu", "EyeLike"})

# ---- algebra and structure: what the training-step builder and the rewrites rely on -------------
# Ops whose output sample n depends on input sample n alone (batch on axis 0), whatever the
# other attributes; passes.rewrites.batch_split checks Flatten, Softmax, MaxPool and Concat further.
PER_SAMPLE_OPS = frozenset({
    "Conv", "ConvTranspose", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Elu", "Selu", "Softplus", "Erf",
    "HardSigmoid", "Identity", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Flatten",
    "Add", "Sub", "Mul", "Div", "Gemm", "MatMul", "Softmax", "LogSoftmax", "Concat"})
# The batch split's form of a training BatchNormalization (passes.rewrites.batch_split): one node
# of MEMSCHED_DOMAIN over the k chunks of the BN's input, inputs (x_0 .. x_k-1, scale, bias,
# running mean, running var), outputs (y_0 .. y_k-1), the BN's attributes. It normalises every
# chunk with the statistics of all of them, so its step is the whole batch's BN step. Only the
# forward graph the step builder reads holds it (rules_nn gives its training form and gradient).
CHUNKED_BATCH_NORM = "ChunkedBatchNormalization"


def is_batch_norm(op: Op) -> bool:
    """ONNX's BatchNormalization (the default domain)."""
    return op.op_type == "BatchNormalization" and op.domain in ("", "ai.onnx")


def is_chunked_batch_norm(op: Op) -> bool:
    """The batch split's CHUNKED_BATCH_NORM node."""
    return op.op_type == CHUNKED_BATCH_NORM and op.domain == MEMSCHED_DOMAIN


# Arithmetic the GELU/LayerNorm pattern matcher follows through.
ARITHMETIC_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Neg"})
# Ops folded to constants when all their inputs are known (the shape arithmetic of exports).
FOLDABLE_OPS = frozenset({
    "Identity", "Cast", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice", "Reshape", "Add",
    "Sub", "Mul", "Div", "Neg", "Equal", "Where", "Range", "ConstantOfShape", "ReduceProd",
    "Max", "Min", "Abs", "Floor", "Ceil", "Sqrt", "Expand", "Transpose", "Not", "Less", "Greater",
})
# Ops through which a weight reaches the layer that reads it unchanged in value (a transposed
# or cast weight is still that weight), and the ops that cut a weight into the parts layers read.
WEIGHT_VIEW_OPS = frozenset({"Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast"})
WEIGHT_PART_OPS = frozenset({"Split", "Slice"})
# Activations whose backward is a mask of their input: under a training BatchNorm, the BN keeps
# its normalised input alone and both are derived from it again (passes.training.bn_relu).
MASK_ACTIVATIONS = frozenset({"Relu", "Clip"})
# Ops cheap enough to run again in the backward pass instead of keeping their output
# (passes.training.rederive): elementwise ops, LayerNormalization, and the shape views between
# them and the layer that reads them.
REDERIVABLE_OPS = (ELEMENTWISE_OPS - {"Dropout"}) | {"LayerNormalization"} | VIEW_OPS
