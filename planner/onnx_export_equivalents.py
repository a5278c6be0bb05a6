"""Export-only stand-ins for model code torch cannot capture as a static ONNX graph.

Two transformers patterns stop the exporter although the arithmetic is plain; each is swapped,
only while `export_onnx` runs, for the same arithmetic in a form torch.export and torch.onnx
accept, and put back afterwards (the model in memory is unchanged after export):

* **Experts that loop over the experts the batch hit** (DBRX: `for expert_idx in expert_hit`, a
  data-dependent count). Stand-in: gather every token's top-k experts' weights by index and
  apply them batched, as transformers' own `batched_mm` experts implementation does for the
  architectures that support it. DBRX's experts are flattened 2-D `mlp.w1/v1/w2` [E x F, D]
  (transformers 5.23 `models/dbrx/modeling_dbrx.py`, `DbrxExpertGLU`, `DbrxExperts`):
  out = sum_k weight_k * (act(x w1_k^T) * (x v1_k^T)) w2_k with w*_k the [F, D] slice of expert k.
* **Complex-valued rotary embeddings** (DeepSeek-V2, Llama-4: `torch.polar`, `view_as_complex`),
  which torch.onnx cannot translate. Stand-in: the rotary module returns (cos, sin) stacked in a
  real last axis [.., D/2, 2] instead of cos + i sin, and the modeling module's
  `apply_rotary_emb` multiplies the interleaved pairs (a, b) by it as the complex product
  (a c - b s, a s + b c) (transformers 5.23 `models/deepseek_v2/modeling_deepseek_v2.py` and
  `models/llama4/modeling_llama4.py`, `apply_rotary_emb` and the `*RotaryEmbedding.forward`).
  The frequencies' broadcast over heads follows each file: DeepSeek-V2 applies rotary to
  [B, H, S, D] (frequencies unsqueezed at 1), Llama-4 to [B, S, H, D] (at 2). Rotary types whose
  frequencies change with the input length (`dynamic`, `longrope`) are left as they are (their
  update branches on the length, which torch.export refuses anyway).
The stand-ins are chosen by the transformers module that defines the class, since they restate
that file's arithmetic; `tests/test_onnx_hf_export.py` checks onnxruntime's logits against torch's.
"""
from __future__ import annotations

import contextlib
import sys
import types

DBRX = "transformers.models.dbrx.modeling_dbrx"
COMPLEX_ROTARY_HEAD_AXIS = {  # modeling module -> axis of the heads in the tensors rotary is applied to
    "transformers.models.deepseek_v2.modeling_deepseek_v2": 1,
    "transformers.models.llama4.modeling_llama4": 2,
}


def _dbrx_batched_experts(self, hidden_states, top_k_index, top_k_weights):
    """hidden_states [.., D], top_k_index / top_k_weights [N, K] -> [B, S', D] (as DbrxExperts)."""
    import torch

    batch_size = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)  # [N, D]
    split = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1 = self.mlp.w1.view(split)[top_k_index]  # [N, K, F, D]
    v1 = self.mlp.v1.view(split)[top_k_index]
    w2 = self.mlp.w2.view(split)[top_k_index]
    gate = self.mlp.activation_fn(torch.einsum("nd,nkfd->nkf", x, w1))
    up = torch.einsum("nd,nkfd->nkf", x, v1)
    down = torch.einsum("nkf,nkfd->nkd", gate * up, w2)  # [N, K, D]
    out = (down * top_k_weights[..., None].to(down.dtype)).sum(1)
    return out.view(batch_size, -1, self.hidden_size)


def _real_rotary_forward(self, x, position_ids):
    """(cos, sin) x attention scaling, [B, S, D/2, 2]: the real form of the complex frequencies."""
    import torch

    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    return torch.stack((freqs.cos(), freqs.sin()), dim=-1) * self.attention_scaling


def _real_apply_rotary(head_axis: int):
    def apply_rotary_emb(xq, xk, freqs_cis):
        """xq, xk [.., D] rotated pairwise by freqs_cis [B, S, D/2, 2] (cos, sin)."""
        import torch

        freqs = freqs_cis.unsqueeze(head_axis).to(xq.device)
        cos, sin = freqs[..., 0], freqs[..., 1]

        def rotate(x):
            a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
            return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)
    return apply_rotary_emb


def _is_complex_rotary(module) -> bool:
    kind = getattr(module, "rope_type", "")
    return (type(module).__module__ in COMPLEX_ROTARY_HEAD_AXIS and type(module).__name__.endswith("RotaryEmbedding")
            and isinstance(kind, str) and "dynamic" not in kind and kind != "longrope")


@contextlib.contextmanager
def export_equivalents(model):
    """Swap in the stand-ins above for `model`'s submodules that need them; restore on exit."""
    instance_forwards, globals_saved = [], []
    try:
        for module in model.modules():
            if type(module).__module__ == DBRX and type(module).__name__ == "DbrxExperts":
                module.forward = types.MethodType(_dbrx_batched_experts, module)
                instance_forwards.append(module)
            elif _is_complex_rotary(module):
                modeling = sys.modules[type(module).__module__]
                module.forward = types.MethodType(_real_rotary_forward, module)
                instance_forwards.append(module)
                if not any(saved[0] is modeling for saved in globals_saved):
                    globals_saved.append((modeling, modeling.apply_rotary_emb))
                    modeling.apply_rotary_emb = _real_apply_rotary(COMPLEX_ROTARY_HEAD_AXIS[modeling.__name__])
        yield
    finally:
        for module in instance_forwards:
            del module.forward
        for modeling, original in globals_saved:
            modeling.apply_rotary_emb = original
