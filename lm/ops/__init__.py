"""Pure tensor math of the sequence mixers, no nn.Module: each op has a chunkwise form (training) and a
recurrent form (decoding) over [B, T, H, *] tensors, takes `initial_state` and `chunk_size` as keywords and
returns (out [B, T, H, V], final_state). State and decay arithmetic runs in float32 (float64 for float64 input),
with autocast off inside (lm.ops.common.autocast_off)."""

from lm.ops.delta_product import delta_product, delta_product_recurrent
from lm.ops.delta_rule import delta_rule, delta_rule_recurrent
from lm.ops.diagonal_scan import diagonal_scan, diagonal_scan_recurrent
from lm.ops.kda import kda, kda_recurrent
from lm.ops.linear_attention import linear_attention, linear_attention_recurrent
from lm.ops.mesa import mesa, mesa_recurrent
from lm.ops.mlstm import mlstm, mlstm_recurrent
from lm.ops.precond_delta_rule import precond_delta_rule, precond_delta_rule_recurrent

__all__ = ["delta_product", "delta_product_recurrent", "delta_rule", "delta_rule_recurrent", "diagonal_scan",
           "diagonal_scan_recurrent", "kda", "kda_recurrent", "linear_attention", "linear_attention_recurrent", "mesa",
           "mesa_recurrent", "mlstm", "mlstm_recurrent", "precond_delta_rule", "precond_delta_rule_recurrent"]
