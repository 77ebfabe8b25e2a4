"""Transformers as Hugging Face defines them: BERT-base encoder + classifier, GPT-2 small.

The graphs mirror torch.onnx.export (TorchScript, opset 17) of the HF modules with eager
attention and without constant folding of the parameters (a training export):
- embeddings are Gather on the embedding tables; position (and BERT's token-type) ids are
  int64 Constants, since shapes are static;
- BERT's nn.Linear on [N, L, d] is Transpose(W) -> MatMul -> Add(bias, .), and on the
  pooled [N, d] vector Gemm(transB=1); GPT-2's Conv1D is torch.addmm, i.e.
  Reshape -> Gemm(x, W[in, out], b) -> Reshape;
- heads are split by Reshape + Transpose, scores are MatMul / sqrt(d_head), Softmax(-1);
  GPT-2 masks future positions with Where(causal mask, scores, finfo.min);
- LayerNormalization; BERT's GELU is the exact Erf form x*0.5*(1+erf(x/sqrt2)), GPT-2's
  is "gelu_new", 0.5x(1+tanh(sqrt(2/pi)(x+0.044715x^3)));
- GPT-2's LM head is tied: MatMul with Transpose(transformer.wte.weight), no bias.
Dropout is left out and BERT takes no attention mask (all positions attend): one input,
``input_ids`` int64 [N, L]. Init as HF: N(0, 0.02) weights and embeddings, zero biases,
LayerNorm 1/0, and GPT-2's c_proj weights at 0.02/sqrt(2 * layers).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto

from .layers import GraphBuilder, linear_gemm

INIT_STD = 0.02


def _layer_norm(b: GraphBuilder, scope: str, x: str, dim: int, eps: float) -> str:
    weight = b.param(f"{scope}.weight", [dim], fill=1.0)
    bias = b.param(f"{scope}.bias", [dim], fill=0.0)
    return b.op("LayerNormalization", scope, [x, weight, bias], axis=-1, epsilon=eps)


def _embed(b: GraphBuilder, scope: str, ids: str, rows: int, dim: int) -> str:
    """nn.Embedding lookup: Gather(table, ids)."""
    table = b.param(f"{scope}.weight", [rows, dim], std=INIT_STD)
    return b.op("Gather", scope, [table, ids], axis=0)


def _positions(b: GraphBuilder, scope: str, seq: int) -> str:
    return b.const(scope, np.arange(seq, dtype=np.int64)[None, :])


def _attention(b: GraphBuilder, scope: str, q: str, k: str, v: str, *, batch: int, seq: int,
               heads: int, head_dim: int, causal_mask: str | None = None) -> str:
    """Eager multi-head attention on [N, L, H*D] projections; returns [N, L, H*D]."""
    def heads_of(t: str, perm: list[int]) -> str:
        t = b.op("Reshape", scope, [t, b.shape_const(scope, [batch, seq, heads, head_dim])])
        return b.op("Transpose", scope, [t], perm=perm)

    q = heads_of(q, [0, 2, 1, 3])
    k = heads_of(k, [0, 2, 3, 1])          # k^T: the exporter fuses the two transposes
    v = heads_of(v, [0, 2, 1, 3])
    scores = b.op("MatMul", scope, [q, k])
    scores = b.op("Div", scope, [scores, b.const(scope, math.sqrt(head_dim))])
    if causal_mask is not None:
        lowest = b.const(scope, np.finfo(b.np_dtype).min)
        scores = b.op("Where", scope, [causal_mask, scores, lowest])
    probs = b.op("Softmax", scope, [scores], axis=-1)
    context = b.op("Transpose", scope, [b.op("MatMul", scope, [probs, v])], perm=[0, 2, 1, 3])
    return b.op("Reshape", scope, [context, b.shape_const(scope, [batch, seq, heads * head_dim])])


def _check_sizes(name: str, seq: int, max_positions: int, hidden: int, heads: int) -> None:
    if not 1 <= seq <= max_positions:
        raise ValueError(f"{name}: seq must be in 1..{max_positions}, got {seq}")
    if hidden % heads:
        raise ValueError(f"{name}: hidden ({hidden}) must be divisible by heads ({heads})")


# -- BERT ------------------------------------------------------------------------------
def _linear(b: GraphBuilder, scope: str, x: str, fin: int, fout: int) -> str:
    """nn.Linear on [N, L, fin] as exported: Transpose(W) -> MatMul -> Add(bias, .)."""
    weight = b.param(f"{scope}.weight", [fout, fin], std=INIT_STD)
    bias = b.param(f"{scope}.bias", [fout], fill=0.0)
    y = b.op("MatMul", scope, [x, b.op("Transpose", scope, [weight], perm=[1, 0])])
    return b.op("Add", scope, [bias, y])


def _gelu_erf(b: GraphBuilder, scope: str, x: str) -> str:
    """torch gelu (approximate='none') as exported: x * (erf(x / sqrt2) + 1) * 0.5."""
    erf = b.op("Erf", scope, [b.op("Div", scope, [x, b.const(scope, math.sqrt(2.0))])])
    y = b.op("Mul", scope, [x, b.op("Add", scope, [erf, b.const(scope, 1.0)])])
    return b.op("Mul", scope, [y, b.const(scope, 0.5)])


def _bert_layer(b: GraphBuilder, scope: str, x: str, *, batch: int, seq: int, hidden: int,
                heads: int, intermediate: int) -> str:
    attn = f"{scope}.attention"
    q, k, v = (_linear(b, f"{attn}.self.{name}", x, hidden, hidden)
               for name in ("query", "key", "value"))
    context = _attention(b, f"{attn}.self", q, k, v, batch=batch, seq=seq, heads=heads,
                         head_dim=hidden // heads)
    y = _linear(b, f"{attn}.output.dense", context, hidden, hidden)
    x = _layer_norm(b, f"{attn}.output.LayerNorm", b.op("Add", f"{attn}.output", [y, x]),
                    hidden, 1e-12)
    y = _linear(b, f"{scope}.intermediate.dense", x, hidden, intermediate)
    y = _gelu_erf(b, f"{scope}.intermediate.intermediate_act_fn", y)
    y = _linear(b, f"{scope}.output.dense", y, intermediate, hidden)
    return _layer_norm(b, f"{scope}.output.LayerNorm", b.op("Add", f"{scope}.output", [y, x]),
                       hidden, 1e-12)


def bert_base(*, batch: int = 8, seq: int = 128, classes: int = 2, layers: int = 12,
              hidden: int = 768, heads: int = 12, vocab: int = 30522,
              max_positions: int = 512, dtype: str = "float32", seed: int = 0,
              weights: bool = True) -> onnx.ModelProto:
    """BertForSequenceClassification (bert-base-uncased shape): encoder, pooler, classifier.

    109,482,240 encoder + pooler parameters, + 768*classes + classes for the classifier.
    """
    _check_sizes("bert-base", seq, max_positions, hidden, heads)
    b = GraphBuilder("bert-base", dtype=dtype, seed=seed, weights=weights)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    emb = "bert.embeddings"
    x = _embed(b, f"{emb}.word_embeddings", ids, vocab, hidden)
    token_types = b.const(emb, np.zeros((1, seq), dtype=np.int64))
    x = b.op("Add", emb, [x, _embed(b, f"{emb}.token_type_embeddings", token_types, 2, hidden)])
    positions = _embed(b, f"{emb}.position_embeddings", _positions(b, emb, seq),
                       max_positions, hidden)
    x = _layer_norm(b, f"{emb}.LayerNorm", b.op("Add", emb, [x, positions]), hidden, 1e-12)
    for i in range(layers):
        x = _bert_layer(b, f"bert.encoder.layer.{i}", x, batch=batch, seq=seq, hidden=hidden,
                        heads=heads, intermediate=4 * hidden)
    first = b.op("Gather", "bert.pooler", [x, b.const("bert.pooler", np.int64(0))], axis=1)
    pooled = b.op("Tanh", "bert.pooler.activation",
                  [linear_gemm(b, "bert.pooler.dense", first, hidden, hidden, std=INIT_STD)])
    x = linear_gemm(b, "classifier", pooled, hidden, classes, std=INIT_STD, out="logits")
    return b.finish(x, [batch, classes])


# -- GPT-2 -----------------------------------------------------------------------------
def _conv1d(b: GraphBuilder, scope: str, x: str, rows: list[int], fin: int, fout: int,
            std: float = INIT_STD) -> str:
    """HF Conv1D (weight [in, out]) as exported: Reshape -> Gemm (torch.addmm) -> Reshape."""
    weight = b.param(f"{scope}.weight", [fin, fout], std=std)
    bias = b.param(f"{scope}.bias", [fout], fill=0.0)
    flat = b.op("Reshape", scope, [x, b.shape_const(scope, [math.prod(rows), fin])])
    y = b.op("Gemm", scope, [flat, weight, bias], alpha=1.0, beta=1.0)
    return b.op("Reshape", scope, [y, b.shape_const(scope, rows + [fout])])


def _gelu_new(b: GraphBuilder, scope: str, x: str) -> str:
    """HF NewGELUActivation: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    half = b.op("Mul", scope, [x, b.const(scope, 0.5)])
    cube = b.op("Pow", scope, [x, b.const(scope, 3.0)])
    inner = b.op("Add", scope, [x, b.op("Mul", scope, [cube, b.const(scope, 0.044715)])])
    scaled = b.op("Mul", scope, [inner, b.const(scope, math.sqrt(2.0 / math.pi))])
    tanh = b.op("Tanh", scope, [scaled])
    return b.op("Mul", scope, [half, b.op("Add", scope, [tanh, b.const(scope, 1.0)])])


def _gpt2_block(b: GraphBuilder, scope: str, x: str, mask: str, *, batch: int, seq: int,
                hidden: int, heads: int, proj_std: float) -> str:
    rows = [batch, seq]
    y = _layer_norm(b, f"{scope}.ln_1", x, hidden, 1e-5)
    qkv = _conv1d(b, f"{scope}.attn.c_attn", y, rows, hidden, 3 * hidden)
    q, k, v = b.op("Split", f"{scope}.attn",
                   [qkv, b.shape_const(f"{scope}.attn", [hidden] * 3)], outputs=3, axis=2)
    y = _attention(b, f"{scope}.attn", q, k, v, batch=batch, seq=seq, heads=heads,
                   head_dim=hidden // heads, causal_mask=mask)
    y = _conv1d(b, f"{scope}.attn.c_proj", y, rows, hidden, hidden, std=proj_std)
    x = b.op("Add", scope, [y, x])
    y = _layer_norm(b, f"{scope}.ln_2", x, hidden, 1e-5)
    y = _conv1d(b, f"{scope}.mlp.c_fc", y, rows, hidden, 4 * hidden)
    y = _gelu_new(b, f"{scope}.mlp.act", y)
    y = _conv1d(b, f"{scope}.mlp.c_proj", y, rows, 4 * hidden, hidden, std=proj_std)
    return b.op("Add", scope, [y, x])


def gpt2(*, batch: int = 4, seq: int = 1024, layers: int = 12, hidden: int = 768,
         heads: int = 12, vocab: int = 50257, max_positions: int = 1024,
         dtype: str = "float32", seed: int = 0, weights: bool = True) -> onnx.ModelProto:
    """GPT2LMHeadModel (GPT-2 small shape), tied LM head: 124,439,808 params; logits [N, L, V]."""
    _check_sizes("gpt2", seq, max_positions, hidden, heads)
    b = GraphBuilder("gpt2", dtype=dtype, seed=seed, weights=weights)
    ids = b.input("input_ids", [batch, seq], TensorProto.INT64)
    wte = b.param("transformer.wte.weight", [vocab, hidden], std=INIT_STD)
    x = b.op("Gather", "transformer.wte", [wte, ids], axis=0)
    positions = _embed(b, "transformer.wpe", _positions(b, "transformer", seq),
                       max_positions, hidden)
    x = b.op("Add", "transformer", [x, positions])
    mask = b.const("transformer", np.tril(np.ones((seq, seq), dtype=bool))[None, None])
    proj_std = INIT_STD / math.sqrt(2 * layers)
    for i in range(layers):
        x = _gpt2_block(b, f"transformer.h.{i}", x, mask, batch=batch, seq=seq,
                        hidden=hidden, heads=heads, proj_std=proj_std)
    x = _layer_norm(b, "transformer.ln_f", x, hidden, 1e-5)
    head = b.op("Transpose", "lm_head", [wte], perm=[1, 0])
    x = b.op("MatMul", "lm_head", [x, head], out="logits")
    return b.finish(x, [batch, seq, vocab])
